"""Shared fixtures: generated WikiSQL data and a tiny T5 built once per test session, and a CPU environment for child processes."""

import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session")
def assets(tmp_path_factory):
    """(data_dir, model_dir): a small generated dataset, prepared with a tokenizer trained on it, and a tiny T5."""
    from textsql.demo import build_assets

    return build_assets(tmp_path_factory.mktemp("assets"), train_tables=60, questions_per_table=8, d_model=64, num_layers=2, seed=1)


@pytest.fixture(scope="session")
def raw_wikisql(assets):
    """The generated release-format folder behind `assets`."""
    return assets[0].parent / "wikisql-generated"


@pytest.fixture
def cpu_env(tmp_path):
    """Environment for child processes: DeepSpeed on the CPU, offline hub, one thread per rank."""
    env = dict(os.environ)
    env.update(
        DS_ACCELERATOR="cpu",
        OMP_NUM_THREADS="1",
        HF_HUB_OFFLINE="1",
        PYTHONUNBUFFERED="1",
        TOKENIZERS_PARALLELISM="false",
        PATH=str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", ""),
    )
    env.setdefault("TORCH_EXTENSIONS_DIR", str(Path.home() / ".cache" / "textsql-torch-extensions"))
    return env
