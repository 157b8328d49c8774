"""The GRPO stage's arguments and its SQL rewards, in one place: a completion executed on its question's table against
the gold query's result (the main reward), parsed as WikiSQL SQL, and stopped at EOS without trailing text, scored by
WikiSQL's own parser and executor (textsql.wikisql.sql)."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from functools import lru_cache

from textsql.errors import TextsqlError
from textsql.wikisql.sql import score_prediction

logger = logging.getLogger(__name__)

STAGES = ("sft", "grpo")
REWARDS = ("execution", "parses", "stops")
# execution carries the task; a query that parses or stops cleanly is worth a little even when its answer is wrong, so
# that a group whose completions are all wrong still has a signal (bench/grpo.py measured these against execution alone).
DEFAULT_REWARD_WEIGHTS = "execution=1.0,parses=0.25,stops=0.25"
LOWEST_REWARD = 0.0  # what a completion earns that does not parse, run or stop: never more than a wrong answer


@dataclass
class GrpoArguments:
    """`textsql train --stage grpo`: reinforcement learning rewarded by executing the generated SQL (TRL's GRPO)."""

    stage: str = field(
        default="sft",
        metadata={
            "help": "sft: supervised fine-tuning on the gold SQL (default). grpo: group relative policy optimization "
            "from a finished run (--model_id RUN_FOLDER: a LoRA run continues its adapter, a full or merged one "
            "trains whole), rewarded by executing each completion on its table (docs/grpo.md); causal LMs only."
        },
    )
    num_generations: int = field(
        default=8, metadata={"help": "--stage grpo: completions sampled per prompt (a group); at least 2."}
    )
    max_completion_length: int = field(
        default=64, metadata={"help": "--stage grpo: longest completion in tokens (WikiSQL's SQL: p99 about 40)."}
    )
    temperature: float = field(default=1.0, metadata={"help": "--stage grpo: sampling temperature of completions."})
    beta: float = field(
        default=0.0,
        metadata={"help": "--stage grpo: weight of the KL term against the starting model (0: none, TRL's default)."},
    )
    reward_weights: str = field(
        default=DEFAULT_REWARD_WEIGHTS,
        metadata={
            "help": "--stage grpo: each reward's weight, 'execution=1.0,parses=0.25,stops=0.25': execution (the "
            "completion's result on the table equals the gold query's), parses (it reads as WikiSQL SQL over the "
            "table's columns), stops (it ends at EOS with nothing after the query). 0 leaves one out."
        },
    )

    def check_grpo(self) -> None:
        if self.stage not in STAGES:
            raise TextsqlError(f"--stage must be one of {', '.join(STAGES)}, not '{self.stage}'.")
        if self.stage != "grpo":
            return
        if self.num_generations < 2:
            raise TextsqlError(
                f"--num_generations must be at least 2 (GRPO compares the completions of one prompt), not "
                f"{self.num_generations}."
            )
        if self.max_completion_length < 8 or not self.temperature > 0 or self.beta < 0:
            raise TextsqlError(
                "--max_completion_length must be at least 8, --temperature above 0 and --beta at least 0."
            )
        reward_weights(self.reward_weights)

    def grpo_settings(self) -> dict | None:
        """What a run summary records of the stage (None for supervised fine-tuning)."""
        if self.stage != "grpo":
            return None
        keys = ("num_generations", "max_completion_length", "temperature", "beta")
        return {
            "stage": "grpo",
            **{key: getattr(self, key) for key in keys},
            "rewards": reward_weights(self.reward_weights),
        }


def reward_weights(text: str) -> dict[str, float]:
    """{reward: weight} from 'execution=1,parses=0.25,stops=0.25'; a reward left out weighs 0."""
    weights = dict.fromkeys(REWARDS, 0.0)
    for part in filter(None, (p.strip() for p in str(text).split(","))):
        name, _, value = part.partition("=")
        try:
            weight = float(value)
        except ValueError:
            weight = None
        if name.strip() not in weights or weight is None or weight < 0:
            raise TextsqlError(
                f"--reward_weights takes name=weight pairs of the rewards {', '.join(REWARDS)} with weights of 0 or "
                f"more, e.g. '{DEFAULT_REWARD_WEIGHTS}'; '{part}' is not one."
            )
        weights[name.strip()] = weight
    if not weights["execution"] and not weights["parses"]:
        raise TextsqlError(
            f"--reward_weights '{text}' rewards neither execution nor parsing: GRPO would learn nothing about SQL. "
            f"Give execution a weight, e.g. '{DEFAULT_REWARD_WEIGHTS}'."
        )
    return weights


def sql_text(completion: str) -> str:
    """A completion as textsql scores generated SQL: runs of whitespace collapsed (textsql.evaluate.generate_sql)."""
    return " ".join(str(completion).split())


class SqlRewards:
    """The reward functions GRPOTrainer calls with each batch's completions and the dataset's columns (table_id, sql:
    the gold query as JSON, target: the gold SQL text), one float per completion. A completion that breaks the parser or
    the executor, or runs past the executor's time limit, gets LOWEST_REWARD; training never stops on it."""

    def __init__(self, tables: dict[str, dict], eos_token_ids):
        self.tables = tables
        self.eos_token_ids = set(eos_token_ids)

        @lru_cache(maxsize=4096)  # execution and parses read the same completion: parsed once
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

    def parses(self, completions, table_id, sql, target, **_) -> list[float]:
        """1 where the completion reads as WikiSQL SQL over the table's columns."""
        return [float(bool(s and s["parsed"] is not None)) for s in self._each(completions, table_id, sql, target)]

    def stops(self, completions, completion_ids, **_) -> list[float]:
        """1 where the completion ended at EOS (not at the length limit) and holds one line: nothing after the query."""
        return [
            float(bool(ids) and ids[-1] in self.eos_token_ids and "\n" not in str(text).strip())
            for text, ids in zip(completions, completion_ids)
        ]

    def functions(self, weights: dict[str, float]) -> tuple[list, list[float]]:
        """(the reward functions with a weight above 0, their weights), in REWARDS' order; each named as TRL logs it
        (rewards/<name>/mean)."""
        chosen = [name for name in REWARDS if weights.get(name)]
        return [getattr(self, name) for name in chosen], [weights[name] for name in chosen]
