"""LoRA in-process: the target presets select exactly T5's layers (never the lm head), the rows of added characters
train and no other row moves, the arguments are checked and travel with the training arguments, and runs are named."""

import json

import pytest

from textsql.adapters import apply_lora, parameter_counts
from textsql.arguments.lora import LoraArguments
from textsql.errors import TextsqlError


def tiny_t5(vocab=300, grown=10, dropout=0.0):
    """A tiny T5 whose embedding was grown by `grown` rows, as fit_embeddings grows it for the characters prep added."""
    import torch
    from transformers import T5Config, T5ForConditionalGeneration

    torch.manual_seed(0)
    config = T5Config(
        d_model=32,
        d_ff=64,
        num_layers=2,
        num_heads=4,
        d_kv=8,
        vocab_size=vocab,
        dropout_rate=dropout,
        decoder_start_token_id=0,
        pad_token_id=0,
        eos_token_id=1,
    )
    model = T5ForConditionalGeneration(config)
    if grown:
        model.resize_token_embeddings(vocab + grown, mean_resizing=False)
    return model


def adapted(model) -> set[str]:
    from textsql.adapters import adapted_modules

    return set(adapted_modules(model))


@pytest.mark.parametrize("preset,suffixes", [("qv", {"q", "v"}), ("all", {"q", "k", "v", "o", "wi", "wo"})])
def test_the_presets_adapt_exactly_these_layers_of_every_block_and_never_the_lm_head(preset, suffixes):
    model = apply_lora(tiny_t5(grown=0), LoraArguments(lora=True, lora_rank=4, lora_targets=preset), token_ids=[])
    names = adapted(model)
    assert {n.rsplit(".", 1)[1] for n in names} == suffixes and not any("lm_head" in n for n in names)
    # every attention of both stacks (self and cross attention in the decoder), every feed-forward block
    attentions = 2 * 1 + 2 * 2
    feed_forwards = 2 + 2
    per_suffix = {
        "q": attentions,
        "k": attentions,
        "v": attentions,
        "o": attentions,
        "wi": feed_forwards,
        "wo": feed_forwards,
    }
    assert len(names) == sum(per_suffix[s] for s in suffixes)
    trainable, total = parameter_counts(model)
    in_out = {"q": (32, 32), "k": (32, 32), "v": (32, 32), "o": (32, 32), "wi": (32, 64), "wo": (64, 32)}
    assert trainable == sum(per_suffix[s] * 4 * sum(in_out[s]) for s in suffixes)  # r (in + out) per adapted layer
    assert total == trainable + sum(p.numel() for p in tiny_t5(grown=0).parameters())


def test_only_the_rows_of_the_added_characters_train_and_the_lm_head_follows_them():
    import torch

    base = tiny_t5()
    before = base.shared.weight.detach().clone()
    added = list(range(300, 310))
    model = apply_lora(base, LoraArguments(lora=True, lora_rank=4, lora_targets="all"), token_ids=added)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    generator = torch.Generator().manual_seed(0)
    for _ in range(5):
        inputs = torch.randint(2, 310, (4, 9), generator=generator)
        labels = torch.randint(300, 310, (4, 6), generator=generator)  # the targets are the added characters
        model(input_ids=inputs, labels=labels).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    merged = model.merge_and_unload()
    after = merged.shared.weight.detach()
    assert torch.equal(after[:300], before[:300]), "a row of the base vocabulary moved"
    assert all(not torch.equal(after[i], before[i]) for i in added), "an added character's row did not train"
    assert merged.lm_head.weight is merged.shared.weight  # still tied: the lm head writes with the trained rows


def test_the_arguments_are_checked_and_travel_with_the_training_arguments(tmp_path):
    from textsql.arguments.training import arguments_dict, arguments_from_dict, parse_arguments
    from textsql.train.run import run_dir

    for argv, message in [
        (["--lora_rank", "0"], "--lora_rank must be"),
        (["--lora_targets", "qkv"], "--lora_targets must be one of qv, all"),
        (["--lora_dropout", "1"], "--lora_dropout"),
        (["--lora_alpha", "0"], "--lora_alpha"),
    ]:
        with pytest.raises(TextsqlError, match=message):
            parse_arguments(["--lora", "True", *argv])
    with pytest.raises(TextsqlError, match="--lora_rank"):
        LoraArguments(lora_rank=-1)
    model, data, training = parse_arguments(
        ["--lora", "True", "--lora_rank", "16", "--lora_targets", "all", "--runs_root", str(tmp_path)]
    )
    values = json.loads(json.dumps(arguments_dict(model, data, training)))  # what every rank and node gets
    assert {k: values[k] for k in ("lora", "lora_rank", "lora_alpha", "lora_dropout", "lora_targets")} == {
        "lora": True,
        "lora_rank": 16,
        "lora_alpha": 16.0,
        "lora_dropout": 0.05,
        "lora_targets": "all",
    }
    *_, again = arguments_from_dict(values)
    assert (
        again.lora_settings()
        == training.lora_settings()
        == {"rank": 16, "alpha": 16.0, "dropout": 0.05, "targets": "all"}
    )
    assert run_dir(model, again, 2, "zero2").name == "t5-small-zero2-lora-r16-ws2-bs32"
    *_, plain = parse_arguments(["--runs_root", str(tmp_path)])
    assert plain.lora_settings() is None and run_dir(model, plain, 1, "none").name == "t5-small-none-ws1-bs32"


def test_the_report_names_a_lora_run_beside_its_strategy(tmp_path):
    from textsql.report import RunRecord, report_row, sort_records
    from textsql.run_summary import RunSummary

    def record(name, strategy, lora=None):
        summary = RunSummary(
            run=name, model_id="t5-small", strategy={"label": strategy, "zero_stage": None, "lora": lora}
        )
        return RunRecord(tmp_path / name, summary)

    lora = {"rank": 8, "alpha": 16.0, "dropout": 0.05, "targets": "qv"}
    records = [record("c", "zero3"), record("b", "zero2", lora), record("a", "zero2"), record("n", "none", lora)]
    assert [report_row(r)["technique"] for r in sort_records(records)] == [
        "none + LoRA r8",
        "zero2",
        "zero2 + LoRA r8",
        "zero3",
    ]
