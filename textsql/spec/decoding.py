"""The decoding flags' choices and check (--decoding/--num_beams of infer, --execution_accuracy_* of train)."""

from __future__ import annotations

from textsql.errors import TextsqlError

DECODINGS = ("greedy", "execution_guided")


def check_decoding(decoding: str, num_beams: int, flag: str = "--") -> None:
    if decoding not in DECODINGS:
        raise TextsqlError(f"{flag}decoding must be one of {', '.join(DECODINGS)}, not '{decoding}'.")
    if num_beams < 1:
        raise TextsqlError(f"{flag}num_beams must be at least 1.")
    if decoding == "execution_guided" and num_beams < 2:
        raise TextsqlError(
            f"{flag}decoding execution_guided chooses among beam-search candidates: pass {flag}num_beams 4 (at least 2)."
        )
