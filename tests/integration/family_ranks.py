"""One rank of every causal family under the two strategies that need two processes, on the CPU (gloo): FSDP2 with the
family's own decoder layers as the units (fsdp_ranks.py's step against an unsharded run, synced generation, the
gathered save) and `textsql train --deepspeed zero3` (textsql.train.run.train itself: the shipped config filled by the
Trainer, the model partitioned by zero.Init, two steps, the final model gathered and saved). One launch for all the
families, so the imports are paid once. Each rank writes RESULTS_DIR/rank<N>.json for
tests/integration/test_causal_families.py.

    DS_ACCELERATOR=cpu python -m torch.distributed.run --nproc_per_node 2 --master_addr 127.0.0.1 --master_port P \\
        tests/integration/family_ranks.py DATASET_DIR MODELS_ROOT RESULTS_DIR FAMILY...

MODELS_ROOT/FAMILY holds a tiny random model of each family with the tokenizer DATASET_DIR was prepared with.
"""

import gc
import json
import sys
import traceback
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist
from fsdp_ranks import reference_run, strategy_row

from textsql.arguments.training import parse_arguments
from textsql.hub import load_model
from textsql.train.run import train

FSDP_STRATEGY = "fsdp_full_shard"  # the unit is the family's; every strategy's own path is tested on T5 and qwen2
# The in-process runs of test_causal_families.py take batches of 8 on one process; 4 per rank on two ranks is the same
# batch (random sampling: the ranks take consecutive batches of the same shuffled order).
ZERO3_FLAGS = [
    "--deepspeed", "zero3", "--max_steps", "2", "--per_device_train_batch_size", "4", "--learning_rate", "3e-3",
    "--logging_steps", "1", "--eval_strategy", "no", "--max_eval_samples", "8", "--execution_accuracy_samples", "0",
    "--save_strategy", "no", "--train_sampling_strategy", "random", "--dataloader_num_workers", "0",
    "--disable_tqdm", "True",
]  # fmt: skip


def fsdp_row(model_dir: Path, rank: int, results: Path) -> dict:
    model = load_model(str(model_dir))
    row = strategy_row(str(model_dir), FSDP_STRATEGY, rank, reference_run(str(model_dir), rank, True), results)
    row["no_split_modules"] = sorted(type(model)._no_split_modules or [])  # the model class's own declaration
    return row


def zero3_row(dataset_dir: str, model_dir: Path, runs_root: Path) -> dict | None:
    """textsql's training run under ZeRO-3 on both ranks; rank 0 reports its summary, losses and saved model."""
    argv = ["--model_id", str(model_dir), "--dataset_dir", dataset_dir, "--runs_root", str(runs_root), *ZERO3_FLAGS]
    summary = train(*parse_arguments(argv))
    if summary is None:  # not rank 0
        return None
    state = json.loads((Path(summary.output_dir) / "trainer_state.json").read_text())
    saved = load_model(summary.output_dir)
    return {
        "world_size": summary.world_size,
        "label": summary.strategy["label"],
        "global_step": summary.global_step,
        "losses": [entry["loss"] for entry in state["log_history"] if "loss" in entry],
        "saved_model_type": saved.config.model_type,
        "saved_parameters": sum(p.numel() for p in saved.parameters()),
    }


def main(dataset_dir: str, models_root: str, results_dir: str, families: list[str]) -> None:
    # A family that fails is reported and the next one runs; a rank left waiting on the other gives up within minutes.
    dist.init_process_group("gloo", timeout=timedelta(minutes=3))
    gc.freeze()  # the imported modules' objects left out of the gc.collect() every run starts with (0.5 s each)
    rank = dist.get_rank()
    results = Path(results_dir)
    report = {"rank": rank, "fsdp": {}, "zero3": {}}
    for family in families:  # FSDP first: a ZeRO-3 run leaves DeepSpeed's state in the process
        try:
            report["fsdp"][family] = fsdp_row(Path(models_root) / family, rank, results / "fsdp" / family)
        except Exception:
            report["fsdp"][family] = {"error": traceback.format_exc()}
    for family in families:
        try:
            report["zero3"][family] = zero3_row(dataset_dir, Path(models_root) / family, results / "runs")
        except Exception:
            report["zero3"][family] = {"error": traceback.format_exc()}
    Path(results_dir, f"rank{rank}.json").write_text(json.dumps(report, indent=2))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4:])
