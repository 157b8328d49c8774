"""`textsql import SOURCE [OUTPUT_DIR]`: a GGUF file (or a packaged model textsql knows) as a plain model folder."""

from __future__ import annotations

from textsql.arguments.import_model import ImportArguments
from textsql.cli.parsing import leading_values, parse_arguments
from textsql.model_import import import_gguf


def import_cli(argv: list[str]) -> int:
    """`textsql import SOURCE [OUTPUT_DIR] [--dtype ...]` (or `--source SOURCE --output_dir OUTPUT_DIR`)."""
    argv = leading_values(argv, "--source")
    if len(argv) > 2 and not argv[2].startswith("-"):  # a second positional value: the output folder
        argv = [*argv[:2], "--output_dir", *argv[2:]]
    import_gguf(parse_arguments(ImportArguments, "import", argv))
    return 0
