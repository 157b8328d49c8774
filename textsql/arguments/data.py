"""Which model and which prepared dataset `textsql train` trains on, and how its validation SQL is scored: the flags
plan and tune take too (no transformers imported, so `textsql plan --help` stays light)."""

from __future__ import annotations

from dataclasses import dataclass, field

from textsql.arguments.decoding import AUTO_DECODING_HELP, check_decoding
from textsql.errors import TextsqlError
from textsql.families import AUTO
from textsql.paths import in_project


@dataclass
class ModelArguments:
    """Which model to fine-tune."""

    model_id: str = field(
        default="t5-small",
        metadata={
            "help": "Hub name (t5-small, t5-large, t5-3b; a causal LM such as Qwen/Qwen2.5-0.5B) or a local model "
            "folder; its config.json decides the family (docs/causal-lm.md)."
        },
    )

    def __post_init__(self):
        self.model_id = in_project(self.model_id, only_if_exists=True)  # a folder of the project, from any subfolder


@dataclass
class DataArguments:
    """Which prepared dataset to train on."""

    dataset_dir: str = field(default="data/wikisql", metadata={"help": "Folder written by `textsql prep`."})
    max_train_samples: int | None = field(default=None, metadata={"help": "Train on at most this many examples."})
    max_eval_samples: int | None = field(
        default=None, metadata={"help": "Evaluate on at most this many validation examples."}
    )
    execution_accuracy_samples: int = field(
        default=200,
        metadata={
            "help": "Generate SQL (batched) for the first N validation questions and score it as WikiSQL does, once at "
            "the end of training on the final weights: execution accuracy in run_summary.json, textsql report, "
            "TensorBoard (eval/execution_accuracy) and MLflow. Costs one generation pass over N questions (its time "
            "in docs/training.md); 0 turns it off. Nothing is scored without a validation split."
        },
    )
    execution_accuracy_each_evaluation: bool = field(
        default=False,
        metadata={
            "help": "Score those N questions at every evaluation (--eval_strategy) too, not only at the end: a curve "
            "of execution accuracy, one generation pass per evaluation."
        },
    )
    execution_accuracy_decoding: str = field(
        default=AUTO,
        metadata={
            "help": f"Decoding for that score: {AUTO_DECODING_HELP}; greedy, execution_guided (the best of "
            "--execution_accuracy_num_beams beams that executes), constrained (only queries over the question's table) or "
            "constrained+execution_guided; see textsql infer --decoding."
        },
    )
    execution_accuracy_num_beams: int = field(
        default=1, metadata={"help": "Beams for that score (at least 2 with the execution_guided decodings)."}
    )

    def __post_init__(self):
        self.dataset_dir = in_project(self.dataset_dir)  # the project's data/, from notebooks/ too
        if self.execution_accuracy_samples < 0:
            raise TextsqlError(
                "--execution_accuracy_samples must be 0 (off) or a positive number of validation questions."
            )
        check_decoding(self.execution_accuracy_decoding, self.execution_accuracy_num_beams, "--execution_accuracy_")
        for name in ("max_train_samples", "max_eval_samples"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise TextsqlError(f"--{name} must be a positive number (or left out for all).")
