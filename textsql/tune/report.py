"""`textsql tune`'s output: the table, the plot, the winner as a `textsql train` recipe, the result as JSON."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from textsql.arguments.training import arguments_dict, arguments_from_dict, parse_arguments
from textsql.arguments.tune import LEVERS, TuneArguments
from textsql.errors import TextsqlError
from textsql.extras import require_notebooks_extra
from textsql.paths import (
    TUNE_TABLE_FILE,
)
from textsql.planner.shape import GIB
from textsql.tune.space import ADAPTERS, strategy_values


def format_table(result: TuneResult) -> str:
    """The candidates as Markdown, fastest first: the median samples/s and the min-max of its measurements, the
    planner's prediction beside what happened, then the winner and, when the machine was busy, a note saying so."""
    lines = [
        "| candidate | strategy | adapter | micro-batch | accumulation | samples/s (median) | min-max | vs default "
        "| runs | peak memory (GB) | predicted GPU (GB) | status |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    default_rate = (
        result.default.get("samples_per_second") if result.default and result.default["status"] == "ok" else None
    )
    winner_key = result.winner["key"] if result.winner else None
    for e in result.table + result.left_out:
        rate = e.get("samples_per_second")
        relative = f"{rate / default_rate:.2f}x" if rate and default_rate else ""
        peak = f"{e['peak_memory_bytes'] / GIB:.2f} {e['memory_kind']}" if e.get("peak_memory_bytes") else ""
        predicted = "" if e.get("predicted_gpu_gb") is None else f"{e['predicted_gpu_gb']:.2f}"
        status = (
            e["status"]
            if e["status"] == "ok"
            else f"{e['status']}: {(e.get('error') or '').splitlines()[-1][:90] if e.get('error') else ''}"
        )
        marks = (" **winner**" if e["key"] == winner_key else "") + (" (default)" if e.get("default") else "")
        spread = (
            f"{e['samples_per_second_min']:.1f}-{e['samples_per_second_max']:.1f} (±{e['spread'] / 2:.0%})"
            if e.get("measurements", 0) > 1
            else ""
        )
        lines.append(
            f"| {e['key']}{marks} | {e['strategy']} | {e.get('adapter') or '-'} | {e['micro_batch']} | "
            f"{e['accumulation']} | {'' if rate is None else f'{rate:.1f}'} | {spread} | {relative} | "
            f"{e.get('measurements', 0)} | {peak} | {predicted} | {status} |"
        )
    lines.append("")
    if result.winner is None:
        lines.append("No candidate trained: see the failures above and their logs.")
    else:
        speedup = result.speedup_over_default
        lines.append(
            f"winner: {result.winner['key']} ({result.winner['samples_per_second']:.1f} samples/s"
            + (f", {speedup:.2f}x textsql train's default settings" if speedup else "")
            + ")"
        )
    lines += confirmation_lines(result)
    busy = [e for e in result.table if e.get("cpu_cores") and e.get("load_average_max", 0) > e["cpu_cores"]]
    if busy:
        worst = max(busy, key=lambda e: e["load_average_max"])
        lines.append(
            f"note: the machine was busier than its {worst['cpu_cores']} cores while {len(busy)} candidate(s) trained "
            f"(load average up to {worst['load_average_max']:.1f}): other processes took CPU time from them, so "
            "their figures vary with that load; compare the min-max, or tune again on an idle machine (on a shared "
            "CPU machine, with OMP_NUM_THREADS=1: threads waiting for a busy core slow every step)."
        )
    return "\n".join(lines)


def confirmation_lines(result: TuneResult) -> list[str]:
    """What training the recipe as textsql train reads it gave, beside the candidates' figure: its samples/s in the
    timed steps and over the whole run, against the default settings trained the same way, or its failure."""
    if not result.confirmation:
        return []
    recipe = next((e for e in result.confirmation if not e["default"]), None)
    if recipe is None or recipe["status"] != "ok":
        error = ((recipe or {}).get("error") or "no measurement").splitlines()[-1]
        return [f"its recipe, trained as textsql train reads it: {(recipe or {}).get('status', 'not run')}: {error}"]
    runs = f"median of {recipe['measurements']}" if recipe["measurements"] > 1 else "one run"
    line = (
        f"its recipe, trained as textsql train reads it ({runs}): {recipe['samples_per_second']:.1f} samples/s in the "
        f"timed steps ({result.winner['samples_per_second']:.1f} as a candidate), "
        f"{recipe['run_samples_per_second']:.1f} over the whole training loop (set-up, warm-up and evaluation in it included)"
    )
    speedup, default = result.confirmed_speedup, result.confirmed(True)
    if speedup is None:
        return [line + (" — the default settings won: nothing to compare with" if result.winner["default"] else "")]
    whole = f"{speedup['whole_run']:.2f}x" if speedup["whole_run"] else "-"
    return [
        line,
        f"textsql train's default settings the same way: {default['samples_per_second']:.1f} and "
        f"{default['run_samples_per_second']:.1f} samples/s; the recipe is {speedup['timed_steps']:.2f}x the default "
        f"in the timed steps and {whole} over the whole loop (what a run of this length gains: set-up and "
        "evaluation do not speed up)",
    ]


