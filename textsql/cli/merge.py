"""`textsql merge ADAPTER`: fold a LoRA run's adapter into its base model, giving a plain model folder; a QLoRA
adapter's merge scored again against the adapter on its quantized base."""

from __future__ import annotations

from textsql.arguments.merge import MergeArguments
from textsql.cli.parsing import parse_arguments
from textsql.merge import merge_and_score


def merge_cli(argv: list[str]) -> int:
    """`textsql merge ADAPTER [--output_dir ...]` (or `--adapter ADAPTER`)."""
    argv = list(argv)
    if argv and not argv[0].startswith("-"):
        argv = ["--adapter", *argv[:1], *argv[1:]]
    merge_and_score(parse_arguments(MergeArguments, "merge", argv))
    return 0
