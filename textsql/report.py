"""The benchmark report: every run under a runs root as one table row, saved as Markdown and CSV, with PNG plots.

The table has the walkthrough's shape (model x technique x nodes -> duration, memory per pod) plus what it lacked:
samples/s, real tokens/s, the memory planner's error, eval loss and SQL execution accuracy. Each row comes from a run's `run_summary.json`
(written by `textsql train`, with the memory planner's check of the run) and, where present, the `eval_metrics.json`
beside it (written by `textsql infer`).
`textsql report` and notebooks/benchmark_report.ipynb both call build_report.
"""

from __future__ import annotations

import json
import logging
import math
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from textsql.errors import TextsqlError
from textsql.extras import require_notebooks_extra
from textsql.paths import METRICS_FILE as EVAL_METRICS_FILE
from textsql.paths import REPORT_DIR, SUMMARY_FILE, in_project
from textsql.run_summary import GIB, RunSummary, accuracy_questions, read_summary
from textsql.strategy.table import strategy_rank
from textsql.tracking import download_summaries
from textsql.wikisql.sql import COMPONENTS

logger = logging.getLogger(__name__)

TABLE_MD, TABLE_CSV = "report.md", "report.csv"
GRPO_COLUMNS = ("stage", "reward")
TIME_MEMORY_PNG, LOSS_PNG = "time_memory.png", "loss_curves.png"
LOSS_TAGS = ("train/loss", "eval/loss")

# column -> Markdown header, in table order
COLUMNS = {
    "model": "model",
    "technique": "technique",
    # --stage grpo (run_summary's grpo): the stage and its last logged mean reward (textsql.rewards' weighted sum)
    "stage": "stage",
    "reward": "reward",
    "nodes": "nodes",
    "world_size": "ranks",
    "epochs": "epochs",
    "duration_s": "duration (s)",
    "samples_per_s": "samples/s",
    "real_tokens_per_s": "real tokens/s",
    # --flops_profiler's step where a run was profiled, else every run's model FLOPs at the real lengths (run_summary's
    # mfu): TFLOPS per GPU and MFU against the GPU's peak
    "tflops_per_gpu": "TFLOPS per GPU",
    "mfu": "MFU",
    "memory_per_pod_gib": "memory per pod (GiB)",
    "memory_measure": "memory measured",
    "planned_memory_gib": "planner (GiB)",
    "memory_vs_plan": "measured / planned",
    "eval_loss": "eval loss",
    "execution_accuracy": "execution accuracy",
    "logical_form_accuracy": "logical form",
    "accuracy_split": "accuracy on",
    "decoding": "decoding",
    # The parts of the query right (textsql.wikisql.sql.COMPONENTS), from `textsql infer`'s eval_metrics.json.
    "select_column": "sel",
    "aggregation": "agg",
    "where_number": "W#",
    "where_column": "Wcol",
    "where_operator": "Wop",
    "where_value": "Wval",
    "precision": "precision",
    "run": "run",
}


@dataclass
class RunRecord:
    """One finished run: its folder, its summary and (if any) its eval metrics."""

    folder: Path
    summary: RunSummary
    eval_metrics: dict | None = None


@dataclass
class Report:
    """What build_report made: the table (a pandas DataFrame), its Markdown text, and the files written."""

    table: object
    markdown: str
    runs: list[RunRecord]
    files: dict[str, Path] = field(default_factory=dict)
    plots: dict[str, Path] = field(default_factory=dict)
    skipped: list[str] = field(default_factory=list)


# ---------------------------------------------------------------------------------------------------------------------
# Collecting runs
# ---------------------------------------------------------------------------------------------------------------------


def find_runs(runs_root: str | Path, *, skipped: list[str] | None = None) -> list[RunRecord]:
    """Every run folder under runs_root that holds a readable run_summary.json, with its eval_metrics.json if present.

    Unreadable files are left out and described in `skipped` (when given) rather than stopping the report.
    """
    root = Path(runs_root)
    if not root.is_dir():
        raise TextsqlError(
            f"The runs root '{root}' does not exist ({root.absolute()}). Train first (`textsql train "
            f"--runs_root {root}`) or pass --runs_root."
        )
    records = []
    for path in sorted(root.rglob(SUMMARY_FILE)):
        try:
            summary = read_summary(path)
        except TextsqlError as error:
            _skip(skipped, str(error))
            continue
        eval_metrics = None
        metrics_path = path.parent / EVAL_METRICS_FILE
        if metrics_path.is_file():
            try:
                eval_metrics = json.loads(metrics_path.read_text())
            except (OSError, ValueError) as error:
                _skip(skipped, f"{metrics_path}: unreadable ({error}); the run is reported without it")
        records.append(RunRecord(path.parent, summary, eval_metrics))
    return records


