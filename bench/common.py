"""What every benchmark in bench/ does the same way: the machine it ran on, its JSON (printed, and written to --output
when given), and real WikiSQL release files prepared once for it. Benchmarks import it as `bench.common` (they put the
repository root on sys.path)."""

from __future__ import annotations

import hashlib
import json
import os
import platform
import shutil
from pathlib import Path

# What holds torch's, oneDNN's and MKL's kernels to an instruction set (set to AVX2: an AVX2-only CPU's kernels)
KERNEL_LIMITS = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS")


def machine() -> dict:
    """The CPU (its model name), cores, library versions, the instruction set torch's kernels run and what held them
    (KERNEL_LIMITS: how an AVX-512 machine runs an AVX2-only CPU's kernels), and the GPU when there is one."""
    import torch
    import transformers

    info = {
        "cpu": platform.processor() or platform.machine(),
        "cores": os.cpu_count(),
        "torch_default_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "kernels": torch.backends.cpu.get_cpu_capability(),
    }
    limits = {name: os.environ[name] for name in KERNEL_LIMITS if name in os.environ}
    if limits:
        info["kernels_held_to"] = limits
    try:
        import deepspeed

        info["deepspeed"] = deepspeed.__version__
    except ImportError:
        pass
    try:
        info["cpu"] = next(
            line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")
        )
    except (OSError, StopIteration):
        pass
    if torch.cuda.is_available():
        info.update(
            gpu=torch.cuda.get_device_name(),
            gpu_count=torch.cuda.device_count(),
            cuda=torch.version.cuda,
            gpu_memory_bytes=torch.cuda.get_device_properties(0).total_memory,
        )
    return info


def run_report(benchmark: str, args, started: float, load_before, results: list, **extra) -> dict:
    """A benchmark's JSON: its name, the date, the wall time since `started` (time.perf_counter), its settings (`args`
    but where it writes), `extra`, the machine, the load average before (`load_before`) and now, and its results."""
    import time

    return {
        "benchmark": benchmark,
        "date": time.strftime("%Y-%m-%d"),
        "wall_seconds": round(time.perf_counter() - started, 1),
        "settings": {k: v for k, v in vars(args).items() if k not in ("output", "workdir")},
        **extra,
        "machine": machine(),
        "load_average_before": [round(x, 2) for x in load_before],
        "load_average_after": [round(x, 2) for x in os.getloadavg()],
        "results": results,
    }


def emit(report: dict, output: str | None) -> None:
    """Print the report as JSON, and write it to `output` too when given."""
    text = json.dumps(report, indent=2)
    print(text)
    if output:
        Path(output).write_text(text + "\n")


def tokenizer_folder(tokenizer: str, workdir: str | Path) -> str:
    """A --model_id for `textsql prep`: a hub name or model folder as given; a tokenizer file (T5's spiece.model or a
    Hugging Face tokenizer.json) is put in a folder of its own in `workdir`, beside a config.json naming T5."""
    path = Path(tokenizer).expanduser()
    if not path.is_file():
        return tokenizer
    folder = Path(workdir) / f"tokenizer-{path.stem}-{path.stat().st_size}"
    if not (folder / path.name).is_file():
        folder.mkdir(parents=True, exist_ok=True)
        shutil.copy(path, folder / path.name)
        # AutoTokenizer picks T5's tokenizer class by the model type
        (folder / "config.json").write_text(json.dumps({"model_type": "t5"}) + "\n")
    return str(folder)


def prepared_release(source: str, tokenizer: str, workdir: str | Path, source_format: str = "question") -> Path:
    """A WikiSQL release folder (or .tar.bz2) prepared by `textsql prep` with `tokenizer` (see tokenizer_folder), once:
    later calls with the same arguments reuse it."""
    from textsql.arguments.prep import PrepArguments
    from textsql.paths import METADATA_FILE
    from textsql.prep import prepare_dataset

    model_id = tokenizer_folder(tokenizer, workdir)
    key = hashlib.sha256(json.dumps([str(Path(source).resolve()), model_id, source_format]).encode()).hexdigest()[:12]
    output_dir = Path(workdir) / f"release-{source_format.replace('+', '-')}-{key}"
    if not (output_dir / METADATA_FILE).is_file():
        prepare_dataset(
            PrepArguments(
                source=source,
                model_id=model_id,
                output_dir=str(output_dir),
                source_format=source_format,
                overwrite=True,
            )
        )
    return output_dir


def prepared_tokenizer(data_dir: str | Path) -> str:
    """The tokenizer a prepared dataset was made with: prep's copy with the characters it added, else the one named."""
    from textsql.paths import METADATA_FILE

    metadata = json.loads((Path(data_dir) / METADATA_FILE).read_text())
    return str(Path(data_dir) / metadata["tokenizer_dir"]) if metadata.get("tokenizer_dir") else metadata["tokenizer"]
