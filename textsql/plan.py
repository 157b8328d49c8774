"""`textsql plan` and the planner's check of finished runs: the plan as a table, a chart and JSON, and a run's measured
peak memory against its prediction (textsql.memory makes the predictions)."""

from __future__ import annotations

import json
import math
import sys
import textwrap
import warnings
from pathlib import Path

from textsql.errors import TextsqlError
from textsql.extras import require_notebooks_extra
from textsql.run_summary import RunSummary
from textsql.memory import (
    COMPONENTS, GIB, PRECISIONS, PlanArguments, Setup, plan_memory, predict, resolve_model, zero_settings,
)

# ---------------------------------------------------------------------------------------------------------------------
# Output
# ---------------------------------------------------------------------------------------------------------------------

COLUMN_TITLES = {"parameters": "params", "gradients": "grads", "optimizer_states": "optim", "weight_copies": "copies",
                 "activations": "activ", "buckets": "buckets", "overhead": "overhead"}


def format_plan(plan: dict, with_problem: bool = True) -> str:
    """The plan as text: what was planned, a row per strategy (GB per GPU by component), then the recommendation."""
    m, a = plan["model"], plan["inputs"]
    lines = [
        f"model      {m['name']} ({m['source']}): {m['parameters'] / 1e6:.1f}M parameters, largest layer "
        f"{m['largest_layer_parameters'] / 1e6:.1f}M",
        f"cluster    {a['nodes']} pod(s) x {a['gpus_per_node']} GPU(s) of {a['gpu_memory_gb']:g} GB"
        + (f", {a['cpu_memory_gb']:g} GB host memory per pod" if a["cpu_memory_gb"] else ""),
        f"training   batch {a['per_device_train_batch_size']} per GPU, {a['max_source_length']}/{a['max_target_length']} "
        f"tokens, {a['precision']}, gradient checkpointing {'on' if a['gradient_checkpointing'] else 'off'}",
        f"buckets    from {plan['zero_settings_source']}",
        _zero3_line(plan["strategies"]["zero3"]["zero3_residency"]),
        "",
        "GPU memory per GPU (GB)                                                              CPU/node",
        f"{'strategy':<15}" + "".join(f"{COLUMN_TITLES[c]:>9}" for c in COMPONENTS) + f"{'TOTAL':>9}{'GB':>9}  fits",
    ]
    for name, row in plan["strategies"].items():
        fits = "yes" if row["fits_with_margin"] else ("tight" if row["fits_gpu"] and row["fits_cpu"] is not False else "no")
        lines.append(f"{name:<15}" + "".join(f"{row['gpu_gb'][c]:>9.2f}" for c in COMPONENTS)
                     + f"{row['gpu_total_gb']:>9.2f}{row['cpu_per_node_gb']:>9.1f}  {fits}")
    lines.append(f"(fits: yes = within {1 - a['safety_margin']:.0%} of the GPU{' and host' if a['cpu_memory_gb'] else ''} "
                 f"memory; tight = fits only without the safety margin)")
    lines.append("")
    rec = plan["recommendation"]
    if rec is None:
        lines.append("recommendation: none." + (f" {plan['problem']}" if with_problem else ""))
    else:
        lines.append(f"recommendation: {rec['strategy']} with batch {rec['per_device_train_batch_size']} per GPU "
                     f"({rec['predicted_gpu_gb']:.1f} GB); the largest batch that fits under {rec['strategy']} is "
                     f"{rec['largest_per_device_train_batch_size']}.")
    lines += ["", "assumptions:"]
    lines += [textwrap.fill(text, width=118, initial_indent="- ", subsequent_indent="  ", break_on_hyphens=False)
              for text in plan["assumptions"]]
    return "\n".join(lines)


def _zero3_line(residency: dict) -> str:
    used = {k.removeprefix("stage3_"): f"{v:.3g}".replace("e+0", "e").replace("e+", "e") for k, v in residency["settings"].items()}
    how = ("an upper bound: no module trace" if residency["source"].startswith("upper bound")
           else "DeepSpeed's coordinator replayed")
    return (f"ZeRO-3     {residency['gathered'] / 1e6:.1f}M parameters gathered at the peak ({how}: "
            + ", ".join(f"{k} {v}" for k, v in used.items()) + ")")


