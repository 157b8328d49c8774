"""Causal LMs beside T5: the tiny causal model, prep's one-sequence layout, the collator's masking by position, and
left-padded generation; the real Qwen2 and GPT-2 tokenizers through prep and generation."""

import json

import pytest

from textsql.arguments.prep import PrepArguments
from textsql.errors import TextsqlError
from textsql.hub import load_tokenizer
from textsql.prep import prepare_dataset
from textsql.prepared import load_prepared
from textsql.prompts import source_text
from textsql.train.collate import CausalLMCollator
from textsql.vocabulary import byte_level
from textsql.wikisql.release import SAMPLE_SOURCE

EDGE_TEXTS = ["SELECT Area (km²) FROM table WHERE Wins < 5", "Ranma ½ — Müller's team", "a\tb  c"]


def test_tiny_causal_tokenizer_reloads_with_the_file_s_ids_and_writes_every_character(causal_assets):
    from tokenizers import Tokenizer

    _, model_dir = causal_assets
    tokenizer = load_tokenizer(str(model_dir))
    # the folder's config says qwen2, so transformers rebuilds the pre-tokenizer in code: it must equal the file's
    assert type(tokenizer).__name__ == "Qwen2Tokenizer"
    from_file = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    dataset, _ = load_prepared(causal_assets[0])
    for text in list(dataset["train"]["prompt"][:50]) + EDGE_TEXTS:
        assert tokenizer(text)["input_ids"] == from_file.encode(text).ids
    assert byte_level(tokenizer)
    for text in EDGE_TEXTS:
        assert tokenizer.decode(tokenizer(text)["input_ids"]) == text
    assert tokenizer.pad_token_id == tokenizer.eos_token_id is not None


