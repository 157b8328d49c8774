"""Tests of the WikiSQL-format generator: release layout, determinism, split isolation, query validity, variety."""

import json
import re
from collections import Counter

import pytest

from textsql.errors import TextsqlError
from textsql.wikisql.format import AGG_OPS, COND_OPS
from textsql.wikisql.release import read_jsonl
from textsql.wikisql.synthetic import DOMAINS, generate_split, generate_wikisql

QUESTION_KEYS = {"phase", "table_id", "question", "sql"}
TABLE_KEYS = {"id", "header", "types", "rows", "page_title", "section_title", "caption", "name"}
NUMERIC_AGGS = {AGG_OPS.index(name) for name in ("MAX", "MIN", "SUM", "AVG")}
EQ, GT, LT = (COND_OPS.index(op) for op in ("=", ">", "<"))


@pytest.fixture(scope="module")
def train_split():
    questions, tables = generate_split("train", 300, 10, seed=0)
    return questions, {table["id"]: table for table in tables}


def _is_number(value):
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _holds(cell, op, value):
    if op == EQ:
        return str(cell).lower() == str(value).lower()
    return cell > value if op == GT else cell < value


def test_writes_the_release_layout(tmp_path):
    out = generate_wikisql(
        tmp_path / "wikisql", train_tables=12, dev_tables=4, test_tables=3, questions_per_table=5, seed=3
    )
    assert out == tmp_path / "wikisql"
    for split, num_tables in (("train", 12), ("dev", 4), ("test", 3)):
        questions, tables = read_jsonl(out / f"{split}.jsonl"), read_jsonl(out / f"{split}.tables.jsonl")
        assert len(tables) == num_tables and len(questions) == num_tables * 5
        assert all(set(q) == QUESTION_KEYS and q["phase"] == 1 for q in questions)
        assert all(set(q["sql"]) == {"sel", "agg", "conds"} for q in questions)
        assert all(set(t) == TABLE_KEYS for t in tables)
        assert {q["table_id"] for q in questions} == {t["id"] for t in tables}
    assert not (out / "validation.jsonl").exists()  # the release calls it dev


def test_release_folder_loads_with_the_package_loader(tmp_path):
    from textsql.wikisql.release import load_wikisql

    folder = generate_wikisql(tmp_path, train_tables=6, dev_tables=2, test_tables=2, questions_per_table=3)
    data = load_wikisql(str(folder))
    assert {name: len(examples) for name, examples in data.splits.items()} == {"train": 18, "validation": 6, "test": 6}
    assert data.splits["train"][0].target.startswith("SELECT ")


def test_default_call_makes_a_few_thousand_training_questions(tmp_path):
    folder = generate_wikisql(tmp_path)
    assert 2000 <= len(read_jsonl(folder / "train.jsonl")) <= 10000
    assert len(read_jsonl(folder / "dev.jsonl")) >= 200


def test_deterministic_for_a_seed():
    assert generate_split("dev", 20, 5, seed=7) == generate_split("dev", 20, 5, seed=7)
    assert generate_split("dev", 20, 5, seed=7) != generate_split("dev", 20, 5, seed=8)


def test_splits_share_no_table():
    splits = {split: generate_split(split, 150, 2, seed=0)[1] for split in ("train", "dev", "test")}
    ids = {split: {t["id"] for t in tables} for split, tables in splits.items()}
    rows = {split: {json.dumps(t["rows"]) for t in tables} for split, tables in splits.items()}
    for first, second in (("train", "dev"), ("train", "test"), ("dev", "test")):
        assert not ids[first] & ids[second]
        assert not rows[first] & rows[second]
    assert all(len(ids[split]) == 150 for split in splits)


def test_unknown_split_is_a_user_error():
    with pytest.raises(TextsqlError, match="dev"):
        generate_split("validation", 3, 2)


def test_tables_look_like_wikisql(train_split):
    _, tables = train_split
    headers = Counter()
    for table in tables.values():
        assert len(set(table["header"])) == len(table["header"]) >= 5
        assert len(table["types"]) == len(table["header"]) and set(table["types"]) <= {"text", "real"}
        assert "real" in table["types"]
        assert 5 <= len(table["rows"]) <= 20
        for row in table["rows"]:
            assert len(row) == len(table["header"])
            for cell, kind in zip(row, table["types"]):
                assert _is_number(cell) if kind == "real" else (isinstance(cell, str) and cell.strip() == cell and cell)
        headers.update(table["header"])
    assert len(DOMAINS) >= 12
    assert len({tuple(t["header"]) for t in tables.values()}) >= 40
    assert {"No. in series", "Original air date", "Total W–L", "Points for", "Result", "Year"} <= set(headers)
    cells = [cell for t in tables.values() for row in t["rows"] for cell in row]
    assert any(isinstance(c, float) for c in cells) and any(isinstance(c, int) for c in cells)
    assert any(re.fullmatch(r"\d–\d(, \d–\d)+", str(c)) for c in cells)  # tennis scores