def plot_plan(plan: dict, path=None):
    """Stacked bars of each strategy's GPU memory by component, with the GPU size and the margin; saved when path is given."""
    require_notebooks_extra("matplotlib", "The plan's plot")
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(9, 4.8))
    FigureCanvasAgg(fig)  # Agg without pyplot: no global backend switch, works headless and in notebooks
    ax = fig.add_subplot()
    names = list(plan["strategies"])
    bottoms = [0.0] * len(names)
    for component in COMPONENTS:
        heights = [plan["strategies"][n]["gpu_gb"][component] for n in names]
        ax.bar(names, heights, bottom=bottoms, label=component.replace("_", " "))
        bottoms = [b + h for b, h in zip(bottoms, heights)]
    inputs = plan["inputs"]
    ax.axhline(inputs["gpu_memory_gb"], color="black", linewidth=1, label=f"GPU memory ({inputs['gpu_memory_gb']:g} GB)")
    ax.axhline(inputs["gpu_memory_gb"] * (1 - inputs["safety_margin"]), color="black", linestyle="--", linewidth=1,
               label=f"with {inputs['safety_margin']:.0%} margin")
    rec = plan["recommendation"]
    title = f"{plan['model']['name']}, {inputs['nodes']} x {inputs['gpus_per_node']} GPU, batch {inputs['per_device_train_batch_size']}, {inputs['precision']}"
    ax.set_title(title + (f": {rec['strategy']} recommended" if rec else ": nothing fits"))
    ax.set_ylabel("predicted peak GPU memory per GPU (GB)")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1))
    fig.tight_layout()
    if path is not None:
        fig.savefig(path)
    return fig


def plan_cli(argv) -> int:
    """Body of `textsql plan ...`: print the table (or --json), 0 when a strategy fits, 2 with a message otherwise."""
    from textsql.cli import parse_arguments
    from textsql.dsconfig import DsConfigWarning

    try:
        args = parse_arguments(PlanArguments, "plan", argv)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", DsConfigWarning)
            plan = plan_memory(args)
    except TextsqlError as error:
        print(f"textsql plan: {error}", file=sys.stderr)
        return 2
    for warning in caught:
        if issubclass(warning.category, DsConfigWarning):
            print(f"textsql plan: warning: {args.dsconfig}: {warning.message}", file=sys.stderr)
    print(json.dumps(_public(plan), indent=2) if args.json else format_plan(plan, with_problem=False))
    if plan["recommendation"] is None:
        print(f"textsql plan: {plan['problem']}", file=sys.stderr)
        return 2
    return 0


def _public(plan: dict) -> dict:
    return json.loads(json.dumps(plan, default=str))


# ---------------------------------------------------------------------------------------------------------------------
# Checking a finished run
# ---------------------------------------------------------------------------------------------------------------------


def compare_with_run(summary: RunSummary, max_source_length: int | None = None, max_target_length: int | None = None) -> dict:
    """Predict the peak memory of a finished run (run_summary.json) and compare it with what was measured.

    ratio = measured / predicted, comparing torch's peak reserved memory on the busiest rank with the predicted total
    less the CUDA context and NCCL buffers (which torch does not count). On a CPU run the prediction is of GPU memory
    and the measurement is the process's peak RSS, so the result says `comparable: false` and why.
    """
    try:
        run = _run_setup(summary, max_source_length, max_target_length)
        shape = resolve_model(run["model"])
    except TextsqlError as error:
        return {"comparable": False, "reason": str(error), "ratio": None}
    row = predict(shape, run["setup"], *run["layout"], run["batch"])
    ranks = summary.peak_memory_per_rank
    on_gpu = [r for r in ranks if "cuda_max_reserved_bytes" in r]
    result = {
        "strategy": run["strategy"], "precision": run["setup"].precision, "world_size": run["setup"].gpus,
        "nodes": run["setup"].nodes, "per_device_train_batch_size": run["batch"],
        "lengths": [run["setup"].source_length, run["setup"].target_length], "lengths_from": run["lengths_from"],
        "gradient_checkpointing": run["setup"].gradient_checkpointing,
        "predicted_gpu_total_bytes": row["gpu_total_bytes"], "predicted_reserved_bytes": row["torch_reserved_bytes"],
        "predicted_allocated_bytes": row["torch_allocated_bytes"],
        "predicted_gpu_gb": {k: round(v / GIB, 3) for k, v in row["gpu_bytes"].items()},
        "predicted_zero3_gathered_elements": (row["zero3_residency"] or {}).get("gathered"),
    }
    if not on_gpu:
        rss = max((r.get("cpu_peak_rss_bytes", 0) for r in ranks), default=0)
        return result | {"comparable": False, "measured_cpu_peak_rss_bytes": rss, "ratio": None,
                         "reason": "This run trained on the CPU: the prediction is of GPU memory, the measurement is the "
                                   "process's peak resident memory (Python, torch, the data and the model together), so "
                                   "no ratio is given. Runs on GPUs are compared."}
    busiest = max(on_gpu, key=lambda r: r["cuda_max_reserved_bytes"])
    reserved, allocated = busiest["cuda_max_reserved_bytes"], busiest["cuda_max_allocated_bytes"]
    return result | {
        "comparable": True, "reason": None, "measured_rank": busiest.get("rank"),
        "measured_reserved_bytes": reserved, "measured_allocated_bytes": allocated,
        "ratio": round(reserved / row["torch_reserved_bytes"], 3),
        "ratio_allocated": round(allocated / row["torch_allocated_bytes"], 3),
    }


