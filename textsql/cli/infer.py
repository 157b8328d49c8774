"""`textsql infer`: generate SQL for a split or typed questions with a fine-tuned model, and score it."""

from __future__ import annotations

from textsql.arguments.infer import InferArguments
from textsql.cli.parsing import parse_arguments
from textsql.infer import run_inference


def infer_cli(argv: list[str]) -> int:
    args = parse_arguments(InferArguments, "infer", argv)
    run_inference(args)
    return 0
