"""Gradient accumulation changes nothing: micro-batch × accumulation × ranks trains as one batch of the same samples
(the same logged loss, gradient norm and weights after a step), for T5 and a causal LM, without DeepSpeed and under
ZeRO-1, ZeRO-2, ZeRO-3 and ZeRO-3 + offload, on one rank and on two."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import child_cpu_env

from textsql.families import family_of
from textsql.train.sft import forward_divides_by_token_count, trainer_class

PROBE = Path(__file__).with_name("accumulation_probe.py")
REFERENCE = "none-mb16-acc1-ws1"  # one batch of 16 on one process, no DeepSpeed


# ---------------------------------------------------------------------------------------------------------------------
# Both model families, through textsql's Trainer in this process
# ---------------------------------------------------------------------------------------------------------------------


def tiny_t5():
    from transformers import T5Config, T5ForConditionalGeneration

    return T5ForConditionalGeneration(
        T5Config(
            d_model=32,
            num_layers=1,
            num_heads=2,
            d_kv=16,
            d_ff=64,
            vocab_size=100,
            dropout_rate=0.0,
            decoder_start_token_id=0,
            pad_token_id=0,
            eos_token_id=1,
        )
    )


def tiny_gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(
        GPT2Config(
            n_layer=1,
            n_embd=32,
            n_head=2,
            vocab_size=100,
            n_positions=64,
            bos_token_id=1,
            eos_token_id=1,
            resid_pdrop=0,
            embd_pdrop=0,
            attn_pdrop=0,
            initializer_range=0.5,  # far from uniform: the micro-batches' losses differ
        )
    )


def examples(causal: bool) -> list[dict]:
    """16 examples: the first 8 with 2 label tokens, the last 8 with 12, so that the mean of the micro-batches' means
    is not the mean over the tokens. A causal LM's odd rows also label their first position, which no position
    predicts: counted as a token, it would make the loss the model's sum over too many tokens."""
    generator = torch.Generator().manual_seed(0)
    rows = []
    for index in range(16):
        prompt = torch.randint(2, 100, (4 + index % 3,), generator=generator)
        target = torch.randint(2, 100, (2 if index < 8 else 12,), generator=generator)
        if causal:  # the prompt's positions are not predicted
            labels = torch.cat([prompt * 0 - 100, target])
            labels[0] = prompt[0] if index % 2 else -100  # never predicted either way (nothing comes before it)
            rows.append({"input_ids": torch.cat([prompt, target]), "labels": labels})
        else:
            rows.append({"input_ids": prompt, "labels": target})
    return rows


def collate(rows: list[dict]) -> dict:
    pad = torch.nn.utils.rnn.pad_sequence
    input_ids = pad([r["input_ids"] for r in rows], batch_first=True, padding_value=0)
    return {
        "input_ids": input_ids,
        "attention_mask": pad([torch.ones_like(r["input_ids"]) for r in rows], batch_first=True),
        "labels": pad([r["labels"] for r in rows], batch_first=True, padding_value=-100),
    }