def test_text_values_collide_in_case(train_split):
    _, tables = train_split
    text_values = {cell for t in tables.values() for row in t["rows"] for cell in row if isinstance(cell, str)}
    by_lower = Counter(value.lower() for value in text_values)
    assert {"Won", "won"} <= text_values
    assert sum(1 for count in by_lower.values() if count > 1) >= 10


def test_every_query_is_valid_and_selects_a_row(train_split):
    questions, tables = train_split
    for question in questions:
        table, sql = tables[question["table_id"]], question["sql"]
        header, types, rows = table["header"], table["types"], table["rows"]
        assert 0 <= sql["sel"] < len(header) and 0 <= sql["agg"] < len(AGG_OPS)
        if sql["agg"] in NUMERIC_AGGS:
            assert types[sql["sel"]] == "real"
        assert 1 <= len(sql["conds"]) <= 4
        assert len({column for column, _, _ in sql["conds"]}) == len(sql["conds"])
        for column, op, value in sql["conds"]:
            assert 0 <= column < len(header) and op in (EQ, GT, LT)
            assert not (sql["agg"] == 0 and column == sql["sel"] and op == EQ)
            column_cells = [row[column] for row in rows]
            if types[column] == "real":
                assert _is_number(value) and value in column_cells
            else:
                assert op == EQ and isinstance(value, str)
                assert value.lower() in {cell.lower() for cell in column_cells}
            assert str(value) in question["question"]
        assert any(all(_holds(row[c], op, v) for c, op, v in sql["conds"]) for row in rows)


def test_users_sometimes_type_values_in_another_case(train_split):
    questions, tables = train_split
    recased = [
        value
        for q in questions
        for column, _, value in q["sql"]["conds"]
        if isinstance(value, str) and value not in {row[column] for row in tables[q["table_id"]]["rows"]}
    ]
    assert 0.01 * len(questions) < len(recased) < 0.2 * len(questions)


def test_aggregation_and_condition_counts_are_distributed_like_wikisql(train_split):
    questions, _ = train_split
    share = lambda counter, key: counter[key] / len(questions)  # noqa: E731
    aggs = Counter(AGG_OPS[q["sql"]["agg"]] for q in questions)
    assert 0.6 < share(aggs, "") < 0.8
    assert 0.06 < share(aggs, "COUNT") < 0.15
    assert all(aggs[name] > 0.02 * len(questions) for name in ("MAX", "MIN", "SUM", "AVG"))
    num_conds = Counter(len(q["sql"]["conds"]) for q in questions)
    assert 0.55 < share(num_conds, 1) < 0.8
    assert 0.15 < share(num_conds, 2) < 0.35
    assert num_conds[3] > 0 and num_conds[4] > 0
    ops = Counter(op for q in questions for _, op, _ in q["sql"]["conds"])
    assert ops[GT] > 0 and ops[LT] > 0 and COND_OPS.index("OP") not in ops


def _question_shape(question, header):
    """The question with condition values and column mentions replaced, so only the template wording is left."""
    text = question["question"]
    for _, _, value in question["sql"]["conds"]:
        text = text.replace(str(value), "{v}")
    for name in sorted(header, key=len, reverse=True):
        text = re.sub(rf"(?<!\w){re.escape(name)}(?!\w)", "{c}", text, flags=re.IGNORECASE)
    return text


def test_questions_come_from_many_templates(train_split):
    questions, tables = train_split
    shapes = {_question_shape(q, tables[q["table_id"]]["header"]) for q in questions}
    openings = {" ".join(shape.split()[:2]) for shape in shapes}
    assert len(shapes) >= 200
    assert len(openings) >= 15
    lower_mentions = sum(
        1
        for q in questions
        if any(
            h.lower() != h and h.lower() in q["question"] and h not in q["question"]
            for h in tables[q["table_id"]]["header"]
        )
    )
    assert lower_mentions > 0.05 * len(questions)


def test_questions_are_distinct_within_a_table(train_split):
    questions, _ = train_split
    assert len({(q["table_id"], q["question"]) for q in questions}) == len(questions)
