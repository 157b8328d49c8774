"""Parsing one command's arguments into its dataclass, with argparse's error policy (usage line, exit 2)."""

from __future__ import annotations

import importlib.util
import sys
from functools import cache

from textsql.cli.flags import package_file


@cache
def _hf_argument_parser() -> type:
    """transformers' HfArgumentParser, loaded from its own file: importing the transformers package takes about a second
    (it indexes every model's source) while hf_argparser.py needs only the standard library and yaml, so `textsql plan
    --help` answers at once. A release whose hf_argparser imports more of transformers gets the package's class."""
    spec = importlib.util.spec_from_file_location(
        "textsql.cli._hf_argparser", package_file("transformers", "hf_argparser.py")
    )
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except ImportError:
        from transformers import HfArgumentParser

        return HfArgumentParser
    return module.HfArgumentParser


def parse_arguments(dataclass_type, command: str, argv: list[str]):
    """Parse argv into one arguments dataclass for `textsql COMMAND`: usage lines name the command, and an unknown flag
    is a usage error (exit 2, one paragraph) as in argparse, not HfArgumentParser's ValueError with a traceback."""
    parser = _hf_argument_parser()(dataclass_type, prog=f"textsql {command}")
    argv = renamed_flags(argv, getattr(sys.modules[dataclass_type.__module__], "LEGACY_FLAGS", {}), command)
    args, unknown = parser.parse_args_into_dataclasses(args=argv, return_remaining_strings=True)
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    return args


def renamed_flags(argv: list[str], legacy: dict[str, str], command: str) -> list[str]:
    """argv with a command's older flag spellings (its arguments module's LEGACY_FLAGS) in their new names, each
    named once on stderr: `textsql plan --model` still plans, and says --model_id."""
    renamed = []
    for argument in argv:
        flag, eq, value = argument.partition("=")
        if flag in legacy:
            print(f"textsql {command}: {flag} is now {legacy[flag]} (textsql train's name).", file=sys.stderr)
            argument = legacy[flag] + eq + value
        renamed.append(argument)
    return renamed


def leading_values(argv: list[str], flag: str, many: bool = False) -> list[str]:
    """`textsql CMD VALUE ... --other` as `textsql CMD FLAG VALUE ... --other`: the leading positional (all of them when
    `many`) belongs to `flag`, so commands read `textsql quantize MODEL` as well as `--model_dir MODEL`."""
    count = 0
    while count < len(argv) and not argv[count].startswith("-") and (many or count < 1):
        count += 1
    return [flag, *argv[:count], *argv[count:]] if count else list(argv)
