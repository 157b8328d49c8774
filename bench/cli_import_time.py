"""The `textsql` command's fixed costs: the wall time of `textsql --help`, of every `textsql COMMAND --help` and of a
`textsql plan` (with the planner's shape cache empty, then filled), each in a fresh interpreter, and what each imports
(`python -X importtime`: the largest imports by cumulative time, and which heavy libraries were loaded).

    python bench/cli_import_time.py
    python bench/cli_import_time.py --commands plan,train --repeat 5 --output cli.json
    python bench/cli_import_time.py --textsql_root /tmp/old-checkout     # an older commit's figures (git worktree add)

It prints one JSON object: the machine, its load average before and after, and per command line the wall times of
`--repeat` runs (seconds; min and median), the exit status, the total import time, the top imports and the heavy
libraries among them. Nothing is trained or downloaded; it takes about a minute at rest (longer for the first plan,
which builds its model's shape with torch and transformers), longer on a busy machine.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))  # runs from a checkout without installing the package

from bench.common import emit, machine  # noqa: E402  (the repository root is on sys.path now)
from textsql.cli import COMMANDS  # noqa: E402

HEAVY = ("torch", "transformers", "deepspeed", "peft", "accelerate", "datasets", "numpy", "pandas", "matplotlib")
PLAN_ARGV = ["plan", "--model_id", "t5-large", "--nodes", "3", "--gpu_memory_gb", "40", "--precision", "fp32"]


def command_lines(commands: list[str]) -> dict[str, tuple[list[str], str]]:
    """The command lines timed, by label, with the planner's shape cache each meets (empty, or filled beforehand):
    `--help` of textsql and of each command asked, and the README's plan."""
    lines = {"textsql --help": (["--help"], "filled")}
    lines |= {f"textsql {name} --help": ([name, "--help"], "filled") for name in commands}
    if "plan" in commands:
        lines |= {f"textsql plan (shape cache {cache})": (PLAN_ARGV, cache) for cache in ("empty", "filled")}
    return lines


def run(argv: list[str], environment: dict, importtime: bool = False) -> tuple[float, int, str]:
    """(seconds, exit status, stderr) of `python [-X importtime] -m textsql ARGV` in a fresh interpreter, started in
    the user cache's folder: `-m` puts the working directory first on the path, where a checkout's textsql would win
    over --textsql_root's."""
    started = time.perf_counter()
    done = subprocess.run(
        [sys.executable, *(["-X", "importtime"] if importtime else []), "-m", "textsql", *argv],
        env=environment,
        cwd=environment["XDG_CACHE_HOME"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    return time.perf_counter() - started, done.returncode, done.stderr


def imports(stderr: str, top: int) -> dict:
    """`-X importtime`'s lines read back: the total, the largest imports by cumulative time (the outermost of each
    chain: what the command itself pulled in), and which heavy libraries were loaded."""
    rows = []  # (depth, name, cumulative microseconds)
    for line in stderr.splitlines():
        if not line.startswith("import time:") or "cumulative" in line:
            continue
        _, _, cumulative, name = (part for part in line.replace("import time:", "|", 1).split("|"))
        depth = (len(name) - len(name.lstrip()) - 1) // 2
        rows.append((depth, name.strip(), int(cumulative)))
    outermost = sorted((r for r in rows if r[0] == 0), key=lambda r: -r[2])
    loaded = {name for _, name, _ in rows}
    return {
        "total_import_s": round(sum(r[2] for r in outermost) / 1e6, 3),
        "top_imports_s": {name: round(us / 1e6, 3) for _, name, us in outermost[:top]},
        "heavy_libraries": [name for name in HEAVY if name in loaded],
    }


def measure(argv: list[str], cache: str, environment: dict, workdir: str, repeat: int, top: int) -> dict:
    """Wall times of `repeat` runs of `textsql ARGV`, then one more under -X importtime for its imports. With an
    empty cache each run has a new user cache folder (so the empty-cache plan runs once and is profiled once); with
    a filled one, one untimed run fills the shared folder first."""

    def with_cache() -> dict:
        return environment | {"XDG_CACHE_HOME": tempfile.mkdtemp(dir=workdir)} if cache == "empty" else environment

    if cache == "filled":
        run(argv, environment)
    runs = [run(argv, with_cache()) for _ in range(1 if cache == "empty" else repeat)]
    seconds = [r[0] for r in runs]
    _, _, profile = run(argv, with_cache(), importtime=True)
    return {
        "argv": argv,
        "shape_cache": cache,
        "exit_status": runs[0][1],
        "wall_s": [round(s, 3) for s in seconds],
        "wall_s_min": round(min(seconds), 3),
        "wall_s_median": round(statistics.median(seconds), 3),
        **imports(profile, top),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--commands", default=",".join(COMMANDS), help="comma-separated commands (default: all)")
    parser.add_argument("--repeat", type=int, default=3, help="runs of each command line (the empty-cache plan: 1)")
    parser.add_argument("--top", type=int, default=6, help="largest imports listed per command line")
    parser.add_argument(
        "--textsql_root", default=str(REPO), help="the checkout whose textsql is timed (default: this one)"
    )
    parser.add_argument("--output", help="also write the JSON to this file")
    args = parser.parse_args()
    commands = [name for name in args.commands.split(",") if name]
    unknown = sorted(set(commands) - set(COMMANDS))
    if unknown:
        parser.error(f"unknown commands {unknown}; textsql has {', '.join(COMMANDS)}")
    with tempfile.TemporaryDirectory(prefix="textsql-cli-bench-") as workdir:
        # The checkout's textsql first on the path (child processes too), offline, and a user cache of its own.
        environment = os.environ | {
            "PYTHONPATH": os.pathsep.join([args.textsql_root, os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
            "XDG_CACHE_HOME": tempfile.mkdtemp(dir=workdir),
            "HF_HUB_OFFLINE": "1",
        }
        load_before = os.getloadavg()
        results = {
            label: measure(argv, cache, environment, workdir, args.repeat, args.top)
            for label, (argv, cache) in command_lines(commands).items()
        }
        load_after = os.getloadavg()
    emit(
        {
            "benchmark": "cli_import_time",
            "textsql_root": args.textsql_root,
            "machine": machine(),
            "load_average_before": [round(x, 2) for x in load_before],
            "load_average_after": [round(x, 2) for x in load_after],
            "results": results,
        },
        args.output,
    )


if __name__ == "__main__":
    main()
