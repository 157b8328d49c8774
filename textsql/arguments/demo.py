"""`textsql demo`'s arguments: the family of the tiny model, the data it generates, how long it trains."""

from __future__ import annotations

from dataclasses import dataclass, field

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


@dataclass
class DemoArguments:
    """What the demo builds and how long it trains."""

    workdir: str = field(default=DEMO_DIR, metadata={"help": "Everything the demo writes goes under this folder."})
    deepspeed: str = field(
        default="zero2",
        metadata={"help": "Shipped strategy (zero1, zero2, zero3_offload), a dsconfig file, or 'none'."},
    )
    family: str = field(
        default="t5",
        metadata={
            "help": "t5 (a tiny T5: an encoder reads the question, a decoder writes the SQL) or causal (a tiny "
            "decoder-only LM shaped like Qwen2, its byte-level BPE tokenizer trained here, reads a prompt and continues "
            "it with the SQL)."
        },
    )
    train_tables: int = field(
        default=300, metadata={"help": "Generated training tables (validation and test get a fifth each)."}
    )
    questions_per_table: int = field(default=10, metadata={"help": "Generated questions per table."})
    epochs: float = field(default=8.0, metadata={"help": "Training epochs (about 1500 steps with the defaults)."})
    batch_size: int = field(
        default=16,
        metadata={"help": "Per-device training batch size (small: a tiny model learns from the number of updates)."},
    )
    d_model: int = field(default=128, metadata={"help": "Width of the tiny model."})
    num_layers: int = field(
        default=2,
        metadata={
            "help": "Layers of the tiny model: the T5's encoder and decoder each, the causal LM's decoder (about the "
            "same training time)."
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
        if self.family not in DEMO_FAMILIES:
            raise TextsqlError(f"--family is one of {', '.join(DEMO_FAMILIES)}, not '{self.family}'.")
        if self.source_format not in (AUTO, *SOURCE_FORMATS) or self.decoding not in DECODING_CHOICES:
            raise TextsqlError(
                f"--source_format is one of {', '.join((AUTO, *SOURCE_FORMATS))} and --decoding one of "
                f"{', '.join(DECODING_CHOICES)}."
            )
        if self.train_tables < 5 or self.questions_per_table < 1 or self.epochs <= 0 or self.batch_size < 1:
            raise TextsqlError("Demo sizes must be positive (and at least 5 training tables).")
