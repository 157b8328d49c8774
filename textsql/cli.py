"""The `textsql` command: prep, train, check-config and demo, each a thin call into the package."""

from __future__ import annotations

import importlib
import sys

from textsql.errors import TextsqlError

USAGE = """usage: textsql COMMAND [ARGS]

commands:
  prep           load WikiSQL (release files, hub copy, or generated), tokenize and save it
  train          fine-tune a model, with or without a DeepSpeed config (dsconfig/*.json)
  infer          generate SQL with a fine-tuned model for a split or typed questions, and score it
  check-config   validate DeepSpeed config files as a user edits them
  plan           predict GPU and CPU memory per pod for every strategy, and recommend one
  report         collect every run's summary into the benchmark table (Markdown, CSV) and plots
  tensorboard    serve TensorBoard on the runs root (127.0.0.1, $CDSW_APP_PORT in CML)
  lab            open JupyterLab on the notebooks (127.0.0.1, token printed once; needs textsql[notebooks])
  cluster        multi-pod training: CML or local workers (no ssh), or your machines over pdsh (`textsql cluster --help`)
  demo           generate data, train a tiny T5 with ZeRO-2 on this machine, print the run summary

`textsql COMMAND --help` lists a command's arguments."""


def parse_arguments(dataclass_type, command: str, argv: list[str]):
    """Parse argv into one arguments dataclass for `textsql COMMAND`: usage lines name the command, and an unknown flag
    is a usage error (exit 2, one paragraph) as in argparse, not HfArgumentParser's ValueError with a traceback."""
    from transformers import HfArgumentParser

    parser = HfArgumentParser(dataclass_type, prog=f"textsql {command}")
    args, unknown = parser.parse_args_into_dataclasses(args=list(argv), return_remaining_strings=True)
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    return args


def prep_command(argv: list[str]) -> int:
    from textsql.data import PrepArguments, format_length_report, load_prepared, prepare_dataset

    args = parse_arguments(PrepArguments, "prep", argv)
    folder = prepare_dataset(args)
    _, metadata = load_prepared(folder)
    print(format_length_report(metadata["lengths"]))
    print(f"saved {sum(metadata['examples'].values())} examples ({metadata['examples']}) to {folder}")
    return 0


def demo_command(argv: list[str]) -> int:
    from textsql.demo import DEMO_ACCURACY_NOTE, DemoArguments, run_demo
    from textsql.infer import format_components
    from textsql.run_summary import SUMMARY_FILE, format_summary

    args = parse_arguments(DemoArguments, "demo", argv)
    result = run_demo(args)
    print("\n=== textsql demo: run summary ===")
    print(format_summary(result.summary))
    print(f"mean real tokens per example: {result.mean_real_tokens_per_example:.1f}")
    test, baseline = result.test_metrics, result.baseline_metrics
    print(f"test split: execution {test['execution_accuracy']:.1%}, logical form {test['logical_form_accuracy']:.1%}, "
          f"exact match {test['exact_match']:.1%}  (trivial baseline: execution {baseline['execution_accuracy']:.1%})")
    print(format_components(test["components"]))
    print(DEMO_ACCURACY_NOTE)
    print(f"full summary: {result.summary.output_dir}/{SUMMARY_FILE}")
    return 0


# Commands that only hand their arguments to a function of the package, imported when the command runs.
DELEGATED = {
    "train": ("textsql.train", "main"),
    "infer": ("textsql.infer", "infer_cli"),
    "check-config": ("textsql.dsconfig", "check_config_cli"),
    "plan": ("textsql.plan", "plan_cli"),
    "cluster": ("textsql.cluster.cli", "cluster_cli"),
    "report": ("textsql.report", "report_cli"),
    "tensorboard": ("textsql.tensorboard_app", "tensorboard_cli"),
    "lab": ("textsql.lab", "lab_cli"),
}


def delegate(module: str, function: str):
    def command(argv: list[str]) -> int:
        return getattr(importlib.import_module(module), function)(argv)

    return command


COMMANDS = {"prep": prep_command, "demo": demo_command, **{name: delegate(*target) for name, target in DELEGATED.items()}}


def main(argv: list[str] | None = None) -> int:
    """`textsql COMMAND ARGS`: the command's exit status; a user error is one paragraph on stderr and exit status 2."""
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0
    if not argv or argv[0] not in COMMANDS:
        problem = f"unknown command '{argv[0]}'" if argv else "a command is needed"
        print(f"{USAGE.splitlines()[0]}\ntextsql: error: {problem}; choose one of {', '.join(COMMANDS)} "
              "(`textsql --help` says what each does).", file=sys.stderr)
        return 2
    try:
        return COMMANDS[argv[0]](argv[1:])
    except TextsqlError as error:
        print(f"textsql {argv[0]}: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
