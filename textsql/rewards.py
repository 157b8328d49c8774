"""The GRPO stage's SQL rewards (its flags: textsql.arguments.grpo), Arctic-Text2SQL-R1's 1/0.1/0: 1 for a completion whose
result on its question's table is the gold query's (execution, the main signal), a small bonus for a wrong one that
still parses, executes and stops cleanly (executes), 0 otherwise, scored by WikiSQL's own parser and executor
(textsql.wikisql.sql)."""

from __future__ import annotations

import json
import logging
from functools import lru_cache

from textsql.arguments.grpo import REWARDS
from textsql.wikisql.sql import score_prediction

logger = logging.getLogger(__name__)

LOWEST_REWARD = 0.0  # what a completion earns that does not parse, run or stop: never more than a wrong answer


def sql_text(completion: str) -> str:
    """A completion as textsql scores generated SQL: runs of whitespace collapsed (textsql.evaluate.generate_sql)."""
    return " ".join(str(completion).split())


class SqlRewards:
    """The reward functions GRPOTrainer calls with each batch's completions and the dataset's columns (table_id, sql:
    the gold query as JSON, target: the gold SQL text), one float per completion. A completion that breaks the parser or
    the executor, or runs past the executor's time limit, gets LOWEST_REWARD from both; training never stops on it.
    The two never both reward a completion: weighted 1 and 0.1 they sum to 1 (right), 0.1 (wrong but a clean,
    executable query) or 0."""

    def __init__(self, tables: dict[str, dict], eos_token_ids):
        self.tables = tables
        self.eos_token_ids = set(eos_token_ids)

        @lru_cache(maxsize=4096)  # execution and executes read the same completion: parsed and executed once
        def scored(text: str, table_id: str, gold_sql: str, target: str) -> dict | None:
            try:
                return score_prediction(text, target, json.loads(gold_sql) if gold_sql else None, self.tables[table_id])
            except Exception as error:  # noqa: BLE001  (a reward never stops training; the log says why)
                logger.warning(
                    "A completion could not be scored (%s: %s); it gets the lowest reward.", type(error).__name__, error
                )
                return None

        self._scored = scored

    def _each(self, completions, table_id, sql, target):
        return [self._scored(sql_text(c), t, s, g) for c, t, s, g in zip(completions, table_id, sql, target)]

    def execution(self, completions, table_id, sql, target, **_) -> list[float]:
        """1 where executing the completion on its table gives the gold query's result (WikiSQL's execution accuracy)."""
        return [float(bool(s and s["execution_match"])) for s in self._each(completions, table_id, sql, target)]

    def executes(self, completions, table_id, sql, target, completion_ids=None, **_) -> list[float]:
        """1 where the completion is wrong yet plausible: it reads as WikiSQL SQL over the table's columns, executes
        without error or time-out, and ended at EOS on one line (nothing after the query). 0 for a right one (execution
        rewards it), so the weighted sum never ranks a wrong query near a right one."""
        ids = completion_ids if completion_ids is not None else [None] * len(completions)
        return [
            float(
                bool(s and s["parsed"] is not None and s["execution_error"] is None and not s["execution_match"])
                and self.stopped(text, each)
            )
            for s, text, each in zip(self._each(completions, table_id, sql, target), completions, ids)
        ]

    def stopped(self, text: str, ids) -> bool:
        """Whether a completion ended at EOS (not at the length limit; unknown ids count as ended) on one line."""
        ended = ids is None or (bool(ids) and ids[-1] in self.eos_token_ids)
        return ended and "\n" not in str(text).strip()

    def functions(self, weights: dict[str, float]) -> tuple[list, list[float]]:
        """(the reward functions with a weight above 0, their weights), in REWARDS' order (execution first: its column is
        what the zero-signal share is computed on); each named as TRL logs it (rewards/<name>/mean)."""
        chosen = [name for name in REWARDS if weights.get(name)]
        return [getattr(self, name) for name in chosen], [weights[name] for name in chosen]
