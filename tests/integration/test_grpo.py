"""`textsql train --stage grpo` (TRL's GRPOTrainer rewarded by executing the SQL) on the tiny Qwen2: two steps from a
fully fine-tuned run and from a LoRA run (its adapter trained on, then merged and scored), in this process; under ZeRO-2
on two ranks through the deepspeed launcher; an interrupted GRPO run resumed; a T5 model refused with the reason."""

import json
import shutil
import subprocess
import sys

import pytest
from conftest import tiny_train_argv

pytestmark = pytest.mark.slow

SFT = dict(
    max_steps=8,
    per_device_train_batch_size=16,
    learning_rate="3e-3",
    logging_steps=2,
    eval_strategy="no",
    save_strategy="no",
    execution_accuracy_samples=0,
)
# Two steps of 2 prompts x 4 completions each, 16 tokens at most; the result scored on 8 validation questions.
GRPO = [
    "--stage", "grpo", "--num_generations", "4", "--per_device_train_batch_size", "8", "--max_steps", "2",
    "--max_completion_length", "16", "--learning_rate", "1e-4", "--logging_steps", "1", "--save_strategy", "no",
    "--execution_accuracy_samples", "8", "--dataloader_num_workers", "0",
]  # fmt: skip


def summary_of(stdout: str) -> dict:
    line = next(line for line in stdout.splitlines() if line.startswith("textsql-run-summary: "))
    return json.loads(open(line.split(": ", 1)[1]).read())