def recipe_values(winner: dict, model, data, training, args: TuneArguments) -> dict:
    """The winner as `textsql train` arguments: every setting the user gave that differs from textsql's defaults, the
    strategy, the micro-batch and the accumulation."""
    given = arguments_dict(model, data, training)
    defaults = arguments_dict(*parse_arguments([]))
    values = {"model_id": model.model_id, "dataset_dir": data.dataset_dir}
    values |= {k: v for k, v in given.items() if v != defaults.get(k) and k not in ("model_id", "dataset_dir")}
    values |= {k: v for k, v in strategy_values(winner["strategy"]).items() if v is not None}
    values |= {
        "per_device_train_batch_size": winner["micro_batch"],
        "gradient_accumulation_steps": winner["accumulation"],
    }
    values |= ADAPTERS.get(winner.get("adapter") or "", {})
    for lever in winner.get("levers") or ():
        values |= LEVERS[lever]
    if args.num_gpus is not None:
        values["num_gpus"] = args.num_gpus
    return values


def write_recipe(path: Path, winner: dict, model, data, training, args: TuneArguments) -> Path:
    import yaml  # PyYAML comes with transformers

    values = recipe_values(winner, model, data, training, args)
    arguments_from_dict(values)  # the recipe must parse as `textsql train` reads it
    header = (
        f"# The fastest setting `textsql tune` measured ({winner['samples_per_second']:.1f} samples/s, global batch "
        f"of {args.global_batch_size}; table: {TUNE_TABLE_FILE}).\n"
        + (
            f"# Run: textsql train {path}\n"
            if args.nodes == 1
            else f"# Measured on {args.nodes} pods: run it on as many, through a started cluster of {args.nodes} pods "
            f"(textsql.cluster.Cluster(workers={args.nodes - 1}, ...).train(['{path}'])); the accumulation keeps the "
            "global batch at that number of ranks only.\n"
        )
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(header + yaml.safe_dump(values, sort_keys=False))
    return path


def plot_tune(result: TuneResult, path: Path) -> Path | None:
    """Samples/s and peak memory per measured candidate; None (and no file) without matplotlib (the notebooks extra)."""
    try:
        require_notebooks_extra("matplotlib", "The tune plot")
    except TextsqlError:
        return None
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    ok = [e for e in result.table if e["status"] == "ok"]
    if not ok:
        return None
    fig = Figure(figsize=(max(6, 0.7 * len(ok) + 2), 6.5))
    FigureCanvasAgg(fig)  # Agg without pyplot: no global backend switch
    speed, memory = fig.subplots(2, 1, sharex=True)
    names = [e["key"] for e in ok]
    colors = [
        "C1" if result.winner and e["key"] == result.winner["key"] else f"C{0 if not e.get('default') else 2}"
        for e in ok
    ]
    speed.bar(names, [e["samples_per_second"] for e in ok], color=colors)
    speed.set_ylabel("samples/s")
    winner = result.winner["key"] if result.winner else "-"
    speed.set_title(
        f"global batch {result.global_batch_size}: winner {winner} (orange), textsql's defaults (green)", fontsize=10
    )
    memory.bar(names, [e["peak_memory_bytes"] / GIB for e in ok], color=colors)
    memory.set_ylabel(f"peak memory (GB, {ok[0]['memory_kind']})")
    for label in memory.get_xticklabels():
        label.set_rotation(45)
        label.set_horizontalalignment("right")
    fig.tight_layout()
    fig.savefig(path)
    return path


def as_dict(result: TuneResult) -> dict:
    """The result as JSON-able data (`textsql tune --json`)."""
    return {
        "table": result.table,
        "winner": result.winner,
        "default": result.default,
        "left_out": result.left_out,
        "speedup_over_default": result.speedup_over_default,
        "tune_dir": str(result.tune_dir),
        "recipe": str(result.recipe) if result.recipe else None,
        "plot": str(result.plot) if result.plot else None,
        "measured_now": result.measured_now,
        "confirmation": result.confirmation,
        "confirmed_speedup": result.confirmed_speedup,
    }


@dataclass
class TuneResult:
    """What `run_tune` found: every candidate (fastest first, failures last), the winner, the default's speed."""

    table: list[dict]
    winner: dict | None
    default: dict | None
    left_out: list[dict]
    tune_dir: Path
    recipe: Path | None
    plot: Path | None
    measured_now: int
    global_batch_size: int = 0
    confirmation: list[dict] | None = None  # the recipe (and the default settings) trained as textsql train reads them

    @property
    def speedup_over_default(self) -> float | None:
        if not (self.winner and self.default and self.default.get("status") == "ok"):
            return None
        return self.winner["samples_per_second"] / self.default["samples_per_second"]

    def confirmed(self, default: bool) -> dict | None:
        """The confirmation's entry of the recipe (default False) or of the default settings, when it trained."""
        return next((e for e in self.confirmation or () if e["status"] == "ok" and bool(e["default"]) == default), None)

    @property
    def confirmed_speedup(self) -> dict | None:
        """The winner's speed-up over the default settings, both trained from their recipes: in the timed steps, and
        over each whole training loop as textsql train reports it (DeepSpeed's set-up, the warm-up and any evaluation
        inside it included)."""
        recipe, default = self.confirmed(False), self.confirmed(True)
        if not (recipe and default):
            return None
        return {
            "timed_steps": recipe["samples_per_second"] / default["samples_per_second"],
            "whole_run": (
                recipe["run_samples_per_second"] / default["run_samples_per_second"]
                if recipe.get("run_samples_per_second") and default.get("run_samples_per_second")
                else None
            ),
        }