def test_a_tokenizer_that_loads_back_with_other_ids_is_refused(tmp_path):
    """GPT-2's pre-tokenizer in a folder whose config says qwen2: Qwen2Tokenizer rebuilds another one, so the ids
    differ once loaded back, and make_tiny_causal_model says so instead of saving a model that reads other ids."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    texts = ["How many wins did the team have in 1999?\n### SQL:\nSELECT COUNT Wins FROM table"] * 20 + EDGE_TEXTS
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.train_from_iterator(
        texts,
        trainers.BpeTrainer(
            vocab_size=320, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
        ),
    )
    gpt2_style = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|endoftext|>")
    from textsql.tiny import make_tiny_causal_model

    with pytest.raises(TextsqlError, match="gives other ids once loaded back"):
        make_tiny_causal_model(tmp_path / "m", texts, tokenizer=gpt2_style, hidden_size=16, num_layers=1)
    # the same tokenizer in a llama folder loads as saved
    make_tiny_causal_model(
        tmp_path / "l", texts, model_type="llama", tokenizer=gpt2_style, hidden_size=16, num_layers=1
    )


def check_causal_rows(split, tokenizer):
    """Every row: prompt ids then SQL ids then EOS in one sequence, labels -100 exactly on the prompt, the SQL back
    whole; and the prompt and SQL tokenized apart give the ids of the whole text tokenized at once."""
    eos = tokenizer.eos_token_id
    for row in split:
        prompt_ids = tokenizer(row["prompt"])["input_ids"]
        answer_ids = tokenizer(row["target"], add_special_tokens=False)["input_ids"]
        assert row["input_ids"] == prompt_ids + answer_ids + [eos]
        assert row["labels"] == [-100] * len(prompt_ids) + answer_ids + [eos]
        assert row["attention_mask"] == [1] * len(row["input_ids"])
        assert tokenizer(row["prompt"] + row["target"])["input_ids"] == prompt_ids + answer_ids
        assert tokenizer.decode(answer_ids) == row["target"]


def test_prep_lays_out_prompt_and_sql_in_one_sequence_with_the_prompt_masked(causal_assets):
    data_dir, model_dir = causal_assets
    dataset, metadata = load_prepared(data_dir)
    tokenizer = load_tokenizer(str(model_dir))
    row = dataset["train"][0]
    assert row["prompt"].startswith("### Question: ") and "\n### Columns: " in row["prompt"]
    assert row["prompt"].endswith("\n### SQL:\n")
    check_causal_rows(dataset["train"].select(range(100)), tokenizer)
    assert (metadata["layout"], metadata["model_family"], metadata["source_prefix"]) == ("causal", "qwen2", "")
    assert metadata["byte_level"] and metadata["added_characters"] == {} and metadata["tokenizer_dir"] is None
    assert metadata["targets_lost_in_tokenization"]["examples"] == 0
    train = metadata["lengths"]["train"]
    prompts = [sum(1 for label in labels if label == -100) for labels in dataset["train"]["labels"]]
    assert train["source_percentiles"]["p100"] == max(prompts)
    assert train["target_percentiles"]["p100"] == max(
        len(ids) - n for ids, n in zip(dataset["train"]["input_ids"], prompts)
    )
    # the whole sequence a batch is padded to: the longest prompt and the longest SQL are not one example's
    assert train["sequence_percentiles"]["p100"] == max(len(ids) for ids in dataset["train"]["input_ids"])


def test_long_prompts_lose_columns_never_sql_and_what_still_does_not_fit_is_dropped_and_counted(
    causal_assets, tmp_path
):
    data_dir, model_dir = causal_assets
    raw = data_dir.parent / "wikisql-generated"
    _, metadata = load_prepared(data_dir)
    longest = metadata["lengths"]["train"]["source_percentiles"]
    limit = longest["p50"]  # half the prompts are longer
    args = dict(source=str(raw), model_id=str(model_dir), source_format="question+header", max_target_length=24)
    with pytest.raises(TextsqlError, match="do not fit even with their column lists cut"):
        prepare_dataset(PrepArguments(**args, output_dir=str(tmp_path / "a"), max_source_length=limit))
    out = prepare_dataset(
        PrepArguments(**args, output_dir=str(tmp_path / "b"), max_source_length=limit, overlong="drop")
    )
    dataset, fitted = load_prepared(out)
    train = fitted["prompts_fitted"]["train"]
    assert train["columns_cut"] > 0 and train["dropped"] > 0
    assert len(dataset["train"]) == metadata["examples"]["train"] - train["dropped"]
    tokenizer = load_tokenizer(str(model_dir))
    check_causal_rows(dataset["train"], tokenizer)  # the SQL is whole in every row kept
    assert all(sum(1 for label in labels if label == -100) <= limit for labels in dataset["train"]["labels"])
    assert all(len(ids) - ids.count(-100) <= 24 for ids in dataset["train"]["labels"])
    assert any("### Columns: " in p and p.count("|") < 3 for p in dataset["train"]["prompt"])
    assert fitted["lengths"]["train"]["source_over_max"] == 0


def test_the_collator_masks_padding_by_position_and_keeps_eos_when_pad_is_eos(causal_assets):
    """Qwen2's pad token is its EOS: padding's labels are -100 by position, the real EOS's label is kept."""
    data_dir, model_dir = causal_assets
    tokenizer = load_tokenizer(str(model_dir))
    eos = tokenizer.eos_token_id
    assert tokenizer.pad_token_id == eos
    dataset, _ = load_prepared(data_dir)
    rows = sorted(dataset["train"].select(range(16)), key=lambda row: len(row["input_ids"]))
    features = [{key: row[key] for key in ("input_ids", "attention_mask", "labels")} for row in (rows[0], rows[-1])]
    short, long = (len(f["input_ids"]) for f in features)
    assert short < long
    batch = CausalLMCollator(tokenizer.pad_token_id)(features)
    assert batch["input_ids"].shape == (2, long)
    assert batch["labels"][0, short - 1].item() == eos  # the short example's own EOS: learned
    assert batch["labels"][0, short:].eq(-100).all() and batch["input_ids"][0, short:].eq(eos).all()
    assert batch["attention_mask"][0].tolist() == [1] * short + [0] * (long - short)
    assert batch["labels"][1].tolist() == features[1]["labels"]
    assert CausalLMCollator(eos, pad_to_multiple_of=8)(features)["input_ids"].shape[1] % 8 == 0


