"""The `textsql` command: one subcommand per module of textsql.cli, each parsing its arguments and calling the package."""

from __future__ import annotations

import importlib
import sys

from textsql.cli.flags import check_command_flags
from textsql.errors import TextsqlError
from textsql.extras import quiet_lifecycle_logs

USAGE = """usage: textsql COMMAND [ARGS]

commands:
  import         a GGUF model file (or a packaged model: smollm2-135m-instruct) as a plain model folder
  prep           load WikiSQL (release files, hub copy, or generated), tokenize and save it
  train          fine-tune a model (T5 or a causal LM; --lora True, QLoRA with --quantize_base nf4), with or without a
                 DeepSpeed (dsconfig/) or FSDP (fsdpconfig/) config
  merge          fold a LoRA run's adapter into its base model: a plain model folder (CPU, fp32)
  infer          generate SQL with a fine-tuned model for a split or typed questions, and score it
  quantize       quantize a model (torchao int8, bitsandbytes 8-bit/nf4, dynamic int8, gptq for causal LMs) and score it
                 against the original
  compare        compare models' SQL side by side: a web app (127.0.0.1, $CDSW_APP_PORT in CML) or a whole split as JSON
  check-config   validate DeepSpeed and FSDP config files as a user edits them
  plan           predict GPU and CPU memory per pod for every strategy, and recommend one
  tune           measure strategies and micro-batches at a fixed global batch; write the winner as a recipe
  report         collect every run's summary into the benchmark table (Markdown, CSV) and plots
  tensorboard    serve TensorBoard on the runs root (127.0.0.1, $CDSW_APP_PORT in CML)
  lab            open JupyterLab on the notebooks (127.0.0.1, token printed once; needs textsql[notebooks])
  cluster        multi-pod training: CML or local workers (no ssh), or your machines over pdsh (`textsql cluster --help`)
  demo           generate data, train a tiny T5 with ZeRO-2 on this machine, print the run summary (--family causal:
                 a tiny Qwen2-shaped causal LM instead)

`textsql COMMAND --help` lists a command's arguments."""


# Each command's module in textsql.cli and its function, imported when the command runs: `textsql --help` and a
# mistyped command answer at once, without importing torch, transformers or DeepSpeed.
COMMANDS = {
    "import": ("import_model", "import_cli"),
    "prep": ("prep", "prep_command"),
    "train": ("train", "train_command"),
    "merge": ("merge", "merge_cli"),
    "infer": ("infer", "infer_cli"),
    "quantize": ("quantize", "quantize_cli"),
    "compare": ("compare", "compare_cli"),
    "check-config": ("check_config", "check_config_cli"),
    "plan": ("plan", "plan_cli"),
    "tune": ("tune", "tune_cli"),
    "report": ("report", "report_cli"),
    "tensorboard": ("tensorboard", "tensorboard_cli"),
    "lab": ("lab", "lab_cli"),
    "cluster": ("cluster", "cluster_cli"),
    "demo": ("demo", "demo_command"),
}


def run_command(name: str, argv: list[str]) -> int:
    module, function = COMMANDS[name]
    if name != "train":  # train checks its own (`python -m textsql.train` enters there)
        check_command_flags(name, argv)  # a typo answered before the command's module imports torch
    return getattr(importlib.import_module(f"textsql.cli.{module}"), function)(argv)


def main(argv: list[str] | None = None) -> int:
    """`textsql COMMAND ARGS`: the command's exit status; a user error is one paragraph on stderr and exit status 2."""
    argv = sys.argv[1:] if argv is None else argv
    quiet_lifecycle_logs()  # before any command imports transformers (which imports torchao when it is installed)
    if argv and argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0
    if not argv or argv[0] not in COMMANDS:
        problem = f"unknown command '{argv[0]}'" if argv else "a command is needed"
        print(
            f"{USAGE.splitlines()[0]}\ntextsql: error: {problem}; choose one of {', '.join(COMMANDS)} "
            "(`textsql --help` says what each does).",
            file=sys.stderr,
        )
        return 2
    try:
        return run_command(argv[0], argv[1:])
    except TextsqlError as error:
        print(f"textsql {argv[0]}: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # one line, not a traceback; `textsql train` says where it resumes
        print(f"textsql {argv[0]}: interrupted.", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
