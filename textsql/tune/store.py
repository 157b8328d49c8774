"""`textsql tune`'s results file: one measured candidate a line, kept under its settings' fingerprint (resumable)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from textsql.arguments.tune import TuneArguments
from textsql.errors import TextsqlError

RESULTS_VERSION = 2


CONFIRM_PREFIX = "recipe:"  # a confirmation's key in the results: the setting trained from its recipe


RETRIED = ("failed", "out of memory", "timed out")  # what --retry_failed measures again


def fingerprint(args: TuneArguments, base: dict, world: int) -> str:
    """What makes measurements comparable: the model, the data, the global batch, the steps, the ranks, the settings."""
    settings = {
        "model": args.model_id,
        "data": args.dataset_dir,
        "global_batch": args.global_batch_size,
        "world": world,
        "warmup": args.warmup_steps,
        "timed": args.timed_steps,
        "version": RESULTS_VERSION,
        "accelerator": args.accelerator,
        "base": {k: v for k, v in sorted(base.items()) if k not in ("output_dir",)},
    }
    return hashlib.sha256(json.dumps(settings, sort_keys=True, default=str).encode()).hexdigest()[:16]


def read_results(path: Path, print_: str) -> list[dict]:
    """The measurements already in the tune folder for these settings; other settings' results are refused."""
    if not path.exists():
        return []
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    other = [r for r in rows if r.get("fingerprint") != print_]
    if other:
        raise TextsqlError(
            f"{path} holds measurements of other settings (model, data, global batch, steps, training "
            "arguments or an older textsql's results format differ), which are not comparable with these. Pass another --tune_dir, or remove "
            "that folder to measure again."
        )
    return rows


def append_result(path: Path, row: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as stream:
        stream.write(json.dumps(row, default=str) + "\n")
        stream.flush()