def format_comparison(result: dict) -> str:
    """One line for the run summary: measured vs predicted GPU memory and the ratio, or why there is none."""
    if not result.get("comparable"):
        return f"memory check   not comparable: {result.get('reason')}"
    return (f"memory check   rank {result['measured_rank']} reserved {result['measured_reserved_bytes'] / GIB:.2f} GB, "
            f"planner predicted {result['predicted_reserved_bytes'] / GIB:.2f} GB (+ context: "
            f"{result['predicted_gpu_total_bytes'] / GIB:.2f} GB): measured/predicted {result['ratio']:.2f}")


def _run_setup(summary: RunSummary, max_source_length, max_target_length) -> dict:
    try:
        training = summary.arguments["training"]
        batch = int(training["per_device_train_batch_size"])
    except (KeyError, TypeError, ValueError) as error:
        raise TextsqlError(f"The run summary lacks {error} needed to predict its memory; it must be a "
                           f"run_summary.json written by textsql train.") from None
    strategy, world, model, precision = summary.strategy, int(summary.world_size), summary.model_id, summary.precision
    hosts = {r.get("host") for r in summary.peak_memory_per_rank} - {None}
    nodes = len(hosts) if hosts and world % len(hosts) == 0 else 1
    stage = int(strategy.get("zero_stage") or 0)
    layout = (stage, strategy.get("offload_optimizer", "none") != "none", strategy.get("offload_param", "none") != "none")
    checkpointing = bool(training.get("activation_checkpointing") or training.get("gradient_checkpointing"))
    on_gpu = any("cuda_max_reserved_bytes" in r for r in summary.peak_memory_per_rank)
    lengths, lengths_from = _run_lengths(summary, max_source_length, max_target_length, pad_multiple=8 if on_gpu else 1)
    settings = zero_settings(summary.deepspeed_config)
    setup = Setup(nodes, world // nodes, lengths[0], lengths[1], precision if precision in PRECISIONS else "fp32",
                  checkpointing, tuple(sorted(settings.items())))
    return {"model": model, "setup": setup, "layout": layout, "batch": batch, "strategy": strategy.get("label", "none"),
            "lengths_from": lengths_from}


def _run_lengths(summary, max_source_length, max_target_length, pad_multiple: int):
    """The longest source/target the run saw: given, or the prepared dataset's longest (rounded up as the collator pads)."""
    if max_source_length and max_target_length:
        return (max_source_length, max_target_length), "given"
    from textsql.data import METADATA_FILE

    folder = summary.dataset.get("dir") or ""
    path = Path(folder) / METADATA_FILE
    try:
        meta = json.loads(path.read_text())
        train = meta["lengths"]["train"]
        source = min(train["source_percentiles"]["p100"], meta.get("max_source_length") or math.inf)
        target = min(train["target_percentiles"]["p100"], meta.get("max_target_length") or math.inf)
    except (OSError, KeyError, TypeError, ValueError):
        raise TextsqlError(f"The longest sequences of the run are unknown: '{path}' (written by textsql prep) cannot be "
                           f"read. Pass max_source_length and max_target_length.") from None

    def pad(n):
        return int(math.ceil(n / pad_multiple) * pad_multiple)

    return (max_source_length or pad(source), max_target_length or pad(target)), str(path)
