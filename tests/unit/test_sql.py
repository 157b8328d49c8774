"""Tests for textsql.wikisql.sql: reading generated SQL back, executing it WikiSQL's way, and the metrics."""

import re

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from textsql.errors import TextsqlError
from textsql.wikisql.format import render_sql
from textsql.wikisql.sql import (
    SQLExecutionError,
    SQLParseError,
    aggregate_metrics,
    component_matches,
    execute_query,
    executes_plausibly,
    parse_sql,
    same_logical_form,
    score_prediction,
    wikisql_number,
)
from textsql.wikisql.synthetic import generate_split

# Names that collide with keywords, prefix one another, or hold AND; none is "<aggregation> <another name>".
ADVERSARIAL_NAMES = (
    "Points",
    "Points for",
    "Points for and against",
    "Order",
    "Max",
    "Count of votes",
    "Select",
    "From",
    "Where it happened",
    "A AND B",
    "AND",
    "Table",
    "Min.",
    "Sum (total)",
    "Total W–L",
    "Year",
    "Team",
    "Team name",
    "# of seats won",
    "Result",
)
NAME_WORDS = ("Alpha", "Points", "for", "Year", "AND", "Where", "Team", "W–L", "No.", "(km)", "Select", "From")
VALUE_WORDS = (
    "Won",
    "won",
    "AND",
    "and",
    "=",
    ">",
    "<",
    ">=",
    "1995",
    "3.5",
    "-2",
    "Points",
    "Year",
    "x",
    "1,234",
    "O'Brien",
    "Rock",
    "Roll",
    "FROM",
    "table",
    "WHERE",
    "Select",
    "Max",
    "A",
    "B",
    "Team name",
)

header_names = st.one_of(
    st.sampled_from(ADVERSARIAL_NAMES), st.lists(st.sampled_from(NAME_WORDS), min_size=1, max_size=3).map(" ".join)
)
headers = st.lists(header_names, min_size=1, max_size=8, unique_by=lambda name: " ".join(name.lower().split()))
values = st.one_of(
    st.lists(st.sampled_from(VALUE_WORDS), min_size=1, max_size=5).map(" ".join),
    st.integers(-5000, 5000).map(str),
    st.floats(-1e6, 1e6, allow_nan=False).map(str),
)


@st.composite
def queries(draw):
    """(header, query) with every aggregation, operator and 0-4 conditions; values as the strings parse returns."""
    header = draw(headers)
    column = st.integers(0, len(header) - 1)
    conds = draw(st.lists(st.tuples(column, st.integers(0, 2), values).map(list), max_size=4))
    return header, {"sel": draw(column), "agg": draw(st.integers(0, 5)), "conds": conds}


def ambiguous(query: dict, header: list[str]) -> bool:
    """Queries whose rendering genuinely reads otherwise: a value holding 'AND <column> <op>' (two conditions), or a
    last value ending in AND or 'AND <column> [op]' (parse_sql takes that for output cut off mid-condition)."""
    names = "|".join(re.escape(" ".join(name.split())) for name in header)
    values = [value for _, _, value in query["conds"]]
    inside = any(re.search(rf"(^|\s)and\s+({names})\s+[=<>]", value, re.IGNORECASE) for value in values)
    cut_off = values and re.search(rf"(^|\s)and(\s+({names})(\s+[=<>])?)?$", values[-1], re.IGNORECASE)
    return bool(inside or cut_off)


# --------------------------------------------------------------------------- parse


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(queries())
def test_parse_inverts_render_on_adversarial_headers(header_and_query):
    header, query = header_and_query
    assume(not ambiguous(query, header))
    assert parse_sql(render_sql(query, header), header) == query


@settings(max_examples=200, deadline=None)
@given(queries())
def test_parse_is_case_insensitive_on_keywords_and_columns(header_and_query):
    header, query = header_and_query
    assume(not ambiguous(query, header))
    text = render_sql(query, header)
    parsed = parse_sql(text.lower(), header)
    assert (parsed["sel"], parsed["agg"]) == (query["sel"], query["agg"])
    assert [c[:2] for c in parsed["conds"]] == [c[:2] for c in query["conds"]]
    assert [c[2] for c in parsed["conds"]] == [c[2].lower() for c in query["conds"]]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_parse_inverts_render_on_generated_data(seed):
    questions, tables = generate_split("train", 30, 10, seed=seed)
    headers_by_id = {table["id"]: table["header"] for table in tables}
    assert len(questions) == 300
    for question in questions:
        sql, header = question["sql"], headers_by_id[question["table_id"]]
        expected = {"sel": sql["sel"], "agg": sql["agg"], "conds": [[c, o, str(v)] for c, o, v in sql["conds"]]}
        assert parse_sql(render_sql(sql, header), header) == expected, question