@pytest.fixture(scope="module")
def sft_runs(causal_assets, tmp_path_factory):
    """{"full": summary, "lora": summary, "qlora": summary}: the supervised runs GRPO starts from."""
    from conftest import main_in_process

    runs = tmp_path_factory.mktemp("sft")
    env = dict(DS_ACCELERATOR="cpu", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", TENSORBOARD_LOGGING_DIR="")
    summaries = {}
    lora = ["--lora", "True", "--lora_targets", "all"]
    for name, extra in (("full", []), ("lora", lora), ("qlora", [*lora, "--quantize_base", "nf4"])):
        folder = runs / name
        argv = tiny_train_argv(causal_assets, runs, *extra, "--output_dir", str(folder), **SFT)
        assert main_in_process(["train", *argv], env) == 0
        summaries[name] = json.loads((folder / "run_summary.json").read_text())
    return summaries


def grpo_argv(parent: dict, data_dir, runs_root) -> list[str]:
    return ["train", "--model_id", parent["output_dir"], "--dataset_dir", str(data_dir), "--runs_root", str(runs_root)]


def tensorboard_tags(run_dir) -> set[str]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tags = set()
    for events in (run_dir / "tensorboard").rglob("events.out.tfevents.*"):
        accumulator = EventAccumulator(str(events))
        accumulator.Reload()
        tags |= set(accumulator.Tags()["scalars"])
    return tags


def test_grpo_from_a_full_run_and_from_a_lora_run_records_its_stage_and_rewards(
    sft_runs, causal_assets, tmp_path, textsql_in_process, monkeypatch
):
    data_dir, _ = causal_assets
    runs = tmp_path / "runs"
    monkeypatch.setenv("TENSORBOARD_LOGGING_DIR", "")
    # with a KL term (--beta above 0: TRL keeps a reference model and logs the KL; at 0, its default, it does not)
    status, out, err = textsql_in_process([*grpo_argv(sft_runs["full"], data_dir, runs), *GRPO, "--beta", "0.04"])
    assert status == 0, err[-3000:]
    full = summary_of(out)
    grpo = full["grpo"]
    assert full["run"].endswith("-grpo") and full["global_step"] == 2 and full["strategy"]["lora"] is None
    assert grpo["parent_run"] == sft_runs["full"]["output_dir"] and grpo["num_generations"] == 4
    assert grpo["logged_steps"] == 2 and 0 <= grpo["rewards/execution/mean"] <= 1
    assert {"kl", "completions/mean_length", "frac_reward_zero_std", "frac_execution_zero_std"} <= grpo.keys()
    assert [step["step"] for step in grpo["steps"]] == [1, 2] and all("kl" in step for step in grpo["steps"])
    assert grpo["lr_scheduler_type"] == "constant_with_warmup" and grpo["loss_type"] == "dapo"
    assert full["execution_accuracy"] is not None  # scored on validation questions at the end
    assert "grpo           from" in out and "groups without signal" in out
    assert (runs / full["run"] / "model.safetensors").is_file()
    tags = tensorboard_tags(runs / full["run"])
    assert {"train/reward", "train/rewards/execution/mean", "train/kl", "train/frac_execution_zero_std"} <= tags, tags

    # A LoRA run's adapter is trained on: the GRPO run is an adapter folder that infer and merge take like any other
    status, out, err = textsql_in_process([*grpo_argv(sft_runs["lora"], data_dir, runs), *GRPO])
    assert status == 0, err[-3000:]
    lora = summary_of(out)
    run_dir = runs / lora["run"]
    assert lora["strategy"]["lora"] == sft_runs["lora"]["strategy"]["lora"] and "kl" not in lora["grpo"]
    assert 0 < lora["trainable_parameters"] < lora["parameters"] / 5
    assert (run_dir / "adapter_model.safetensors").is_file() and not (run_dir / "model.safetensors").exists()
    status, out, err = textsql_in_process(
        ["infer", "--model_dir", str(run_dir), "--dataset_dir", str(data_dir), "--max_examples", "8"]
        + ["--max_new_tokens", "16", "--show_examples", "0"]
    )
    assert status == 0 and "8 examples (test, constrained greedy)" in out, err[-3000:]
    status, out, err = textsql_in_process(["merge", str(run_dir)])
    assert status == 0, err[-3000:]
    status, out, err = textsql_in_process(["report", "--runs_root", str(runs)])
    assert status == 0 and "| stage | reward |" in out and " | grpo | " in out, err[-3000:]


def optimizer_and_scheduler(checkpoint):
    import torch

    optimizer = torch.load(checkpoint / "optimizer.pt", weights_only=True)
    scheduler = torch.load(checkpoint / "scheduler.pt", weights_only=True)
    return optimizer, scheduler


def assert_same_state(one, other, where=""):
    """Every tensor and number of two saved states equal (optimizer moments, steps, the scheduler's last LR)."""
    import torch

    if isinstance(one, dict):
        assert one.keys() == other.keys(), where
        for key in one:
            assert_same_state(one[key], other[key], f"{where}/{key}")
    elif isinstance(one, (list, tuple)):
        assert len(one) == len(other), where
        for i, (a, b) in enumerate(zip(one, other)):
            assert_same_state(a, b, f"{where}/{i}")
    elif isinstance(one, torch.Tensor):
        assert torch.equal(one, other), where
    else:
        assert one == other, where


def test_an_interrupted_grpo_run_resumes_to_the_state_of_an_uninterrupted_one(
    sft_runs, causal_assets, tmp_path, textsql_in_process
):
    """Resumed from its first checkpoint, a GRPO run reaches the same step with the same optimizer and scheduler state
    and the same second-step loss and rewards as the same run never interrupted (the sampler's RNG restored too)."""
    data_dir, _ = causal_assets
    runs = {}
    for name in ("whole", "resumed"):
        folder = tmp_path / name
        argv = [*grpo_argv(sft_runs["full"], data_dir, tmp_path), *GRPO, "--output_dir", str(folder)]
        argv += ["--save_strategy", "steps", "--save_steps", "1", "--execution_accuracy_samples", "0", "--seed", "3"]
        if name == "resumed":
            status, _, err = textsql_in_process([*argv, "--max_steps", "1"])
            assert status == 0, err[-3000:]
            (folder / "run_summary.json").unlink()  # as if it had been stopped after its first checkpoint
        status, out, err = textsql_in_process(argv)
        assert status == 0, err[-3000:]
        runs[name] = summary_of(out)
    assert runs["resumed"]["resumed_from"].endswith("checkpoint-1") and runs["whole"]["resumed_from"] is None
    assert runs["resumed"]["global_step"] == runs["whole"]["global_step"] == 2
    whole, resumed = (optimizer_and_scheduler(tmp_path / n / "checkpoint-2") for n in ("whole", "resumed"))
    assert whole[0]["state"], "the optimizer saved no moments"
    assert_same_state(whole, resumed)
    last = [
        json.loads((tmp_path / n / "checkpoint-2" / "trainer_state.json").read_text())["log_history"][-1] for n in runs
    ]
    assert last[0]["step"] == last[1]["step"] == 2
    for key in ("loss", "reward", "rewards/execution/mean", "completions/mean_length"):
        assert last[0][key] == pytest.approx(last[1][key], rel=1e-6, abs=1e-9), key
    assert runs["whole"]["grpo"]["steps"][-1] == pytest.approx(runs["resumed"]["grpo"]["steps"][-1])


def test_grpo_continues_a_qlora_run_s_adapter_on_its_4_bit_base(sft_runs, causal_assets, tmp_path, textsql_in_process):
    data_dir, _ = causal_assets
    status, out, err = textsql_in_process([*grpo_argv(sft_runs["qlora"], data_dir, tmp_path), *GRPO])
    assert status == 0, err[-3000:]
    summary = summary_of(out)
    assert summary["strategy"]["lora"] == sft_runs["qlora"]["strategy"]["lora"] and summary["grpo"]["logged_steps"] == 2
    assert (tmp_path / summary["run"] / "adapter_model.safetensors").is_file()
    status, _, err = textsql_in_process(
        [
            *grpo_argv(sft_runs["qlora"], data_dir, tmp_path / "again"),
            *GRPO,
            "--lora",
            "True",
            "--quantize_base",
            "int8",
        ]
    )
    assert status == 2 and "GRPO continues its adapter on that base" in err


@pytest.mark.parametrize("strategy", ["zero2", "zero3"])
def test_grpo_under_zero_on_two_ranks(strategy, sft_runs, causal_assets, tmp_path, cpu_env):
    """ZeRO-2, and ZeRO-3 (TRL gathers the sharded weights for each generation)."""
    data_dir, _ = causal_assets
    command = [sys.executable, "-m", "textsql", *grpo_argv(sft_runs["full"], data_dir, tmp_path / "runs"), *GRPO]
    command += ["--deepspeed", strategy, "--num_gpus", "2", "--per_device_train_batch_size", "4"]
    done = subprocess.run(command, env=cpu_env, cwd=tmp_path, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, (done.stdout + done.stderr)[-5000:]
    summary = summary_of(done.stdout)
    assert summary["world_size"] == 2 and summary["strategy"]["label"] == strategy
    assert summary["grpo"]["logged_steps"] == 2 and (tmp_path / "runs" / summary["run"] / "model.safetensors").is_file()


def test_grpo_refuses_t5_with_the_reason(assets, tmp_path, textsql_in_process):
    data_dir, model_dir = assets
    status, _, err = textsql_in_process(
        ["train", "--model_id", str(model_dir), "--dataset_dir", str(data_dir), "--runs_root", str(tmp_path), *GRPO]
    )
    assert status == 2 and "--stage grpo trains causal LMs only" in err
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())
    shutil.rmtree(tmp_path, ignore_errors=True)