def _skip(skipped: list[str] | None, message: str) -> None:
    logger.warning("%s", message)
    if skipped is not None:
        skipped.append(message)


# ---------------------------------------------------------------------------------------------------------------------
# One row per run
# ---------------------------------------------------------------------------------------------------------------------


def memory_per_pod(summary: RunSummary) -> tuple[float | None, str]:
    """(GiB, what was measured): the max over ranks of CUDA reserved memory, or of peak RSS on a CPU-only run."""
    ranks = summary.peak_memory_per_rank
    gpu = [m["cuda_max_reserved_bytes"] for m in ranks if m.get("cuda_max_reserved_bytes") is not None]
    if gpu:
        return max(gpu) / GIB, "GPU reserved (max over ranks)"
    rss = [m["cpu_peak_rss_bytes"] for m in ranks if m.get("cpu_peak_rss_bytes") is not None]
    if rss:
        return max(rss) / GIB, "CPU peak RSS (max over ranks)"
    return None, "not recorded"


def planner_check(summary: RunSummary) -> tuple[float | None, float | None]:
    """(planned GiB, measured / planned) from the summary's memory_check (textsql.planner.check.compare_with_run), where the two are comparable (GPU runs)."""
    check = summary.memory_check or {}
    if not check.get("comparable") or not check.get("predicted_reserved_bytes"):
        return None, None
    return check["predicted_reserved_bytes"] / GIB, _number(check.get("ratio"))


def flops_columns(summary: RunSummary) -> dict:
    """TFLOPS per GPU and MFU of the step --flops_profiler profiled (the count the user asked for), else of
    the whole run from the model's FLOPs (run_summary's mfu); None without either, MFU None without a known peak."""
    profile = summary.flops_profile or {}
    figures = profile if profile.get("profiled") else summary.mfu or {}
    return {"tflops_per_gpu": _number(figures.get("tflops_per_gpu")), "mfu": _number(figures.get("mfu"))}


def execution_accuracy(record: RunRecord) -> tuple[float | None, str | None]:
    """(accuracy, what it was measured on).

    From eval_metrics.json (`textsql infer`: a whole split) where present, else from the run summary (the final
    weights, scored at the end of training on the first --execution_accuracy_samples validation questions), else
    (None, None).
    """
    metrics = record.eval_metrics or {}
    if metrics.get("execution_accuracy") is not None:
        examples = metrics.get("examples")
        split = metrics.get("split") or "?"
        return float(metrics["execution_accuracy"]), f"{split} ({examples} questions)" if examples else split
    if record.summary.execution_accuracy is not None:
        questions = accuracy_questions(record.summary)
        return float(record.summary.execution_accuracy), (
            f"validation ({questions} questions, end of training)" if questions else "validation (end of training)"
        )
    return None, None


def sql_quality(record: RunRecord) -> dict:
    """Logical-form accuracy, decoding and the component accuracies of the run's eval_metrics.json (all None without one)."""
    metrics = record.eval_metrics or {}
    components = metrics.get("components") or {}
    decoding = metrics.get("decoding")
    return {
        "logical_form_accuracy": _number(metrics.get("logical_form_accuracy")),
        "decoding": decoding.get("label") if isinstance(decoding, dict) else decoding,
        **{name: _number(components.get(name)) for name in COMPONENTS},
    }