HEADER = ["Points", "Points for", "Year", "Count of votes", "Max", "A AND B", "Where it happened", "From", "Total W–L"]


def test_case_and_spacing_tolerance():
    assert parse_sql("select count  points FOR from table where YEAR = 1995", HEADER) == {
        "sel": 1,
        "agg": 3,
        "conds": [[2, 0, "1995"]],
    }
    assert parse_sql("SELECT Pointsfor FROM table WHERE Year=1995 AND Total W – L >3", HEADER) == {
        "sel": 1,
        "agg": 0,
        "conds": [[2, 0, "1995"], [8, 1, "3"]],
    }
    assert parse_sql("  SELECT   MAX  Max FROM   table  ", HEADER) == {"sel": 4, "agg": 1, "conds": []}
    # The header's own spacing may differ from the output's.
    assert parse_sql("SELECT Total W–L FROM table", ["Total  W–L "]) == {"sel": 0, "agg": 0, "conds": []}


def test_longest_column_names_and_keywords_inside_names():
    assert parse_sql("SELECT Max FROM table", HEADER) == {"sel": 4, "agg": 0, "conds": []}
    assert parse_sql("SELECT COUNT Count of votes FROM table", HEADER) == {"sel": 3, "agg": 3, "conds": []}
    assert parse_sql("SELECT From FROM table WHERE Where it happened = Rock AND Roll", HEADER) == {
        "sel": 7,
        "agg": 0,
        "conds": [[6, 0, "Rock AND Roll"]],
    }
    assert parse_sql(
        "SELECT Points FROM table WHERE A AND B = x AND y AND Points for < 3 AND Year > 1,990", HEADER
    ) == {"sel": 0, "agg": 0, "conds": [[5, 0, "x AND y"], [1, 2, "3"], [2, 1, "1,990"]]}


def test_values_ending_in_and_before_another_condition():
    assert parse_sql("SELECT Points FROM table WHERE Points = Won AND AND Year = 0", HEADER) == {
        "sel": 0,
        "agg": 0,
        "conds": [[0, 0, "Won AND"], [2, 0, "0"]],
    }


def test_longest_condition_column_wins_when_both_readings_parse():
    assert parse_sql("SELECT W FROM table WHERE W > L = 3", ["W", "W > L"]) == {
        "sel": 0,
        "agg": 0,
        "conds": [[1, 0, "3"]],
    }


def test_repeated_column_name_maps_to_its_first_column():
    assert parse_sql("SELECT Points FROM table WHERE Points = 3", ["Year", "Points", "Points"]) == {
        "sel": 1,
        "agg": 0,
        "conds": [[1, 0, "3"]],
    }


def test_column_names_match_as_the_t5_tokenizer_writes_them():
    # T5's normalizer (NFKC) gives back "Area (km²)" as "Area (km2)" and "½" as "1⁄2"; values stay as written.
    header = ["Area (km²)", "Density (pop/km²)", "Length (1½ mi)", "Title"]
    assert parse_sql("SELECT Area (km2) FROM table WHERE Density (pop/km2) = 137.61", header) == {
        "sel": 0,
        "agg": 0,
        "conds": [[1, 0, "137.61"]],
    }
    assert parse_sql("SELECT MAX Length (11⁄2 mi) FROM table WHERE Title = Ranma 1⁄2", header) == {
        "sel": 2,
        "agg": 1,
        "conds": [[3, 0, "Ranma 1⁄2"]],
    }
    lenient = parse_sql("select area(km2) from table where density(pop/km²)=5", header)
    assert lenient["conds"] == [[1, 0, "5"]]
    # A normalized form that is another column's own name stays that column's.
    assert parse_sql("SELECT Area (km2) FROM table", ["Area (km²)", "Area (km2)"])["sel"] == 1
    assert parse_sql("SELECT Area (km²) FROM table", ["Area (km²)", "Area (km2)"])["sel"] == 0