def generated_one_at_a_time_and_batched(model, tokenizer, prompts, **kwargs):
    from textsql.evaluate import generate_sql

    batched = generate_sql(model, tokenizer, prompts, batch_size=len(prompts), progress=False, **kwargs)
    alone = [generate_sql(model, tokenizer, [p], batch_size=1, progress=False, **kwargs)[0] for p in prompts]
    return batched, alone


def test_left_padded_batched_generation_equals_one_question_at_a_time_and_returns_only_the_new_tokens(causal_assets):
    from textsql.evaluate import load_scoring_set
    from textsql.hub import load_model

    data_dir, model_dir = causal_assets
    model, tokenizer = load_model(str(model_dir)), load_tokenizer(str(model_dir))
    prompts = load_scoring_set(str(data_dir), "test", 8).sources
    assert len({len(tokenizer(p)["input_ids"]) for p in prompts}) > 1  # the batch is really padded
    batched, alone = generated_one_at_a_time_and_batched(model, tokenizer, prompts, max_new_tokens=8)
    assert batched == alone
    assert not any("### Question" in text[0] for text in batched)
    beams, beams_alone = generated_one_at_a_time_and_batched(
        model, tokenizer, prompts[:4], max_new_tokens=6, num_beams=3, num_candidates=3
    )
    assert beams == beams_alone and all(len(c) == 3 for c in beams)


def test_generation_in_several_batches_keeps_the_input_order_and_its_bar_counts_questions(causal_assets, capsys):
    """Batches of similar length taken longest and shortest in turn (so the progress bar's rate is the run's after
    two batches, not the longest questions'); the answers come back in the questions' order."""
    from textsql.evaluate import alternating, generate_sql, load_scoring_set
    from textsql.hub import load_model

    assert alternating(range(6)) == [0, 5, 1, 4, 2, 3] and alternating(range(3)) == [0, 2, 1] and alternating([]) == []
    data_dir, model_dir = causal_assets
    model, tokenizer = load_model(str(model_dir)), load_tokenizer(str(model_dir))
    prompts = load_scoring_set(str(data_dir), "test", 7).sources
    batches = []  # on_batch: called after each batch (a Trainer's callbacks, a pod's watch of progress)
    several = generate_sql(
        model, tokenizer, prompts, batch_size=2, max_new_tokens=6, progress=True, on_batch=lambda: batches.append(1)
    )
    assert len(batches) == 4
    _, alone = generated_one_at_a_time_and_batched(model, tokenizer, prompts, max_new_tokens=6)
    assert several == alone
    bar = capsys.readouterr().err
    assert "7/7" in bar and "question" in bar, bar


def test_generation_stops_at_eos(causal_assets):
    """A model whose every next token is EOS stops at once: nothing is decoded after the prompt."""
    import torch

    from textsql.evaluate import generate_sql
    from textsql.hub import load_model

    _, model_dir = causal_assets
    model, tokenizer = load_model(str(model_dir)), load_tokenizer(str(model_dir))
    # every logit 0 (the output layer's weight zeroed) but EOS's, raised by a bias on the output layer
    with torch.no_grad():
        model.lm_head.weight.zero_()
    model.lm_head.bias = torch.nn.Parameter(torch.zeros(len(tokenizer)))
    with torch.no_grad():
        model.lm_head.bias[tokenizer.eos_token_id] = 1.0
    assert generate_sql(model, tokenizer, ["### Question: x\n### SQL:\n"] * 2, progress=False) == [[""], [""]]


@pytest.fixture(scope="module", params=["qwen2", "gpt2"])
def real_causal_model(request, real_files, tmp_path_factory):
    """(family, folder): a real tokenizer (../shared/real/qwen2 or gpt2) and a tiny random model of that family."""
    from conftest import real_causal_folder

    return request.param, real_causal_folder(
        real_files, request.param, tmp_path_factory.mktemp(f"real-{request.param}")
    )


