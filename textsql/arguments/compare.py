"""`textsql compare`'s arguments: the models (labelled), the dataset, the app's port or the JSON of a whole split."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from textsql.arguments import same_flag
from textsql.arguments.data import DataArguments
from textsql.arguments.infer import InferArguments
from textsql.errors import TextsqlError

DEFAULT_PORT = 7860


@dataclass
class CompareArguments:
    """Which models, which dataset, and whether to serve the app or score a whole split."""

    models: list[str] = field(
        default_factory=list,
        metadata={
            "help": "Model folders or hub names, each optionally labelled: base=t5-small lora=runs/lora int8=runs/int8."
        },
    )
    dataset_dir: str = same_flag(
        DataArguments, "dataset_dir", "Prepared dataset (textsql prep): its tables and questions."
    )
    split: str = same_flag(InferArguments, "split", "Split whose questions the app offers, or that --output scores.")
    output: str | None = field(
        default=None,
        metadata={
            "help": "Compare over the split (or --max_examples) and write this JSON file, instead of serving the app."
        },
    )
    max_examples: int | None = same_flag(InferArguments, "max_examples", "With --output: only the first N questions.")
    batch_size: int = same_flag(InferArguments, "batch_size", "With --output: questions per generate() call.")
    max_new_tokens: int = same_flag(InferArguments, "max_new_tokens", "Longest SQL to generate, in tokens.")
    device: str = same_flag(InferArguments, "device", "auto (GPU when there is one), cuda, or cpu.")
    port: int | None = field(
        default=None, metadata={"help": f"Port when $CDSW_APP_PORT is not set (default {DEFAULT_PORT})."}
    )

    def __post_init__(self):
        if not self.models:
            raise TextsqlError(
                "Name at least one model to compare: `textsql compare base=t5-small tuned=runs/my-run ...`."
            )
        if self.device not in ("auto", "cuda", "cpu"):
            raise TextsqlError(f"--device must be auto, cuda or cpu, not '{self.device}'.")
        if self.batch_size < 1 or self.max_new_tokens < 1 or (self.max_examples is not None and self.max_examples < 1):
            raise TextsqlError("--batch_size, --max_new_tokens and --max_examples must be at least 1.")
        model_specs(self.models)


def model_specs(models: list[str]) -> list[tuple[str, str]]:
    """(label, path) for each `label=path` or `path` (labelled by its folder's name); labels must differ."""
    specs = []
    for text in models:
        label, _, path = text.partition("=") if "=" in text and not Path(text).exists() else ("", "", text)
        specs.append((label or Path(path.rstrip("/")).name or path, path))
    labels = [label for label, _ in specs]
    if len(set(labels)) != len(labels):
        raise TextsqlError(
            f"Two models share a label ({', '.join(labels)}): label them, e.g. base=t5-small tuned=runs/my-run."
        )
    return specs
