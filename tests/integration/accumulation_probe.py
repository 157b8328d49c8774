"""Train the tiny T5 one optimizer step with textsql's own training for each case given, all in this one process.

    DS_ACCELERATOR=cpu python tests/integration/accumulation_probe.py RESULTS MODEL DATA CASE [CASE ...]
    deepspeed --num_gpus 2 tests/integration/accumulation_probe.py RESULTS MODEL DATA CASE [CASE ...]   (two ranks)

CASE is STRATEGY:MICRO_BATCH:ACCUMULATION (STRATEGY: none or a DeepSpeed config file). Each case writes its run to
RESULTS/<strategy>-mb<micro batch>-acc<accumulation>-ws<world size>; tests/integration/test_accumulation.py compares
the logged loss and gradient norm (TensorBoard, run_summary.json) and the saved weights across cases. Plain SGD without
clipping, so that the update is proportional to the gradient (Adam's first step is nearly its sign), and sequential
batches, so that every case's optimizer step sees the same samples whatever its micro-batch, accumulation and ranks.
"""

import os
import sys
from pathlib import Path


def case_argv(results: Path, model: str, data: str, case: str, world: int) -> list[str]:
    strategy, micro_batch, accumulation = case.split(":")
    label = "none" if strategy == "none" else Path(strategy).stem
    argv = ["--model_id", model, "--dataset_dir", data, "--precision", "fp32", "--overwrite", "True"]
    argv += ["--execution_accuracy_samples", "0"]
    argv += ["--output_dir", str(results / f"{label}-mb{micro_batch}-acc{accumulation}-ws{world}")]
    flags = {
        "per_device_train_batch_size": micro_batch,
        "gradient_accumulation_steps": accumulation,
        "max_steps": 1,
        "optim": "sgd",
        "learning_rate": 0.5,
        "warmup_steps": 0,
        "max_grad_norm": 1e6,  # the norm is computed and logged; clipping never applies
        "train_sampling_strategy": "sequential",
        "logging_steps": 1,
        "eval_strategy": "no",
        "save_strategy": "no",
        "dataloader_num_workers": 0,
        "disable_tqdm": True,
    }
    for name, value in flags.items():
        argv += [f"--{name}", str(value)]
    return argv + ([] if strategy == "none" else ["--deepspeed", strategy])


def main(results: str, model: str, data: str, cases: list[str]) -> int:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from accelerate.state import AcceleratorState
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    from textsql.arguments.training import parse_arguments
    from textsql.train.distributed import ensure_distributed_env, world_size
    from textsql.train.run import train

    ensure_distributed_env()  # one process group for every case, DeepSpeed or not
    for case in cases:
        try:
            train(*parse_arguments(case_argv(Path(results), model, data, case, world_size())))
        finally:
            unset_hf_deepspeed_config()
            AcceleratorState._reset_state(True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4:]))
