"""Defer Ctrl-C while the cluster is started or stopped, so that clean-up is never cut short."""

import contextlib
import signal
import threading


@contextlib.contextmanager
def interrupts_deferred(echo=print, doing: str = "stopping the cluster"):
    """Ctrl-C (a notebook's interrupt) waits until the block is done, then is raised: clean-up is not cut short by
    a second interrupt. Only the main thread receives signals; elsewhere this does nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    received = []

    def later(signum, frame):
        received.append(signum)
        echo(f"textsql: still {doing}; the interrupt takes effect once that is done")

    previous = signal.signal(signal.SIGINT, later)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if received:
            raise KeyboardInterrupt