def report_row(record: RunRecord) -> dict:
    s = record.summary
    memory, measure = memory_per_pod(s)
    accuracy, split = execution_accuracy(record)
    planned, vs_plan = planner_check(s)
    return {
        "model": Path(str(s.model_id or "?").rstrip("/")).name,
        "technique": s.strategy_label + (f" + LoRA r{s.lora['rank']}" if s.lora else ""),
        "stage": (s.grpo or {}).get("stage", "sft"),
        "reward": _number((s.grpo or {}).get("reward")),
        "nodes": s.nodes,
        "world_size": int(s.world_size or 1),
        "epochs": _number(s.epochs),
        "duration_s": _number(s.train_runtime),
        "samples_per_s": _number(s.train_samples_per_second),
        "real_tokens_per_s": _number(s.real_tokens_per_second),
        **flops_columns(s),
        "memory_per_pod_gib": memory,
        "memory_measure": measure,
        "planned_memory_gib": planned,
        "memory_vs_plan": vs_plan,
        "eval_loss": _number(s.eval_loss),
        "execution_accuracy": accuracy,
        "accuracy_split": split,
        **sql_quality(record),
        "precision": s.precision,
        "run": s.run or record.folder.name,
    }


def _number(value) -> float | None:
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return number if math.isfinite(number) else None


def sort_records(records: list[RunRecord]) -> list[RunRecord]:
    """Table order: model, nodes, ranks, technique (none, ZeRO-1, 2, 3, ...), run name."""

    def key(record):
        row = report_row(record)
        strategy = row["technique"].split(" + ")[0]  # a LoRA run sorts beside its strategy
        return (row["model"], row["nodes"], row["world_size"], strategy_rank(strategy), row["technique"], row["run"])

    return sorted(records, key=key)


def build_table(records: list[RunRecord]):
    """The report as a pandas DataFrame, one row per run, in the order of `records`; the GRPO columns only where a
    run is a GRPO run (every other run is "sft" with no reward: two columns of nothing)."""
    import pandas as pd

    table = pd.DataFrame([report_row(r) for r in records], columns=list(COLUMNS))
    if (table["stage"] == "sft").all():
        table = table.drop(columns=list(GRPO_COLUMNS))
    return table


# ---------------------------------------------------------------------------------------------------------------------
# Markdown and CSV
# ---------------------------------------------------------------------------------------------------------------------

DECIMALS = {
    "epochs": 2,
    "duration_s": 1,
    "samples_per_s": 1,
    "real_tokens_per_s": 0,
    "tflops_per_gpu": 4,
    "memory_per_pod_gib": 2,
    "planned_memory_gib": 2,
    "memory_vs_plan": 2,
    "eval_loss": 4,
    "reward": 3,
}
# Shares shown as percentages in the Markdown, as everywhere else textsql prints them (the CSV keeps the fractions).
PERCENTAGES = {"execution_accuracy", "logical_form_accuracy", "mfu", *COMPONENTS}


def to_markdown(table) -> str:
    """A GitHub Markdown table with the walkthrough-style headers (no extra dependency)."""
    headers = [COLUMNS[c] for c in table.columns]
    lines = [
        "| " + " | ".join(headers) + " |",
        "|" + "|".join("---:" if _numeric(table, c) else "---" for c in table.columns) + "|",
    ]
    for _, row in table.iterrows():
        lines.append("| " + " | ".join(_cell(row[c], c) for c in table.columns) + " |")
    return "\n".join(lines)


def _numeric(table, column) -> bool:
    return column in DECIMALS or column in ("nodes", "world_size")


def _cell(value, column) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "–"
    if column in PERCENTAGES:
        return f"{float(value):.1%}"
    if column in DECIMALS:
        return f"{float(value):,.{DECIMALS[column]}f}"
    return str(value).replace("|", "\\|")


# ---------------------------------------------------------------------------------------------------------------------
# Plots (matplotlib's object API: no pyplot state, works headless and in notebooks)
# ---------------------------------------------------------------------------------------------------------------------


PLOTS_PURPOSE = "The report's plots (`textsql report --no_plots` writes only the table)"


def row_label(row) -> str:
    return f"{row['model']} · {row['technique']} · {row['nodes']} node{'s' if row['nodes'] != 1 else ''} / {row['world_size']} rank{'s' if row['world_size'] != 1 else ''}"


