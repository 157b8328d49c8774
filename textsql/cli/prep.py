"""`textsql prep`: load WikiSQL, tokenize it and save it, with a report of the lengths."""

from __future__ import annotations

from textsql.arguments.prep import PrepArguments
from textsql.cli.parsing import parse_arguments
from textsql.prep import format_layout, format_length_report, prepare_dataset
from textsql.prepared import load_prepared


def prep_command(argv: list[str]) -> int:
    args = parse_arguments(PrepArguments, "prep", argv)
    folder = prepare_dataset(args)
    _, metadata = load_prepared(folder)
    print(format_length_report(metadata["lengths"]))
    print(format_layout(metadata))
    print(f"saved {sum(metadata['examples'].values())} examples ({metadata['examples']}) to {folder}")
    return 0
