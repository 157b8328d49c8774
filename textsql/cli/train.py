"""`textsql train ARGS` or `textsql train recipe.yaml` (also the rank entry point `python -m textsql.train`)."""

from __future__ import annotations

import sys

from textsql.errors import TextsqlError
from textsql.train.arguments import parse_arguments
from textsql.train.local_launch import launches_ranks, run_training, train_and_report


def train_command(argv: list[str]) -> int:
    """`textsql train ARGS` or `textsql train recipe.yaml`: parse once, then train here or start one rank per GPU."""
    try:
        model_args, data_args, training_args = parse_arguments(argv)
        ranks = launches_ranks(training_args)
        if ranks:
            run_training(model_args, data_args, training_args, num_gpus=ranks)  # rank 0 prints the summary
            return 0
    except TextsqlError as error:
        print(f"textsql train: {error}", file=sys.stderr)
        return 2
    return train_and_report(model_args, data_args, training_args)
