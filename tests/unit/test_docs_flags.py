"""Every `textsql COMMAND` and `--flag` that README.md and docs/*.md name in code (spans and blocks) exists: the command
in textsql.cli.COMMANDS, a flag on a `textsql COMMAND` line in that command's own parser (train's from its argument
dataclasses, the others' from their --help), any other flag in some command's. A negative case shows what fails."""

import contextlib
import io
import re
from functools import cache
from pathlib import Path

import pytest

from textsql.arguments.plan import LEGACY_FLAGS as PLAN_LEGACY_FLAGS
from textsql.cli import COMMANDS, main
from textsql.cli.cluster import TRAINING_SUBCOMMANDS
from textsql.cli.flags import train_flags

REPO = Path(__file__).resolve().parents[2]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]

COMMAND = re.compile(r"(?<![\w.-])textsql\s+([a-z][\w-]*)(:?)")  # `textsql plan: ...` (a colon) quotes a message
FLAG = re.compile(r"(?<![\w-])--[A-Za-z][\w-]*")
FENCE = re.compile(r"^\s*(```|~~~)")
COMMENT = re.compile(r"(^|\s)#.*$")
SHELL_SEPARATOR = re.compile(r"\s(?:&&|\|\||\||;|>)\s")
# Commands that hand the flags they do not know to another program: TensorBoard's (textsql/cli/tensorboard.py).
FORWARDS_UNKNOWN_FLAGS = {"tensorboard"}
# Flags a command reads before its parser sees the rest: textsql/cli/tune.py takes --json out.
READ_BEFORE_PARSING = {"tune": {"--json"}}
LEGACY_FLAGS = {"plan": PLAN_LEGACY_FLAGS}
# Another program's flags that a doc names in a code span of their own (outside a line of that program). textsql's
# flags are Python names, so a hyphenated flag there (pip's --find-links, torchrun's --rdzv-id) is never textsql's.
OTHER_PROGRAMS = {"--nnodes": "torchrun's (docs/multi-pod.md)", "--dist": "pytest-xdist's (docs/testing.md)"}


def code_lines(text: str):
    """(line number, code) for each line of a fenced block (comments left out; a line ending in a backslash or
    followed by indented lines joined with them) and each inline code span."""
    in_block, command = False, None
    for number, line in enumerate([*text.splitlines(), ""], 1):
        if in_block and command and line[:1].isspace() and line.strip() and not FENCE.match(line):
            command = (command[0], f"{command[1]} {COMMENT.sub('', line).strip()}")  # a continued command
            continue
        if command:
            yield command
            command = None
        if FENCE.match(line):
            in_block = not in_block
        elif in_block:
            command = (number, COMMENT.sub("", line).rstrip().removesuffix("\\"))
        else:
            yield from ((number, span) for span in re.findall(r"`([^`]+)`", line))


def help_flags(argv: list[str]) -> frozenset[str] | None:
    """The flags `textsql ARGV --help` lists (each option line's names), or None when that is no command."""
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed), contextlib.redirect_stderr(io.StringIO()):
        try:
            status = main([*argv, "--help"])
        except SystemExit as exit_:
            status = exit_.code or 0
    if status != 0:
        return None
    options = [line.strip() for line in printed.getvalue().splitlines() if line.startswith("  -")]
    return frozenset(flag for option in options for flag in FLAG.findall(re.split(r"\s{2,}", option)[0]))


@cache
def known_flags(command: str, subcommand: str = "") -> frozenset[str] | None:
    """The flags `textsql COMMAND [SUBCOMMAND]` accepts (None: no such subcommand)."""
    if command == "train":
        return frozenset(f"--{name}" for name in train_flags())
    if command == "cluster":
        if subcommand in TRAINING_SUBCOMMANDS:
            return help_flags(["cluster", subcommand])
        return frozenset({"--help"}) if subcommand in ("", "check-hostfile") else None
    older = LEGACY_FLAGS.get(command, {})  # a command's older spellings still work (textsql.cli.parsing.renamed_flags)
    return help_flags([command]) | READ_BEFORE_PARSING.get(command, set()) | set(older)


