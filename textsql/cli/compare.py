"""`textsql compare MODEL ...`: the models side by side, in a web app on 127.0.0.1 ($CDSW_APP_PORT in CML) or, with
--output, over a whole split as JSON."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from textsql.arguments.compare import DEFAULT_PORT, CompareArguments
from textsql.cli.parsing import leading_values, parse_arguments
from textsql.serve.compare import (
    DATASET_VARIABLE,
    DEFAULT_HOST,
    MODELS_VARIABLE,
    Comparison,
    format_split_comparison,
    serve_app,
)
from textsql.serve.tensorboard import resolve_port


def compare_cli(argv: list[str]) -> int:
    argv = leading_values(argv, "--models", many=True)
    if "--models" not in argv and os.environ.get(MODELS_VARIABLE, "").strip():  # a CML Application passes no arguments
        argv = ["--models", *os.environ[MODELS_VARIABLE].replace(",", " ").split(), *argv]
    if "--dataset_dir" not in argv and os.environ.get(DATASET_VARIABLE, "").strip():
        argv = [*argv, "--dataset_dir", os.environ[DATASET_VARIABLE].strip()]
    args = parse_arguments(CompareArguments, "compare", argv)
    try:
        port, note = resolve_port(args.port, default=DEFAULT_PORT)
    except ValueError as error:
        print(f"textsql compare: {error}", file=sys.stderr)
        return 2
    comparison = Comparison(args)
    if args.output:
        report = comparison.compare_split(args.max_examples)
        Path(args.output).write_text(json.dumps(report, indent=2, ensure_ascii=False) + "\n")
        print(format_split_comparison(report))
        print(f"wrote {args.output}")
        return 0
    if note:
        print(f"textsql compare: {note}", file=sys.stderr)
    print(f"textsql compare: serving {len(comparison.models)} models on http://{DEFAULT_HOST}:{port}/", flush=True)
    serve_app(comparison, port)
    return 0
