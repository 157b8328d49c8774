"""`textsql tune [ARGS] [-- TRAIN ARGS]`: measure strategies and micro-batches at a fixed global batch, and write the
winner as a `textsql train` recipe."""

from __future__ import annotations

import json
import sys

from textsql.arguments.tune import TuneArguments
from textsql.cli.parsing import parse_arguments
from textsql.errors import TextsqlError
from textsql.tune import run_tune
from textsql.tune.report import as_dict, format_table


def tune_cli(argv) -> int:
    """Body of `textsql tune`: the progress, the table and the winner; 0 when a candidate trained, 2 otherwise.
    Arguments after `--` are `textsql train` arguments for every candidate and the recipe (--learning_rate 1e-3 ...)."""
    argv = list(argv)
    train_argv = argv[argv.index("--") + 1 :] if "--" in argv else []
    own = argv[: argv.index("--")] if "--" in argv else argv
    json_output = "--json" in own
    own = [a for a in own if a != "--json"]
    try:
        args = parse_arguments(TuneArguments, "tune", own)
        result = run_tune(args, train_argv, echo=(lambda line: print(line, file=sys.stderr)) if json_output else print)
    except TextsqlError as error:
        print(f"textsql tune: {error}", file=sys.stderr)
        return 2
    if json_output:
        print(json.dumps(as_dict(result), indent=2, default=str))
    else:
        print()
        print(format_table(result))
        if result.recipe:
            print(f"recipe: {result.recipe} (run it: textsql train {result.recipe})")
        print(
            f"table: {result.tune_dir / 'tune_table.md'}"
            + (f"; plot: {result.plot}" if result.plot else "; no plot (matplotlib: the notebooks extra)")
        )
    if result.winner is None:
        print(
            "textsql tune: no candidate trained; the table says why each failed, and its log is in "
            f"{result.tune_dir / 'logs'}.",
            file=sys.stderr,
        )
        return 2
    return 0
