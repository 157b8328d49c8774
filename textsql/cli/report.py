"""`textsql report`: every run's summary under a runs root in one table (Markdown, CSV), with plots."""

from __future__ import annotations

import argparse
import sys

from textsql.errors import TextsqlError
from textsql.report import build_report


def report_cli(argv: list[str]) -> int:
    """Body of `textsql report`: build the report, print the Markdown table and where the files are. 0, or 2 on an error."""
    parser = argparse.ArgumentParser(
        prog="textsql report",
        description="Collect every run_summary.json (and eval_metrics.json) under a runs root into one table "
        "(Markdown + CSV) with PNG plots of time, memory and loss curves.",
    )
    parser.add_argument("--runs_root", default="runs", help="Root of the runs (default: runs).")
    parser.add_argument(
        "--output_dir",
        default=None,
        help="Where to write report.md, report.csv and the PNGs (default: <runs_root>/report).",
    )
    parser.add_argument("--no_plots", action="store_true", help="Write only the table.")
    parser.add_argument(
        "--mlflow_experiment",
        default=None,
        help="Report the finished runs of this MLflow experiment instead ($MLFLOW_TRACKING_URI, else the local "
        "store under --runs_root; docs/training.md#track-runs-in-mlflow-cml-experiments).",
    )
    args = parser.parse_args(argv)
    try:
        report = build_report(
            args.runs_root, args.output_dir, plots=not args.no_plots, mlflow_experiment=args.mlflow_experiment
        )
    except TextsqlError as error:
        print(f"textsql report: {error}", file=sys.stderr)
        return 2
    print(report.markdown)
    for message in report.skipped:
        print(f"skipped {message}", file=sys.stderr)
    for path in [*report.files.values(), *report.plots.values()]:
        print(f"wrote {path}")
    return 0
