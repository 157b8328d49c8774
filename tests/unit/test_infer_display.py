"""What `textsql infer` and the demo print for one example: an untrained model's runaway repeats stay one line."""

from textsql.infer import format_example, shorten_repeats


def test_a_word_repeated_many_times_is_shown_once_with_its_count():
    assert shorten_repeats("SELECT " + " ".join(["Week"] * 130) + " FROM table") == "SELECT Week … (×130) FROM table"
    assert shorten_repeats("SELECT Week Week FROM table WHERE Week = 1") == "SELECT Week Week FROM table WHERE Week = 1"
    assert shorten_repeats("uil" * 40 + "ity" * 20) == "uil … (×40)ity … (×20)"
    assert (
        shorten_repeats("SELECT Attendance FROM table WHERE Score = 100000")
        == "SELECT Attendance FROM table WHERE Score = 100000"
    )


def test_the_example_line_is_short_and_the_record_keeps_the_text():
    sql = "SELECT " + " ".join(["Week"] * 130)
    record = {
        "question": "Which week?",
        "predicted_sql": sql,
        "gold_sql": "SELECT Week FROM table",
        "parse_error": None,
        "execution_match": False,
        "wrong_parts": ["select column"],
    }
    text = format_example(record)
    assert "Week … (×130)" in text and len(text) < 200
    assert record["predicted_sql"] == sql