def one_step(build, rows, tmp_path, micro_batch, accumulation, collator=collate):
    """(logged loss, logged gradient norm, weights) after one SGD step of textsql's Trainer, no clipping."""
    from transformers import Seq2SeqTrainingArguments

    torch.manual_seed(0)
    model = build()
    args = Seq2SeqTrainingArguments(
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
    trainer = trainer_class(family_of(model.config))(model=model, args=args, train_dataset=rows, data_collator=collator)
    trainer.train()
    logged = next(h for h in trainer.state.log_history if "loss" in h)
    return logged["loss"], logged["grad_norm"], {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("family", ["t5", "gpt2"])
def test_accumulation_trains_as_one_batch_for_both_model_families(tmp_path, family):
    build, causal = {"t5": (tiny_t5, False), "gpt2": (tiny_gpt2, True)}[family]
    assert forward_divides_by_token_count(build()) is causal  # decided from the model's forward, not its name
    rows = examples(causal)
    torch.manual_seed(0)
    model = build()
    with torch.no_grad():
        means = [model(**collate(rows[i : i + 8])).loss.item() for i in (0, 8)]
        whole = model(**collate(rows)).loss.item()
    assert abs(whole - sum(means) / 2) > 0.05, "the data cannot tell token weighting from the mean of the means"
    reference = one_step(build, rows, tmp_path, 16, 1)
    assert reference[0] == pytest.approx(whole, rel=1e-5)  # the logged loss is the batch's, over its tokens
    for micro_batch, accumulation in ((8, 2), (4, 4)):
        check_same_one_step(one_step(build, rows, tmp_path, micro_batch, accumulation), reference)


def check_same_one_step(got, reference, rel=1e-5):
    """one_step's loss, gradient norm and weights equal."""
    assert got[0] == pytest.approx(reference[0], rel=rel)
    assert got[1] == pytest.approx(reference[1], rel=rel)
    for name, value in reference[2].items():
        torch.testing.assert_close(got[2][name], value, rtol=rel, atol=1e-6, msg=name)


def test_packed_micro_batches_accumulate_to_the_padded_batch_s_step(tmp_path):
    """--packing (a causal LM's examples end to end in one row, no padding) keeps the token-weighted step: packed
    micro-batches of 16, 8 x 2 and 4 x 4 train as the padded batch of 16 does."""
    from textsql.train.collate import PackedCausalLMCollator

    rows = examples(causal=True)
    reference = one_step(tiny_gpt2, rows, tmp_path / "padded", 16, 1)
    for micro_batch, accumulation in ((16, 1), (8, 2), (4, 4)):
        packed = one_step(tiny_gpt2, rows, tmp_path / "packed", micro_batch, accumulation, PackedCausalLMCollator())
        check_same_one_step(packed, reference, rel=1e-4)


# ---------------------------------------------------------------------------------------------------------------------
# textsql train under each strategy, one rank and two (tests/integration/accumulation_probe.py)
# ---------------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def dsconfigs(tmp_path_factory) -> dict[str, str]:
    """zero1 and zero2 (shipped), zero3 (zero3_offload without the offload), and zero3_offload with the Trainer's own optimizer
    (DeepSpeed would swap in its CPU Adam, whose first step is nearly the gradient's sign)."""
    folder = tmp_path_factory.mktemp("dsconfigs")
    shipped = Path(__file__).parents[2] / "dsconfig"
    offload = json.loads((shipped / "zero3_offload.json").read_text())
    without = json.loads(json.dumps(offload))
    del without["zero_optimization"]["offload_optimizer"], without["zero_optimization"]["offload_param"]
    (folder / "zero3.json").write_text(json.dumps(without))
    (folder / "zero3_offload.json").write_text(json.dumps(offload | {"zero_force_ds_cpu_optimizer": False}))
    configs = {"zero3": str(folder / "zero3.json"), "zero3_offload": str(folder / "zero3_offload.json")}
    return {"zero1": str(shipped / "zero1.json"), "zero2": str(shipped / "zero2.json"), **configs}


def run_probe(command: list[str], cwd: Path) -> None:
    done = subprocess.run(command, capture_output=True, text=True, env=child_cpu_env(), cwd=cwd, timeout=900)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-6000:]


def logged(run: Path) -> dict:
    """The first step's loss and gradient norm as TensorBoard and run_summary.json have them, and the saved weights."""
    from safetensors.torch import load_file
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (events,) = {p.parent for p in (run / "tensorboard").rglob("events.out.tfevents.*")}
    accumulator = EventAccumulator(str(events))
    accumulator.Reload()
    summary = json.loads((run / "run_summary.json").read_text())
    return {
        "tensorboard loss": accumulator.Scalars("train/loss")[0].value,
        "tensorboard grad_norm": accumulator.Scalars("train/grad_norm")[0].value,
        "summary first loss": summary["first_logged_loss"],
        "summary train_loss": summary["train_loss"],
        "weights": load_file(run / "model.safetensors"),
    }


def check_same_step(results: Path, cases: list[str]) -> None:
    reference = logged(results / REFERENCE)
    assert reference["tensorboard loss"] == pytest.approx(reference["summary first loss"], rel=1e-4)
    for case in cases:
        got = logged(results / case)
        for key in ("tensorboard loss", "tensorboard grad_norm", "summary first loss", "summary train_loss"):
            assert got[key] == pytest.approx(reference[key], rel=1e-4), (case, key)
        for name, value in reference["weights"].items():
            torch.testing.assert_close(got["weights"][name], value, rtol=1e-4, atol=1e-5, msg=f"{case}: {name}")


@pytest.fixture(scope="module")
def one_rank(assets, dsconfigs, tmp_path_factory) -> Path:
    """One process trains every one-rank case in turn: batch 16 without DeepSpeed, and 8 × 2 under each strategy."""
    results = tmp_path_factory.mktemp("accumulation-one-rank")
    data_dir, model_dir = assets
    cases = ["none:16:1", "none:8:2"] + [f"{dsconfigs[s]}:8:2" for s in ("zero1", "zero2", "zero3", "zero3_offload")]
    run_probe([sys.executable, str(PROBE), str(results), str(model_dir), str(data_dir), *cases], results)
    return results


@pytest.mark.slow
def test_one_rank_accumulation_equals_one_batch_under_each_strategy(one_rank):
    check_same_step(one_rank, [f"{s}-mb8-acc2-ws1" for s in ("none", "zero1", "zero2", "zero3", "zero3_offload")])


@pytest.mark.slow
def test_two_ranks_accumulating_equal_one_rank_with_the_whole_batch(one_rank, assets, dsconfigs, tmp_path):
    """Two ranks × micro-batch 4 × accumulation 2 through the real deepspeed launcher: the step's loss is the mean over
    both ranks' tokens (average_tokens_across_devices), as one process with batch 16 has it."""
    from textsql.train.distributed import free_port

    data_dir, model_dir = assets
    launcher = Path(sys.executable).with_name("deepspeed")
    cases = ["none:4:2", f"{dsconfigs['zero2']}:4:2", f"{dsconfigs['zero3']}:4:2"]
    command = [str(launcher), "--no_local_rank", "--master_port", str(free_port()), "--num_gpus", "2", str(PROBE)]
    run_probe([*command, str(tmp_path), str(model_dir), str(data_dir), *cases], tmp_path)
    (tmp_path / REFERENCE).symlink_to(one_rank / REFERENCE)
    check_same_step(tmp_path, ["none-mb4-acc2-ws2", "zero2-mb4-acc2-ws2", "zero3-mb4-acc2-ws2"])
