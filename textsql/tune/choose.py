"""`textsql tune`'s choice: measurements summarized, the fastest repeated, a simpler setting within the tolerance."""

from __future__ import annotations

import statistics
from dataclasses import replace

from textsql.arguments.tune import TuneArguments
from textsql.strategy.table import strategy_rank
from textsql.tune.measure import recipe_arguments
from textsql.tune.report import TuneResult, recipe_values
from textsql.tune.space import Candidate


def summarize(rows: list[dict]) -> list[dict]:
    """One row per candidate: its measurements' median samples/s with their min and max (the spread the table states),
    the largest peak, or its failure."""
    by_key: dict[str, list[dict]] = {}
    for row in rows:
        by_key.setdefault(row["key"], []).append(row)
    table = []
    for measured in by_key.values():
        ok = [r for r in measured if r["status"] == "ok"]
        first = measured[0]
        entry = {
            k: first[k]
            for k in (
                "key",
                "strategy",
                "micro_batch",
                "accumulation",
                "adapter",
                "default",
                "predicted_gpu_gb",
                "predicted_fits",
            )
        } | {"levers": first.get("levers") or []}
        if ok:
            rates = [r["samples_per_second"] for r in ok]
            middle = statistics.median(rates)
            entry |= {
                "status": "ok",
                "samples_per_second": middle,
                "samples_per_second_min": min(rates),
                "samples_per_second_max": max(rates),
                "measurements": len(rates),
                "spread": (max(rates) - min(rates)) / middle,
                "run_samples_per_second": statistics.median([r.get("run_samples_per_second") or 0 for r in ok]),
                "load_average_max": max((r.get("load_average") or 0) for r in ok),
                "cpu_cores": ok[0].get("cpu_cores"),
                "peak_memory_bytes": max(r["peak_memory_bytes"] or 0 for r in ok),
                "memory_kind": ok[0]["memory_kind"],
            }
        else:
            entry |= {"status": measured[-1]["status"], "error": measured[-1].get("error"), "measurements": 0}
        table.append(entry)
    return sorted(table, key=lambda e: (e["status"] != "ok", -(e.get("samples_per_second") or 0), e["key"]))


def simplicity(entry: dict) -> tuple:
    """Simpler first: every weight trained (an adapter learns less), fewer speed levers, the strategy table's order
    (plain data parallel, then ZeRO-1, ...), then less accumulation."""
    return (
        bool(entry.get("adapter")),
        len(entry.get("levers") or ()),
        strategy_rank(entry["strategy"]),
        entry["accumulation"],
        entry["key"],
    )


def choose_winner(table: list[dict], tolerance: float) -> dict | None:
    """The simplest candidate within `tolerance` of the fastest; None when nothing ran."""
    ok = [e for e in table if e["status"] == "ok"]
    if not ok:
        return None
    best = max(e["samples_per_second"] for e in ok)
    close = [e for e in ok if e["samples_per_second"] >= best * (1 - tolerance)]
    return min(close, key=simplicity)


def confirmation_runs(result: TuneResult, by_key: dict, args: TuneArguments, settings: tuple, parent_id) -> list:
    """What --confirm trains, as (candidate, its arguments for an output folder): the winner from the recipe file tune
    wrote, and textsql train's default settings (when they did not win) from their recipe's values, each as textsql
    train reads them. A candidate trains with tune's own settings (no evaluation, no reporting, no progress bar): these
    say what a user gets."""
    winner, default = result.winner, result.default
    runs = [
        (
            replace(by_key[winner["key"]], from_recipe=True, default=False),
            lambda output_dir: recipe_arguments(result.recipe, args, output_dir, parent_id),
        )
    ]
    if default is not None and default["status"] == "ok" and default["key"] != winner["key"]:
        values = recipe_values(default, *settings, args)
        runs.append(
            (
                replace(by_key[default["key"]], from_recipe=True),
                lambda output_dir: recipe_arguments(values, args, output_dir, parent_id),
            )
        )
    return runs


def repeat_rounds(rows: list[dict], ordered: list[Candidate], args: TuneArguments) -> list[list[Candidate]]:
    """The rounds after the first: the fastest --repeat_top candidates of the first round and textsql train's default
    settings (the winner is compared with them), each round in the reverse order of the one before, so that a
    candidate's place in the order (the machine's load then, what ran just before) does not decide the ranking."""
    if not args.repeat_top or args.repeats < 2:
        return []
    first = summarize([r for r in rows if r["repeat"] == 0 and r["key"] in {c.key for c in ordered}])
    ok = [e for e in first if e["status"] == "ok"]  # fastest first
    chosen = {e["key"] for e in ok[: args.repeat_top]} | {e["key"] for e in ok if e["default"]}
    contenders = [c for c in ordered if c.key in chosen]
    return [contenders[::-1] if round_ % 2 else contenders for round_ in range(1, args.repeats)]
