"""Where a training's messages go: the terminal shows progress, losses, warnings and textsql's own lines (not the
packages' noise, textsql.extras.TERMINAL_NOISE); rank 0's train.log keeps everything at INFO."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

from textsql.extras import TerminalNoise, is_terminal_noise, noise_to_log_file

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class _TerminalFilter(logging.Filter):
    """Warnings from everyone but the packages' noise (textsql.extras.TERMINAL_NOISE, which train.log keeps), and
    textsql's own messages (resuming, grown embeddings, ...) on rank 0."""

    def __init__(self, is_main: bool):
        super().__init__()
        self.is_main = is_main

    def filter(self, record: logging.LogRecord) -> bool:
        if is_terminal_noise(record):
            return False
        return record.levelno >= logging.WARNING or (self.is_main and record.name.startswith("textsql"))


def configure_logging(is_main: bool, log_file: Path | None = None) -> None:
    """The terminal shows one training progress bar (the Trainer's), the logged losses and evaluation results, warnings,
    textsql's own messages and the summary; rank 0's `log_file` keeps everything at INFO (transformers' per-checkpoint
    "Configuration saved in ..." lines, DeepSpeed's engine and config dumps). Safe to call again in one process."""
    import datasets
    import transformers

    root = logging.getLogger()
    for handler in [h for h in root.handlers if getattr(h, "textsql", False)]:
        root.removeHandler(handler)
        handler.close()
    terminal = logging.StreamHandler()
    terminal.addFilter(_TerminalFilter(is_main))
    handlers = [terminal]
    if log_file is not None and is_main:
        Path(log_file).parent.mkdir(parents=True, exist_ok=True)
        handlers.append(logging.FileHandler(log_file, encoding="utf-8"))
    for handler in handlers:
        handler.textsql = True
        handler.setFormatter(logging.Formatter(LOG_FORMAT))
        root.addHandler(handler)
    root.setLevel(logging.INFO)
    # The noise reaches the file; the terminal handler drops it. Python's warnings become log records (textsql.extras).
    noise_to_log_file(len(handlers) > 1)
    logging.captureWarnings(True)
    transformers.utils.logging.set_verbosity(logging.INFO if is_main else logging.WARNING)
    transformers.utils.logging.disable_default_handler()  # its records reach the two handlers above instead
    transformers.utils.logging.enable_propagation()
    transformers.utils.logging.disable_progress_bar()  # "Loading weights", "Writing model shards"
    datasets.disable_progress_bars()
    if "deepspeed" in sys.modules:
        _route_deepspeed_logs()


def _route_deepspeed_logs() -> None:
    """DeepSpeed logs through its own stdout handler: keep its INFO lines for the file only."""
    from deepspeed.utils import logger as deepspeed_logger

    for handler in deepspeed_logger.handlers:
        if not getattr(handler, "textsql", False):
            handler.setLevel(logging.WARNING)
            if not any(isinstance(f, TerminalNoise) for f in handler.filters):
                handler.addFilter(TerminalNoise())  # its own stdout handler is a terminal too
    deepspeed_logger.propagate = True