# Hand-checked readings where the text alone is ambiguous: the table's cells decide, and a reading that uses all of
# the text beats calling it cut off. The first table is two rows of WikiSQL's test table 1-1430913-1, where the gold
# value of a question ends in "and" plus a column name.
TREKS = {
    "id": "1-1430913-1",
    "header": ["Name Of Place", "Height from Sea Level In Meters", "Nearby Town", "Trekking Route", "Category"],
    "types": ["text"] * 5,
    "rows": [
        ["Valley of Flowers", "3000M to 4500M", "Govind Gath", "19km", "Picturesque and Trekking Route"],
        ["Auli Bugyal", "3300M to 4500M", "Joshi Math", "5km", "Trekking and winter sports"],
    ],
}
TREKS_GOLD = "SELECT Height from Sea Level In Meters FROM table WHERE Category = Picturesque and Trekking Route"


def test_the_only_complete_reading_is_taken_when_its_value_is_in_the_cells():
    query = {"sel": 1, "agg": 0, "conds": [[4, 0, "Picturesque and Trekking Route"]]}
    assert parse_sql(TREKS_GOLD, TREKS["header"], TREKS["rows"]) == query
    scored = score_prediction(TREKS_GOLD, TREKS_GOLD, query, TREKS)
    assert scored["exact_match"] and scored["logical_form_match"] and scored["execution_match"]
    # Any spelling of it, too (the model's output is rarely the gold's exact text).
    lower = parse_sql(TREKS_GOLD.lower(), TREKS["header"], TREKS["rows"])
    assert lower["conds"] == [[4, 0, "picturesque and trekking route"]]
    # Without the cells nothing says the value is whole: output cut off after "AND Trekking Route" reads the same.
    with pytest.raises(SQLParseError, match="operator"):
        parse_sql(TREKS_GOLD, TREKS["header"])
    # A last value ending in "and <column>" that no cell holds is still output cut off mid-condition.
    with pytest.raises(SQLParseError, match="operator"):
        parse_sql(
            "SELECT Nearby Town FROM table WHERE Category = Picturesque and Nearby Town", TREKS["header"], TREKS["rows"]
        )


def test_cells_decide_between_two_complete_readings():
    header = ["Show", "Year", "Network"]
    text = "SELECT Network FROM table WHERE Show = Tom AND Year = 1995"
    split = {"sel": 2, "agg": 0, "conds": [[0, 0, "Tom"], [1, 0, "1995"]]}
    whole = {"sel": 2, "agg": 0, "conds": [[0, 0, "Tom AND Year = 1995"]]}
    assert parse_sql(text, header) == split  # no cells: the earliest AND splits
    assert parse_sql(text, header, [["Tom", 1994, "NBC"]]) == split  # "Tom" is a cell: 1 value found against 0
    assert parse_sql(text, header, [["Tom and Year = 1995", 1990, "NBC"]]) == whole  # only the whole value is a cell
    assert parse_sql(text, header, [["Tom", 1995.0, "NBC"]]) == split  # numbers match by value
    # Two values found beat one; ties keep the earliest split.
    assert parse_sql(text, header, [["Tom and Year = 1995", 1990, "NBC"], ["Tom", 1995, "ABC"]]) == split
    assert parse_sql(text, header, [["Tom and Year = 1995", 1990, "NBC"], ["Tom", 1990, "ABC"]]) == split


def test_a_value_ending_in_and_is_whole_when_its_column_holds_it():
    header, rows = ["Act", "Year"], [["Rock and", 1990]]
    assert parse_sql("SELECT Year FROM table WHERE Act = Rock and", header, rows)["conds"] == [[0, 0, "Rock and"]]
    with pytest.raises(SQLParseError, match="no column"):
        parse_sql("SELECT Year FROM table WHERE Act = Roll and", header, rows)


