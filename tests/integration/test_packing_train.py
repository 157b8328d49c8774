"""Packed batches through textsql's Trainer and `textsql train` (in this process, on the CPU): one step on packed
micro-batches, accumulated or not, trains as the padded batch of the same examples does (loss, gradient norm,
weights); a packed run logs the padded run's loss and real tokens and records the setting; T5 is refused before
anything is written."""

import json

import pytest
import torch
from conftest import tiny_train_argv

from textsql.families import family_named
from textsql.hub import load_tokenizer
from textsql.prep import load_prepared
from textsql.train.collate import CausalLMCollator, PackedCausalLMCollator
from textsql.train.trainer import make_trainer_class


def one_step(model_dir, rows, tmp_path, collator, micro_batch, accumulation):
    """(logged loss, logged gradient norm, weights, real tokens) after one SGD step, no clipping."""
    from transformers import AutoModelForCausalLM, TrainingArguments

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    args = TrainingArguments(
        output_dir=str(tmp_path / f"mb{micro_batch}-acc{accumulation}"),
        use_cpu=True,
        max_steps=1,
        per_device_train_batch_size=micro_batch,
        gradient_accumulation_steps=accumulation,
        optim="sgd",
        learning_rate=0.5,
        max_grad_norm=1e6,
        train_sampling_strategy="sequential",
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    trainer = make_trainer_class(family_named("qwen2"))(
        model=model, args=args, train_dataset=rows, data_collator=collator
    )
    trainer.train()
    logged = next(h for h in trainer.state.log_history if "loss" in h)
    weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return logged["loss"], logged["grad_norm"], weights, trainer.real_tokens


def test_packed_micro_batches_accumulate_to_the_padded_batch_s_step(causal_assets, tmp_path):
    """The step's loss is the sum over its label tokens divided by their count (num_items_in_batch) whether the
    examples come padded or packed, in one micro-batch or several."""
    data_dir, model_dir = causal_assets
    dataset, _ = load_prepared(data_dir)
    # 8 short examples then 8 long ones: the mean of the micro-batches' means is not the mean over the tokens
    rows = sorted(dataset["train"].select(range(64)), key=lambda row: len(row["labels"]))
    rows = [{key: row[key] for key in ("input_ids", "attention_mask", "labels")} for row in rows[:8] + rows[-8:]]
    padded = CausalLMCollator(load_tokenizer(str(model_dir)).pad_token_id)
    packed = PackedCausalLMCollator()
    loss, grad_norm, weights, real_tokens = one_step(model_dir, rows, tmp_path / "padded", padded, 16, 1)
    assert real_tokens == sum(len(row["input_ids"]) for row in rows)
    for micro_batch, accumulation in ((16, 1), (8, 2), (4, 4)):
        got = one_step(model_dir, rows, tmp_path / "packed", packed, micro_batch, accumulation)
        assert got[0] == pytest.approx(loss, rel=1e-5), (micro_batch, accumulation)
        assert got[1] == pytest.approx(grad_norm, rel=1e-4), (micro_batch, accumulation)
        assert got[3] == real_tokens  # every token is real in a packed batch
        for name, value in weights.items():
            torch.testing.assert_close(got[2][name], value, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.slow
def test_a_packed_run_logs_the_padded_run_s_loss_and_tokens_and_records_packing(
    causal_assets, tmp_path, textsql_in_process
):
    flags = dict(
        max_steps=2,
        per_device_train_batch_size=8,
        learning_rate="3e-3",
        logging_steps=1,
        eval_strategy="no",
        save_strategy="no",
        dataloader_num_workers=0,
    )
    summaries = {}
    for packing in ("False", "True"):
        argv = tiny_train_argv(causal_assets, tmp_path / "runs", "--packing", packing, **flags)
        status, out, err = textsql_in_process(["train", *argv])
        assert status == 0, err[-3000:]
        line = next(line for line in out.splitlines() if line.startswith("textsql-run-summary: "))
        summaries[packing] = json.loads(open(line.split(": ", 1)[1]).read())
    padded, packed = summaries["False"], summaries["True"]
    assert packed["run"] == padded["run"] + "-packed"  # another experiment: never the padded run's folder
    assert packed["strategy"]["packing"] is True and padded["strategy"]["packing"] is False
    assert packed["arguments"]["training"]["packing"] is True
    assert packed["first_logged_loss"] == pytest.approx(padded["first_logged_loss"], rel=1e-4)
    assert packed["last_logged_loss"] == pytest.approx(padded["last_logged_loss"], rel=1e-3)
    assert packed["real_tokens"] == padded["real_tokens"]


def test_packing_t5_is_refused_before_a_run_folder_is_made(assets, tmp_path, textsql_in_process):
    argv = tiny_train_argv(assets, tmp_path / "runs", "--packing", "True", max_steps=1, eval_strategy="no")
    status, _, err = textsql_in_process(["train", *argv])
    assert status != 0
    assert "--packing True was asked for, but the t5 family cannot: T5 is an encoder-decoder" in err
    assert not (tmp_path / "runs").exists()
