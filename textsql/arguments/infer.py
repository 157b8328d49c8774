"""`textsql infer`'s arguments: the model, the questions (a split or typed ones), the decoding, the files written."""

from __future__ import annotations

from dataclasses import dataclass, field

from textsql.arguments import same_flag
from textsql.arguments.data import DataArguments
from textsql.arguments.decoding import AUTO_DECODING_HELP, check_decoding
from textsql.errors import TextsqlError
from textsql.families import AUTO
from textsql.paths import in_project

DTYPES = ("float32", "bfloat16", "auto")


@dataclass
class InferArguments:
    """Which model, which questions, and how to decode."""

    model_dir: str = field(
        metadata={
            "help": "A fine-tuned model folder (the run folder of any strategy), a LoRA run's "
            "adapter folder (its base model loaded beside it; needs the peft extra) or a hub name."
        }
    )
    dataset_dir: str = same_flag(
        DataArguments, "dataset_dir", "Prepared dataset (textsql prep) holding the split and its tables."
    )
    split: str = field(default="test", metadata={"help": "Split to score: test, validation or train."})
    question: list[str] = field(
        default_factory=list,
        metadata={"help": "Questions typed by you, instead of a split: --question 'How many ...?' 'Which ...?'"},
    )
    table_id: str | None = field(
        default=None,
        metadata={"help": "With --question: the table the questions are about, to parse and execute the SQL."},
    )
    max_examples: int | None = field(default=None, metadata={"help": "Score only the first N examples of the split."})
    spread_examples: bool = field(
        default=False,
        metadata={
            "help": "With --max_examples: take the N examples evenly across the split instead of its first N (a "
            "release's slice starts with easier questions)."
        },
    )
    batch_size: int = field(default=64, metadata={"help": "Questions per generate() call."})
    decoding: str = field(
        default=AUTO,
        metadata={
            "help": f"{AUTO_DECODING_HELP}; greedy (with --num_beams > 1: the top beam of beam search), what the "
            "walkthrough did; execution_guided: of the "
            "--num_beams candidates, the best-scored one that parses against the table's header and executes (and, "
            "without aggregation, returns a row), the top beam when none does; constrained: greedy or beam search "
            "that may only write a WikiSQL query over the question's table (its columns, MAX MIN COUNT SUM AVG, = > <, "
            "values from the question or the column's cells), so every answer parses and executes; "
            "constrained+execution_guided: the first constrained beam that executes plausibly."
        },
    )
    num_beams: int = field(
        default=1,
        metadata={"help": "1 for greedy decoding, more for beam search (at least 2 with execution_guided decodings)."},
    )
    compare_to_greedy: bool = field(
        default=True,
        metadata={
            "help": "With any decoding but plain greedy, generate greedy answers too (one more pass) and report the "
            "decoding against them: answers fixed, broken and the net gain, the top beam's own gain and the "
            "execution filter's (eval_metrics.json's decoding block). --no_compare_to_greedy skips that pass."
        },
    )
    greedy_predictions: str | None = field(
        default=None,
        metadata={
            "help": "With --compare_to_greedy: the predictions.jsonl of a greedy `textsql infer` of this model over "
            "the same questions, compared against instead of generating greedy answers again."
        },
    )
    max_new_tokens: int = field(default=128, metadata={"help": "Longest SQL to generate, in tokens."})
    device: str = field(default="auto", metadata={"help": "auto (GPU when there is one), cuda, or cpu."})
    dtype: str = field(
        default="float32",
        metadata={
            "help": "Weights' dtype at inference: float32 (every strategy saves the model in it, so scores compare), "
            "bfloat16 (faster on Ampere and newer GPUs and on CPUs with AVX512-BF16 or AMX), or auto (bfloat16 where the device "
            "computes it natively, as training's --precision auto decides; float32 elsewhere). A quantized folder (textsql quantize) keeps its own."
        },
    )
    output_dir: str | None = field(
        default=None, metadata={"help": "Where predictions.jsonl and eval_metrics.json go (default: the model folder)."}
    )
    show_examples: int = field(default=5, metadata={"help": "How many examples to print in the walkthrough's format."})

    def __post_init__(self):
        self.model_dir = in_project(self.model_dir, only_if_exists=True)
        self.dataset_dir, self.output_dir = in_project(self.dataset_dir), in_project(self.output_dir)
        self.greedy_predictions = in_project(self.greedy_predictions)
        if self.batch_size < 1 or self.num_beams < 1 or self.max_new_tokens < 1:
            raise TextsqlError("--batch_size, --num_beams and --max_new_tokens must be at least 1.")
        if self.max_examples is not None and self.max_examples < 1:
            raise TextsqlError("--max_examples must be a positive number (or left out for the whole split).")
        if self.device not in ("auto", "cuda", "cpu"):
            raise TextsqlError(f"--device must be auto, cuda or cpu, not '{self.device}'.")
        if self.dtype not in DTYPES:
            raise TextsqlError(f"--dtype must be one of {', '.join(DTYPES)}, not '{self.dtype}'.")
        check_decoding(self.decoding, self.num_beams)