def test_exact_gold_text_scores_as_the_gold_even_where_it_reads_otherwise():
    # The gold value is in no cell (WikiSQL has such questions), so the text alone reads as two conditions, or as cut
    # off; the prediction that is the gold's exact text is still the gold query.
    gold = {"sel": 2, "agg": 0, "conds": [[0, 0, "Tom AND Year = 1995"]]}
    table = {
        "id": "shows",
        "header": ["Show", "Year", "Network"],
        "types": ["text", "real", "text"],
        "rows": [["Tom", 1995, "NBC"]],
    }
    text = render_sql(gold, table["header"])
    assert parse_sql(text, table["header"], table["rows"]) != gold
    scored = score_prediction(text, text, gold, table)
    assert scored["exact_match"] and scored["logical_form_match"] and scored["execution_match"]
    assert scored["parsed"] == gold


@pytest.mark.parametrize(
    "text, reason",
    [
        ("", "empty"),
        ("   ", "empty"),
        ("garbage", "SELECT"),
        ("SELECT Score FROM table", "no column"),
        ("SELECT FROM table", "FROM table"),  # reads "From" as the column, then misses FROM table
        ("SELECT Points", "FROM table"),
        ("SELECT Points FROM", "FROM table"),
        ("SELECT Points table WHERE Year = 5", "FROM table"),
        ("SELECT Points FROM table Year = 5", "WHERE"),
        ("SELECT Points FROM table WHERE", "no column"),
        ("SELECT Points FROM table WHERE Score = 5", "no column"),
        ("SELECT Points FROM table WHERE Year", "operator"),
        ("SELECT Points FROM table WHERE Year =", "value"),
        # Cut off after AND: not read as the value "5 AND ...".
        ("SELECT Points FROM table WHERE Year = 5 AND", "no column"),
        ("SELECT Points FROM table WHERE Year = 5 AND Max", "operator"),
        ("SELECT Points FROM table WHERE Year = 5 AND Max >", "value"),
        ("SELECT AVG FROM table", "FROM table"),
    ],
)
def test_unparseable_output_raises_parse_error_with_a_reason(text, reason):
    with pytest.raises(SQLParseError, match=re.escape(reason)):
        parse_sql(text, HEADER)
    assert issubclass(SQLParseError, ValueError)


# --------------------------------------------------------------------------- execute

TABLE = {
    "id": "1-100-1",
    "header": ["Player", "Result", "Points", "Year", "Goals"],
    "types": ["text", "text", "real", "real", "real"],
    "rows": [
        ["Ann", "Won", "1,234", 1995, "3.5"],
        ["Bob", "won", "12", 1996, 2],
        ["Cid", "Lost", 7.5, "1997", "n/a"],
        ["Dee", "WON", 12.0, 1998, 1],
    ],
}


def run(sel, agg=0, conds=(), table=TABLE):
    return execute_query({"sel": sel, "agg": agg, "conds": [list(c) for c in conds]}, table)


# Each expectation below was worked out by hand from WikiSQL's rules (DESIGN.md section 3) and SQLite's affinity rules.


def test_text_comparisons_ignore_case_and_results_come_back_lower_cased_in_table_order():
    assert run(0, conds=[(1, 0, "won")]) == ["ann", "bob", "dee"]
    assert run(0, conds=[(1, 0, "WON")]) == ["ann", "bob", "dee"]
    assert run(0, conds=[(1, 0, "Lost")]) == ["cid"]
    reversed_rows = dict(TABLE, id="1-100-reversed", rows=TABLE["rows"][::-1])
    assert run(0, table=reversed_rows) == ["dee", "cid", "bob", "ann"]  # SQLite's order, never sorted


def test_real_columns_keep_text_that_is_not_a_plain_number_as_text():
    # "1,234" in a real column stays TEXT in SQLite: no number equals it, and it is greater than every number.
    assert run(0, conds=[(2, 0, "1234")]) == []
    assert run(0, conds=[(2, 0, "1,234")]) == []  # the value is read as 1234.0 (babel drops the ","); the cell is not
    assert run(0, conds=[(2, 1, "10")]) == ["ann", "bob", "dee"]
    assert run(0, conds=[(2, 2, "12.5")]) == ["bob", "cid", "dee"]
    assert run(0, conds=[(4, 1, "2")]) == ["ann", "cid"]  # "3.5" became 3.5; "n/a" is TEXT, so > 2
    # Text that is a plain number converts to REAL on insert: "12" and "1997" compare as numbers.
    assert run(0, conds=[(2, 0, "12")]) == ["bob", "dee"]
    assert run(0, conds=[(2, 0, 12)]) == ["bob", "dee"]
    assert run(0, conds=[(3, 0, "1997")]) == ["cid"]


