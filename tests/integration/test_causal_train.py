"""Causal LMs through `textsql train` and `textsql infer` (in this process, on the CPU): the tiny Qwen2 without
DeepSpeed, with ZeRO-2 and with LoRA, scored by infer (every family under every strategy: test_causal_families.py)."""

import json
from pathlib import Path

import pytest
from conftest import real_causal_folder, tiny_train_argv

from textsql.wikisql.release import SAMPLE_SOURCE

pytestmark = pytest.mark.slow

SHORT = dict(
    max_steps=8,
    per_device_train_batch_size=16,
    per_device_eval_batch_size=32,
    learning_rate="3e-3",
    logging_steps=2,
    eval_strategy="no",
    save_strategy="no",
    dataloader_num_workers=0,
)


def summary_of(stdout: str) -> dict:
    line = next(line for line in stdout.splitlines() if line.startswith("textsql-run-summary: "))
    return json.loads(open(line.split(": ", 1)[1]).read())


@pytest.fixture(scope="module")
def causal_runs(causal_assets, tmp_path_factory):
    return tmp_path_factory.mktemp("causal-runs")


def test_full_fine_tuning_without_deepspeed_and_with_zero2_trains_alike_and_infer_scores_it(
    causal_assets, causal_runs, textsql_in_process
):
    status, out, err = textsql_in_process(["train", *tiny_train_argv(causal_assets, causal_runs, **SHORT)])
    assert status == 0, err[-3000:]
    plain = summary_of(out)
    assert plain["global_step"] == 8 and plain["model_id"].endswith("tiny-qwen2")
    assert plain["last_logged_loss"] < plain["first_logged_loss"]
    # every run says once, from its own first steps, how long it takes
    assert (Path(plain["output_dir"]) / "train.log").read_text().count("the training takes about") == 1
    status, out, err = textsql_in_process(
        ["train", *tiny_train_argv(causal_assets, causal_runs, "--deepspeed", "zero2", **SHORT)]
    )
    assert status == 0, err[-3000:]
    zero2 = summary_of(out)
    assert zero2["strategy"]["label"] == "zero2"
    # the same data, seed and fp32 arithmetic: the same loss curve
    assert zero2["first_logged_loss"] == pytest.approx(plain["first_logged_loss"], rel=1e-4)
    assert zero2["last_logged_loss"] == pytest.approx(plain["last_logged_loss"], rel=1e-3)
    data_dir, _ = causal_assets
    status, out, err = textsql_in_process(
        ["infer", "--model_dir", plain["output_dir"], "--dataset_dir", str(data_dir), "--max_examples", "16",
         "--max_new_tokens", "24", "--show_examples", "1"]
    )  # fmt: skip
    assert status == 0, err[-3000:]
    metrics = json.loads(open(f"{plain['output_dir']}/eval_metrics.json").read())
    assert metrics["examples"] == 16 and "execution_accuracy" in metrics
    records = [json.loads(line) for line in open(f"{plain['output_dir']}/predictions.jsonl")]
    assert len(records) == 16 and not any("### Question" in r["predicted_sql"] for r in records)
    # typed questions get the same prompt layout, with the named table's columns
    table_id = records[0]["table_id"]
    status, out, err = textsql_in_process(
        ["infer", "--model_dir", plain["output_dir"], "--dataset_dir", str(data_dir), "--question",
         records[0]["question"], "--table_id", table_id, "--max_new_tokens", "24"]
    )  # fmt: skip
    assert status == 0, err[-3000:]
    assert f"Model Prediction: {records[0]['predicted_sql']}" in out  # the same prompt as the split's


def test_lora_on_a_causal_lm_saves_an_adapter_that_infer_loads_and_merge_folds_in(
    causal_assets, causal_runs, textsql_in_process
):
    status, out, err = textsql_in_process(
        ["train", *tiny_train_argv(causal_assets, causal_runs, "--lora", "True", "--lora_targets", "all", **SHORT)]
    )
    assert status == 0, err[-3000:]
    summary = summary_of(out)
    assert 0 < summary["trainable_parameters"] < summary["parameters"] / 5
    run = summary["output_dir"]
    adapter = json.loads(open(f"{run}/adapter_config.json").read())
    assert adapter["task_type"] == "CAUSAL_LM"
    assert {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"} <= {
        name.rsplit(".", 1)[-1] for name in adapter["target_modules"]
    }
    status, out, err = textsql_in_process(
        ["infer", "--model_dir", run, "--dataset_dir", str(causal_assets[0]), "--max_examples", "8",
         "--max_new_tokens", "16"]
    )  # fmt: skip
    assert status == 0, err[-3000:]
    adapter_metrics = json.loads(open(f"{run}/eval_metrics.json").read())
    assert adapter_metrics["examples"] == 8
    # merged into its base: a plain causal LM whose generations are the adapter's
    merged_dir = causal_runs / "merged"
    status, out, err = textsql_in_process(["merge", run, "--output_dir", str(merged_dir)])
    assert status == 0, err[-3000:]
    from textsql.evaluate import generate_sql, load_scoring_set
    from textsql.hub import load_model
    from textsql.loading import load_folder, read_folder

    merged = load_model(str(merged_dir))
    assert type(merged).__name__ == "Qwen2ForCausalLM" and not (merged_dir / "adapter_config.json").exists()
    adapter_model, tokenizer = load_folder(read_folder(run))
    prompts = load_scoring_set(str(causal_assets[0]), "test", 8).sources
    from_adapter = generate_sql(adapter_model, tokenizer, prompts, max_new_tokens=16, progress=False)
    assert generate_sql(merged.eval(), tokenizer, prompts, max_new_tokens=16, progress=False) == from_adapter


