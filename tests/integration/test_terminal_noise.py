"""The terminal shows what docs/training.md promises, on every command (issue 32, item 3): a real ZeRO-3 + offload LoRA
training of a tiny T5 whose embeddings grew (DeepSpeed on the CPU, a child process as a user runs it) and the merge of
its adapter print none of torch's, transformers', DeepSpeed's, peft's or bitsandbytes' noise, while the run's
train.log keeps it."""

import subprocess
import sys

import pytest
from conftest import tiny_train_argv

from textsql.extras import TERMINAL_NOISE


def textsql(*argv, env, cwd, timeout=900) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "textsql", *argv], capture_output=True, text=True, env=env, cwd=cwd, timeout=timeout
    )


@pytest.mark.slow
def test_training_and_merging_show_no_noise_and_train_log_keeps_it(header_assets, tmp_path, cpu_env):
    argv = tiny_train_argv(
        header_assets,  # its tokenizer lacked '<': prep added it, so the model's embeddings grow (transformers, peft)
        tmp_path / "runs",
        "--deepspeed",
        "zero3_offload",
        max_steps=4,
        per_device_train_batch_size=8,
        logging_steps=2,
        eval_strategy="steps",
        eval_steps=4,
        max_eval_samples=16,
        lora="True",
        save_strategy="no",
        dataloader_num_workers=0,
    )
    trained = textsql("train", *argv, env=cpu_env, cwd=tmp_path)
    terminal = trained.stdout + trained.stderr
    assert trained.returncode == 0, terminal[-4000:]
    (run,) = [p.parent for p in (tmp_path / "runs").glob("*/run_summary.json")]
    log = (run / "train.log").read_text()
    for logger, text in TERMINAL_NOISE:
        assert text not in terminal, f"{logger}'s '{text}' reached the terminal:\n{terminal[-4000:]}"
    # The noise happened, and the full log kept it: ZeRO-3's collectives (once per call), the grown embeddings.
    assert log.count("`torch.distributed.reduce_scatter_tensor` is deprecated") > 1
    assert "will be initialized from a multivariate normal distribution" in log
    # What the terminal is for: the progress bar, the losses, the evaluation, the summary.
    assert "'loss':" in terminal and "'eval_loss':" in terminal and "run_summary.json" in terminal
    assert terminal.count("\n") < 80, terminal

    merged = textsql("merge", str(run), env=cpu_env, cwd=tmp_path)
    terminal = merged.stdout + merged.stderr
    assert merged.returncode == 0, terminal[-4000:]
    for logger, text in TERMINAL_NOISE:
        assert text not in terminal, f"{logger}'s '{text}' reached the terminal of textsql merge:\n{terminal}"
    assert terminal.count("\n") < 10, terminal
