"""The GRPO stage's flags (--stage, --num_generations, --reward_weights, --loss_type, ...): their defaults and checks."""

from __future__ import annotations

from dataclasses import dataclass, field

from textsql.errors import TextsqlError

STAGES = ("sft", "grpo")
REWARDS = ("execution", "executes")
# Arctic-Text2SQL-R1's 1/0.1/0: execution carries the task; a wrong query that still parses, executes and stops cleanly
# earns a small bonus, so a group whose completions are all wrong keeps a little signal. Under TRL's group scaling a
# bonus as large as the 0.25-weighted parses/stops terms of before moved the model as hard as right-vs-wrong; the
# bonus must stay well below execution's weight (AUXILIARY_SHARE) so that within a group right always outranks wrong.
DEFAULT_REWARD_WEIGHTS = "execution=1.0,executes=0.1"
AUXILIARY_SHARE = 0.5  # the most the executes bonus may weigh against execution
LOSS_TYPES = ("dapo", "grpo", "dr_grpo", "bnpo", "cispo", "sapo")  # TRL 1.16's token-level losses
SCALE_REWARDS = ("group", "batch", "none")
# textsql's GRPO schedule when --lr_scheduler_type is left out: constant after --warmup_steps (a linear decay to 0
# over a short run left Adam's steps too small to move the model; published execution-reward runs keep it constant)
GRPO_LR_SCHEDULER = "constant_with_warmup"


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
        metadata={
            "help": "--stage grpo: weight of the KL term against the starting model (0: none and no reference model "
            "kept, TRL's default; SQL-R1 used 0.001)."
        },
    )
    reward_weights: str = field(
        default=DEFAULT_REWARD_WEIGHTS,
        metadata={
            "help": f"--stage grpo: each reward's weight, '{DEFAULT_REWARD_WEIGHTS}' (Arctic-Text2SQL-R1's 1/0.1/0): "
            "execution (1 where the completion's result on the table equals the gold query's), executes (1 where a "
            "wrong completion still parses as WikiSQL SQL over the table's columns, executes without error and ends "
            f"at EOS on one line). execution must weigh above 0; executes at most {AUXILIARY_SHARE:g} of it (0 "
            "leaves it out)."
        },
    )
    loss_type: str = field(
        default="dapo",
        metadata={
            "help": f"--stage grpo: TRL's loss aggregation, one of {', '.join(LOSS_TYPES)} (TRL's default dapo: "
            "token losses normalised by the active tokens of the accumulated batch)."
        },
    )
    scale_rewards: str = field(
        default="group",
        metadata={
            "help": "--stage grpo: how advantages are scaled, one of group (divided by each group's reward std, TRL's "
            "default: a group differing only by a small bonus moves the model as hard as right-vs-wrong), batch (by "
            "the batch's std), none (Dr. GRPO: not scaled)."
        },
    )
    grpo_questions_from: int = field(
        default=0,
        metadata={
            "help": "--stage grpo: train on the train split's questions from this index on (0: all of them). A "
            "supervised run given --max_train_samples N learned the first N; --grpo_questions_from N gives GRPO "
            "questions that run never saw (--max_train_samples then counts GRPO's questions from there)."
        },
    )
    learnable_only: bool = field(
        default=False,
        metadata={
            "help": "--stage grpo: before training, sample --learnable_samples completions of each train question at "
            "--temperature with the starting model, record each question's success rate (learnable.json in the run "
            "folder) and train only on questions with 0 < success < 1 (DAPO's dynamic sampling, filtered up front): "
            "the others' groups give no execution signal. The statistics go to the run summary either way it is set."
        },
    )
    learnable_samples: int = field(
        default=0,
        metadata={
            "help": "--stage grpo --learnable_only True: completions sampled per question (0: --num_generations)."
        },
    )
    mask_truncated_completions: bool = field(
        default=False,
        metadata={
            "help": "--stage grpo: leave completions cut at --max_completion_length out of the loss (DAPO's advice; "
            "TRL's default False)."
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
        if self.grpo_questions_from < 0:
            raise TextsqlError(f"--grpo_questions_from must be 0 or more, not {self.grpo_questions_from}.")
        if self.learnable_samples < 0 or self.learnable_samples == 1:
            raise TextsqlError(
                f"--learnable_samples must be 0 (--num_generations) or at least 2, not {self.learnable_samples}."
            )
        if self.loss_type not in LOSS_TYPES:
            raise TextsqlError(f"--loss_type must be one of {', '.join(LOSS_TYPES)}, not '{self.loss_type}'.")
        if self.scale_rewards not in SCALE_REWARDS:
            raise TextsqlError(
                f"--scale_rewards must be one of {', '.join(SCALE_REWARDS)}, not '{self.scale_rewards}'."
            )
        reward_weights(self.reward_weights)

    def grpo_settings(self) -> dict | None:
        """What a run summary records of the stage (None for supervised fine-tuning)."""
        if self.stage != "grpo":
            return None
        keys = (
            "num_generations",
            "max_completion_length",
            "temperature",
            "beta",
            "loss_type",
            "scale_rewards",
            "mask_truncated_completions",
            "learning_rate",
            "lr_scheduler_type",
            "warmup_steps",
            "learnable_only",
            "grpo_questions_from",
        )
        return {
            "stage": "grpo",
            **{key: _plain(getattr(self, key, None)) for key in keys},
            "rewards": reward_weights(self.reward_weights),
        }


def _plain(value):
    """An enum (the Trainer's SchedulerType once finalized) as its value: the summary is JSON."""
    return getattr(value, "value", value)


def reward_weights(text: str) -> dict[str, float]:
    """{reward: weight} from 'execution=1,executes=0.1'; a reward left out weighs 0."""
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
    if not weights["execution"]:
        raise TextsqlError(
            f"--reward_weights '{text}' gives execution no weight: GRPO would learn nothing about right answers. "
            f"Give it one, e.g. '{DEFAULT_REWARD_WEIGHTS}'."
        )
    if weights["executes"] > AUXILIARY_SHARE * weights["execution"]:
        raise TextsqlError(
            f"--reward_weights '{text}' weighs the executes bonus above {AUXILIARY_SHARE:g} of execution: a wrong "
            f"query would earn nearly as much as a right one. Keep it small, e.g. '{DEFAULT_REWARD_WEIGHTS}'."
        )
    return weights
