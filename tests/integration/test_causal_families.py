"""Every causal family under every strategy, on a tiny random model of each (sharing the tiny Qwen2's tokenizer and
prepared data): without DeepSpeed, with ZeRO-2 (interrupted and resumed) and with LoRA on the family's own preset, in
this process; FSDP2 with the family's decoder layers as the units and ZeRO-3 on two ranks, all in one torchrun launch
(family_ranks.py). Each is compared with the unsharded run: the same batches give the same losses."""

import gc
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import IN_PROCESS_ENV, child_cpu_env, main_in_process, tiny_train_argv
from test_causal_train import SHORT, summary_of, train_interrupt_and_resume

from textsql.families import family_named
from textsql.tiny import CAUSAL_CONFIG_NAMES
from textsql.train.distributed import free_port

pytestmark = pytest.mark.slow

FAMILIES = sorted(CAUSAL_CONFIG_NAMES)
RANKS_SCRIPT = Path(__file__).resolve().parent / "family_ranks.py"
# What FSDP must wrap in each family, written out here rather than read from textsql: the units are tested, not echoed.
DECODER_LAYERS = {
    "bloom": "BloomBlock",
    "codegen": "CodeGenBlock",
    "falcon": "FalconDecoderLayer",
    "gpt2": "GPT2Block",
    "gpt_bigcode": "GPTBigCodeBlock",
    "llama": "LlamaDecoderLayer",
    "mistral": "MistralDecoderLayer",
    "opt": "OPTDecoderLayer",
    "qwen2": "Qwen2DecoderLayer",
}
# Random batches of 8 (family_ranks.py's ZeRO-3 runs take 4 per rank on two ranks: the same batches), a loss logged at
# every step, a short final evaluation.
FAMILY_RUN = dict(
    SHORT,
    max_steps=4,
    per_device_train_batch_size=8,
    logging_steps=1,
    max_eval_samples=8,
    train_sampling_strategy="random",
)


@pytest.fixture(scope="module", autouse=True)
def objects_alive_now_left_out_of_collections():
    """Every run starts with a full gc.collect() (accelerate's free_memory; DeepSpeed's ZeRO-3 too), which walks every
    object torch, transformers and DeepSpeed hold: about 0.5 s a run here, a third of a tiny run. Frozen for this
    module's tests, the objects alive now (the imported modules' mostly) are left out of those walks."""
    gc.collect()
    gc.freeze()
    yield
    gc.unfreeze()


def logged_losses(run_dir) -> list[float]:
    state = json.loads((Path(run_dir) / "trainer_state.json").read_text())
    return [entry["loss"] for entry in state["log_history"] if "loss" in entry]


@pytest.fixture(scope="module")
def plain_losses(causal_assets, causal_family_models, tmp_path_factory):
    """model_type -> the losses of its full fine-tuning without DeepSpeed (4 steps), trained on first request."""
    runs_root = tmp_path_factory.mktemp("family-plain")
    losses = {}

    def of(model_type: str) -> list[float]:
        if model_type not in losses:
            output = runs_root / model_type
            argv = tiny_train_argv((causal_assets[0], causal_family_models / model_type), runs_root, **FAMILY_RUN)
            assert main_in_process(["train", *argv, "--output_dir", str(output)], IN_PROCESS_ENV) == 0
            saved = json.loads((output / "config.json").read_text())
            assert saved["model_type"] == model_type
            assert saved["architectures"][0].endswith(("ForCausalLM", "LMHeadModel"))
            losses[model_type] = logged_losses(output)
        return losses[model_type]

    return of


