"""Unknown flags answered at once, before torch and transformers are imported: the names a command accepts are read
from the source of its argument dataclasses (textsql's and the Trainer's), and a typo gets the closest one."""

from __future__ import annotations

import ast
import difflib
import importlib.util
from functools import cache
from pathlib import Path

from textsql.errors import TextsqlError

TRAIN_ARGUMENT_SOURCES = (  # textsql/arguments/: every `textsql train` flag textsql adds, in one folder
    ("textsql", "arguments/data.py", ("ModelArguments", "DataArguments")),
    ("textsql", "arguments/training.py", ("TextsqlTrainingArguments",)),
    ("textsql", "arguments/devices.py", ("DeviceArguments",)),  # a base: --precision, --accelerator, --num_gpus, ...
    ("textsql", "arguments/lora.py", ("LoraArguments",)),  # another: --lora, --lora_rank, ...
    ("textsql", "arguments/dstools.py", ("DsToolsArguments",)),  # another: --flops_profiler, --ds_monitor, ...
    ("textsql", "arguments/tracking.py", ("TrackingArguments",)),  # another: --mlflow_log_model, ...
    ("textsql", "arguments/grpo.py", ("GrpoArguments",)),  # another: --stage, --num_generations, ...
    ("textsql", "arguments/speed.py", ("SpeedArguments",)),  # another: --attention, --compile, --fused_loss, ...
    ("transformers", "training_args.py", ("TrainingArguments",)),
    ("transformers", "training_args_seq2seq.py", ("Seq2SeqTrainingArguments",)),
)
# Every other command parsed into a dataclass (textsql.cli.parsing): its module in textsql/arguments/ and class.
ARGUMENT_SOURCES = {
    "import": ("import_model", "ImportArguments"),
    "prep": ("prep", "PrepArguments"),
    "merge": ("merge", "MergeArguments"),
    "infer": ("infer", "InferArguments"),
    "quantize": ("quantize", "QuantizeArguments"),
    "compare": ("compare", "CompareArguments"),
    "plan": ("plan", "PlanArguments"),
    "tune": ("tune", "TuneArguments"),
    "demo": ("demo", "DemoArguments"),
}
# Commands whose arguments after `--` are `textsql train`'s (each candidate's, every rank's)
TRAIN_AFTER_SEPARATOR = ("tune", "cluster")
READ_BEFORE_PARSING = {"tune": frozenset({"json"})}  # textsql/cli/tune.py takes --json out before parsing


def package_file(package: str, relative: str) -> Path:
    """A file of an installed package, found without importing the package."""
    spec = importlib.util.find_spec(package)
    return Path(spec.origin).parent / relative


@cache
def dataclass_fields(package: str, relative: str, classes: tuple[str, ...]) -> frozenset[str]:
    """The annotated fields of `classes` in that source file, and the keys of a LEGACY_FLAGS mapping beside them."""
    names = set()
    for node in ast.parse(package_file(package, relative).read_text(encoding="utf-8")).body:
        if isinstance(node, ast.ClassDef) and node.name in classes:
            names |= {
                item.target.id
                for item in node.body
                if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name)
            }
        elif isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "LEGACY_FLAGS" for t in node.targets):
            names |= {key.removeprefix("--") for key in ast.literal_eval(node.value)}
    return frozenset(names)


def train_flags() -> frozenset[str]:
    """Every `--name` `textsql train` accepts (the launcher's --local_rank too)."""
    return frozenset().union(
        *(dataclass_fields(*source) for source in TRAIN_ARGUMENT_SOURCES), {"local_rank", "help", "h"}
    )


def command_flags(command: str) -> frozenset[str]:
    """Every `--name` a dataclass command accepts (its aliases too), read from its source without importing it."""
    module, name = ARGUMENT_SOURCES[command]
    own = dataclass_fields("textsql", f"arguments/{module}.py", (name,))
    return own | READ_BEFORE_PARSING.get(command, frozenset()) | {"help", "h"}


def check_command_flags(command: str, argv: list[str]) -> None:
    """The early typo check of `textsql COMMAND ARGV`, before the command's module (torch, transformers) loads: its own
    flags against its dataclass, those after `--` against `textsql train`'s (tune, cluster)."""
    own, separator, after = (
        (argv[: argv.index("--")], "--", argv[argv.index("--") + 1 :]) if "--" in argv else (argv, "", [])
    )
    if command == "train":
        check_flags(argv, train_flags(), "train")
        return
    if command in ARGUMENT_SOURCES:
        check_flags(own, command_flags(command), command)
    if separator and command in TRAIN_AFTER_SEPARATOR:
        check_flags(after, train_flags(), "train")


def check_flags(argv: list[str], known: frozenset[str], command: str) -> None:
    """Raise TextsqlError naming the first flag `command` does not know, with the closest known one."""
    for argument in argv:
        if not argument.startswith("--"):
            continue
        name = argument[2:].split("=", 1)[0]
        if name in known or (name.startswith("no_") and name[3:] in known):  # HfArgumentParser's --no_<flag>
            continue
        close = difflib.get_close_matches(name, sorted(known), n=1, cutoff=0.6)
        hint = f"; did you mean --{close[0]}?" if close else ""
        raise TextsqlError(f"unrecognized argument --{name}{hint} (`textsql {command} --help` lists every argument).")
