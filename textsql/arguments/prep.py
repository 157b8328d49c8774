"""`textsql prep`'s arguments: where the questions come from, the tokenizer, the source format, the folder written."""

from __future__ import annotations

from dataclasses import dataclass, field

from textsql.arguments import same_flag
from textsql.arguments.data import ModelArguments
from textsql.errors import TextsqlError
from textsql.families import AUTO, best_settings_help
from textsql.paths import in_project
from textsql.wikisql.cells import DEFAULT_MAX_VALUES, DEFAULT_VALUES_PER_COLUMN
from textsql.wikisql.format import SOURCE_FORMATS, VALUES_FORMAT
from textsql.wikisql.release import SAMPLE_SOURCE

OVERLONG_POLICIES = ("error", "truncate", "drop")


PROMPT_FORMATS = ("plain", "chat")


@dataclass
class PrepArguments:
    """Where the data comes from, how it is tokenized, and where it is saved."""

    source: str = field(
        metadata={
            "help": f"'{SAMPLE_SOURCE}' for real WikiSQL lines shipped with textsql (1,000 train and the first 1,062 "
            "test questions with their tables; simple tables, no SUM/AVG); 'generate' for built-in generated "
            "WikiSQL-format data; a folder or .tar.bz2 of the original WikiSQL release (train.jsonl, "
            "train.tables.jsonl, dev.jsonl, ...); or a hub dataset name of a parquet copy (the script-based 'wikisql' "
            "cannot be loaded by current datasets)."
        }
    )
    model_id: str = same_flag(
        ModelArguments,
        "model_id",
        "The model to prepare for: hub name or local model folder (its config.json decides the family: "
        "T5 or a causal LM) and its tokenizer.",
    )
    output_dir: str = field(default="data/wikisql", metadata={"help": "Folder to save the tokenized DatasetDict in."})
    source_prefix: str = field(
        default="translate English to SQL: ",
        metadata={"help": "T5 task prefix put before every question (a causal LM reads a plain prompt instead)."},
    )
    source_format: str = field(
        default=AUTO,
        metadata={
            "help": f"What the model reads: {best_settings_help('source_format')}; 'question' (the walkthrough's "
            "format); 'question+header': the question followed by the table's column names ('... columns: Year | "
            "Team | Wins'); or 'question+header+values': also the table's cells that match words of the question "
            "(exact or fuzzy), each with its column ('... values: Team = Utah Jazz | Year = 1998'; none: no values "
            "section). The last two need the tables."
        },
    )
    values_per_column: int = field(
        default=DEFAULT_VALUES_PER_COLUMN,
        metadata={
            "help": "With --source_format question+header+values: at most this many matching cells listed per column "
            "(the best matches: exact before fuzzy, then the column the question names, then the longer cell)."
        },
    )
    max_values: int = field(
        default=DEFAULT_MAX_VALUES,
        metadata={
            "help": "With --source_format question+header+values: at most this many cells listed in all. A source over "
            "--max_source_length loses its values first (worst match first), then (a causal LM's) columns."
        },
    )
    prompt_format: str = field(
        default="plain",
        metadata={
            "help": "A causal LM's prompt: plain ('### Question:', '### Columns:' and '### SQL:' lines) or chat: those "
            "lines as the user's message in the tokenizer's chat template, the SQL as the assistant's answer (only "
            "for tokenizers that have a template; T5 reads its prefixed source either way)."
        },
    )
    max_source_length: int = field(
        default=512, metadata={"help": "Longest question in tokens (prefix included; a causal LM's whole prompt)."}
    )
    max_target_length: int = field(
        default=256, metadata={"help": "Longest SQL target in tokens (a causal LM's with its end-of-sequence token)."}
    )
    overlong: str = field(
        default="error",
        metadata={
            "help": "What to do with examples longer than the max lengths: error, truncate or drop (always reported). "
            "A source's listed cell values (question+header+values) are dropped first, then for a causal LM the "
            "prompt's column list is cut, never the SQL; what still does not fit is an error, or dropped with "
            "truncate and drop."
        },
    )
    max_examples_per_split: int | None = field(
        default=None, metadata={"help": "Keep at most this many examples per split (quick runs)."}
    )
    generate_train_tables: int = field(
        default=300,
        metadata={"help": "With --source generate: tables in the train split (dev and test get a fifth each)."},
    )
    generate_questions_per_table: int = field(
        default=10, metadata={"help": "With --source generate: questions per table."}
    )
    seed: int = field(default=0, metadata={"help": "Seed for the generator (and for --validation_from_train)."})
    validation_from_train: float | None = field(
        default=None,
        metadata={
            "help": "For a source without a validation (dev) split: hold out this fraction of the train split's "
            "tables as validation, so training can evaluate. Default: 0.1 for such a source (said in one line), "
            "nothing for a source with its own dev split; 0: none (then train with --eval_strategy no)."
        },
    )
    generated_train: int = field(
        default=0,
        metadata={
            "help": "Add about this many generated questions (textsql's WikiSQL-format generator, on generated tables "
            "of their own) to the train split of the source, e.g. real release files; validation and test stay the "
            "source's. 0: none. bench/real_model.py measures whether it helps."
        },
    )
    overwrite: bool = field(default=False, metadata={"help": "Replace a prepared dataset already in output_dir."})

    def __post_init__(self):
        # Relative folders mean the project's (textsql.paths.in_project): a notebook and the command see the same data.
        self.output_dir = in_project(self.output_dir)
        self.model_id = in_project(self.model_id, only_if_exists=True)
        if self.source != SAMPLE_SOURCE:  # the name is the shipped lines wherever the command runs
            self.source = in_project(self.source, only_if_exists=True)
        if self.source_format not in (AUTO, *SOURCE_FORMATS):
            raise TextsqlError(
                f"--source_format must be one of {', '.join((AUTO, *SOURCE_FORMATS))}, not '{self.source_format}'."
            )
        if self.values_per_column < 1 or self.max_values < 1:
            raise TextsqlError(
                f"--values_per_column and --max_values bound the cells listed with --source_format {VALUES_FORMAT}: "
                f"at least 1 each, not {self.values_per_column} and {self.max_values}."
            )
        if self.prompt_format not in PROMPT_FORMATS:
            raise TextsqlError(
                f"--prompt_format must be one of {', '.join(PROMPT_FORMATS)}, not '{self.prompt_format}'."
            )
        if self.overlong not in OVERLONG_POLICIES:
            raise TextsqlError(f"--overlong must be one of {', '.join(OVERLONG_POLICIES)}, not '{self.overlong}'.")
        if self.max_source_length < 8 or self.max_target_length < 8:
            raise TextsqlError("--max_source_length and --max_target_length must be at least 8 tokens.")
        if self.max_examples_per_split is not None and self.max_examples_per_split < 1:
            raise TextsqlError("--max_examples_per_split must be a positive number (or left out for all).")
        if self.validation_from_train is not None and not 0 <= self.validation_from_train < 0.5:
            raise TextsqlError(
                f"--validation_from_train is the fraction of train held out as validation, from 0 to below 0.5 "
                f"(e.g. 0.1), not {self.validation_from_train!r}."
            )
        if self.generated_train < 0:
            raise TextsqlError(f"--generated_train is a number of questions (0: none), not {self.generated_train}.")
        if self.generated_train and self.source == "generate":
            raise TextsqlError(
                "--generated_train adds generated questions to another source; --source generate is generated already "
                "(--generate_train_tables sets its size). Leave --generated_train out."
            )
        if self.generate_train_tables < 5 or self.generate_questions_per_table < 1:
            raise TextsqlError(
                "--generate_train_tables must be at least 5 and --generate_questions_per_table at least 1."
            )
