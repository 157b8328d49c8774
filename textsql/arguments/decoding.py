"""The decoding flags' choices and check (--decoding/--num_beams of infer, --execution_accuracy_* of train)."""

from __future__ import annotations

from textsql.errors import TextsqlError
from textsql.families import AUTO, best_settings_help

# constrained: only tokens that keep the text a WikiSQL query over the question's table (textsql.wikisql.constrained);
# with execution_guided, the first of the constrained beams that executes plausibly.
DECODINGS = ("greedy", "execution_guided", "constrained", "constrained+execution_guided")
# What a decoding flag takes: a decoding, or auto, the model family's best (textsql.families.best_settings), made one
# where the model is known (textsql.families.best_setting).
DECODING_CHOICES = (AUTO, *DECODINGS)
AUTO_DECODING_HELP = best_settings_help("decoding")


def execution_guided(decoding: str) -> bool:
    return decoding in ("execution_guided", "constrained+execution_guided")


def constrained(decoding: str) -> bool:
    return decoding.startswith("constrained")


def check_decoding(decoding: str, num_beams: int, flag: str = "--") -> None:
    if decoding not in DECODING_CHOICES:
        raise TextsqlError(f"{flag}decoding must be one of {', '.join(DECODING_CHOICES)}, not '{decoding}'.")
    if num_beams < 1:
        raise TextsqlError(f"{flag}num_beams must be at least 1.")
    if execution_guided(decoding) and num_beams < 2:
        raise TextsqlError(
            f"{flag}decoding {decoding} chooses among beam-search candidates: pass {flag}num_beams 4 (at least 2)."
        )
