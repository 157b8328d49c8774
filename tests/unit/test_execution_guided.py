"""Execution-guided decoding's choice, on planted beams over real WikiSQL tables: where the top beam does not execute
(or answers nothing), a later beam that does is taken, and the answers it fixes and breaks against greedy's are the
questions planted so (a choice that always kept the top beam fails here: every other test's beams agree with it)."""

import pytest

from textsql.evaluate import ScoringSet, compare_with_greedy, score_candidates
from textsql.wikisql.format import render_sql
from textsql.wikisql.release import SAMPLE_SOURCE, load_wikisql
from textsql.wikisql.sql import executes_plausibly

PER_GROUP = 6


@pytest.fixture(scope="module")
def planted():
    """(scoring, candidates, greedy answers, the questions of each group): real test questions without aggregation
    and with a condition, in groups of PER_GROUP, each given three beams and a greedy answer:

    - unparsable: the top beam is no query; the second is the gold query (greedy wrote the top beam): fixed;
    - empty: the top beam parses but answers nothing (its condition holds no cell); then gold: fixed;
    - kept: the top beam is gold (so is greedy): unchanged;
    - broken: the top beam is a wrong query that executes (another column selected), gold second; greedy wrote gold;
    - none_execute: no beam executes: the top one is kept (greedy wrote it)."""
    data = load_wikisql(SAMPLE_SOURCE)  # the real lines shipped in the package
    examples = [e for e in data.splits["test"] if e.sql["agg"] == 0 and e.sql["conds"]]
    groups = ("unparsable", "empty", "kept", "broken", "none_execute")
    chosen = examples[: PER_GROUP * len(groups)]
    candidates, greedy, members = [], [], {g: [] for g in groups}
    for n, example in enumerate(chosen):
        group, table = groups[n // PER_GROUP], data.tables[example.table_id]
        gold = example.target
        nothing = render_sql(
            dict(example.sql, conds=[[example.sql["conds"][0][0], 0, "no such cell zzqx"]]), table["header"]
        )
        other = render_sql(dict(example.sql, sel=(example.sql["sel"] + 1) % len(table["header"])), table["header"])
        garbage = "SELECT FROM WHERE"
        beams = {
            "unparsable": [garbage, gold, other],
            "empty": [nothing, gold, garbage],
            "kept": [gold, other, garbage],
            "broken": [other, gold, garbage],
            "none_execute": [garbage, nothing, "SELECT no column FROM table"],
        }[group]
        candidates.append(beams)
        greedy.append(gold if group in ("kept", "broken") else beams[0])
        members[group].append(example.question)
    scoring = ScoringSet(
        sources=[e.question for e in chosen],
        questions=[e.question for e in chosen],
        table_ids=[e.table_id for e in chosen],
        gold_texts=[e.target for e in chosen],
        gold_queries=[e.sql for e in chosen],
        tables=data.tables,
    )
    return scoring, candidates, greedy, members


def test_the_planted_beams_are_what_their_group_says(planted):
    """The premise: which planted beams execute plausibly on their real tables."""
    scoring, candidates, _, members = planted
    for question, beams, table_id in zip(scoring.questions, candidates, scoring.table_ids):
        group = next(g for g, questions in members.items() if question in questions)
        runs = [executes_plausibly(text, scoring.tables[table_id]) for text in beams]
        expected = {
            "unparsable": [False, True, True],
            "empty": [False, True, False],
            "kept": [True, True, False],
            "broken": [True, True, False],
            "none_execute": [False, False, False],
        }[group]
        assert runs == expected, (group, beams)


def test_execution_guided_takes_the_first_beam_that_executes_and_says_what_it_fixed_and_broke(planted):
    scoring, candidates, greedy, members = planted
    records, metrics = score_candidates(scoring, candidates, "constrained+execution_guided", 3)
    compare_with_greedy(scoring, records, metrics, candidates, greedy)
    by_question = {r["question"]: r for r in records}
    for question in members["unparsable"] + members["empty"]:
        assert by_question[question]["candidate_rank"] == 1 and by_question[question]["decoding_changed"], question
    for question in members["kept"] + members["broken"] + members["none_execute"]:
        assert by_question[question]["candidate_rank"] == 0 and not by_question[question]["decoding_changed"]
    fixed = {r["question"] for r in records if r["execution_match"] and r["greedy_execution_match"] is False}
    broken = {r["question"] for r in records if r["greedy_execution_match"] and r["execution_match"] is False}
    assert fixed == set(members["unparsable"] + members["empty"])
    assert broken == set(members["broken"])
    block = metrics["decoding"]
    assert block["changed"] == 2 * PER_GROUP
    assert block["against_greedy"] == {"fixed": 2 * PER_GROUP, "broken": PER_GROUP, "net": PER_GROUP}
    # the beams' top against greedy loses the broken group; the choice among them fixes the first two
    assert block["top_candidate_against_greedy"] == {"fixed": 0, "broken": PER_GROUP, "net": -PER_GROUP}
    assert block["choice_against_top_candidate"] == {"fixed": 2 * PER_GROUP, "broken": 0, "net": 2 * PER_GROUP}
    right = len(members["unparsable"] + members["empty"] + members["kept"])
    assert metrics["execution_accuracy"] == pytest.approx(right / len(records))


@pytest.mark.parametrize("decoding", ["greedy", "constrained"])
def test_without_execution_guidance_the_top_beam_is_the_answer(planted, decoding):
    scoring, candidates, _, _ = planted
    records, metrics = score_candidates(scoring, candidates, decoding, 3)
    assert all(r["candidate_rank"] == 0 and not r["decoding_changed"] for r in records)
    assert [r["predicted_sql"] for r in records] == [beams[0] for beams in candidates]
    assert metrics["decoding"]["changed"] == 0
