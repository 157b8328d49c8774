"""LoRA end to end on a tiny T5 whose tokenizer lacked '<' (prep added it): trained without DeepSpeed (scored during
training, resumed), under ZeRO-2 and ZeRO-3 + offload with two ranks through the deepspeed launcher (the same adapter,
real shapes), and merged into a plain model whose greedy SQL is the adapter's; a wrong base or tokenizer is refused."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import main_in_process, tiny_train_argv

STEPS = 10


@pytest.fixture(scope="module")
def lora_base(header_assets, tmp_path_factory):
    """(data_dir, model_dir): header_assets' data and a copy of its model without dropout, so that runs under different
    strategies take the same steps and their adapters can be compared value by value."""
    data_dir, model_dir = header_assets
    folder = tmp_path_factory.mktemp("lora-base") / "tiny-t5"
    shutil.copytree(model_dir, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "dropout_rate": 0.0}, indent=2))
    return data_dir, folder


def lora_argv(base, runs_root, *extra, steps=STEPS):
    return tiny_train_argv(
        base,
        runs_root,
        *extra,
        max_steps=steps,
        per_device_train_batch_size=8,
        per_device_eval_batch_size=32,
        learning_rate="1e-2",
        warmup_steps=0,
        logging_steps=5,
        max_eval_samples=32,
        dataloader_num_workers=0,
        lora="True",
        lora_targets="all",
        lora_dropout=0,
    )


def adapter_tensors(run_dir: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(run_dir / "adapter_model.safetensors")


@pytest.fixture(scope="module")
def plain_lora_run(lora_base, tmp_path_factory):
    """A LoRA run without DeepSpeed, in this process, scored at its last step and checkpointed half-way: (run_dir)."""
    runs = tmp_path_factory.mktemp("lora-runs")
    argv = lora_argv(
        lora_base,
        runs,
        "--eval_strategy",
        "steps",
        "--eval_steps",
        str(STEPS),
        "--save_strategy",
        "steps",
        "--save_steps",
        str(STEPS // 2),
        "--execution_accuracy_samples",
        "8",
    )
    env = dict(DS_ACCELERATOR="cpu", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", TENSORBOARD_LOGGING_DIR="")
    assert main_in_process(["train", *argv], env) == 0
    return runs / f"tiny-t5-none-lora-r8-ws1-bs8-lr0.01-steps{STEPS}"  # the settings that differ from the defaults


@pytest.mark.slow
def test_a_lora_run_saves_the_adapter_and_tokenizer_and_says_what_trained(plain_lora_run, lora_base):
    from textsql.run_summary import read_summary

    run = plain_lora_run
    summary = read_summary(run)
    assert summary.strategy["label"] == "none" and summary.lora == {
        "rank": 8,
        "alpha": 16.0,
        "dropout": 0.0,
        "targets": "all",
    }
    assert 0 < summary.trainable_parameters < summary.parameters / 5 and summary.global_step == STEPS
    assert [h["step"] for h in summary.execution_accuracy_history] == [STEPS] and summary.eval_loss is not None
    assert summary.last_logged_loss < summary.first_logged_loss
    files = {p.name for p in run.iterdir()}
    assert {"adapter_config.json", "adapter_model.safetensors", "textsql_adapter.json", "tokenizer.json"} <= files
    assert (
        "model.safetensors" not in files and "config.json" not in files
    )  # the adapter, never a copy of the frozen base
    tensors = adapter_tensors(run)
    assert {str(t.dtype) for t in tensors.values()} == {"torch.float32"}
    assert sum(t.numel() for t in tensors.values()) == summary.trainable_parameters
    record = json.loads((run / "textsql_adapter.json").read_text())
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(run)
    assert record["trainable_token_ids"] == sorted(
        tokenizer.convert_tokens_to_ids(["<", "▁<"])
    )  # the pieces prep added
    (rows,) = [t for name, t in tensors.items() if "trainable_tokens" in name]
    assert tuple(rows.shape) == (2, 64)


@pytest.mark.slow
def test_an_interrupted_lora_run_resumes_from_its_checkpoint_to_the_same_adapter(
    plain_lora_run, lora_base, tmp_path, monkeypatch
):
    import torch

    from textsql.cli import main

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TENSORBOARD_LOGGING_DIR", "")
    interrupted = tmp_path / "runs" / plain_lora_run.name
    interrupted.mkdir(parents=True)
    shutil.copytree(
        plain_lora_run / f"checkpoint-{STEPS // 2}", interrupted / f"checkpoint-{STEPS // 2}"
    )  # killed after it
    argv = lora_argv(
        lora_base,
        tmp_path / "runs",
        "--eval_strategy",
        "no",
        "--save_strategy",
        "steps",
        "--save_steps",
        str(STEPS // 2),
    )
    assert main(["train", *argv]) == 0
    summary = json.loads((interrupted / "run_summary.json").read_text())
    assert Path(summary["resumed_from"]).name == f"checkpoint-{STEPS // 2}" and summary["global_step"] == STEPS
    resumed, whole = adapter_tensors(interrupted), adapter_tensors(plain_lora_run)
    assert resumed.keys() == whole.keys()
    for name in whole:
        torch.testing.assert_close(
            resumed[name], whole[name], rtol=1e-4, atol=1e-5, msg=lambda m, name=name: f"{name}: {m}"
        )


@pytest.mark.slow
def test_lora_under_zero2_and_zero3_offload_with_two_ranks_trains_the_same_adapter(lora_base, tmp_path, cpu_env):
    """Both through the deepspeed launcher, at the same time. ZeRO-3 holds every parameter as a (0,) placeholder: the
    adapter is gathered from DeepSpeed's fp32 master weights, so it has its real shapes and ZeRO-2's values (the added
    rows and the adapter start from the seed alone; a small learning rate keeps Adam's first, sign-like steps from
    magnifying the last bits in which the two strategies' sums differ)."""
    import torch

    from textsql.run_summary import read_summary

    runs = tmp_path / "runs"
    children = {}
    for strategy in ("zero2", "zero3_offload"):
        argv = lora_argv(
            lora_base,
            runs,
            "--deepspeed",
            strategy,
            "--num_gpus",
            "2",
            "--eval_strategy",
            "no",
            "--save_strategy",
            "no",
            "--learning_rate",
            "1e-3",
            steps=4,
        )
        children[strategy] = subprocess.Popen(
            [sys.executable, "-m", "textsql", "train", *argv],
            env=cpu_env,
            cwd=tmp_path,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
    adapters, summaries = {}, {}
    for strategy, child in children.items():
        output, _ = child.communicate(timeout=900)
        assert child.returncode == 0, f"{strategy}:\n{output[-5000:]}"
        run = runs / f"tiny-t5-{strategy}-lora-r8-ws2-bs8-lr0.001-steps4"
        summaries[strategy], adapters[strategy] = read_summary(run), adapter_tensors(run)
        assert summaries[strategy].lora["rank"] == 8 and summaries[strategy].world_size == 2
        assert "model.safetensors" not in {p.name for p in run.iterdir()}
    assert summaries["zero2"].trainable_parameters == summaries["zero3_offload"].trainable_parameters
    assert summaries["zero2"].parameters == summaries["zero3_offload"].parameters  # ZeRO-3 counted by ds_numel
    zero2, zero3 = adapters["zero2"], adapters["zero3_offload"]
    assert zero2.keys() == zero3.keys()
    for name, tensor in zero3.items():
        assert tensor.shape == zero2[name].shape and tensor.numel() > 0 and tensor.dtype == torch.float32, name
        torch.testing.assert_close(tensor, zero2[name], rtol=1e-4, atol=1e-5, msg=lambda m, name=name: f"{name}: {m}")
    assert any(t.abs().sum() > 0 for name, t in zero3.items() if "lora_B" in name)  # B starts at zero: it trained


@pytest.mark.slow
def test_merge_makes_a_plain_model_with_the_adapters_greedy_sql(
    plain_lora_run, lora_base, assets, tmp_path, textsql_in_process
):
    import torch
    from transformers import AutoModelForSeq2SeqLM, AutoTokenizer

    from textsql.evaluate import generate_sql
    from textsql.loading import load_folder, read_folder
    from textsql.prepared import load_prepared

    merged_dir = tmp_path / "merged"
    status, out, err = textsql_in_process(["merge", str(plain_lora_run), "--output_dir", str(merged_dir)])
    assert status == 0, err
    assert not (merged_dir / "adapter_config.json").exists() and (merged_dir / "model.safetensors").is_file()
    merged = AutoModelForSeq2SeqLM.from_pretrained(merged_dir)  # a plain transformers model
    assert type(merged).__name__ == "T5ForConditionalGeneration" and merged.dtype == torch.float32
    adapter, tokenizer = load_folder(read_folder(plain_lora_run))
    assert AutoTokenizer.from_pretrained(merged_dir).get_vocab() == tokenizer.get_vocab()
    dataset, _ = load_prepared(lora_base[0])
    sources = tokenizer.batch_decode(dataset["validation"]["input_ids"][:16], skip_special_tokens=True)
    from_adapter = generate_sql(adapter, tokenizer, sources, batch_size=8, max_new_tokens=32, progress=False)
    from_merged = generate_sql(merged.eval(), tokenizer, sources, batch_size=8, max_new_tokens=32, progress=False)
    assert from_merged == from_adapter

    # `textsql infer` scores the merged folder and the adapter folder alike
    scores = {}
    for name, model_dir in (("merged", merged_dir), ("adapter", plain_lora_run)):
        status, out, err = textsql_in_process(
            [
                "infer",
                "--model_dir",
                str(model_dir),
                "--dataset_dir",
                str(lora_base[0]),
                "--split",
                "validation",
                "--max_examples",
                "16",
                "--output_dir",
                str(tmp_path / name),
            ]
        )
        assert status == 0, err
        scores[name] = json.loads((tmp_path / name / "eval_metrics.json").read_text())["execution_accuracy"]
    assert scores["merged"] == scores["adapter"]

    status, _, err = textsql_in_process(["merge", str(plain_lora_run), "--output_dir", str(merged_dir)])
    assert status == 2 and "--overwrite True" in err

    # A checkpoint of the run merges too (what people do with the best step), beside the run, not inside it.
    checkpoint = plain_lora_run / f"checkpoint-{STEPS // 2}"
    status, out, err = textsql_in_process(["merge", str(checkpoint)])
    assert status == 0, err
    merged_checkpoint = plain_lora_run.parent / f"{plain_lora_run.name}-checkpoint-{STEPS // 2}-merged"
    adapter, tokenizer = load_folder(read_folder(checkpoint))
    merged = AutoModelForSeq2SeqLM.from_pretrained(merged_checkpoint).eval()
    from_checkpoint = generate_sql(adapter, tokenizer, sources, batch_size=8, max_new_tokens=32, progress=False)
    assert generate_sql(merged, tokenizer, sources, batch_size=8, max_new_tokens=32, progress=False) == from_checkpoint
    final, halfway = AutoModelForSeq2SeqLM.from_pretrained(merged_dir).state_dict(), merged.state_dict()
    assert any(not torch.equal(final[name], halfway[name]) for name in final), "the checkpoint's own adapter was merged"


@pytest.mark.slow
def test_merge_refuses_another_base_or_tokenizer_with_the_fix(plain_lora_run, assets, tmp_path, textsql_in_process):
    status, _, err = textsql_in_process(
        ["merge", str(plain_lora_run), "--base_model", str(assets[1]), "--output_dir", str(tmp_path / "m")]
    )
    assert (
        status == 2 and "is not the base model the adapter" in err and "--base_model" in err and "Traceback" not in err
    )
    other = tmp_path / "other-base"
    shutil.copytree(json.loads((plain_lora_run / "textsql_adapter.json").read_text())["base_model"], other)
    from safetensors.torch import load_file, save_file

    weights = load_file(other / "model.safetensors")
    name = next(n for n in weights if n.endswith("SelfAttention.q.weight"))
    weights[name] = weights[name] + 0.01  # same shapes and tokenizer, other weights
    save_file(weights, other / "model.safetensors", metadata={"format": "pt"})
    status, _, err = textsql_in_process(
        ["merge", str(plain_lora_run), "--base_model", str(other), "--output_dir", str(tmp_path / "m")]
    )
    assert status == 2 and "weights" in err and "differ" in err and "--base_model" in err
    swapped = tmp_path / "swapped"
    shutil.copytree(plain_lora_run, swapped)
    for file in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(assets[1] / file, swapped / file)  # another tokenizer
    status, _, err = textsql_in_process(["merge", str(swapped), "--output_dir", str(tmp_path / "m")])
    assert status == 2 and "not the one the adapter was trained with" in err
    assert not (tmp_path / "m").exists()
