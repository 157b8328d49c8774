"""Tests of the locally trained tokenizer and the tiny T5: token counts, exact round trips, save and reload."""

import pytest

from textsql.errors import TextsqlError
from textsql.tiny import SOURCE_PREFIX, build_tiny_t5, corpus_for_tokenizer, make_tiny_model, train_tokenizer
from textsql.wikisql.format import render_sql
from textsql.wikisql.synthetic import generate_split


@pytest.fixture(scope="module")
def train_data():
    return generate_split("train", 200, 10, seed=0)


@pytest.fixture(scope="module")
def tokenizer(train_data):
    return train_tokenizer(corpus_for_tokenizer(*train_data))


@pytest.fixture(scope="module")
def held_out():
    """Questions and SQL of the dev split: tables the tokenizer never saw."""
    questions, tables = generate_split("dev", 40, 10, seed=0)
    headers = {table["id"]: table["header"] for table in tables}
    return [q["question"] for q in questions], [render_sql(q["sql"], headers[q["table_id"]]) for q in questions]


def _tokens_per_word(tokenizer, texts):
    tokens = sum(len(tokenizer(text, add_special_tokens=False)["input_ids"]) for text in texts)
    return tokens / sum(len(text.split()) for text in texts)


def _round_trip(tokenizer, text):
    return tokenizer.decode(tokenizer(text)["input_ids"], skip_special_tokens=True)


def test_tokens_per_word_are_close_to_a_real_t5_tokenizer(tokenizer, held_out):
    questions, sqls = held_out
    assert 1.1 <= _tokens_per_word(tokenizer, questions) <= 1.6
    assert 1.1 <= _tokens_per_word(tokenizer, sqls) <= 1.6


def test_common_words_are_single_tokens(tokenizer):
    assert tokenizer.tokenize("SELECT COUNT FROM table WHERE") == ["▁SELECT", "▁COUNT", "▁FROM", "▁table", "▁WHERE"]
    assert tokenizer.tokenize("What is the Year?") == ["▁What", "▁is", "▁the", "▁Year", "?"]


def test_decode_gives_back_generated_questions_and_sql_exactly(tokenizer, held_out):
    questions, sqls = held_out
    for text in questions + sqls + [SOURCE_PREFIX + q for q in questions[:50]]:
        assert _round_trip(tokenizer, text) == text


@pytest.mark.parametrize(
    "text",
    [
        "SELECT COUNT Total W–L FROM table WHERE Result = won",
        "SELECT Score FROM table WHERE Score = 6–3, 7–5",
        "SELECT MAX No. in series FROM table WHERE U.S. viewers (millions) > 3.5 AND Year < 1995",
        "What is the Area (km²) of O'Brien's 26696 ?",
        "a b . , ( ) – 0.25",
    ],
)
def test_punctuation_and_numbers_round_trip(tokenizer, text):
    assert _round_trip(tokenizer, text) == text


def test_whitespace_runs_decode_as_one_space(tokenizer):
    assert _round_trip(tokenizer, "  SELECT   Year\tFROM table ") == "SELECT Year FROM table"


def test_special_tokens_sit_where_t5_has_them(tokenizer):
    assert (tokenizer.pad_token_id, tokenizer.eos_token_id, tokenizer.unk_token_id) == (0, 1, 2)
    assert len(tokenizer) <= 4000
    assert tokenizer.convert_tokens_to_ids("<extra_id_0>") == len(tokenizer) - 1
    assert tokenizer.convert_tokens_to_ids("<extra_id_99>") == len(tokenizer) - 100
    assert tokenizer("Year")["input_ids"][-1] == tokenizer.eos_token_id
    assert tokenizer("☃")["input_ids"] == [tokenizer.convert_tokens_to_ids("▁"), 2, 1]  # unseen character -> <unk>


def test_too_small_a_vocabulary_is_a_user_error(train_data):
    with pytest.raises(TextsqlError, match="vocab_size"):
        train_tokenizer(corpus_for_tokenizer(*train_data), vocab_size=150)
    with pytest.raises(TextsqlError, match="training text"):
        train_tokenizer([])


def test_corpus_covers_questions_sql_and_cells(train_data):
    questions, tables = train_data
    corpus = list(corpus_for_tokenizer(questions[:3], tables))
    assert SOURCE_PREFIX + questions[0]["question"] in corpus
    assert any(text.startswith("SELECT ") and " FROM table" in text for text in corpus)
    characters_in_cells = {c for t in tables for row in t["rows"] for cell in row for c in str(cell)}
    assert characters_in_cells <= set("".join(corpus))


def test_tiny_t5_is_seeded_and_leaves_the_global_random_state_alone(tokenizer):
    import torch

    before = torch.random.get_rng_state()
    first, second = build_tiny_t5(tokenizer, seed=1), build_tiny_t5(tokenizer, seed=1)
    assert torch.equal(torch.random.get_rng_state(), before)
    assert all(torch.equal(a, b) for a, b in zip(first.state_dict().values(), second.state_dict().values()))
    assert first.config.vocab_size == len(tokenizer) and first.config.decoder_start_token_id == 0
    assert (first.config.d_model, first.config.num_layers, first.config.num_heads) == (64, 2, 4)
    with pytest.raises(TextsqlError, match="multiple of num_heads"):
        build_tiny_t5(tokenizer, d_model=30, num_heads=4)


def test_saved_folder_reloads_with_auto_classes_and_generates(tmp_path, train_data, held_out):
    import torch
    from transformers import AutoModelForSeq2SeqLM, AutoTokenizer

    folder = make_tiny_model(tmp_path / "tiny", corpus_for_tokenizer(*train_data), d_model=32, num_heads=2, d_ff=64)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForSeq2SeqLM.from_pretrained(folder)
    question, sql = held_out[0][0], held_out[1][0]
    assert tokenizer.decode(tokenizer(sql)["input_ids"], skip_special_tokens=True) == sql
    assert (tokenizer.pad_token_id, tokenizer.eos_token_id, len(tokenizer)) == (0, 1, model.config.vocab_size)
    batch = tokenizer([SOURCE_PREFIX + question], return_tensors="pt")
    labels = tokenizer([sql], return_tensors="pt")["input_ids"]
    assert torch.isfinite(model(**batch, labels=labels).loss)
    output = model.generate(**batch, max_new_tokens=8)
    assert output.shape[0] == 1 and output[0, 0].item() == 0  # decoding starts from <pad>
    assert isinstance(tokenizer.decode(output[0], skip_special_tokens=True), str)
