"""`textsql quantize MODEL --method ...`: quantize a model folder, save it, score it against the unquantized model."""

from __future__ import annotations

from textsql.arguments.quantize import QuantizeArguments
from textsql.cli.parsing import leading_values, parse_arguments
from textsql.quantize import quantize_model


def quantize_cli(argv: list[str]) -> int:
    args = parse_arguments(QuantizeArguments, "quantize", leading_values(argv, "--model_dir"))
    quantize_model(args)
    return 0
