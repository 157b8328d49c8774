"""question+header+values: the cells a question mentions, found on the real WikiSQL tables, laid out for both families,
bounded per column and in all, and fitted to --max_source_length by dropping values before columns."""

import json

import pytest

from textsql.arguments.prep import PrepArguments
from textsql.errors import TextsqlError
from textsql.paths import WIKISQL_SAMPLE_DIR
from textsql.prep import prepare_dataset
from textsql.prepared import load_prepared, load_tables
from textsql.prompts import fitted_source, source_text, table_values
from textsql.wikisql.cells import FUZZY_RATIO, cell_matches, cell_text
from textsql.wikisql.format import VALUES_FORMAT
from textsql.wikisql.release import SAMPLE_SOURCE


@pytest.fixture(scope="module")
def real_test():
    """(questions, tables by id) of the real 1,062-question test slice (shipped in the package)."""
    folder = WIKISQL_SAMPLE_DIR
    tables = {t["id"]: t for t in map(json.loads, (folder / "test.tables.jsonl").read_text().splitlines())}
    return [json.loads(line) for line in (folder / "test.jsonl").read_text().splitlines()], tables


def test_gold_where_values_that_are_cells_are_listed_under_their_column(real_test):
    """On the real slice, nearly every gold WHERE value that is a cell of its column is listed under that column with
    the default bounds (99.7% when written: the misses are 'Many' and two 20-token cells), and most questions get
    at least one value."""
    questions, tables = real_test
    cells = listed = with_values = 0
    for question in questions:
        table = tables[question["table_id"]]
        found = {(m.column, m.cell.lower()) for m in cell_matches(question["question"], table)}
        with_values += bool(found)
        for column, _, value in question["sql"]["conds"]:
            value = cell_text(value).lower()
            if value in {cell_text(row[column]).lower() for row in table["rows"]}:
                cells += 1
                listed += (column, value) in found
    assert cells > 1000  # nearly every condition of the slice compares with a cell
    assert listed / cells >= 0.95, (listed, cells)
    assert with_values / len(questions) >= 0.9


def test_the_bounds_hold_and_matches_come_best_first(real_test):
    questions, tables = real_test
    crowded = 0
    for question in questions[:300]:
        table = tables[question["table_id"]]
        matches = cell_matches(question["question"], table, per_column=1, total=3)
        columns = [m.column for m in matches]
        assert len(columns) == len(set(columns)) and len(matches) <= 3
        assert [m.score for m in matches] == sorted((m.score for m in matches), reverse=True)
        unbounded = cell_matches(question["question"], table, per_column=100, total=100)
        crowded += len(unbounded) > 3
        assert set(matches) <= set(unbounded)
    assert crowded, "some real questions match more than three cells, so the bound is exercised"


def test_a_column_with_no_match_lists_nothing_in_either_layout(real_test):
    _, tables = real_test
    table = tables["1-10015132-16"]  # Player | No. | Nationality | Position | Years in Toronto | School/Club Team
    settings = {"source_format": VALUES_FORMAT, "source_prefix": "translate English to SQL: "}
    question = "What is terrence ross' nationality"
    assert table_values(question, table, settings) == [("Player", "Terrence Ross")]
    columns = "Player | No. | Nationality | Position | Years in Toronto | School/Club Team"
    assert fitted_source(question, table, settings).text == (
        f"translate English to SQL: {question} columns: {columns} values: Player = Terrence Ross"
    )
    assert fitted_source(question, table, {**settings, "layout": "causal"}).text == (
        f"### Question: {question}\n### Columns: {columns}\n### Values: Player = Terrence Ross\n### SQL:\n"
    )
    # a question that names no cell: no values section at all
    assert table_values("What is the name of the player?", table, settings) == []
    assert fitted_source("Who?", table, {**settings, "layout": "causal"}).text == (
        f"### Question: Who?\n### Columns: {columns}\n### SQL:\n"
    )
    # the other formats list no values, whatever is passed
    assert "values" not in source_text(question, table["header"], "", "question+header", values=[("Player", "x")])
    with pytest.raises(TextsqlError, match="needs the question's table"):
        source_text(question, None, "", VALUES_FORMAT)


def test_a_misspelt_value_is_found_fuzzily_and_numbers_only_exactly(real_test):
    _, tables = real_test
    table = tables["1-10015132-16"]
    (match,) = cell_matches("What is terence ross' nationality", table)  # 'Terrence' with one r
    assert (table["header"][match.column], match.cell) == ("Player", "Terrence Ross")
    assert FUZZY_RATIO <= match.score < 1
    assert [m.cell for m in cell_matches("which club was in toronto 2003-06", table)] == ["2003-06"]
    assert cell_matches("which club was in toronto 2003-07", table) == []  # a number is not misspelt
    numbers = {"header": ["Year", "Wins"], "rows": [[1998.0, 3], [1999.0, 12]]}
    assert [(m.column, m.cell) for m in cell_matches("Wins in 1998?", numbers)] == [(0, "1998")]  # 1998.0 as 1998


