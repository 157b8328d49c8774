"""GRPO's SQL rewards (textsql.rewards: 1/0.1/0) on right, wrong, unparsable, non-stopping and failing completions,
scored by WikiSQL's own parser and executor against a hand-checked table; the weights' parsing; what group scaling makes
of them; the execution-based zero-signal share; the run summary's curve."""

import json

import pytest

from textsql.arguments.grpo import DEFAULT_REWARD_WEIGHTS, REWARDS, GrpoArguments, reward_weights
from textsql.errors import TextsqlError
from textsql.rewards import SqlRewards
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
    return rewards.execution(completions, **columns), rewards.executes(completions, completion_ids=ids, **columns)


def weighted(completions, ids=None, text=DEFAULT_REWARD_WEIGHTS):
    """The weighted sum TRL computes from the chosen functions."""
    weights = reward_weights(text)
    return [
        round(sum(weights[name] * r for name, r in zip(REWARDS, each)), 6)
        for each in zip(*rewards_of(completions, ids))
    ]


def test_right_wrong_and_unparsable_completions():
    execution, executes = rewards_of(
        [
            GOLD_TEXT,  # the gold text itself
            "SELECT Player FROM table WHERE Goals > 4.0",  # another text with the same result: right by execution
            "SELECT Team FROM table WHERE Goals > 4",  # parses, another result
            "SELECT Player FROM table WHERE Shoe size > 4",  # no such column: does not parse
            "```sql\nSELECT Player.Name FROM Players```",  # what the model writes zero-shot
        ]
    )
    assert execution == [1.0, 1.0, 0.0, 0.0, 0.0]
    # the bonus only for the wrong query that parses and executes: never added to a right one
    assert executes == [0.0, 0.0, 1.0, 0.0, 0.0]
    assert weighted(["SELECT Team FROM table WHERE Goals > 4", GOLD_TEXT, "SELECT Shoe FROM x"]) == [0.1, 1.0, 0.0]


def test_the_bonus_needs_a_clean_stop():
    wrong = "SELECT Team FROM table WHERE Goals > 4"
    completions = [wrong, wrong, wrong + "\n\nThis query selects the teams"]
    _, executes = rewards_of(completions, ids=[[5, 6, EOS], [5, 6, 7], [5, 6, 8, 9, EOS]])
    # EOS reached; cut at the length limit (no EOS); EOS after an explanation
    assert executes == [1.0, 0.0, 0.0]


def test_under_group_scaling_the_bonus_never_rivals_right_against_wrong():
    """The issue's case: 8 right answers, one of which ran on after the query, against 7 right and 1 wrong. With the
    old 0.25-weighted parses/stops terms both gave the same advantages (-2.47/+0.35); now the first group's outlier is
    simply wrong (what runs on does not parse), and a right answer always outranks any wrong one within a group."""
    import torch

    wrong = "SELECT Team FROM table WHERE Goals > 4"
    group = [GOLD_TEXT] * 6 + [wrong, "SELECT Shoe FROM x"]
    rewards = torch.tensor(weighted(group))
    advantages = (rewards - rewards.mean()) / (rewards.std() + 1e-4)  # TRL's scale_rewards="group"
    assert (advantages[:6] > 0).all() and (advantages[6:] < 0).all()
    # the bonus moves a wrong query above an unparsable one by a tenth of what a right answer earns
    bonus, right = (advantages[6] - advantages[7]).item(), (advantages[0] - advantages[7]).item()
    assert bonus == pytest.approx(0.1 * right, rel=1e-3)


def test_a_query_that_breaks_the_executor_or_runs_too_long_gets_the_lowest_reward(monkeypatch):
    # a real column holding no number for the value: WikiSQL's engine raises; textsql counts it wrong
    execution, executes = rewards_of(["SELECT Player FROM table WHERE Goals > many"])
    assert execution == [0.0] and executes == [0.0]  # it parses, but breaks the executor: the lowest reward
    # a query interrupted by the executor's time limit (SQLite's progress handler, asked every 1,000 instructions: a
    # table of 3,000 rows takes more): wrong, and training goes on
    big = {**TABLE, "id": "big", "rows": TABLE["rows"] * 1000}
    long_running = SqlRewards({"big": big}, [EOS])
    columns = dict(table_id=["big"], sql=[json.dumps(GOLD)], target=[GOLD_TEXT])
    assert long_running.execution([GOLD_TEXT + ".0"], **columns) == [1.0]
    monkeypatch.setattr(wikisql_sql, "QUERY_TIME_LIMIT_S", -1.0)
    assert long_running.execution([GOLD_TEXT + ".00"], **columns) == [0.0]
    assert long_running.executes([GOLD_TEXT + ".000"], **columns) == [0.0]  # timed out: no bonus either
    # a table that breaks the executor (rows of the wrong width), and a question whose table is unknown
    broken = SqlRewards({"t": {**TABLE, "id": "t", "rows": [["Ann"]]}}, [EOS])
    assert broken.execution([GOLD_TEXT], table_id=["t"], sql=[json.dumps(GOLD)], target=[GOLD_TEXT]) == [0.0]
    assert broken.execution([GOLD_TEXT], table_id=["missing"], sql=[json.dumps(GOLD)], target=[GOLD_TEXT]) == [0.0]


