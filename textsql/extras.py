"""The optional extras, `notebooks` (plots, notebooks, JupyterLab), `lifecycle` (LoRA, quantization, the compare
app) and `mlflow` (tracking runs in MLflow): a clear error naming the extra when a part of it is missing."""

from __future__ import annotations

import importlib
import importlib.util
import logging
import sys

from textsql.errors import TextsqlError

NOTEBOOKS_EXTRA = "textsql[notebooks]"
LIFECYCLE_EXTRA = "textsql[lifecycle]"
MLFLOW_EXTRA = "textsql[mlflow]"


def require_notebooks_extra(module: str, purpose: str) -> None:
    """Import `module` (one of the extra's packages), or raise TextsqlError saying what needs it and how to install it."""
    _require_extra(module, purpose, NOTEBOOKS_EXTRA)


def require_lifecycle_extra(module: str, purpose: str) -> None:
    """The same for the lifecycle extra (peft, torchao, bitsandbytes, gradio)."""
    _require_extra(module, purpose, LIFECYCLE_EXTRA)


def require_mlflow_extra(purpose: str) -> None:
    """The same for the mlflow extra, asked without importing mlflow (seconds): only whether it is installed."""
    if importlib.util.find_spec("mlflow") is None:
        _require_extra("mlflow", purpose, MLFLOW_EXTRA)


def _require_extra(module: str, purpose: str, extra: str) -> None:
    try:
        importlib.import_module(module)
    except ImportError as error:
        name = extra.split("[")[1].rstrip("]")
        raise TextsqlError(
            f"{purpose} needs {module}, which is part of the optional {name} extra: install it with "
            f"`pip install '{extra}'` (from a checkout: `pip install '.[{name}]'`; "
            f"`bash scripts/bootstrap.sh setup` installs everything). ({error})"
        ) from error


# Messages the lifecycle extra's packages print that a user can do nothing about, kept out of the terminal:
# (logger, text in the message, dropped only where there is no CUDA GPU). transformers imports torchao whenever it is
# installed (its Trainer does), so these appear in every command, not only in `textsql quantize`.
QUIET_MESSAGES = (
    ("torchao", "Failed to load", True),  # torchao's CUDA kernels (.so files) cannot load without a GPU
    ("torchao", "Skipping import of cpp extensions", True),
    ("torch.utils._pytree", "is an Enum subclass", False),  # a deprecation notice to torchao's authors
    ("bitsandbytes.autograd._functions", "MatMul8bitLt: inputs will be cast", False),  # LLM.int8's design, every call
)


class _QuietMessages(logging.Filter):
    """Drops one logger's messages that hold one of `texts` (some only on machines without a CUDA GPU)."""

    def __init__(self, texts: tuple[tuple[str, bool], ...]):
        super().__init__()
        self.texts = texts

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not any(
            text in message and (not without_gpu_only or not _cuda_available()) for text, without_gpu_only in self.texts
        )


def _cuda_available() -> bool:
    torch = sys.modules.get("torch")  # a message from torchao means torch is imported; never import it here
    return bool(torch is not None and torch.cuda.is_available())


def quiet_lifecycle_logs() -> None:
    """Install the filters for QUIET_MESSAGES on their loggers (idempotent; imports nothing heavy). Every entry point
    calls it first (textsql.cli.main, a rank's process, textsql.notebook.setup), so that it is in place before
    transformers imports torchao; importing textsql does nothing of the kind."""
    by_logger: dict[str, list[tuple[str, bool]]] = {}
    for name, text, without_gpu_only in QUIET_MESSAGES:
        by_logger.setdefault(name, []).append((text, without_gpu_only))
    for name, texts in by_logger.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, _QuietMessages) for f in logger.filters):
            logger.addFilter(_QuietMessages(tuple(texts)))