@pytest.mark.parametrize("model_type", FAMILIES)
def test_every_causal_family_trains_plain_under_zero2_resumed_and_with_its_lora_preset(
    model_type, causal_assets, causal_family_models, plain_losses, tmp_path, textsql_in_process, capsys
):
    plain = plain_losses(model_type)
    capsys.readouterr()  # the plain run's lines, which the commands below would read as theirs
    assert len(plain) == 4 and plain[-1] < plain[0]
    assets = (causal_assets[0], causal_family_models / model_type)
    # ZeRO-2, saving every 2 steps, its last checkpoint taken away and resumed: the loss curve of the plain run
    argv = tiny_train_argv(assets, tmp_path / "runs", "--deepspeed", "zero2", **FAMILY_RUN)
    argv += ["--save_strategy", "steps", "--save_steps", "2", "--save_total_limit", "3"]
    run = train_interrupt_and_resume(argv, tmp_path / "runs", textsql_in_process)
    assert logged_losses(run) == pytest.approx(plain, rel=1e-4)  # steps 1-2 before the interruption, 3-4 resumed
    # LoRA on the family's own query and value projections (fused where the family fuses them), in every layer
    status, out, err = textsql_in_process(
        ["train", *tiny_train_argv(assets, tmp_path / "runs", "--lora", "True", "--lora_targets", "qv",
                                   **dict(FAMILY_RUN, max_steps=2))]
    )  # fmt: skip
    assert status == 0, err[-3000:]
    summary = summary_of(out)
    assert 0 < summary["trainable_parameters"] < summary["parameters"] / 5
    adapter = json.loads((Path(summary["output_dir"]) / "adapter_config.json").read_text())
    assert adapter["task_type"] == "CAUSAL_LM"
    targets = family_named(model_type).lora_targets["qv"]
    assert set(adapter["target_modules"]) == set(targets)
    from safetensors.torch import load_file

    from textsql.hub import load_model

    projections = {name for name, _ in load_model(str(assets[1])).named_modules() if name.rsplit(".", 1)[-1] in targets}
    assert len(projections) == 2 * len(targets)  # two decoder layers
    weights = load_file(Path(summary["output_dir"]) / "adapter_model.safetensors")
    adapted = {name.removeprefix("base_model.model.").split(".lora_")[0] for name in weights if ".lora_" in name}
    assert adapted == projections
    lora_b = [tensor for name, tensor in weights.items() if "lora_B" in name]
    assert all(tensor.abs().sum() > 0 for tensor in lora_b)  # trained away from its zero start


@pytest.fixture(scope="module")
def family_ranks(causal_assets, causal_family_models, tmp_path_factory):
    """Both ranks' reports of family_ranks.py: every causal family under FSDP2 and ZeRO-3 on two processes."""
    out = tmp_path_factory.mktemp("family-ranks")
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
        "--master_port", str(free_port()), str(RANKS_SCRIPT), str(causal_assets[0]), str(causal_family_models),
        str(out), *FAMILIES,
    ]  # fmt: skip
    env = child_cpu_env()
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(RANKS_SCRIPT.parent), env.get("PYTHONPATH")]))
    done = subprocess.run(command, env=env, cwd=out, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in (0, 1)]


@pytest.mark.parametrize("model_type", FAMILIES)
def test_every_causal_family_shards_its_decoder_layers_with_fsdp2_like_an_unsharded_run(model_type, family_ranks):
    rows = [report["fsdp"][model_type] for report in family_ranks]
    for row in rows:
        assert "error" not in row, row.get("error")
        assert row["units"] == row["no_split_modules"] == [DECODER_LAYERS[model_type]]
        assert row["decoder_layers"] == 2 and row["decoder_layers_sharded"]
        assert row["mean_loss"] == pytest.approx(row["reference_loss"], abs=1e-5)
        assert row["synced_gpus"] and row["same_answer"]  # each rank generated its own length, neither hung
    zero, one = rows
    assert one["state_on_rank"] == 0 and zero["names_match"] and zero["all_float32"]
    assert zero["max_difference"] < 2e-5  # one step on half a batch per rank = the whole batch at once
    assert zero["reloaded_max_difference"] < 2e-5 and zero["saved_architectures"][0].endswith(
        ("ForCausalLM", "LMHeadModel")
    )


@pytest.mark.parametrize("model_type", FAMILIES)
def test_every_causal_family_trains_under_zero3_on_two_ranks_as_on_one_process(
    model_type, family_ranks, plain_losses, causal_family_models
):
    for report in family_ranks:
        assert "error" not in (report["zero3"][model_type] or {}), report["zero3"][model_type]["error"]
    row = family_ranks[0]["zero3"][model_type]
    assert family_ranks[1]["zero3"][model_type] is None  # rank 0 alone writes the summary
    assert row["world_size"] == 2 and row["label"] == "zero3" and row["global_step"] == 2
    # batches of 4 on each of two ranks: the plain run's batches of 8, the same first loss and the same first step
    assert row["losses"] == pytest.approx(plain_losses(model_type)[:2], rel=1e-4)
    from textsql.hub import load_model

    assert row["saved_model_type"] == model_type
    assert row["saved_parameters"] == sum(
        p.numel() for p in load_model(str(causal_family_models / model_type)).parameters()
    )
