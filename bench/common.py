"""What every benchmark in bench/ reports the same way: the machine it ran on, and its JSON (printed, and written to
--output when given). Benchmarks import it as `bench.common` (they put the repository root on sys.path)."""

from __future__ import annotations

import json
import os
import platform
from pathlib import Path


def machine() -> dict:
    """The CPU (its model name), cores, library versions, and the GPU when there is one."""
    import torch
    import transformers

    info = {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(), "torch_default_threads": torch.get_num_threads(),
            "torch": torch.__version__, "transformers": transformers.__version__, "python": platform.python_version(),
            "platform": platform.platform()}
    try:
        import deepspeed

        info["deepspeed"] = deepspeed.__version__
    except ImportError:
        pass
    try:
        info["cpu"] = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    if torch.cuda.is_available():
        info.update(gpu=torch.cuda.get_device_name(), gpu_count=torch.cuda.device_count(), cuda=torch.version.cuda,
                    gpu_memory_bytes=torch.cuda.get_device_properties(0).total_memory)
    return info


def emit(report: dict, output: str | None) -> None:
    """Print the report as JSON, and write it to `output` too when given."""
    text = json.dumps(report, indent=2)
    print(text)
    if output:
        Path(output).write_text(text + "\n")
