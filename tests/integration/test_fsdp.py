"""textsql's FSDP2 logic on two real processes (gloo on the CPU), for the tiny T5 and a tiny causal LM: the model's own
decoder layers as the units, the tied-embedding unit accelerate's wrapping needs on T5, one training step against an
unsharded run, generation with synced_gpus, and the gathered fp32 save; and, on a machine with two GPUs, the Trainer
itself under every FSDP strategy."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import tiny_train_argv

from textsql.train.distributed import free_port

RANKS_SCRIPT = Path(__file__).resolve().parent / "fsdp_ranks.py"
STRATEGIES = ("fsdp_full_shard", "fsdp_shard_grad_op", "fsdp_full_shard_offload", "fsdp_hybrid_shard")


@pytest.fixture(scope="module", params=["t5", "causal"])
def fsdp_ranks(request, tmp_path_factory):
    """Both ranks' reports of tests/integration/fsdp_ranks.py (started once per model by torchrun, two processes) on the
    tiny T5 and on the tiny Qwen2 (a causal LM with tied embeddings)."""
    assets = request.getfixturevalue("assets" if request.param == "t5" else "causal_assets")
    out = tmp_path_factory.mktemp("fsdp-ranks")
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "2",
        "--master_addr",
        "127.0.0.1",
        "--master_port",
        str(free_port()),
        str(RANKS_SCRIPT),
        str(assets[1]),
        str(out),
    ]
    env = dict(
        os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1"
    )
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in (0, 1)]


def test_without_the_tied_unit_accelerates_wrapping_stops_on_t5(fsdp_ranks):
    if fsdp_ranks[0]["family"] != "t5":
        pytest.skip("T5's four tied modules; a causal LM ties two, which accelerate groups itself")
    for report in fsdp_ranks:
        assert report["tied_modules"] == ["decoder.embed_tokens", "encoder.embed_tokens", "lm_head", "shared"]
        assert (
            "'shared.weight' is shared with a parameter already managed by another FSDP group"
            in report["without_grouping"]
        )


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_each_strategy_steps_generates_and_saves_like_an_unsharded_run(fsdp_ranks, strategy):
    rows = [report["strategies"][strategy] for report in fsdp_ranks]
    t5 = fsdp_ranks[0]["family"] == "t5"
    for row in rows:
        # the units: the model's own decoder layers (its _no_split_modules; the shipped configs name none), each sharded
        assert row["units"] == (["T5Block"] if t5 else ["Qwen2DecoderLayer"])
        assert row["decoder_layers"] == (4 if t5 else 2) and row["decoder_layers_sharded"]
        if t5:
            assert row["grouped"] == 4 and row["embeddings_one_unit"]
        else:
            assert row["grouped"] == 0
        assert row["mean_loss"] == pytest.approx(row["reference_loss"], abs=1e-5)
        # each rank generated a different number of tokens: with synced_gpus neither waited on the other for ever
        assert row["synced_gpus"] and row["same_answer"]
    assert rows[0]["offload_policy"] == ("CPUOffloadPolicy" if strategy.endswith("_offload") else "OffloadPolicy")
    zero, one = rows
    assert one["state_on_rank"] == 0  # gathered on rank 0 only
    assert zero["names_match"] and zero["all_float32"]
    assert zero["max_difference"] < 2e-5  # one AdamW step (lr 1e-3) on half a batch per rank = the whole batch at once
    architecture = "T5ForConditionalGeneration" if t5 else "Qwen2ForCausalLM"
    assert zero["reloaded_max_difference"] < 2e-5 and zero["saved_architectures"] == [architecture]


def gpus() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.skipif(
    gpus() < 2, reason="needs 2 CUDA GPUs (NCCL gives each rank its own); the CPU side of FSDP is tested above"
)
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_the_trainer_shards_with_each_fsdp_strategy_on_two_gpus(assets, tmp_path, strategy, monkeypatch):
    from textsql.arguments.training import parse_arguments
    from textsql.train.local_launch import run_training

    monkeypatch.delenv("DS_ACCELERATOR", raising=False)
    argv = tiny_train_argv(
        assets,
        str(tmp_path),
        max_steps=8,
        per_device_train_batch_size=8,
        eval_strategy="steps",
        eval_steps=8,
        save_strategy="no",
        max_eval_samples=32,
        execution_accuracy_samples=8,
        logging_steps=4,
        fsdp_config=strategy,
    )
    summary = run_training(*parse_arguments(argv), num_gpus=2, echo=lambda line: None)
    assert summary.strategy["strategy"] == "fsdp" and summary.strategy["label"] == strategy and summary.world_size == 2
    assert summary.execution_accuracy is not None  # generation under FSDP finished on both ranks
    assert summary.memory_check["comparable"] and summary.memory_check["strategy"] == strategy
    import torch
    from transformers import AutoModelForSeq2SeqLM

    saved = AutoModelForSeq2SeqLM.from_pretrained(summary.output_dir)
    assert saved.dtype == torch.float32 and saved.config.architectures == ["T5ForConditionalGeneration"]