def plot_time_and_memory(table, path: Path) -> Path:
    """Three horizontal bar charts, one bar per run: duration, samples/s and memory per pod."""
    require_notebooks_extra("matplotlib", PLOTS_PURPOSE)
    from matplotlib.figure import Figure

    labels = [row_label(row) for _, row in table.iterrows()]
    colors = [f"C{strategy_rank(t.split(' + ')[0])}" for t in table["technique"]]
    measures = set(table["memory_measure"])
    memory_label = "memory per pod (GiB)" + (
        f"\n{measures.pop()}" if len(measures) == 1 else "\nsee table: GPU reserved or CPU RSS"
    )
    panels = [
        ("duration_s", "train runtime (s)"),
        ("samples_per_s", "samples/s (all ranks)"),
        ("memory_per_pod_gib", memory_label),
    ]
    height = 2.6 + 0.45 * len(table)
    figure = Figure(figsize=(15, height), dpi=100, layout="constrained")
    axes = figure.subplots(1, len(panels), sharey=True)
    positions = list(range(len(table)))
    for axis, (column, title) in zip(axes, panels):
        values = [0.0 if v is None or (isinstance(v, float) and math.isnan(v)) else float(v) for v in table[column]]
        bars = axis.barh(positions, values, color=colors)
        axis.bar_label(bars, labels=[_cell(v, column) for v in table[column]], padding=3, fontsize=8)
        axis.set_title(title, fontsize=10)
        axis.margins(x=0.25)
        axis.grid(axis="x", alpha=0.3)
        if column == "memory_per_pod_gib" and table["planned_memory_gib"].notna().any():
            planned = [
                (p, v) for p, v in zip(positions, table["planned_memory_gib"]) if v is not None and not math.isnan(v)
            ]
            axis.scatter(
                [v for _, v in planned],
                [p for p, _ in planned],
                marker="|",
                s=400,
                color="black",
                zorder=3,
                label="planner",
            )
            axis.legend(fontsize=8, loc="lower right")
    axes[0].set_yticks(positions, labels, fontsize=8)
    axes[0].invert_yaxis()
    figure.suptitle("Time and memory per strategy", fontsize=12)
    figure.savefig(path)
    return path


def run_event_dirs(record: RunRecord) -> list[Path]:
    """Folders holding the run's TensorBoard event files: <run>/tensorboard, else the summary's path, else the run folder."""
    candidates = [record.folder / "tensorboard"]
    recorded = record.summary.tensorboard_dir
    if recorded:
        candidates.append(Path(recorded))
    candidates.append(record.folder)  # e.g. output_dir/runs/<time>_<host>/ when the logging dir was not set
    for base in candidates:
        if base.is_dir():
            dirs = sorted({p.parent for p in base.rglob("events.out.tfevents.*")})
            if dirs:
                return dirs
    return []


def load_scalars(event_dirs: list[Path], tags=LOSS_TAGS) -> dict[str, list[tuple[int, float]]]:
    """tag -> [(step, value)] sorted by step, merged over the event folders (a resumed run's later values win)."""
    from tensorboard.backend.event_processing.event_accumulator import SCALARS, EventAccumulator

    by_tag: dict[str, dict[int, tuple[float, float]]] = {tag: {} for tag in tags}
    for folder in event_dirs:
        accumulator = EventAccumulator(str(folder), size_guidance={SCALARS: 0})
        accumulator.Reload()
        available = set(accumulator.Tags().get("scalars", []))
        for tag in tags:
            if tag not in available:
                continue
            for event in accumulator.Scalars(tag):
                previous = by_tag[tag].get(event.step)
                if previous is None or event.wall_time >= previous[0]:
                    by_tag[tag][event.step] = (event.wall_time, event.value)
    return {
        tag: sorted((step, value) for step, (_, value) in points.items()) for tag, points in by_tag.items() if points
    }


