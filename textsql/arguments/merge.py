"""`textsql merge`'s arguments: the LoRA run whose adapter is folded in, the folder written, the base merged onto."""

from __future__ import annotations

from dataclasses import dataclass, field

from textsql.arguments import same_flag
from textsql.arguments.infer import InferArguments
from textsql.errors import TextsqlError

MERGE_ONTO = ("full", "rounded")  # a QLoRA adapter merged into the full-precision base, or onto its rounded weights


@dataclass
class MergeArguments:
    """What `textsql merge` folds together."""

    adapter: str = field(
        metadata={
            "help": "The adapter: the run folder of a `textsql train --lora True` run, or one of its checkpoint-N "
            "folders (the best or an earlier step); also the first argument."
        }
    )
    output_dir: str | None = field(
        default=None, metadata={"help": "Where the merged model goes; default: <adapter>-merged beside it."}
    )
    base_model: str | None = field(
        default=None,
        metadata={"help": "The base model (hub name or folder) if it moved; default: the one the run trained from."},
    )
    overwrite: bool = field(default=False, metadata={"help": "Replace a merged model already in --output_dir."})
    merge_onto: str = field(
        default="full",
        metadata={
            "help": "A QLoRA adapter (--quantize_base nf4|int8) only: merge into the full-precision base (full), or "
            "onto the base's weights rounded as the adapter saw them, the quantized base dequantized (rounded). "
            "Either way the merged model is scored against the adapter on its quantized base."
        },
    )
    dataset_dir: str | None = field(
        default=None,
        metadata={"help": "A QLoRA merge's scoring: the prepared dataset; default: the one the run trained on."},
    )
    score_examples: int = field(
        default=64, metadata={"help": "A QLoRA merge's scoring: the first N validation questions (at least 1)."}
    )
    batch_size: int = field(default=16, metadata={"help": "A QLoRA merge's scoring: questions per generate() call."})
    max_new_tokens: int = field(default=64, metadata={"help": "A QLoRA merge's scoring: longest SQL, in tokens."})
    device: str = same_flag(
        InferArguments, "device", "A QLoRA merge's scoring: auto (a GPU when there is one), cuda or cpu."
    )

    def __post_init__(self):
        if not str(self.adapter).strip():
            raise TextsqlError("Pass the adapter folder: the run folder of a `textsql train --lora True` run.")
        if self.merge_onto not in MERGE_ONTO:
            raise TextsqlError(f"--merge_onto must be one of {', '.join(MERGE_ONTO)}, not '{self.merge_onto}'.")
        if self.score_examples < 1 or self.batch_size < 1 or self.max_new_tokens < 1:
            raise TextsqlError("--score_examples, --batch_size and --max_new_tokens must be at least 1.")
