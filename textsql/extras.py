"""The optional extras, `notebooks` (plots, notebooks, JupyterLab), `lifecycle` (LoRA, quantization, the compare
app) and `mlflow` (tracking runs in MLflow): a clear error naming the extra when a part of it is missing, and the
packages' log noise kept out of the terminal."""

from __future__ import annotations

import importlib
import importlib.util
import logging
import sys

from textsql.errors import TextsqlError

NOTEBOOKS_EXTRA = "textsql[notebooks]"
LIFECYCLE_EXTRA = "textsql[lifecycle]"
MLFLOW_EXTRA = "textsql[mlflow]"
GRPO_EXTRA = "textsql[grpo]"


def require_notebooks_extra(module: str, purpose: str) -> None:
    """Import `module` (one of the extra's packages), or raise TextsqlError saying what needs it and how to install it."""
    _require_extra(module, purpose, NOTEBOOKS_EXTRA)


def require_lifecycle_extra(module: str, purpose: str) -> None:
    """The same for the lifecycle extra (peft, torchao, bitsandbytes, gradio)."""
    _require_extra(module, purpose, LIFECYCLE_EXTRA)


def require_grpo_extra() -> None:
    """The grpo extra (TRL), for `textsql train --stage grpo`."""
    _require_extra("trl", "`textsql train --stage grpo`", GRPO_EXTRA)


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


# Messages a user can do nothing about, kept out of the terminal but in a run's train.log: (logger, text in the
# message). Python's warnings arrive as records of the "py.warnings" logger (logging.captureWarnings). Seen on every
# command: torch's deprecation of the collectives ZeRO-3 calls (once per call: 1,794 lines in a 39-step ZeRO-3 + offload
# run), transformers' notes on grown embeddings and a renamed property, DeepSpeed's accelerator detection in processes
# that never train, peft's note that grown embeddings are saved with the adapter, bitsandbytes' optional CPU kernels.
TERMINAL_NOISE = (
    ("py.warnings", "`torch.distributed.reduce_scatter_tensor` is deprecated"),
    ("py.warnings", "`torch.distributed.all_gather_into_tensor` is deprecated"),
    ("py.warnings", "`is_gradient_checkpointing` is deprecated"),
    ("py.warnings", "Setting `save_embedding_layers` to `True`"),
    ("transformers.modeling_utils", "will be initialized from a multivariate normal distribution"),
    ("DeepSpeed", "Setting accelerator to CPU"),
    ("bitsandbytes.backends.cpu.ops", "Failed to load CPU gemm_4bit_forward from kernels-community"),
)
_noise_goes_to_a_log_file = False  # set by textsql.train.logs while a run's train.log takes every record


def is_terminal_noise(record: logging.LogRecord) -> bool:
    """Whether `record` is one of TERMINAL_NOISE."""
    return any(record.name == name and text in record.getMessage() for name, text in TERMINAL_NOISE)


class TerminalNoise(logging.Filter):
    """Drops TERMINAL_NOISE. On a handler that writes to the terminal: always. On the loggers that emit it
    (`on_logger`): unless a log file takes every record (textsql.train.logs), whose terminal handler drops it instead."""

    def __init__(self, on_logger: bool = False):
        super().__init__()
        self.on_logger = on_logger

    def filter(self, record: logging.LogRecord) -> bool:
        if self.on_logger and _noise_goes_to_a_log_file:
            return True
        return not is_terminal_noise(record)


def noise_to_log_file(on: bool) -> None:
    """textsql.train.logs: while on, TERMINAL_NOISE reaches the handlers (train.log keeps it, the terminal's drops it)."""
    global _noise_goes_to_a_log_file
    _noise_goes_to_a_log_file = on


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
    """Install the filters for QUIET_MESSAGES and TERMINAL_NOISE on their loggers, and route Python's warnings
    through logging so that they are filtered too (idempotent; imports nothing heavy). Every entry point calls it first
    (textsql.cli.main, a rank's process, textsql.notebook.setup), so that it is in place before transformers imports
    torchao; importing textsql does nothing of the kind. A warning that is not noise still reaches the terminal."""
    by_logger: dict[str, list[tuple[str, bool]]] = {}
    for name, text, without_gpu_only in QUIET_MESSAGES:
        by_logger.setdefault(name, []).append((text, without_gpu_only))
    for name, texts in by_logger.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, _QuietMessages) for f in logger.filters):
            logger.addFilter(_QuietMessages(tuple(texts)))
    for name in {name for name, _ in TERMINAL_NOISE}:
        logger = logging.getLogger(name)
        if not any(isinstance(f, TerminalNoise) for f in logger.filters):
            logger.addFilter(TerminalNoise(on_logger=True))
    logging.captureWarnings(True)
