"""`textsql train ARGS` or `textsql train recipe.yaml` (also the rank entry point `python -m textsql.train`)."""

from __future__ import annotations

import sys

from textsql.cli.flags import check_command_flags
from textsql.errors import TextsqlError

INTERRUPTED_STATUS = 130  # what a shell reports for a program ended by Ctrl-C


def train_command(argv: list[str]) -> int:
    """`textsql train ARGS` or `textsql train recipe.yaml`: parse once, then train here or start one rank per GPU. An
    interrupt ends with one line saying where the same command resumes."""
    try:
        check_command_flags("train", argv)  # a typo is answered at once, before torch and transformers load
    except TextsqlError as error:
        print(f"textsql train: {error}", file=sys.stderr)
        return 2
    # The training modules import torch, transformers and DeepSpeed: only now, once the flags are known to be right.
    from textsql.arguments.training import parse_arguments
    from textsql.train.distributed import rank, world_size
    from textsql.train.local_launch import launches_ranks, run_training, train_and_report
    from textsql.train.run import TrainingInterrupted, interrupted_message

    try:
        model_args, data_args, training_args = parse_arguments(argv)
        ranks = launches_ranks(training_args)
    except TextsqlError as error:
        print(f"textsql train: {error}", file=sys.stderr)
        return 2
    try:
        if ranks:
            run_training(model_args, data_args, training_args, num_gpus=ranks)  # rank 0 prints the summary
            return 0
        return train_and_report(model_args, data_args, training_args)
    except TrainingInterrupted as interrupted:
        print(f"textsql train: {interrupted}", file=sys.stderr)
        return INTERRUPTED_STATUS
    except TextsqlError as error:
        print(f"textsql train: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        close_progress_bars()
        if rank() == 0:  # one line from the whole launch
            print(f"textsql train: {interrupted_message(model_args, training_args, world_size())}", file=sys.stderr)
        return INTERRUPTED_STATUS


def close_progress_bars() -> None:
    """End the Trainer's progress bar before the interrupt's line: tqdm would redraw it at exit, after the line."""
    tqdm = sys.modules.get("tqdm")
    for bar in list(getattr(getattr(tqdm, "tqdm", None), "_instances", ())):
        bar.close()