@cache
def every_flag() -> frozenset[str]:
    named = [known_flags(name) for name in COMMANDS] + [known_flags("cluster", sub) for sub in TRAINING_SUBCOMMANDS]
    return frozenset().union(*named)


def unknown_flag(command: str, flag: str, known: frozenset[str]) -> bool:
    if command in FORWARDS_UNKNOWN_FLAGS or flag in known:
        return False
    return not (command == "train" and flag.startswith("--no_") and f"--{flag[5:]}" in known)  # HfArgumentParser's


def problems(text: str, name: str = "doc") -> list[str]:
    """What the doc's code names that does not exist, one line each."""
    found = []
    for number, code in code_lines(text):
        where = f"{name}:{number}"
        commands = list(COMMAND.finditer(code))
        if not commands:
            if code.strip().startswith("--"):  # bare flags in a span: some textsql command's
                found += [
                    f"{where}: `{flag}` is no flag of any textsql command"
                    for flag in FLAG.findall(code)
                    if "-" not in flag[2:] and flag not in every_flag() and flag not in OTHER_PROGRAMS
                ]
            continue  # another program's line (deepspeed, torchrun, pip) keeps its own flags
        for i, match in enumerate(commands):
            command, quoted = match.groups()
            if command not in COMMANDS:
                found.append(f"{where}: `textsql {command}` is no command (textsql.cli.COMMANDS)")
                continue
            if quoted:
                continue
            end = commands[i + 1].start() if i + 1 < len(commands) else len(code)
            own, _, after = SHELL_SEPARATOR.split(code[match.end() : end])[0].partition(" -- ")
            words = own.split()
            subcommand = words[0] if command == "cluster" and words and not words[0].startswith("-") else ""
            known = known_flags(command, subcommand)
            if known is None:
                found.append(f"{where}: `textsql cluster {subcommand}` is no cluster subcommand")
                continue
            label = f"textsql {command} {subcommand}".rstrip()
            found += [f"{where}: `{label}` has no {f}" for f in FLAG.findall(own) if unknown_flag(command, f, known)]
            train = known_flags("train")  # after `--`: tune's and cluster's training arguments
            found += [
                f"{where}: `{label} -- ...` passes {f}, no train flag" for f in FLAG.findall(after) if f not in train
            ]
    return found


@pytest.mark.parametrize("doc", DOCS, ids=lambda path: str(path.relative_to(REPO)))
def test_every_command_and_flag_a_doc_names_exists(doc):
    assert problems(doc.read_text(encoding="utf-8"), str(doc.relative_to(REPO))) == []


def test_a_doc_naming_a_command_or_flag_that_does_not_exist_fails():
    doc = (
        "Run `textsql trian --max_steps 2`, `textsql plan --model_id t5-small` and `--no_such_flag`; DeepSpeed's own\n"
        "`deepspeed --launcher pdsh` and pip's `--find-links` are theirs.\n\n"
        "```bash\n"
        "textsql plan --nodez 3 \\\n    --gpu_memory_gb 40   # --not_checked in a comment\n"
        "textsql cluster launch --hostfile h -- --model_idd x && textsql cluster bogus\n"
        "textsql train --no_lora --max_stepz 2\n"
        "```\n"
    )
    assert problems(doc) == [
        "doc:1: `textsql trian` is no command (textsql.cli.COMMANDS)",
        "doc:1: `--no_such_flag` is no flag of any textsql command",
        "doc:5: `textsql plan` has no --nodez",
        "doc:7: `textsql cluster launch -- ...` passes --model_idd, no train flag",
        "doc:7: `textsql cluster bogus` is no cluster subcommand",
        "doc:8: `textsql train` has no --max_stepz",
    ]


def test_every_command_has_a_row_in_the_readmes_table():
    rows = re.findall(r"^\| `textsql ([a-z-]+)`", (REPO / "README.md").read_text(encoding="utf-8"), re.MULTILINE)
    assert set(COMMANDS) - set(rows) == set()