def test_an_interrupted_causal_run_resumes_from_its_checkpoint(causal_assets, tmp_path, textsql_in_process):
    """A run whose last checkpoint and summary are gone (as a pod taken back leaves it) resumes from the one before
    and ends with the loss of the uninterrupted run."""
    argv = tiny_train_argv(causal_assets, tmp_path / "runs", **dict(SHORT, max_steps=4, logging_steps=1))
    argv += ["--save_strategy", "steps", "--save_steps", "2", "--save_total_limit", "3"]
    train_interrupt_and_resume(argv, tmp_path / "runs", textsql_in_process)


def train_interrupt_and_resume(argv: list[str], runs_root, textsql_in_process) -> Path:
    """Train 4 steps saving every 2; take the last checkpoint and the summary away (as a pod taken back leaves the
    run); train again: it resumes from checkpoint-2 and ends with the uninterrupted run's loss. The run folder."""
    import shutil

    status, out, err = textsql_in_process(["train", *argv])
    assert status == 0, err[-3000:]
    whole = summary_of(out)
    run = Path(runs_root) / whole["run"]
    shutil.rmtree(run / "checkpoint-4")
    (run / "run_summary.json").unlink()
    status, out, err = textsql_in_process(["train", *argv])
    assert status == 0, err[-3000:]
    resumed = summary_of(out)
    assert resumed["resumed_from"].endswith("checkpoint-2") and resumed["global_step"] == 4
    assert resumed["last_logged_loss"] == pytest.approx(whole["last_logged_loss"], rel=1e-4)
    return run


def test_two_ranks_with_zero3_offload_train_a_causal_lm_and_generate_together(
    causal_assets, tmp_path, cpu_env, monkeypatch
):
    """`deepspeed --num_gpus 2 --module textsql.train` on the CPU: ZeRO-3 partitions the tiny Qwen2 over two ranks,
    both generate together (synced, left-padded) for execution accuracy, and the saved model reloads whole."""
    from textsql.arguments.training import parse_arguments
    from textsql.hub import load_model
    from textsql.train.local_launch import run_training

    for key, value in cpu_env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.chdir(tmp_path)
    argv = tiny_train_argv(
        causal_assets,
        tmp_path / "runs",
        "--deepspeed",
        "zero3_offload",
        **dict(SHORT, max_steps=6, eval_strategy="steps", eval_steps=6, max_eval_samples=16),
        execution_accuracy_samples=8,
    )
    summary = run_training(*parse_arguments(argv), num_gpus=2, echo=lambda line: None)
    assert summary.world_size == 2 and sorted(m["rank"] for m in summary.peak_memory_per_rank) == [0, 1]
    assert summary.global_step == 6 and 0.0 <= summary.execution_accuracy <= 1.0
    model = load_model(summary.output_dir)
    assert type(model).__name__ == "Qwen2ForCausalLM" and model.lm_head.weight.shape[0] > 0


def test_gpt2_without_a_pad_token_prepares_trains_and_generates(real_files, tmp_path, textsql_in_process):
    """GPT-2's real tokenizer has no pad token: batches are padded with EOS and masked by position. The prompts list
    the table's cells the question mentions (question+header+values), and a typed question about a table gets the
    split's prompt, so the same SQL."""
    folder = real_causal_folder(real_files, "gpt2", tmp_path / "tiny-gpt2")
    data = tmp_path / "data"
    status, out, err = textsql_in_process(
        ["prep", "--source", SAMPLE_SOURCE, "--model_id", str(folder), "--output_dir", str(data),
         "--source_format", "question+header+values", "--max_examples_per_split", "48"]
    )  # fmt: skip
    assert status == 0, err[-3000:]
    assert "layout: causal LM (gpt2)" in out and "byte-level BPE: every character can be written" in out
    assert "cell values listed in " in out
    argv = tiny_train_argv((data, folder), tmp_path / "runs", **dict(SHORT, max_steps=2, per_device_train_batch_size=8))
    status, out, err = textsql_in_process(["train", *argv])
    assert status == 0, err[-3000:]
    run = summary_of(out)["output_dir"]
    assert json.loads(open(f"{run}/config.json").read())["task_specific_params"]["textsql"]["max_values"] == 10
    status, out, err = textsql_in_process(
        ["infer", "--model_dir", run, "--dataset_dir", str(data), "--max_examples", "8", "--max_new_tokens", "6",
         "--batch_size", "1"]
    )  # fmt: skip
    assert status == 0, err[-3000:]
    assert json.loads(open(f"{run}/eval_metrics.json").read())["examples"] == 8
    record = next(json.loads(line) for line in open(f"{run}/predictions.jsonl"))
    status, out, err = textsql_in_process(
        ["infer", "--model_dir", run, "--dataset_dir", str(data), "--question", record["question"], "--table_id",
         record["table_id"], "--max_new_tokens", "6"]
    )  # fmt: skip
    assert status == 0, err[-3000:]
    assert f"Model Prediction: {record['predicted_sql']}" in out


