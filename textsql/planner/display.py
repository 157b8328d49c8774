"""The memory plan for people: a table of GB per GPU by component for every strategy, the recommendation, and a chart."""

from __future__ import annotations

import textwrap

from textsql.extras import require_notebooks_extra
from textsql.planner.phases import COMPONENTS
from textsql.planner.recommend import host_memory_words
from textsql.planner.shape import GIB
from textsql.strategy.table import NVME_STRATEGIES

COLUMN_TITLES = {
    "parameters": "params",
    "gradients": "grads",
    "optimizer_states": "optim",
    "weight_copies": "copies",
    "activations": "activ",
    "buckets": "buckets",
    "overhead": "overhead",
}


def format_plan(plan: dict, with_problem: bool = True, with_assumptions: bool = True) -> str:
    """The plan as text: what was planned, a row per strategy (GB per GPU by component), then the recommendation."""
    m, a = plan["model"], plan["inputs"]
    width = strategy_column_width(plan)
    lines = [
        f"model      {m['name']} ({m['source']}): {m['parameters'] / 1e6:.1f}M parameters, largest layer "
        f"{m['largest_layer_parameters'] / 1e6:.1f}M",
        f"cluster    {a['nodes']} pod(s) x {a['gpus_per_node']} GPU(s) of {a['gpu_memory_gb']:g} GB"
        + f", {host_memory_words(a['cpu_memory_gb'], a.get('cpu_memory_assumed', False))}",
        f"training   batch {a['per_device_train_batch_size']} per GPU, {a['max_source_length']}/{a['max_target_length']} "
        f"tokens, {a['precision']}, gradient checkpointing {'on' if a['activation_checkpointing'] else 'off'}",
        f"evaluation batch {a['per_device_eval_batch_size']} per GPU, "
        + (
            f"generating SQL with {a['execution_accuracy_num_beams']} beam(s)"
            if a["execution_accuracy_num_beams"]
            else "loss only (no generation)"
        ),
        f"buckets    from {plan['zero_settings_source']}",
        _zero3_line(plan["strategies"]["zero3"]["zero3_residency"]),
        *_nvme_lines(plan["strategies"]),
        "",
        "GPU memory per GPU (GB): the training step by component, then the run's peak over its phases    CPU/node",
        f"{'strategy':<{width}}"
        + "".join(f"{COLUMN_TITLES[c]:>9}" for c in COMPONENTS)
        + f"{'step':>9}{'PEAK':>9}  {'peak phase':<16}{'GB':>7}  {'host peak':<16}fits",
    ]
    lines += _rows(plan["strategies"], width)
    lora = plan.get("lora")
    if lora:
        lines.append(
            f"with LoRA r={lora['rank']} on {lora['targets']} ({lora['adapted_layers']} layers, "
            f"{lora['trainable_parameters'] / 1e6:.2f}M trainable parameters, "
            f"{lora['trainable_parameters'] / m['parameters']:.2%} of the model)"
        )
        lines += _rows(lora["strategies"], width)
    qlora = plan.get("qlora")
    if qlora:
        base = qlora["quantized_base"]
        lines.append(
            f"with QLoRA: the same adapter on the base in {qlora['quantize_base']} ({base['weights'] / 1e6:.1f}M "
            f"weights quantized: {base['quantized'] / GIB:.2f} GB; {base['other_parameters'] / 1e6:.1f}M parameters "
            f"left in fp32: {base['other'] / GIB:.2f} GB)"
        )
        lines += _rows(qlora["strategies"], width)
    lines.append(
        "(phases: training step, evaluation (loss, and generate() when it generates SQL), checkpoint_save, final_save "
        "(fp32); PEAK is the largest, and it decides fits and the recommendation)"
    )
    lines.append(
        f"(fits: yes = within {1 - a['safety_margin']:.0%} of the GPU and host "
        f"memory; tight = fits only without the safety margin)"
    )
    lines += ["", *_recommendation_lines(plan, with_problem)]
    if with_assumptions:
        lines += ["", "assumptions:"]
        lines += [
            textwrap.fill(text, width=118, initial_indent="- ", subsequent_indent="  ", break_on_hyphens=False)
            for text in plan["assumptions"]
        ]
    else:
        lines.append(f"({len(plan['assumptions'])} assumptions behind these numbers: `textsql plan ... --assumptions`)")
    return "\n".join(lines)


def _recommendation_lines(plan: dict, with_problem: bool) -> list[str]:
    """The recommendation, its command and alternative, and what LoRA and QLoRA would need where they were planned."""
    rec, lora, qlora = plan["recommendation"], plan.get("lora"), plan.get("qlora")
    lines = []
    if rec is None:
        lines.append("recommendation: nothing fits." + (f" {plan['problem']}" if with_problem else ""))
    else:
        quantized = rec.get("quantize_base", "none") != "none"
        what = (
            (f"QLoRA ({rec['quantize_base']} base)" if quantized else "LoRA") + f" under {rec['strategy']}"
            if rec.get("lora")
            else strategy_words(rec["strategy"])
        )
        lines.append(
            f"recommendation: {what} with batch {rec['per_device_train_batch_size']} per GPU "
            f"({rec['predicted_gpu_gb']:.1f} GB, peak in {rec['peak_phase']}); the largest batch that fits under {rec['strategy']} is "
            f"{rec['largest_per_device_train_batch_size']}." + (f" Why: {rec['reason']}." if rec.get("lora") else "")
        )
        if rec.get("alternative"):
            lines.append(f"alternative: {rec['alternative']}.")
        if rec.get("command"):
            on_pods = plan["inputs"]["nodes"] > 1
            lines.append(
                f"command{' (on every pod, through textsql cluster: docs/multi-pod.md)' if on_pods else ''}: "
                + rec["command"]
            )
    if lora:
        if not rec or not rec.get("lora"):
            best = lora.get("recommendation")
            lines.append(
                "LoRA: fits under no strategy either."
                if best is None
                else f"LoRA: fastest fitting strategy {best['strategy']} ({best['predicted_gpu_gb']:.1f} GB), largest "
                f"batch {best['largest_per_device_train_batch_size']}."
            )
        lines.append(textwrap.fill(f"LoRA with offload: {lora['offload_note']}", width=118, subsequent_indent="  "))
    if qlora and not (rec or {}).get("quantize_base", "none") != "none":
        best = qlora.get("recommendation")
        lines.append(
            "QLoRA: fits under no strategy either."
            if best is None
            else f"QLoRA: fastest fitting strategy {best['strategy']} ({best['predicted_gpu_gb']:.1f} GB), largest "
            f"batch {best['largest_per_device_train_batch_size']}."
        )
    return lines