def test_condition_values_for_real_columns_are_read_as_wikisql_reads_them():
    assert run(0, conds=[(2, 0, "12 points")]) == ["bob", "dee"]  # not a decimal: the first number in the text
    assert run(0, conds=[(2, 0, " 12 ")]) == ["bob", "dee"]
    assert run(0, conds=[(2, 0, "1_2")]) == ["bob", "dee"]  # decimal.Decimal takes underscores between digits
    with pytest.raises(SQLExecutionError, match="no number"):
        run(0, conds=[(2, 0, "no number here")])  # WikiSQL raises IndexError here


def test_two_conditions_on_one_column_share_the_last_value():
    # Bound by name (:col3): both read "< 1999"; bound by position it would be "< 1997 AND < 1999" = ann, bob.
    assert run(0, conds=[(3, 2, "1997"), (3, 2, "1999")]) == ["ann", "bob", "cid", "dee"]
    # Both read "> 1995" here, so nothing is both above and below it.
    assert run(0, conds=[(3, 2, "1998"), (3, 1, "1995")]) == []


def test_aggregates_checked_by_hand():
    won = [(1, 0, "won")]  # ann ("1,234" TEXT), bob (12.0), dee (12.0)
    assert run(2, 1, won) == ["1,234"]  # TEXT is the maximum
    assert run(2, 2, won) == [12.0]
    assert run(2, 3, won) == [3]
    assert run(2, 4, won) == [25.0]  # SUM reads "1,234" as its numeric prefix 1
    assert run(2, 5, won) == [25 / 3]
    assert run(4, 5, won) == [6.5 / 3]  # 3.5, 2, 1
    assert run(2, 4) == [32.5]  # 1 + 12 + 7.5 + 12
    assert run(4, 3) == [4]  # "n/a" is kept as text, and COUNT counts it
    assert run(4, 1) == ["n/a"] and run(4, 2) == [1.0]


def test_empty_results():
    nobody = [(1, 0, "draw")]
    assert run(0, conds=nobody) == []
    assert run(1, conds=[(3, 1, "5000")]) == []
    assert run(0, 3, nobody) == [0]
    assert run(2, 4, nobody) == [None]
    assert run(2, 1, nobody) == [None]


def test_values_are_bound_not_spliced_into_the_sql():
    assert run(0, conds=[(1, 0, "x'; DROP TABLE t; --")]) == []
    assert run(0, 3) == [4]


def test_same_id_with_different_rows_is_not_served_from_the_cache():
    changed = dict(TABLE, rows=[["Eve", "Won", 1, 2000, 0]])
    assert run(0, table=TABLE) == ["ann", "bob", "cid", "dee"]
    assert run(0, table=changed) == ["eve"]
    assert run(0, table=dict(TABLE)) == ["ann", "bob", "cid", "dee"]


@pytest.mark.parametrize(
    "query",
    [
        {"sel": 5, "agg": 0, "conds": []},
        {"sel": -1, "agg": 0, "conds": []},
        {"sel": 0, "agg": 6, "conds": []},
        {"sel": 0, "agg": 0, "conds": [[9, 0, "x"]]},
        {"sel": 0, "agg": 0, "conds": [[1, 3, "x"]]},  # "OP": WikiSQL's list has it, SQLite cannot run it
        {"sel": 0, "agg": 0, "conds": [[1, 4, "x"]]},
        {"sel": 0, "agg": 0, "conds": [[1, 0]]},
        {"sel": "0", "agg": 0, "conds": []},
        {"agg": 0, "conds": []},
    ],
)
def test_bad_queries_raise_execution_error(query):
    with pytest.raises(SQLExecutionError):
        execute_query(query, TABLE)


def test_malformed_table_raises_execution_error():
    with pytest.raises(SQLExecutionError, match="cells"):
        run(0, table=dict(TABLE, id="1-100-2", rows=[["Ann", "Won"]]))
    with pytest.raises(SQLExecutionError, match="types"):
        run(0, table=dict(TABLE, id="1-100-3", types=["text", "text", "real", "real", "integer); DROP TABLE t; --"]))


