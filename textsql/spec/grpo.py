"""The GRPO stage's flags (--stage, --num_generations, --reward_weights, ...): their defaults and checks."""

from __future__ import annotations

from dataclasses import dataclass, field

from textsql.errors import TextsqlError

STAGES = ("sft", "grpo")
REWARDS = ("execution", "parses", "stops")
# execution carries the task; a query that parses or stops cleanly is worth a little even when its answer is wrong, so
# that a group whose completions are all wrong still has a signal (bench/grpo.py measured these against execution alone).
DEFAULT_REWARD_WEIGHTS = "execution=1.0,parses=0.25,stops=0.25"


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
