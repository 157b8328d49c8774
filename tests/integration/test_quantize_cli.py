"""`textsql quantize MODEL` as a user runs it: a real process, the model as a positional argument, the comparison
printed, and none of torchao's CUDA-kernel load failures in the terminal of a machine without a GPU."""

import os
import subprocess
import sys

import torch


def test_quantize_command_prints_the_comparison_and_no_torchao_noise(assets, tmp_path):
    data_dir, model_dir = assets
    env_extra = {"HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    command = [
        sys.executable,
        "-m",
        "textsql",
        "quantize",
        str(model_dir),
        "--dataset_dir",
        str(data_dir),
        "--max_examples",
        "4",
        "--max_new_tokens",
        "8",
        "--device",
        "cpu",
        "--output_dir",
        str(tmp_path / "int8"),
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, env={**os.environ, **env_extra})
    assert done.returncode == 0, done.stderr[-3000:]
    assert "torchao-int8" in done.stdout and "execution accuracy" in done.stdout and "questions/s" in done.stdout
    assert (tmp_path / "int8" / "model.safetensors").is_file()
    if not torch.cuda.is_available():
        terminal = done.stdout + done.stderr
        assert "Failed to load" not in terminal and "is an Enum subclass" not in terminal, terminal[-3000:]
