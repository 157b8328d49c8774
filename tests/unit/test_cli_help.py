"""Every `textsql COMMAND --help` prints its help and exits 0, without a traceback, under a usage line that names the
command (in-process: cheap)."""

import pytest
from test_cli_errors import run as run_help

from textsql.cli import COMMANDS

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


# `textsql cluster --help` prints the module's overview (textsql/cli/cluster.py); its subcommands have usage lines.
USAGE_ARGV = {name: [name, "--help"] for name in EXPECTED - {"cluster"}}
USAGE_ARGV |= {f"cluster {sub}": ["cluster", sub, "--help"] for sub in ("train", "launch", "preflight")}


@pytest.mark.parametrize("command", sorted(USAGE_ARGV))
def test_usage_line_names_the_command(command, capsys):
    run_help(USAGE_ARGV[command])
    captured = capsys.readouterr()
    usage = [line for line in (captured.out + captured.err).splitlines() if line.startswith("usage:")]
    assert usage and usage[0].startswith(f"usage: textsql {command} "), usage