NUMBER_TEXT = st.text(alphabet="0123456789,.-+ e_xkmnaif", max_size=10)


@settings(max_examples=500, deadline=None)
@given(NUMBER_TEXT)
def test_wikisql_number_equals_babel_parse_decimal_with_wikisql_fallback(text):
    """What lib/dbengine.py computes for a real column's condition value (lower-cased first), with babel itself."""
    from babel.numbers import NumberFormatError, parse_decimal

    value = text.lower()
    try:
        expected = float(parse_decimal(value, locale="en_US"))
    except NumberFormatError:
        found = re.findall(r"[-+]?\d*\.\d+|\d+", value)
        expected = float(found[0]) if found else None
    except ValueError:  # decimal's signalling NaN: no float
        expected = None
    if expected is None:
        with pytest.raises(SQLExecutionError):
            wikisql_number(value)
    else:
        got = wikisql_number(value)
        assert got == expected or (got != got and expected != expected)  # nan equals nan here


def test_wikisql_number_by_hand():
    assert wikisql_number("1,234") == 1234.0
    assert wikisql_number(" 3.5 ") == 3.5
    assert wikisql_number("-2") == -2.0
    assert wikisql_number("12 km") == 12.0
    assert wikisql_number("1e3") == 1000.0
    assert wikisql_number("x-2.5y") == -2.5
    with pytest.raises(SQLExecutionError):
        wikisql_number("n/a")


# --------------------------------------------------------------------------- metrics

METRIC_TABLE = {
    "id": "1-200-1",
    "header": ["Player", "Result", "Points", "Year", "Team"],
    "types": ["text", "text", "real", "real", "text"],
    "rows": [
        ["Ann", "Won", 10, 1995, "Reds"],
        ["Bob", "Lost", 20, 1996, "Blues"],
        ["Cid", "Won", 30, 1997, "Reds"],
        ["Dee", "Lost", 40, 1998, "Greens"],
    ],
}
H = METRIC_TABLE["header"]

# (gold query, prediction): 3 exact, 4 logical-form right, 6 execute right, 2 that do not parse.
MIX = [
    ({"sel": 0, "agg": 0, "conds": [[3, 0, 1995]]}, "SELECT Player FROM table WHERE Year = 1995"),
    ({"sel": 0, "agg": 3, "conds": [[1, 0, "Won"]]}, "SELECT COUNT Player FROM table WHERE Result = Won"),
    (
        {"sel": 2, "agg": 1, "conds": [[4, 0, "Reds"], [1, 0, "Won"]]},
        "SELECT MAX Points FROM table WHERE Team = Reds AND Result = Won",
    ),
    (
        {"sel": 0, "agg": 0, "conds": [[1, 0, "Won"], [4, 0, "Reds"]]},
        "SELECT Player FROM table WHERE Team = reds AND Result = Won",
    ),
    ({"sel": 0, "agg": 0, "conds": [[3, 0, 1996]]}, "SELECT Player FROM table WHERE Points = 20"),
    ({"sel": 2, "agg": 4, "conds": []}, "SELECT SUM Points FROM table WHERE Year > 1990"),
    ({"sel": 2, "agg": 2, "conds": [[1, 0, "Lost"]]}, "SELECT MAX Points FROM table WHERE Result = Lost"),
    ({"sel": 2, "agg": 5, "conds": [[4, 0, "Reds"]]}, "SELECT AVG Score FROM table"),
    ({"sel": 4, "agg": 0, "conds": [[0, 0, "Ann"], [3, 0, 1995], [2, 0, 10], [1, 0, "Won"]]}, ""),
    (
        {"sel": 0, "agg": 0, "conds": [[4, 0, "Reds"], [1, 0, "Won"], [3, 1, 1995]]},
        "SELECT Player FROM table WHERE Team = Reds",
    ),
]
EXPECTED = [  # exact, logical form, execution
    (True, True, True),
    (True, True, True),
    (True, True, True),
    (False, True, True),
    (False, False, True),
    (False, False, True),
    (False, False, False),
    (False, False, False),
    (False, False, False),
    (False, False, False),
]