def test_real_qwen2_and_gpt2_tokenizers_through_prep_and_generation(real_causal_model, real_files, tmp_path):
    from textsql.evaluate import load_scoring_set
    from textsql.hub import load_model

    name, folder = real_causal_model
    out = prepare_dataset(
        PrepArguments(
            source=SAMPLE_SOURCE,
            model_id=str(folder),
            output_dir=str(tmp_path / "data"),
            source_format="question+header",
            max_examples_per_split=120,
        )
    )
    dataset, metadata = load_prepared(out)
    tokenizer = load_tokenizer(str(folder))
    assert metadata["byte_level"] and metadata["added_characters"] == {} and metadata["model_family"] == name
    assert metadata["targets_lost_in_tokenization"]["examples"] == 0  # byte-level BPE writes every character
    check_causal_rows(dataset["test"], tokenizer)
    assert json.loads((out / "textsql_data.json").read_text())["lengths"]["test"]["examples"] == len(dataset["test"])
    if name == "gpt2":
        assert tokenizer.pad_token is None  # GPT-2 has none: generation pads with EOS
    prompts = load_scoring_set(str(out), "test", 6).sources
    batched, alone = generated_one_at_a_time_and_batched(load_model(str(folder)), tokenizer, prompts, max_new_tokens=5)
    assert batched == alone


def test_a_model_refuses_data_laid_out_for_another_family_or_prompt_format(causal_assets, assets):
    from textsql.hub import load_config
    from textsql.prompts import check_source_settings

    data_dir, _ = causal_assets
    _, metadata = load_prepared(data_dir)
    with pytest.raises(TextsqlError, match="prepared for a causal model .*seq2seq t5 model"):
        check_source_settings(load_config(str(assets[1])), metadata, data_dir)
    assert source_text("Who?", ["A", "B"], "ignored: ", "question", "causal") == "### Question: Who?\n### SQL:\n"
    # a causal model fine-tuned on chat prompts refuses plain ones
    from textsql.prompts import record_source_settings

    causal_config = load_config(str(causal_assets[1]))
    record_source_settings(causal_config, dict(metadata, prompt_format="chat"))
    with pytest.raises(TextsqlError, match="fine-tuned on chat prompts.*--prompt_format chat"):
        check_source_settings(causal_config, metadata, data_dir)
    check_source_settings(causal_config, dict(metadata, prompt_format="chat"), data_dir)


def test_chat_prompts_use_the_tokenizer_s_template_and_are_refused_without_one(
    real_files, causal_assets, assets, tmp_path
):
    """--prompt_format chat: the plain lines as the user's message in Qwen2's chat template, the SQL as the assistant's
    answer; typed questions get the same prompt; a tokenizer without a template, or T5, is refused with the fix."""
    from conftest import real_causal_folder

    from textsql.prompts import model_source

    folder = real_causal_folder(real_files, "qwen2", tmp_path / "qwen2")
    args = dict(source=SAMPLE_SOURCE, source_format="question+header", max_examples_per_split=40)
    out = prepare_dataset(
        PrepArguments(**args, model_id=str(folder), output_dir=str(tmp_path / "d"), prompt_format="chat")
    )
    dataset, metadata = load_prepared(out)
    tokenizer = load_tokenizer(str(folder))
    row = dataset["test"][0]
    assert row["prompt"].startswith("<|im_start|>system\n") and "<|im_start|>user\n### Question: " in row["prompt"]
    assert row["prompt"].endswith("### SQL:<|im_end|>\n<|im_start|>assistant\n")
    check_causal_rows(dataset["test"], tokenizer)
    assert metadata["prompt_format"] == "chat"
    tables = {t["id"]: t for t in map(json.loads, (out / "tables.jsonl").read_text().splitlines())}
    assert model_source(row["question"], tables[row["table_id"]], metadata, tokenizer) == row["prompt"]
    with pytest.raises(TextsqlError, match="has no chat template.*--prompt_format plain"):
        prepare_dataset(
            PrepArguments(**args, model_id=str(causal_assets[1]), output_dir=str(tmp_path / "e"), prompt_format="chat")
        )
    with pytest.raises(TextsqlError, match="t5 model, which reads a prefixed source"):
        prepare_dataset(
            PrepArguments(**args, model_id=str(assets[1]), output_dir=str(tmp_path / "f"), prompt_format="chat")
        )
