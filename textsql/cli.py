"""The `textsql` command: prep, train, check-config and demo, each a thin call into the package."""

from __future__ import annotations

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
  cluster        multi-pod training: workers, hostfile, preflight, launch over pdsh (`textsql cluster --help`)
  demo           generate data, train a tiny T5 with ZeRO-2 on this machine, print the run summary

`textsql COMMAND --help` lists a command's arguments."""


def prep_command(argv: list[str]) -> int:
    from transformers import HfArgumentParser

    from textsql.data import PrepArguments, format_length_report, load_prepared, prepare_dataset

    (args,) = HfArgumentParser(PrepArguments).parse_args_into_dataclasses(args=argv)
    folder = prepare_dataset(args)
    _, metadata = load_prepared(folder)
    print(format_length_report(metadata["lengths"]))
    print(f"saved {sum(metadata['examples'].values())} examples ({metadata['examples']}) to {folder}")
    return 0


def train_command(argv: list[str]) -> int:
    from textsql.train import main

    return main(argv)


def infer_command(argv: list[str]) -> int:
    from textsql.infer import infer_cli

    return infer_cli(argv)


def check_config_command(argv: list[str]) -> int:
    from textsql.dsconfig import check_config_cli

    return check_config_cli(argv)


def plan_command(argv: list[str]) -> int:
    from textsql.memory import plan_cli

    return plan_cli(argv)


def cluster_command(argv: list[str]) -> int:
    from textsql.cluster.cli import cluster_cli

    return cluster_cli(argv)


def report_command(argv: list[str]) -> int:
    from textsql.report import report_cli

    return report_cli(argv)


def tensorboard_command(argv: list[str]) -> int:
    from textsql.tensorboard_app import tensorboard_cli

    return tensorboard_cli(argv)


def demo_command(argv: list[str]) -> int:
    from transformers import HfArgumentParser

    from textsql.demo import DemoArguments, run_demo
    from textsql.train import format_summary

    (args,) = HfArgumentParser(DemoArguments).parse_args_into_dataclasses(args=argv)
    summary = run_demo(args)
    print("\n=== textsql demo: run summary ===")
    print(format_summary(summary))
    print(f"mean real tokens per example: {summary['mean_real_tokens_per_example']:.1f}")
    test, baseline = summary["test_metrics"], summary["baseline_metrics"]
    print(f"test split: exact match {test['exact_match']:.1%}, logical form {test['logical_form_accuracy']:.1%}, "
          f"execution {test['execution_accuracy']:.1%}  (trivial baseline: execution {baseline['execution_accuracy']:.1%})")
    print(f"full summary: {summary['output_dir']}/run_summary.json")
    return 0


COMMANDS = {"prep": prep_command, "train": train_command, "infer": infer_command, "check-config": check_config_command, "plan": plan_command, "cluster": cluster_command, "report": report_command, "tensorboard": tensorboard_command, "demo": demo_command}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        print(USAGE, file=sys.stderr if argv and argv[0] not in ("-h", "--help") else sys.stdout)
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    try:
        return COMMANDS[argv[0]](argv[1:])
    except TextsqlError as error:
        print(f"textsql {argv[0]}: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