def score_mix():
    return [score_prediction(predicted, render_sql(gold, H), gold, METRIC_TABLE) for gold, predicted in MIX]


def test_score_prediction_on_a_known_mix():
    scored = score_mix()
    assert [(s["exact_match"], s["logical_form_match"], s["execution_match"]) for s in scored] == EXPECTED
    assert [s["parse_error"] is not None for s in scored] == [False] * 7 + [True, True, False]
    assert scored[3]["parsed"] == {"sel": 0, "agg": 0, "conds": [[4, 0, "reds"], [1, 0, "Won"]]}
    assert scored[7]["parsed"] is None and "no column" in scored[7]["parse_error"]
    assert scored[8]["parse_error"] == "empty output"


def test_aggregate_metrics_on_a_known_mix():
    metrics = aggregate_metrics(score_mix(), [gold for gold, _ in MIX])
    assert metrics["examples"] == 10
    assert metrics["exact_match"] == pytest.approx(0.3)
    assert metrics["logical_form_accuracy"] == pytest.approx(0.4)
    assert metrics["execution_accuracy"] == pytest.approx(0.6)
    assert metrics["parse_errors"] == 2
    assert metrics["components"] == {
        "select_column": pytest.approx(0.8),
        "aggregation": pytest.approx(0.7),
        "where_number": pytest.approx(0.6),
        "where_column": pytest.approx(0.5),
        "where_operator": pytest.approx(0.6),
        "where_value": pytest.approx(0.5),
    }

    def row(group):
        return (group["count"], group["exact_match"], group["logical_form_accuracy"], group["execution_accuracy"])

    by_agg = {name: row(group) for name, group in metrics["by_aggregation"].items()}
    assert list(by_agg) == ["none", "MAX", "MIN", "COUNT", "SUM", "AVG"]
    assert by_agg["none"] == (5, pytest.approx(0.2), pytest.approx(0.4), pytest.approx(0.6))
    assert by_agg["COUNT"] == by_agg["MAX"] == (1, 1.0, 1.0, 1.0)
    assert by_agg["SUM"] == (1, 0.0, 0.0, 1.0)
    assert by_agg["MIN"] == by_agg["AVG"] == (1, 0.0, 0.0, 0.0)

    by_conds = {bucket: row(group) for bucket, group in metrics["by_num_conditions"].items()}
    assert list(by_conds) == ["0", "1", "2", "3", "4+"]
    assert by_conds["0"] == (1, 0.0, 0.0, 1.0)
    assert by_conds["1"] == (5, pytest.approx(0.4), pytest.approx(0.4), pytest.approx(0.6))
    assert by_conds["2"] == (2, 0.5, 1.0, 1.0)
    assert by_conds["3"] == by_conds["4+"] == (1, 0.0, 0.0, 0.0)


def test_aggregate_metrics_edge_cases():
    empty = aggregate_metrics([], [])
    assert empty["examples"] == 0 and empty["execution_accuracy"] == 0.0 and empty["by_aggregation"] == {}
    with pytest.raises(ValueError):
        aggregate_metrics(score_mix(), [])


def test_logical_form_is_wikisql_query_eq():
    gold = {"sel": 0, "agg": 0, "conds": [[3, 0, 1995], [1, 0, "Won"]]}
    # Order-insensitive, values compared as str(value).lower(): "1995" equals 1995, "1995.0" does not.
    assert same_logical_form({"sel": 0, "agg": 0, "conds": [[1, 0, "WON"], [3, 0, "1995"]]}, gold)
    assert not same_logical_form({"sel": 0, "agg": 0, "conds": [[1, 0, "won"], [3, 0, "1995.0"]]}, gold)
    assert same_logical_form(
        {"sel": 0, "agg": 0, "conds": [[3, 0, 2003.0]]}, {"sel": 0, "agg": 0, "conds": [[3, 0, "2003.0"]]}
    )
    assert not same_logical_form(
        {"sel": 0, "agg": 0, "conds": [[3, 0, 2003]]}, {"sel": 0, "agg": 0, "conds": [[3, 0, 2003.0]]}
    )
    assert not same_logical_form({"sel": 0, "agg": 0, "conds": [[1, 0, "won"], [3, 0, "1996"]]}, gold)
    assert not same_logical_form({"sel": 0, "agg": 3, "conds": gold["conds"]}, gold)
    assert not same_logical_form({"sel": 0, "agg": 0, "conds": gold["conds"][:1]}, gold)
    # Sets: a repeated condition is the same condition.
    assert same_logical_form({"sel": 0, "agg": 0, "conds": gold["conds"] + gold["conds"][:1]}, gold)
    scored = score_prediction("SELECT Player FROM table WHERE Result = WON AND Year = 1995.0", "x", gold, METRIC_TABLE)
    assert scored["execution_match"] and not scored["logical_form_match"] and not scored["exact_match"]


