"""Real training of a tiny T5 on the CPU: no DeepSpeed, ZeRO-1, ZeRO-2, ZeRO-3 + offload, two ranks, resume, and bad input."""

import json
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import tiny_train_argv

SUMMARY_KEYS = {
    "run",
    "output_dir",
    "model_id",
    "parameters",
    "world_size",
    "strategy",
    "precision",
    "train_runtime",
    "train_samples_per_second",
    "real_tokens",
    "real_tokens_per_second",
    "global_step",
    "train_loss",
    "eval_loss",
    "peak_memory_per_rank",
    "arguments",
    "versions",
    "tensorboard_dir",
}


def train_argv(assets, runs_root, *extra, steps=40):
    return tiny_train_argv(
        assets,
        runs_root,
        *extra,
        max_steps=steps,
        per_device_train_batch_size=16,
        per_device_eval_batch_size=32,
        learning_rate="3e-3",
        warmup_steps=5,
        logging_steps=5,
        eval_strategy="steps",
        eval_steps=20,
        save_strategy="steps",
        save_steps=20,
        max_eval_samples=64,
        dataloader_num_workers=0,
    )


def run_train(argv, env, cwd, timeout=900):
    return subprocess.run(
        [sys.executable, "-m", "textsql.train", *argv],
        capture_output=True,
        text=True,
        env=env,
        cwd=cwd,
        timeout=timeout,
    )


def scalar_tags(event_dir: Path) -> set[str]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tags = set()
    for run_dir in {p.parent for p in event_dir.rglob("events.out.tfevents.*")}:
        accumulator = EventAccumulator(str(run_dir))
        accumulator.Reload()
        tags |= set(accumulator.Tags()["scalars"])
    return tags


def check_model_reloads_and_generates(output_dir: Path, initial_model_dir: Path):
    import torch
    from transformers import AutoModelForSeq2SeqLM, AutoTokenizer

    model = AutoModelForSeq2SeqLM.from_pretrained(output_dir)
    assert model.dtype == torch.float32  # loads without DeepSpeed, in the dtype it was saved in
    initial = AutoModelForSeq2SeqLM.from_pretrained(initial_model_dir)
    tokenizer = AutoTokenizer.from_pretrained(output_dir)
    name, trained = next(iter(model.state_dict().items()))
    assert trained.abs().sum() > 0
    assert not torch.equal(trained, initial.state_dict()[name]), "the saved weights are the untrained ones"
    inputs = tokenizer(["translate English to SQL: What is the Result when the Year is 1995?"], return_tensors="pt")
    generated = model.generate(**inputs, max_new_tokens=24)
    assert tokenizer.decode(generated[0], skip_special_tokens=True).strip()


# ZeRO-2 and ZeRO-3 train in bf16 (CPU autocast; DeepSpeed keeps a bf16 module and fp32 master weights), the others in fp32.
STRATEGIES = [
    ("none", None, None, "none", "fp32"),
    ("zero1", "zero1", 1, "none", "fp32"),
    ("zero2", "zero2", 2, "none", "bf16"),
    ("zero3_offload", "zero3_offload", 3, "cpu", "bf16"),
]


def check_saved_in_float32(output_dir: Path):
    """Every strategy saves fp32 weights; after bf16 training they are DeepSpeed's fp32 master weights, not bf16 copies."""
    import torch
    from safetensors.torch import load_file

    weights = load_file(output_dir / "model.safetensors")
    assert {str(t.dtype) for t in weights.values()} == {"torch.float32"}
    assert json.loads((output_dir / "config.json").read_text())["dtype"] == "float32"
    low_bits = [bool((t.view(torch.int32) & 0xFFFF).any()) for t in weights.values()]
    assert all(low_bits), (
        "weights a bf16 value can hold exactly: saved from the bf16 module, not the fp32 master weights"
    )


