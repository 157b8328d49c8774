"""Every `textsql COMMAND --help` prints its help and exits 0, without a traceback (in-process: cheap)."""

import traceback

from textsql.cli import COMMANDS, main

EXPECTED = {"prep", "train", "infer", "check-config", "plan", "report", "tensorboard", "lab", "demo", "cluster"}


def run_help(argv: list[str]) -> tuple[int | str, str]:
    """(exit status, or the exception's traceback; what was printed) of `textsql ARGV`."""
    try:
        return main(argv), ""
    except SystemExit as exit_:  # argparse ends --help with sys.exit(0)
        return (exit_.code or 0), ""
    except Exception:  # noqa: BLE001 - a crash is the failure this test reports
        return "crashed", traceback.format_exc()


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
