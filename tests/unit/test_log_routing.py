"""What the terminal shows and what train.log keeps (textsql.train.logs, textsql.extras): the packages' noise, raised by
the real transformers calls that raise it, stays out of the terminal and in the file; a warning that is not noise
still reaches the terminal; without a log file (merge, quantize, compare, infer, other ranks) the noise is dropped."""

import logging
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from textsql.extras import TERMINAL_NOISE, noise_to_log_file, quiet_lifecycle_logs
from textsql.train.logs import configure_logging


@pytest.fixture
def logging_restored():
    # Start from a fresh process's state whatever earlier tests in this process did: warnings not yet routed to logging
    # (captureWarnings patches only once, and pytest resets warnings.showwarning for every test) and no logger disabled
    # (a dictConfig elsewhere disables the loggers that exist by then).
    logging.captureWarnings(False)
    warnings.showwarning = warnings._showwarning_orig
    for name in {"py.warnings", *(name for name, _ in TERMINAL_NOISE)}:
        logging.getLogger(name).disabled = False
    yield
    root = logging.getLogger()
    for handler in [h for h in root.handlers if getattr(h, "textsql", False)]:
        root.removeHandler(handler)
        handler.close()
    noise_to_log_file(False)
    logging.captureWarnings(False)


def make_noise():
    """transformers' own messages, from the calls that print them: grown embeddings, a renamed property; DeepSpeed's
    accelerator detection (its logger's real text); and a warning a user must see."""
    from transformers import T5Config, T5ForConditionalGeneration

    model = T5ForConditionalGeneration(
        T5Config(vocab_size=40, d_model=8, d_kv=4, d_ff=8, num_layers=1, num_heads=2, decoder_start_token_id=0)
    )
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        model.resize_token_embeddings(42)
        assert model.is_gradient_checkpointing is False
        warnings.warn("a warning the user must see", UserWarning, stacklevel=1)
    logging.getLogger("DeepSpeed").warning(
        "Setting accelerator to CPU. If you have GPU or other accelerator, we were unable to detect it."
    )


def noise_with_a_log_file(log_file: str) -> None:
    """What a training rank does first (quiet_lifecycle_logs, then train.log), then the noise."""
    quiet_lifecycle_logs()
    configure_logging(True, Path(log_file))
    make_noise()


def test_noise_goes_to_train_log_only(tmp_path):
    # In a fresh process: in this one, earlier tests' imports and commands have already emitted (or patched) the
    # warnings that make_noise raises, so whether they reach the file would depend on the tests' order.
    log_file = tmp_path / "train.log"
    code = f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); import test_log_routing as t; "
    code += f"t.noise_with_a_log_file({str(log_file)!r})"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    terminal, log = done.stdout + done.stderr, log_file.read_text()
    for _, text in TERMINAL_NOISE:
        assert text not in terminal, terminal
    for text in (
        "will be initialized from a multivariate normal distribution",
        "`is_gradient_checkpointing` is deprecated",
        "Setting accelerator to CPU",
    ):
        assert text in log, log
    assert "a warning the user must see" in terminal and "a warning the user must see" in log


def test_without_a_log_file_the_noise_is_dropped(capsys, logging_restored):
    quiet_lifecycle_logs()
    configure_logging(False)  # another rank: no file
    make_noise()
    terminal = capsys.readouterr().err
    for _, text in TERMINAL_NOISE:
        assert text not in terminal, terminal
    assert "a warning the user must see" in terminal
