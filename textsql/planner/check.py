"""The planner's check of every finished run: its measured peak memory against what the planner predicts for it."""

from __future__ import annotations

import json
import math
from pathlib import Path

from textsql.errors import TextsqlError
from textsql.paths import METADATA_FILE
from textsql.planner.phases import predict, predict_fsdp, with_phases
from textsql.planner.shape import GIB, resolve_model
from textsql.planner.states import setup_from_arguments, zero_settings
from textsql.prep import longest_lengths
from textsql.run_summary import RunSummary

# ---------------------------------------------------------------------------------------------------------------------
# Output
# ---------------------------------------------------------------------------------------------------------------------


# ---------------------------------------------------------------------------------------------------------------------
# Checking a finished run
# ---------------------------------------------------------------------------------------------------------------------


def compare_with_run(
    summary: RunSummary, max_source_length: int | None = None, max_target_length: int | None = None
) -> dict:
    """Predict the peak memory of a finished run (run_summary.json) and compare it with what was measured.

    ratio = measured / predicted, comparing torch's peak reserved memory on the busiest rank with the predicted total
    less the CUDA context and NCCL buffers (which torch does not count). On a CPU run the prediction is of GPU memory
    and the measurement is the process's peak RSS, so the result says `comparable: false` and why.
    """
    try:
        run = run_setup(summary, max_source_length, max_target_length)
        shape = resolve_model(run["model"])
    except TextsqlError as error:
        return {"comparable": False, "reason": str(error), "ratio": None}
    if run["fsdp_layout"] is not None:
        step = predict_fsdp(shape, run["setup"], *run["fsdp_layout"], run["batch"])
        row = with_phases(shape, run["setup"], step, 3, run["fsdp_layout"][1], fsdp=True)
    else:
        step = predict(shape, run["setup"], *run["layout"], run["batch"])
        row = with_phases(shape, run["setup"], step, run["layout"][0], run["layout"][1], fsdp=False)
    # The measurement is the whole run's peak, so it is compared with the largest phase, whose share of the allocator
    # overhead and unseen memory is as the training step's.
    peak = row["phases"][row["peak_phase"]]
    unseen = step["gpu_total_bytes"] - step["torch_reserved_bytes"]
    ranks = summary.peak_memory_per_rank
    on_gpu = [r for r in ranks if "cuda_max_reserved_bytes" in r]
    result = {
        "strategy": run["strategy"],
        "precision": run["setup"].precision,
        "world_size": run["setup"].gpus,
        "nodes": run["setup"].nodes,
        "per_device_train_batch_size": run["batch"],
        "lengths": [run["setup"].source_length, run["setup"].target_length],
        "lengths_from": run["lengths_from"],
        "gradient_checkpointing": run["setup"].gradient_checkpointing,
        "lora_rank": run["setup"].lora_rank,
        "quantize_base": run["setup"].quantize_base,
        "model_kind": shape.sequence_kind,  # causal: one sequence of both lengths
        "predicted_gpu_total_bytes": row["gpu_total_bytes"],
        "predicted_peak_phase": row["peak_phase"],
        "predicted_phases_gb": {name: phase["gpu_total_gb"] for name, phase in row["phases"].items()},
        # a measured training step also holds what offload's allocator gives back only when memory runs short
        "predicted_reserved_bytes": max(
            peak["gpu_total_bytes"], row["phases"]["training"]["gpu_total_bytes"] + step.get("reclaimable_bytes", 0)
        )
        - unseen,
        "predicted_allocated_bytes": peak["allocated_bytes"],
        "predicted_gpu_gb": {k: round(v / GIB, 3) for k, v in row["gpu_bytes"].items()},
        "predicted_zero3_gathered_elements": (row["zero3_residency"] or {}).get("gathered"),
    }
    if not on_gpu:
        rss = max((r.get("cpu_peak_rss_bytes", 0) for r in ranks), default=0)
        return result | {
            "comparable": False,
            "measured_cpu_peak_rss_bytes": rss,
            "ratio": None,
            "reason": "This run trained on the CPU: the prediction is of GPU memory, the measurement is the "
            "process's peak resident memory (Python, torch, the data and the model together), so "
            "no ratio is given. Runs on GPUs are compared.",
        }
    busiest = max(on_gpu, key=lambda r: r["cuda_max_reserved_bytes"])
    reserved, allocated = busiest["cuda_max_reserved_bytes"], busiest["cuda_max_allocated_bytes"]
    return result | {
        "comparable": True,
        "reason": None,
        "measured_rank": busiest.get("rank"),
        "measured_reserved_bytes": reserved,
        "measured_allocated_bytes": allocated,
        "ratio": round(reserved / result["predicted_reserved_bytes"], 3),
        "ratio_allocated": round(allocated / result["predicted_allocated_bytes"], 3),
    }


