"""GRPO's SQL rewards (textsql.rewards) on right, wrong, unparsable, non-stopping and failing completions, scored by
WikiSQL's own parser and executor against a hand-checked table; the weights' parsing."""

import json

import pytest

from textsql.errors import TextsqlError
from textsql.rewards import SqlRewards
from textsql.spec.grpo import DEFAULT_REWARD_WEIGHTS, GrpoArguments, reward_weights
from textsql.wikisql import sql as wikisql_sql

TABLE = {
    "id": "1-1000-1",
    "header": ["Player", "Team", "Goals"],
    "types": ["text", "text", "real"],
    "rows": [["Ann", "Reds", 3], ["Bo", "Blues", 5], ["Cy", "Reds", 7]],
}
GOLD = {"sel": 0, "agg": 0, "conds": [[2, 1, 4]]}  # the players with more than 4 goals: Bo, Cy
GOLD_TEXT = "SELECT Player FROM table WHERE Goals > 4"
EOS = 2


def rewards_of(completions, ids=None):
    rewards = SqlRewards({TABLE["id"]: TABLE}, [EOS])
    n = len(completions)
    columns = dict(table_id=[TABLE["id"]] * n, sql=[json.dumps(GOLD)] * n, target=[GOLD_TEXT] * n)
    ids = ids or [[5, 6, EOS]] * n
    return (
        rewards.execution(completions, **columns),
        rewards.parses(completions, **columns),
        rewards.stops(completions, completion_ids=ids),
    )


def test_right_wrong_and_unparsable_completions():
    execution, parses, _ = rewards_of(
        [
            GOLD_TEXT,  # the gold text itself
            "SELECT Player FROM table WHERE Goals > 4.0",  # another text with the same result: right by execution
            "SELECT Team FROM table WHERE Goals > 4",  # parses, another result
            "SELECT Player FROM table WHERE Shoe size > 4",  # no such column: does not parse
            "```sql\nSELECT Player.Name FROM Players```",  # what the model writes zero-shot
        ]
    )
    assert execution == [1.0, 1.0, 0.0, 0.0, 0.0]
    assert parses == [1.0, 1.0, 1.0, 0.0, 0.0]


def test_stopping_at_eos_without_trailing_text():
    completions = [GOLD_TEXT, GOLD_TEXT, GOLD_TEXT + "\n\nThis query selects the players"]
    _, _, stops = rewards_of(completions, ids=[[5, 6, EOS], [5, 6, 7], [5, 6, 8, 9, EOS]])
    # EOS reached; cut at the length limit (no EOS); EOS after an explanation
    assert stops == [1.0, 0.0, 0.0]


def test_a_query_that_breaks_the_executor_or_runs_too_long_gets_the_lowest_reward(monkeypatch):
    # a real column holding no number for the value: WikiSQL's engine raises; textsql counts it wrong
    execution, parses, _ = rewards_of(["SELECT Player FROM table WHERE Goals > many"])
    assert execution == [0.0] and parses == [1.0]
    # a query interrupted by the executor's time limit (SQLite's progress handler, asked every 1,000 instructions: a
    # table of 3,000 rows takes more): wrong, and training goes on
    big = {**TABLE, "id": "big", "rows": TABLE["rows"] * 1000}
    long_running = SqlRewards({"big": big}, [EOS])
    columns = dict(table_id=["big"], sql=[json.dumps(GOLD)], target=[GOLD_TEXT])
    assert long_running.execution([GOLD_TEXT + ".0"], **columns) == [1.0]
    monkeypatch.setattr(wikisql_sql, "QUERY_TIME_LIMIT_S", -1.0)
    assert long_running.execution([GOLD_TEXT + ".00"], **columns) == [0.0]
    # a table that breaks the executor (rows of the wrong width), and a question whose table is unknown
    broken = SqlRewards({"t": {**TABLE, "id": "t", "rows": [["Ann"]]}}, [EOS])
    assert broken.execution([GOLD_TEXT], table_id=["t"], sql=[json.dumps(GOLD)], target=[GOLD_TEXT]) == [0.0]
    assert broken.execution([GOLD_TEXT], table_id=["missing"], sql=[json.dumps(GOLD)], target=[GOLD_TEXT]) == [0.0]


def test_reward_weights_are_parsed_and_checked():
    assert reward_weights(DEFAULT_REWARD_WEIGHTS) == {"execution": 1.0, "parses": 0.25, "stops": 0.25}
    assert reward_weights("execution=1") == {"execution": 1.0, "parses": 0.0, "stops": 0.0}
    chosen, weights = SqlRewards({}, [EOS]).functions(reward_weights("execution=2,stops=0.5"))
    assert [f.__name__ for f in chosen] == ["execution", "stops"] and weights == [2.0, 0.5]
    for bad in ("execution=x", "speed=1", "execution=-1", "stops=1"):
        with pytest.raises(TextsqlError, match="reward"):
            reward_weights(bad)
    with pytest.raises(TextsqlError, match="--num_generations must be at least 2"):
        GrpoArguments(stage="grpo", num_generations=1).check_grpo()
    with pytest.raises(TextsqlError, match="--stage must be one of sft, grpo"):
        GrpoArguments(stage="ppo").check_grpo()
