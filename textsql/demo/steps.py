"""A demo's steps as it prints them: a numbered header, then the step's time."""

from __future__ import annotations

import contextlib
import time


@contextlib.contextmanager
def demo_step(echo, number: int, title: str, total: int, seconds: dict | None = None, key: str = ""):
    """A header before step `number` of `total` of a demo and its time after it, so a long run shows that all is well;
    `seconds[key]` keeps the time."""
    echo(f"\n== [{number}/{total}] {title}")
    started = time.perf_counter()
    yield
    took = time.perf_counter() - started
    if seconds is not None:
        seconds[key or str(number)] = took
    echo(f"== [{number}/{total}] done in {took:.0f} s")
