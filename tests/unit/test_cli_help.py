"""Every `textsql COMMAND --help` prints its help and exits 0, without a traceback, under a usage line that names the
command (in-process: cheap), and imports no heavy library where the command does not train."""

import json
import subprocess
import sys

import pytest
from test_cli_errors import run as run_help

from textsql.cli import COMMANDS, USAGE
from textsql.cli.cluster import TRAINING_SUBCOMMANDS

EXPECTED = {"prep", "train", "infer", "check-config", "plan", "tune", "report", "tensorboard", "lab", "demo", "cluster"}


def test_every_command_help_exits_zero_without_traceback(capsys):
    assert EXPECTED <= set(COMMANDS), f"commands missing from textsql.cli: {EXPECTED - set(COMMANDS)}"
    failures = []
    for argv in [["--help"], *([name, "--help"] for name in sorted(COMMANDS))]:
        status, crash = run_help(argv)
        captured = capsys.readouterr()
        printed = captured.out + captured.err
        if status != 0 or "Traceback" in printed + crash or not printed.strip():
            failures.append(f"textsql {' '.join(argv)}: exit {status}\n{crash or printed[-2000:]}")
    assert not failures, "\n\n".join(failures)


def test_textsql_help_names_every_command_once():
    commands = USAGE.split("commands:\n", 1)[1].split("\n\n", 1)[0]
    named = [line.split()[0] for line in commands.splitlines() if line[:3].strip() and line.startswith("  ")]
    assert named == list(COMMANDS)


# `textsql cluster --help` prints the module's overview (textsql/cli/cluster.py); its subcommands have usage lines.
USAGE_ARGV = {name: [name, "--help"] for name in EXPECTED - {"cluster"}}
USAGE_ARGV |= {f"cluster {sub}": ["cluster", sub, "--help"] for sub in TRAINING_SUBCOMMANDS}


@pytest.mark.parametrize("command", sorted(USAGE_ARGV))
def test_usage_line_names_the_command(command, capsys):
    run_help(USAGE_ARGV[command])
    captured = capsys.readouterr()
    usage = [line for line in (captured.out + captured.err).splitlines() if line.startswith("usage:")]
    assert usage and usage[0].startswith(f"usage: textsql {command} "), usage


# `--help` of these imports the training stack: train's lists the Trainer's own arguments (transformers'
# TrainingArguments imports torch), and tune's and demo's argument dataclasses live beside the training they run.
HELP_WITH_TRAINING = {"train", "tune", "demo"}
HEAVY = ("torch", "transformers", "deepspeed", "peft", "datasets", "accelerate", "numpy", "pandas", "matplotlib")


def test_help_imports_no_heavy_library_where_the_command_does_not_train():
    # One fresh interpreter runs each --help in turn and notes what was imported after it: the first command that
    # imports torch (or transformers, ...) is the one named.
    argvs = [["--help"], *([name, "--help"] for name in sorted(COMMANDS) if name not in HELP_WITH_TRAINING)]
    code = (
        "import contextlib, io, json, sys\nfrom textsql.cli import main\nloaded = {}\n"
        f"for argv in {argvs!r}:\n"
        "    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):\n"
        "        try:\n            main(argv)\n        except SystemExit:\n            pass\n"
        f"    loaded[' '.join(argv)] = [m for m in {HEAVY!r} if m in sys.modules]\n"
        "print(json.dumps(loaded))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    loaded = json.loads(done.stdout)
    assert list(loaded) == [" ".join(argv) for argv in argvs]
    assert {argv: heavy for argv, heavy in loaded.items() if heavy} == {}, "what `textsql ARGV` imported"