def test_stop_words_short_words_and_punctuation_match_nothing():
    table = {
        "header": ["Name", "Note", "Result"],
        "rows": [["The", "of", "–"], ["Who", "a", "—"], ["Utah Jazz", "no", "Won"]],
    }
    assert cell_matches("Who is the name of the team with a – ?", table) == []
    assert [m.cell for m in cell_matches("Who is the team of utah jazz?", table)] == ["Utah Jazz"]
    assert [m.cell for m in cell_matches("when the note is no", table)] == ["no"]  # yes/no columns hold 'no'
    assert cell_matches("who wan", table) == []  # too short to match fuzzily ('Won')


def test_prep_with_the_real_qwen2_tokenizer_drops_values_before_columns_and_every_prompt_fits(real_files, tmp_path):
    """A small --max_source_length: every kept prompt fits; a prompt that lost values lists the best ones (the head of
    its list) and would not fit with one more; a prompt that lost columns lost every value first; the bounds and the
    counts are in the metadata."""
    import shutil

    from transformers import Qwen2Config

    from textsql.hub import load_tokenizer
    from textsql.prompts import model_source

    folder = tmp_path / "qwen2"  # the real tokenizer, and a config saying the family (prep loads no weights)
    shutil.copytree(real_files / "qwen2", folder)
    tokenizer = load_tokenizer(str(folder))
    Qwen2Config(vocab_size=len(tokenizer), hidden_size=16, num_hidden_layers=1, num_attention_heads=2).save_pretrained(
        folder
    )
    limit = 56
    args = PrepArguments(
        source=SAMPLE_SOURCE,
        model_id=str(folder),
        output_dir=str(tmp_path / "data"),
        source_format=VALUES_FORMAT,
        values_per_column=1,
        max_values=4,
        max_source_length=limit,
        max_examples_per_split=80,
        overlong="drop",
    )
    dataset, meta = load_prepared(prepare_dataset(args))
    tables = load_tables(tmp_path / "data")
    assert meta["values_per_column"] == 1 and meta["max_values"] == 4 and meta["source_format"] == VALUES_FORMAT
    fitted = meta["prompts_fitted"]["test"]
    assert fitted["values_dropped"] > 0 and fitted["columns_cut"] > 0, fitted
    assert meta["lengths"]["test"]["source_over_max"] == 0
    listed = meta["values_listed"]["test"]
    assert 0 < listed["prompts_with_values"] <= listed["values"] <= 4 * listed["sources"]
    lost_values = lost_columns = 0
    for row in dataset["test"]:
        table = tables[row["table_id"]]
        prompt, n = row["prompt"], row["labels"].count(-100)
        assert n == len(tokenizer(prompt)["input_ids"]) <= limit
        assert prompt == model_source(row["question"], table, meta, tokenizer)  # typed questions: the same prompt
        values = table_values(row["question"], table, meta)
        assert len({column for column, _ in values}) == len(values) <= 4  # one per column, four in all
        whole = fitted_source(row["question"], table, meta)
        if whole.text == prompt:
            continue
        heads = [fitted_source(row["question"], table, meta, values=values[:k]).text for k in range(len(values))]
        if prompt in heads:  # lost values only: the best ones kept, and one more would not fit
            lost_values += 1
            one_more = fitted_source(row["question"], table, meta, values=values[: heads.index(prompt) + 1]).text
            assert len(tokenizer(one_more)["input_ids"]) > limit
        else:  # lost columns: no value is left
            lost_columns += 1
            assert "### Values:" not in prompt and prompt.count(" | ") < len(table["header"]) - 1
    assert lost_values and lost_columns


def test_the_bounds_are_checked_and_a_model_refuses_data_listing_values_with_other_bounds():
    from transformers import Qwen2Config

    from textsql.prompts import check_source_settings, record_source_settings, source_settings

    with pytest.raises(TextsqlError, match="--values_per_column and --max_values .* at least 1"):
        PrepArguments(source="generate", source_format=VALUES_FORMAT, values_per_column=0)
    metadata = {
        "source_prefix": "",
        "source_format": VALUES_FORMAT,
        "prompt_format": "plain",
        "layout": "causal",
        "values_per_column": 2,
        "max_values": 10,
        "max_source_length": 512,
    }
    assert source_settings(metadata) == {
        "source_prefix": "",
        "source_format": VALUES_FORMAT,
        "prompt_format": "plain",
        "values_per_column": 2,
        "max_values": 10,
        "max_source_length": 512,
    }
    config = Qwen2Config(hidden_size=16, num_hidden_layers=1, num_attention_heads=2)
    record_source_settings(config, metadata)
    check_source_settings(config, {**metadata, "max_source_length": 256}, "data")  # the budget only fits
    with pytest.raises(TextsqlError, match="--max_values 10, but 'data' was prepared with --max_values 3"):
        check_source_settings(config, {**metadata, "max_values": 3}, "data")