def test_components_follow_sqlova_counting():
    gold = {"sel": 0, "agg": 3, "conds": [[3, 1, 1995], [1, 0, "Won"]]}
    right = component_matches({"sel": 0, "agg": 3, "conds": [[1, 0, "won"], [3, 1, "1995"]]}, gold)
    assert all(right.values())
    wrong_value = component_matches({"sel": 0, "agg": 3, "conds": [[1, 0, "Lost"], [3, 1, "1995"]]}, gold)
    assert [name for name, ok in wrong_value.items() if not ok] == ["where_value"]
    # Operators and values are compared in column order, whether or not the columns are right (SQLova's wo, wv).
    other_columns = component_matches({"sel": 2, "agg": 0, "conds": [[0, 0, "won"], [4, 1, "1995"]]}, gold)
    assert [name for name, ok in other_columns.items() if not ok] == ["select_column", "aggregation", "where_column"]
    fewer = component_matches({"sel": 0, "agg": 3, "conds": [[1, 0, "won"]]}, gold)
    assert [name for name, ok in fewer.items() if ok] == ["select_column", "aggregation"]
    assert not any(component_matches(None, gold).values())


def test_score_records_the_wrong_parts():
    scored = score_mix()
    assert scored[0]["wrong_parts"] == []
    assert scored[4]["wrong_parts"] == ["where_column", "where_value"]  # Points = 20 for Year = 1996
    assert scored[6]["wrong_parts"] == ["aggregation"]
    assert scored[7]["wrong_parts"] == list(scored[7]["components"])  # unparseable: every part wrong


def test_execution_guided_test_of_a_candidate():
    assert executes_plausibly("SELECT Player FROM table WHERE Result = Won", METRIC_TABLE)
    assert not executes_plausibly("SELECT Player FROM table WHERE Result = Draw", METRIC_TABLE)  # no row
    assert executes_plausibly("SELECT COUNT Player FROM table WHERE Result = Draw", METRIC_TABLE)  # [0] is an answer
    assert not executes_plausibly("SELECT Player FROM table WHERE Year > recent", METRIC_TABLE)  # raises in WikiSQL
    assert not executes_plausibly("SELECT Score FROM table", METRIC_TABLE)  # does not parse


def test_gold_query_is_parsed_from_the_gold_text_when_missing():
    gold_text = "SELECT Player FROM table WHERE Year = 1995"
    scored = score_prediction("SELECT Player FROM table WHERE Year = 1995", gold_text, None, METRIC_TABLE)
    assert scored["exact_match"] and scored["logical_form_match"] and scored["execution_match"]


def test_exact_match_collapses_whitespace_only():
    gold = {"sel": 0, "agg": 0, "conds": [[3, 0, 1995]]}
    assert score_prediction(
        " SELECT  Player FROM table WHERE Year = 1995 ",
        "SELECT Player FROM table WHERE Year = 1995",
        gold,
        METRIC_TABLE,
    )["exact_match"]
    assert not score_prediction(
        "select Player FROM table WHERE Year = 1995", "SELECT Player FROM table WHERE Year = 1995", gold, METRIC_TABLE
    )["exact_match"]


def test_a_failing_gold_query_makes_execution_wrong_not_a_crash():
    scored = score_prediction(
        "SELECT Player FROM table", "SELECT Player FROM table", {"sel": 9, "agg": 0, "conds": []}, METRIC_TABLE
    )
    assert not scored["execution_match"] and scored["execution_error"].startswith("gold query")


def test_scoring_without_a_table_says_what_to_do():
    with pytest.raises(TextsqlError, match="table"):
        score_prediction("SELECT a FROM table", "SELECT a FROM table", None, None)
