"""`textsql merge ADAPTER`: fold a LoRA run's adapter into its base model, giving a plain model folder."""

from __future__ import annotations

from textsql.adapters import MergeArguments, merge_adapter
from textsql.cli.parsing import parse_arguments


def merge_cli(argv: list[str]) -> int:
    """`textsql merge ADAPTER [--output_dir ...]` (or `--adapter ADAPTER`)."""
    argv = list(argv)
    if argv and not argv[0].startswith("-"):
        argv = ["--adapter", *argv[:1], *argv[1:]]
    args = parse_arguments(MergeArguments, "merge", argv)
    folder = merge_adapter(args)
    print(
        f"merged {args.adapter} into its base model: {folder} (fp32; `textsql infer --model_dir {folder}` and "
        "from_pretrained load it without peft)"
    )
    return 0