def strategy_words(name: str) -> str:
    """A strategy's name as a recommendation reads it: "none" alone would read as "no recommendation"."""
    if name in NVME_STRATEGIES:
        return (
            f"{name} (ZeRO-Infinity: textsql train --deepspeed {name} --nvme_path DIR, a folder on a local NVMe drive)"
        )
    return "none (no DeepSpeed: plain PyTorch, DDP across GPUs)" if name == "none" else name


def strategy_column_width(plan: dict) -> int:
    """The strategy column's width: the longest name (fsdp_full_shard_offload) and a space, at least 15."""
    names = [*plan["strategies"], *((plan.get("lora") or {}).get("strategies") or {})]
    return max(15, *(len(name) + 1 for name in names))


def _rows(strategies: dict, width: int) -> list[str]:
    lines = []
    for name, row in strategies.items():
        fits = (
            "yes"
            if row["fits_with_margin"]
            else ("tight" if row["fits_gpu"] and row["fits_cpu"] is not False else "no")
        )
        lines.append(
            f"{name:<{width}}"
            + "".join(f"{row['gpu_gb'][c]:>9.2f}" for c in COMPONENTS)
            + f"{row['training_gpu_total_bytes'] / GIB:>9.2f}{row['gpu_total_gb']:>9.2f}  {row['peak_phase']:<16}"
            + f"{row['cpu_per_node_gb']:>7.1f}  {row['cpu_peak_phase']:<16}{fits}"
        )
    return lines


def _nvme_lines(strategies: dict) -> list[str]:
    """What each NVMe row keeps where: the GPU as under zero3_offload, the host, the disk, and the disk traffic."""
    lines = []
    for name, row in strategies.items():
        nvme = row.get("nvme")
        if not nvme:
            continue
        text = (
            f"NVMe       {name}: the GPU holds what it holds under zero3_offload; the host "
            f"{row.get('training_cpu_per_node_bytes', row['cpu_per_node_bytes']) / GIB:.1f} GB per pod in the training "
            f"step (pinned swap buffers {(nvme['host_detail']['optimizer_swap_buffers'] + nvme['host_detail']['param_swap_buffers']) / GIB:.1f}, "
            f"fp32 gradient partitions {nvme['host_detail']['fp32_gradient_partitions'] / GIB:.1f}, processes); the disk at "
            f"--nvme_path {nvme['disk_bytes'] / GIB:.1f} GB per pod (16-bit parameters, fp32 master weights and Adam "
            f"moments); {nvme['traffic_per_step_bytes'] / GIB:.1f} GB read and written per step: at least "
            f"{nvme['seconds_per_step_at_least']:.1f} s per step at {nvme['gb_per_s']:g} GB/s (--nvme_gb_per_s, "
            "assumed: one PCIe NVMe drive)"
        )
        lines += textwrap.wrap(text, width=118, subsequent_indent=" " * 11, break_on_hyphens=False)
    return lines


def _zero3_line(residency: dict) -> str:
    used = {
        k.removeprefix("stage3_"): f"{v:.3g}".replace("e+0", "e").replace("e+", "e")
        for k, v in residency["settings"].items()
    }
    how = (
        "an upper bound: no module trace"
        if residency["source"].startswith("upper bound")
        else "DeepSpeed's coordinator replayed"
    )
    return (
        f"ZeRO-3     {residency['gathered'] / 1e6:.1f}M parameters gathered at the peak ({how}: "
        + ", ".join(f"{k} {v}" for k, v in used.items())
        + ")"
    )


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
    peaks = [plan["strategies"][n]["gpu_total_gb"] for n in names]
    ax.scatter(names, peaks, marker="_", s=400, color="black", label="peak over the run's phases")
    inputs = plan["inputs"]
    ax.axhline(
        inputs["gpu_memory_gb"], color="black", linewidth=1, label=f"GPU memory ({inputs['gpu_memory_gb']:g} GB)"
    )
    ax.axhline(
        inputs["gpu_memory_gb"] * (1 - inputs["safety_margin"]),
        color="black",
        linestyle="--",
        linewidth=1,
        label=f"with {inputs['safety_margin']:.0%} margin",
    )
    rec = plan["recommendation"]
    title = f"{plan['model']['name']}, {inputs['nodes']} x {inputs['gpus_per_node']} GPU, batch {inputs['per_device_train_batch_size']}, {inputs['precision']}"
    ax.set_title(title + (f": {rec['strategy']} recommended" if rec else ": nothing fits"))
    ax.set_ylabel("predicted peak GPU memory per GPU (GB)")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1))
    fig.tight_layout()
    if path is not None:
        fig.savefig(path)
    return fig