def test_a_packed_run_logs_the_padded_run_s_loss_and_tokens_and_records_packing(
    causal_assets, tmp_path, textsql_in_process
):
    summaries = {}
    for packing in ("False", "True"):
        flags = dict(SHORT, max_steps=2, logging_steps=1, per_device_train_batch_size=8)
        argv = tiny_train_argv(causal_assets, tmp_path / "runs", "--packing", packing, **flags)
        status, out, err = textsql_in_process(["train", *argv])
        assert status == 0, err[-3000:]
        summaries[packing] = summary_of(out)
    padded, packed = summaries["False"], summaries["True"]
    assert packed["run"] == padded["run"] + "-packed"  # another experiment: never the padded run's folder
    assert packed["strategy"]["packing"] is True and padded["strategy"]["packing"] is False
    assert packed["arguments"]["training"]["packing"] is True
    assert packed["first_logged_loss"] == pytest.approx(padded["first_logged_loss"], rel=1e-4)
    assert packed["last_logged_loss"] == pytest.approx(padded["last_logged_loss"], rel=1e-3)
    assert packed["real_tokens"] == padded["real_tokens"]  # a packed batch's tokens are all real


def test_packing_t5_is_refused_before_a_run_folder_is_made(assets, tmp_path, textsql_in_process):
    argv = tiny_train_argv(assets, tmp_path / "runs", "--packing", "True", max_steps=1, eval_strategy="no")
    status, _, err = textsql_in_process(["train", *argv])
    assert status != 0
    assert "--packing True was asked for, but the t5 family cannot: T5 is an encoder-decoder" in err
    assert not (tmp_path / "runs").exists()


def test_a_checkpoint_saved_in_bf16_trains_from_fp32_weights(causal_assets, tmp_path):
    """Qwen2.5 and Llama checkpoints say bf16 in their config, which transformers 5 loads by default: the model to train
    must hold fp32 weights (the optimizer's states and updates), mixed precision computing from them."""
    from types import SimpleNamespace

    import torch

    from textsql.hub import load_model
    from textsql.train.objective import load_base_model

    _, model_dir = causal_assets
    saved = tmp_path / "bf16"
    load_model(str(model_dir), dtype=torch.bfloat16).save_pretrained(saved)
    assert {p.dtype for p in load_model(str(saved)).parameters()} == {torch.bfloat16}  # what a plain load gives
    model = load_base_model(str(saved), SimpleNamespace(quantize_base="none"), None)
    assert {p.dtype for p in model.parameters()} == {torch.float32}


def test_the_speed_levers_that_run_on_the_cpu_train_alike_and_the_rest_are_refused_early(
    causal_assets, tmp_path, textsql_in_process
):
    """LoRA in bf16 with the loss at the label positions (--fused_loss chunked) and the frozen base in bf16, against the
    same run without them: the same losses to bf16's rounding, the model FLOPs recorded (no MFU on the CPU);
    FlexAttention, which has no backward on the CPU, refused before a run folder is made."""
    summaries = {}
    lora = dict(SHORT, max_steps=2, logging_steps=1, per_device_train_batch_size=8, lora="True", precision="bf16")
    for name, levers in (("plain", []), ("levers", ["--fused_loss", "chunked", "--lora_base_dtype", "bfloat16"])):
        argv = tiny_train_argv(causal_assets, tmp_path / name, *levers, **lora)
        status, out, err = textsql_in_process(["train", *argv])
        assert status == 0, err[-3000:]
        summaries[name] = summary_of(out)
    plain, levers = summaries["plain"], summaries["levers"]
    assert levers["arguments"]["training"]["fused_loss"] == "chunked"
    assert levers["first_logged_loss"] == pytest.approx(plain["first_logged_loss"], rel=2e-2)
    assert levers["real_tokens"] == plain["real_tokens"]
    for summary in (plain, levers):
        assert summary["mfu"]["model_flops"] > 0 and summary["mfu"]["mfu"] is None
    # The output layer at the label positions only: fewer FLOPs for the same tokens
    assert levers["mfu"]["model_flops"] < plain["mfu"]["model_flops"]
    argv = tiny_train_argv(causal_assets, tmp_path / "flex", "--attention", "flex_attention", max_steps=1)
    status, _, err = textsql_in_process(["train", *argv])
    assert status != 0 and "no FlexAttention backward on the CPU" in err
    assert not (tmp_path / "flex").exists()