def test_reward_weights_are_parsed_and_checked():
    assert reward_weights(DEFAULT_REWARD_WEIGHTS) == {"execution": 1.0, "executes": 0.1}
    assert reward_weights("execution=1") == {"execution": 1.0, "executes": 0.0}
    chosen, weights = SqlRewards({}, [EOS]).functions(reward_weights("execution=2,executes=0.5"))
    assert [f.__name__ for f in chosen] == ["execution", "executes"] and weights == [2.0, 0.5]
    for bad in ("execution=x", "speed=1", "execution=-1", "executes=0.1", "parses=0.25", "execution=1,executes=0.6"):
        with pytest.raises(TextsqlError, match="reward"):
            reward_weights(bad)
    with pytest.raises(TextsqlError, match="--num_generations must be at least 2"):
        GrpoArguments(stage="grpo", num_generations=1).check_grpo()
    with pytest.raises(TextsqlError, match="--stage must be one of sft, grpo"):
        GrpoArguments(stage="ppo").check_grpo()
    with pytest.raises(TextsqlError, match="--loss_type must be one of"):
        GrpoArguments(stage="grpo", loss_type="ppo").check_grpo()
    with pytest.raises(TextsqlError, match="--scale_rewards must be one of group, batch, none"):
        GrpoArguments(stage="grpo", scale_rewards="True").check_grpo()


def test_the_schedule_defaults_to_constant_after_warm_up_for_grpo_only(tmp_path):
    from textsql.arguments.training import TextsqlTrainingArguments

    def args(**given):
        return TextsqlTrainingArguments(output_dir=str(tmp_path), **given)

    grpo = args(stage="grpo", warmup_steps=5, loss_type="dr_grpo", scale_rewards="batch", beta=0.001)
    assert grpo.lr_scheduler_type == "constant_with_warmup" and args().lr_scheduler_type == "linear"
    assert args(stage="grpo", lr_scheduler_type="cosine").lr_scheduler_type == "cosine"  # a flag given is honoured
    settings = grpo.grpo_settings()
    assert settings["lr_scheduler_type"] == "constant_with_warmup" and settings["warmup_steps"] == 5
    assert (settings["loss_type"], settings["scale_rewards"], settings["beta"]) == ("dr_grpo", "batch", 0.001)
    assert settings["mask_truncated_completions"] is False and settings["rewards"] == {
        "execution": 1.0,
        "executes": 0.1,
    }


def test_zero_signal_is_read_on_execution_and_the_summary_keeps_the_curve():
    import torch

    from textsql.run_summary import format_grpo
    from textsql.train.grpo import execution_zero_signal, grpo_figures

    # groups of 4: all right; mixed; all wrong (a bonus on one would make TRL's weighted share miss it)
    assert execution_zero_signal(torch.tensor([1.0, 1, 1, 1, 1, 0, 0, 1, 0, 0, 0, 0]), 4) == pytest.approx(2 / 3)
    history = [
        {"step": 1, "reward": 0.2, "rewards/execution/mean": 0.1, "frac_execution_zero_std": 0.5, "kl": 0.0},
        {"step": 1, "train_runtime": 3.0},
        {"step": 2, "reward": 0.6, "rewards/execution/mean": 0.55, "frac_execution_zero_std": 0.25, "kl": 0.01},
    ]
    figures = grpo_figures(history)
    assert [s["rewards/execution/mean"] for s in figures["steps"]] == [0.1, 0.55] and figures["logged_steps"] == 2
    assert figures["first_execution"] == 0.1 and figures["frac_execution_zero_std"] == 0.25
    assert "groups without signal 25%" in format_grpo(figures)
    # a summary written before schema 7: its weighted share, and no curve
    old = {
        "parent_run": None,
        "reward": 0.5,
        "first_reward": 0.4,
        "frac_reward_zero_std": 0.5,
        "rewards/parses/mean": 1,
    }
    assert "groups without signal 50%" in format_grpo(old)