def plot_loss_curves(records: list[RunRecord], table, path: Path) -> Path:
    """Training loss (lines) and eval loss (markers) against the step, one colour per run, from the TensorBoard events.

    `records` and the rows of `table` are in the same order.
    """
    require_notebooks_extra("matplotlib", PLOTS_PURPOSE)
    from matplotlib.figure import Figure

    figure = Figure(figsize=(10, 5.5), dpi=100, layout="constrained")
    axis = figure.subplots()
    plotted = 0
    for index, (record, (_, row)) in enumerate(zip(records, table.iterrows())):
        scalars = load_scalars(run_event_dirs(record))
        # Runs with the same maths (e.g. ZeRO-2 on one rank vs no DeepSpeed) overlap: earlier runs are drawn wider.
        color, label, width = f"C{index % 10}", row_label(row), max(1.2, 4.0 - 1.2 * index)
        if "train/loss" in scalars:
            steps, values = zip(*scalars["train/loss"])
            axis.plot(steps, values, color=color, linewidth=width, alpha=0.85, label=f"{label}: train")
            plotted += 1
        if "eval/loss" in scalars:
            steps, values = zip(*scalars["eval/loss"])
            axis.plot(
                steps,
                values,
                color=color,
                linewidth=width / 2,
                linestyle="--",
                marker="o",
                markersize=3 + width,
                alpha=0.85,
                label=f"{label}: eval",
            )
            plotted += 1
    if plotted:
        axis.legend(fontsize=8)
    else:
        axis.text(
            0.5,
            0.5,
            "no loss scalars in the runs' TensorBoard events",
            ha="center",
            va="center",
            transform=axis.transAxes,
        )
    axis.set_xlabel("step")
    axis.set_ylabel("loss")
    axis.set_title("Loss curves (TensorBoard events)")
    axis.grid(alpha=0.3)
    figure.savefig(path)
    return path


# ---------------------------------------------------------------------------------------------------------------------
# The whole report
# ---------------------------------------------------------------------------------------------------------------------


def build_report(
    runs_root: str | Path = "runs",
    output_dir: str | Path | None = None,
    *,
    plots: bool = True,
    mlflow_experiment: str | None = None,
) -> Report:
    """Collect every run under runs_root, save report.md, report.csv and the PNG plots in output_dir.

    output_dir defaults to <runs_root>/report. Returns a Report (its `table` is a pandas DataFrame). With
    `mlflow_experiment`, the runs are those of that MLflow experiment (textsql.tracking: $MLFLOW_TRACKING_URI, else
    the local store under runs_root), their summaries fetched into a temporary folder.
    """
    runs_root = Path(in_project(str(runs_root)))  # the project's runs/, from notebooks/ too
    if mlflow_experiment:
        with tempfile.TemporaryDirectory(prefix="textsql-mlflow-") as fetched:
            download_summaries(mlflow_experiment, Path(fetched), runs_root)
            return build_report(fetched, output_dir or runs_root / REPORT_DIR, plots=plots)
    skipped: list[str] = []
    records = find_runs(runs_root, skipped=skipped)
    if not records:
        raise TextsqlError(
            f"No finished runs under {runs_root.absolute()} (no {SUMMARY_FILE} found). Train first, or "
            "pass the right --runs_root."
        )
    records = sort_records(records)
    table = build_table(records)
    out = Path(output_dir) if output_dir is not None else Path(runs_root) / REPORT_DIR
    out.mkdir(parents=True, exist_ok=True)
    report = Report(table=table, markdown=to_markdown(table), runs=records, skipped=skipped)
    if plots:
        report.plots["time_memory"] = plot_time_and_memory(table, out / TIME_MEMORY_PNG)
        report.plots["loss_curves"] = plot_loss_curves(records, table, out / LOSS_PNG)
    report.files["csv"] = out / TABLE_CSV
    table.to_csv(report.files["csv"], index=False)
    report.files["markdown"] = out / TABLE_MD
    report.files["markdown"].write_text(_markdown_document(report, runs_root))
    return report


def _markdown_document(report: Report, runs_root) -> str:
    parts = [f"# Benchmark report: {len(report.table)} runs under `{runs_root}`", "", report.markdown, ""]
    parts.append(
        "Memory per pod is the largest value over the ranks: CUDA reserved memory on GPUs, peak resident memory on a "
        "CPU-only run. The planner column is textsql's memory planner's prediction of that reserved memory for the run's "
        "settings (GPU runs only) and the next its error as measured / planned. Nodes are the distinct hosts among the "
        "ranks. Execution accuracy comes from `eval_metrics.json` (`textsql infer`) where present, else from the run "
        "summary (scored during training). TFLOPS per GPU and MFU are those of the one step `--flops_profiler` "
        "profiled (model FLOPs: three times the forward's, per GPU, over the step's wall time); MFU is against the "
        "GPU's dense peak for the run's precision, none on a CPU."
    )
    for name, path in report.plots.items():
        parts += ["", f"![{name}]({path.name})"]
    return "\n".join(parts) + "\n"
