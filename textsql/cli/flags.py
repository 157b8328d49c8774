"""Unknown flags answered at once, before torch and transformers are imported: the names a command accepts are read
from the source of its argument dataclasses (textsql's and the Trainer's), and a typo gets the closest one."""

from __future__ import annotations

import ast
import difflib
import importlib.util
from functools import cache
from pathlib import Path

from textsql.errors import TextsqlError

TRAIN_ARGUMENT_SOURCES = (  # the run spec (textsql/arguments/): every `textsql train` flag textsql adds, in one folder
    ("textsql", "arguments/training.py", ("ModelArguments", "DataArguments", "TextsqlTrainingArguments")),
    (
        "textsql",
        "arguments/lora.py",
        ("LoraArguments",),
    ),  # a base of TextsqlTrainingArguments: --lora, --lora_rank, ...
    (
        "textsql",
        "arguments/dstools.py",
        ("DsToolsArguments",),
    ),  # another: --flops_profiler, --ds_monitor, --comms_logger
    (
        "textsql",
        "arguments/tracking.py",
        ("TrackingArguments",),
    ),  # another: --mlflow_log_model, --mlflow_experiment, ...
    ("textsql", "arguments/grpo.py", ("GrpoArguments",)),  # another: --stage, --num_generations, --reward_weights, ...
    ("textsql", "arguments/speed.py", ("SpeedArguments",)),  # another: --attention, --compile, --fused_loss, ...
    ("transformers", "training_args.py", ("TrainingArguments",)),
    ("transformers", "training_args_seq2seq.py", ("Seq2SeqTrainingArguments",)),
)


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