def run_setup(summary: RunSummary, max_source_length, max_target_length) -> dict:
    """What the planner predicts a finished run from: its model, its Setup (from its arguments, as `textsql plan` and
    tune build theirs: planner.states.setup_from_arguments), its ZeRO or FSDP layout, its batch and strategy."""
    try:
        training = summary.arguments["training"]
        batch = int(training["per_device_train_batch_size"])
    except (KeyError, TypeError, ValueError) as error:
        raise TextsqlError(
            f"The run summary lacks {error} needed to predict its memory; it must be a "
            f"run_summary.json written by textsql train."
        ) from None
    strategy, world, model, precision = summary.strategy, int(summary.world_size), summary.model_id, summary.precision
    hosts = {r.get("host") for r in summary.peak_memory_per_rank} - {None}
    nodes = len(hosts) if hosts and world % len(hosts) == 0 else 1
    stage = int(strategy.get("zero_stage") or 0)
    layout = (
        stage,
        strategy.get("offload_optimizer", "none") != "none",
        strategy.get("offload_param", "none") != "none",
    )
    on_gpu = any("cuda_max_reserved_bytes" in r for r in summary.peak_memory_per_rank)
    lengths, lengths_from = _run_lengths(summary, max_source_length, max_target_length, pad_multiple=8 if on_gpu else 1)
    setup = setup_from_arguments(
        {**(summary.arguments.get("data") or {}), **training},  # the run's flags, as `textsql train` parsed them
        nodes=nodes,
        gpus_per_node=world // nodes,
        source_length=lengths[0],
        target_length=lengths[1],
        precision=precision,
        settings=zero_settings(summary.deepspeed_config),
    )
    fsdp_layout = None
    if strategy.get("strategy") == "fsdp":
        fsdp_layout = (
            bool(strategy.get("reshard_after_forward", True)),
            strategy.get("offload_param", "none") != "none",
            bool(strategy.get("hybrid_shard")),
        )
    return {
        "model": model,
        "setup": setup,
        "layout": layout,
        "fsdp_layout": fsdp_layout,
        "batch": batch,
        "strategy": strategy.get("label", "none"),
        "lengths_from": lengths_from,
    }


def _run_lengths(summary, max_source_length, max_target_length, pad_multiple: int):
    """The longest source/target the run saw: given, or the prepared dataset's longest (rounded up as the collator pads)."""
    if max_source_length and max_target_length:
        return (max_source_length, max_target_length), "given"

    folder = summary.dataset.get("dir") or ""
    path = Path(folder) / METADATA_FILE
    try:
        meta = json.loads(path.read_text())
        source, target = longest_lengths(meta["lengths"]["train"])
        source = min(source, meta.get("max_source_length") or math.inf)
        target = min(target, meta.get("max_target_length") or math.inf)
    except (OSError, KeyError, TypeError, ValueError):
        raise TextsqlError(
            f"The longest sequences of the run are unknown: '{path}' (written by textsql prep) cannot be "
            f"read. Pass max_source_length and max_target_length."
        ) from None

    def pad(n):
        return int(math.ceil(n / pad_multiple) * pad_multiple)

    return (max_source_length or pad(source), max_target_length or pad(target)), str(path)