@pytest.mark.slow
@pytest.mark.parametrize("label,dsconfig,stage,offload,precision", STRATEGIES, ids=[s[0] for s in STRATEGIES])
def test_tiny_t5_trains_under_every_strategy(assets, tmp_path, cpu_env, label, dsconfig, stage, offload, precision):
    argv = train_argv(assets, tmp_path / "runs", "--precision", precision) + (
        ["--deepspeed", dsconfig] if dsconfig else []
    )
    done = run_train(argv, cpu_env, tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    output_dir = tmp_path / "runs" / f"tiny-t5-{label}-ws1-bs16-lr0.003-steps40-warmup5"
    summary = json.loads((output_dir / "run_summary.json").read_text())
    assert SUMMARY_KEYS <= set(summary)
    assert summary["strategy"]["label"] == label and summary["strategy"]["zero_stage"] == stage
    assert summary["strategy"]["offload_optimizer"] == offload and summary["strategy"]["offload_param"] == offload
    assert summary["world_size"] == 1 and summary["precision"] == precision and summary["global_step"] == 40
    assert summary["device"] == "cpu" and summary["tf32"] is False and summary["saved_dtype"] == "float32"
    assert (
        summary["train_runtime"] > 0
        and summary["train_samples_per_second"] > 0
        and summary["real_tokens_per_second"] > 0
    )
    assert summary["eval_loss"] is not None and summary["train_loss"] > 0
    assert summary["last_logged_loss"] < 0.8 * summary["first_logged_loss"], "the loss did not go down"
    (memory,) = summary["peak_memory_per_rank"]
    assert memory["rank"] == 0 and memory["cpu_peak_rss_bytes"] > 100 * 2**20
    assert summary["arguments"]["training"]["average_tokens_across_devices"] is True
    if dsconfig:
        assert summary["deepspeed_config"]["zero_optimization"]["stage"] == stage
        assert summary["deepspeed_config"]["train_micro_batch_size_per_gpu"] == 16  # "auto" filled by the Trainer
    assert {
        "train/loss",
        "eval/loss",
        "train/learning_rate",
        "train/samples_per_second",
        "train/real_tokens_per_second",
    } <= scalar_tags(output_dir / "tensorboard")
    check_model_reloads_and_generates(output_dir, assets[1])
    check_saved_in_float32(output_dir)
    assert "Traceback" not in done.stderr
    # The terminal: one progress bar, the logged metrics and the summary; the rest is in the run's train.log.
    terminal = done.stdout + done.stderr
    assert "Configuration saved in" not in terminal and "\x1b[A" not in terminal and "Loading weights" not in terminal
    assert "Configuration saved in" in (output_dir / "train.log").read_text()
    assert "'eval_loss'" in done.stdout and "strategy       " + label in done.stdout


@pytest.mark.slow
def test_two_ranks_with_the_deepspeed_launcher_zero3(assets, tmp_path, cpu_env, monkeypatch):
    """`deepspeed --num_gpus 2 --module textsql.train`: both ranks train, their memory is gathered to rank 0."""
    from textsql.arguments.training import parse_arguments
    from textsql.train.local_launch import run_training

    for key, value in cpu_env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.chdir(tmp_path)
    lines = []
    # Execution accuracy at evaluation: under ZeRO-3 both ranks must generate together (synced_gpus).
    argv = train_argv(
        assets, tmp_path / "runs", "--deepspeed", "zero3_offload", "--execution_accuracy_samples", "16", steps=20
    )
    summary = run_training(*parse_arguments(argv), num_gpus=2, echo=lines.append)
    assert lines[0].startswith("$ ") and "--num_gpus 2 --module textsql.train" in lines[0]
    assert summary.world_size == 2 and summary.run == "tiny-t5-zero3_offload-ws2-bs16-lr0.003-steps20-warmup5"
    assert sorted(m["rank"] for m in summary.peak_memory_per_rank) == [0, 1]
    assert summary.deepspeed_config["train_batch_size"] == 32
    assert 0.0 <= summary.execution_accuracy <= 1.0 and [h["step"] for h in summary.execution_accuracy_history] == [
        20
    ]  # scored once at the last step
    assert summary.last_logged_loss < summary.first_logged_loss
    check_model_reloads_and_generates(Path(summary.output_dir), assets[1])


def test_a_finished_rank_leaves_its_process_group_before_exit():
    """Exiting with gloo's threads alive can abort a finished rank; a failed one leaves without waiting for the others.
    In a child process: this one may hold the process group of an in-process DeepSpeed training."""
    code = """if True:
        import torch.distributed as dist
        from textsql.train.distributed import end_distributed

        end_distributed(True)  # nothing started: nothing to do
        for succeeded in (True, False):
            dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
            end_distributed(succeeded)
            assert not dist.is_initialized(), succeeded
        print("left")
    """
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "left", done.stderr[-3000:]


@pytest.mark.slow
def test_interrupted_run_resumes_and_a_finished_one_is_kept(assets, tmp_path, cpu_env):
    # No rotation: a loaded machine may wake the loop below only after later saves, which would rotate checkpoint-10 away.
    argv = train_argv(
        assets, tmp_path / "runs", "--save_steps", "10", "--eval_steps", "30", "--save_total_limit", "5", steps=30
    )
    output_dir = tmp_path / "runs" / "tiny-t5-none-ws1-bs16-lr0.003-steps30-warmup5"
    child = subprocess.Popen(
        [sys.executable, "-m", "textsql.train", *argv],
        env=cpu_env,
        cwd=tmp_path,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 300
    while not (output_dir / "checkpoint-10" / "trainer_state.json").exists():
        assert child.poll() is None and time.monotonic() < deadline, (
            "training ended or stalled before its first checkpoint"
        )
        time.sleep(0.2)
    time.sleep(0.5)  # let the checkpoint finish writing its last files
    child.send_signal(signal.SIGKILL)
    child.wait()
    assert not (output_dir / "run_summary.json").exists()
    # As if the kill had come right after checkpoint-10 (30 steps take 2 s on an idle machine, and a loaded one can
    # let the loop above wake only after later saves, even the last): later checkpoints go.
    for later in output_dir.glob("checkpoint-*"):
        if int(later.name.split("-")[1]) > 10:
            shutil.rmtree(later)
    # A save the kill cut short (as a pod taken back mid-save leaves one): the Trainer alone would resume from it.
    (output_dir / "checkpoint-29").mkdir()
    (output_dir / "checkpoint-29" / "optimizer.pt").write_bytes(b"PK\x03\x04")

    resumed = run_train(argv, cpu_env, tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-5000:]
    assert "Not resuming from" in resumed.stderr and "checkpoint-29: trainer_state.json is missing" in resumed.stderr
    summary = json.loads((output_dir / "run_summary.json").read_text())
    assert summary["resumed_from"] and Path(summary["resumed_from"]).name == "checkpoint-10"
    assert summary["global_step"] == 30

    again = run_train(argv, cpu_env, tmp_path)
    assert again.returncode == 2 and "holds a finished run" in again.stderr and "Traceback" not in again.stderr
    assert json.loads((output_dir / "run_summary.json").read_text()) == summary  # nothing was touched


def test_walkthrough_flag_names_and_booleans_parse(assets, tmp_path, monkeypatch):
    import copy

    from textsql.arguments.training import parse_arguments
    from textsql.train.run import set_up_run

    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    data_dir, model_dir = assets
    base = [
        "--model_id",
        str(model_dir),
        "--dataset_dir",
        str(data_dir),
        "--outputdir",
        str(tmp_path / "out"),
        "--epochs",
        "2",
        "--per_device_train_batch_size",
        "8",
        "--per_device_eval_batch_size",
        "4",
    ]
    model, data, training = parse_arguments(base + ["--gradient_checkpointing", "False"])
    assert training.activation_checkpointing is False  # the walkthrough's type=bool turned this ON
    assert training.output_dir == str(tmp_path / "out") and training.num_train_epochs == 2
    assert (training.per_device_train_batch_size, training.per_device_eval_batch_size) == (8, 4)
    assert training.train_sampling_strategy == "group_by_length" and training.average_tokens_across_devices is True
    assert not training.finalized  # parsing decides nothing: the Trainer's checks run in train()
    plan = set_up_run(model, training)
    finalized = copy.copy(training).finalize(**plan.trainer_settings)
    assert plan.precision.name == "fp32" and finalized.use_cpu and not finalized.bf16 and finalized.tf32 is False
    *_, training = parse_arguments(base + ["--gradient_checkpointing", "True"])
    assert training.activation_checkpointing is True
    assert not (tmp_path / "out").exists()  # parsing writes nothing without a DeepSpeed config


def test_fp16_on_t5_is_refused_with_the_reason(assets, tmp_path):
    from textsql.arguments.training import parse_arguments
    from textsql.errors import TextsqlError
    from textsql.train.run import set_up_run

    model, _, training = parse_arguments(
        ["--model_id", str(assets[1]), "--precision", "fp16", "--output_dir", str(tmp_path / "o")]
    )
    with pytest.raises(TextsqlError, match="fp16 is refused for T5.*overflow"):
        set_up_run(model, training)


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


@pytest.mark.parametrize(
    "case,message",
    [
        ("bad_json", "line 3"),
        ("unknown_key", "did you mean"),
        ("batch_mismatch", "train_micro_batch_size_per_gpu"),
        ("missing_dataset", "not a prepared textsql dataset"),
        ("unknown_model", "HF_HUB_OFFLINE is set"),
    ],
)
def test_bad_input_gets_one_paragraph_and_no_traceback(
    assets, tmp_path, monkeypatch, textsql_in_process, case, message
):
    argv = tiny_train_argv(assets, tmp_path / "runs", max_steps=2, per_device_train_batch_size=16)
    if case == "bad_json":
        argv += [
            "--deepspeed",
            str(write(tmp_path / "bad.json", '{\n  "zero_optimization": {\n    "stage": 2,,\n  }\n}\n')),
        ]
    elif case == "unknown_key":
        argv += [
            "--deepspeed",
            str(
                write(
                    tmp_path / "typo.json", json.dumps({"zero_optimization": {"stage": 2, "reduce_bucket_sise": 5e7}})
                )
            ),
        ]
    elif case == "batch_mismatch":
        argv += [
            "--deepspeed",
            str(
                write(
                    tmp_path / "mismatch.json",
                    json.dumps({"train_micro_batch_size_per_gpu": 8, "zero_optimization": {"stage": 2}}),
                )
            ),
        ]
    elif case == "missing_dataset":
        argv[3] = str(tmp_path / "no-such-dataset")
    elif case == "unknown_model":
        argv[1] = "nobody-knows/t5-none"
    monkeypatch.chdir(tmp_path)
    status, out, err = textsql_in_process(["train", *argv])
    assert status == 2, err[-3000:]
    assert message in err and "Traceback" not in err and len(err.strip().split("\n\n")) == 1
    assert not (tmp_path / "runs").exists() or case in ("missing_dataset", "unknown_model")


def test_arguments_are_dataclasses_from_a_command_line_or_a_recipe_and_travel_as_one_json_object(assets, tmp_path):
    from textsql.arguments.training import (
        TextsqlTrainingArguments,
        arguments_dict,
        arguments_from_dict,
        parse_arguments,
    )
    from textsql.errors import TextsqlError

    data_dir, model_dir = assets
    argv = [
        "--model_id",
        str(model_dir),
        "--dataset_dir",
        str(data_dir),
        "--epochs",
        "2",
        "--deepspeed",
        "zero2",
        "--report_to",
        "none",
        "--hub_token",
        "hf_secret_canary",
    ]
    model, data, training = parse_arguments(argv)
    assert (model.model_id, data.dataset_dir, training.num_train_epochs, training.deepspeed) == (
        str(model_dir),
        str(data_dir),
        2,
        "zero2",
    )
    assert training.learning_rate == 3e-4 and training.save_total_limit == 2  # textsql's defaults, as field defaults
    values = arguments_dict(model, data, training)
    assert values["hub_token"] is None and "hf_secret_canary" not in json.dumps(
        values
    )  # never travels, never lands in files
    again = arguments_from_dict(json.loads(json.dumps(values)))
    assert arguments_dict(*again) == values

    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(
        f"model_id: {model_dir}\ndataset_dir: {data_dir}\nnum_train_epochs: 2\ndeepspeed: zero2\nreport_to: none\n"
    )
    from_yaml = arguments_dict(*parse_arguments([str(recipe)]))
    assert all(
        from_yaml[key] == values[key]
        for key in ("model_id", "dataset_dir", "num_train_epochs", "deepspeed", "report_to", "learning_rate")
    )
    (tmp_path / "recipe.json").write_text(json.dumps(values))
    assert arguments_dict(*parse_arguments([str(tmp_path / "recipe.json")])) == values
    # what each rank of `deepspeed --module textsql.train recipe.json` gets
    assert arguments_dict(*parse_arguments(["--local_rank=1", str(tmp_path / "recipe.json")])) == values
    (tmp_path / "typo.yaml").write_text("model_idd: t5-small\n")
    with pytest.raises(TextsqlError, match="model_idd"):
        parse_arguments([str(tmp_path / "typo.yaml")])
    with pytest.raises(TextsqlError, match="--precision must be one of"):
        parse_arguments(["--precision", "fp8"])

    # Building the arguments touches no device (the Trainer would refuse bf16 on this CPU here); finalizing does.
    described = TextsqlTrainingArguments(bf16=True, output_dir=str(tmp_path / "o"))
    assert not described.finalized
    with pytest.raises(TextsqlError, match="Invalid training arguments.*bf16"):
        described.finalize(use_cpu=False)
