"""The main figures under two sets of pins side by side, in one run on this machine: the same benchmarks, the same
settings and this checkout's textsql, once with an old environment's Python and once with a new one's.

    python bench/pins.py --old_python OLD_VENV/bin/python                     # new = the Python running this script
    python bench/pins.py --old_python OLD/bin/python --new_python NEW/bin/python --rounds 3 --output pins.json

For every setting and round it runs the benchmark script itself (bench/train_throughput.py, bench/causal_vs_t5.py)
under each Python, the order alternating from round to round (old, new; new, old; ...) so that neither environment
always meets the machine's quieter moment. Each run is a fresh process tree with this checkout first on PYTHONPATH, so
only the installed packages differ, never textsql's code. Settings (small, a few minutes in all on 2 idle cores):

- throughput-question, throughput-header: train_throughput.py's main row (the cpu-small T5, the walkthrough's recipe
  against textsql's, one torch thread) with question and question+header sources;
- causal: causal_vs_t5.py's tiny T5 and tiny Qwen2 (padded and packed) trained by `textsql train`.

It prints one JSON object: the pinned packages' versions of each environment, the machine, the load average before
and after the whole run and each benchmark run, every round's figures, and per figure the median of the rounds for
old and new and their ratio new / old.
"""

from __future__ import annotations

import argparse
import json
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

# The packages requirements*.txt pins that decide the figures (issue 32's set, and what they run on).
PINNED = (
    "torch",
    "transformers",
    "tokenizers",
    "safetensors",
    "huggingface_hub",
    "datasets",
    "accelerate",
    "deepspeed",
    "peft",
    "bitsandbytes",
    "torchao",
    "gradio",
    "numpy",
)
SETTINGS = ("throughput-question", "throughput-header", "causal")


def versions(python: str) -> dict:
    """{package: version or None} of the PINNED packages in the environment of `python`."""
    code = (
        "import json, importlib.metadata as m\n"
        "def v(p):\n    try:\n        return m.version(p)\n    except m.PackageNotFoundError:\n        return None\n"
        f"print(json.dumps({{p: v(p) for p in {list(PINNED)!r}}}))"
    )
    return json.loads(subprocess.run([python, "-c", code], capture_output=True, text=True, check=True).stdout)


def command(setting: str, python: str, output: str, args) -> list[str]:
    """The benchmark command of one setting under `python`, writing its JSON to `output`."""
    if setting.startswith("throughput"):
        source_format = "question+header" if setting == "throughput-header" else "question"
        return [
            python,
            str(REPO / "bench" / "train_throughput.py"),
            "--shapes",
            "cpu-small",
            "--steps",
            str(args.throughput_steps),
            "--repetitions",
            "1",
            "--source_format",
            source_format,
            "--train_tables",
            str(args.train_tables),
            "--workdir",
            str(Path(args.workdir) / "throughput"),
            "--output",
            output,
        ]
    return [
        python,
        str(REPO / "bench" / "causal_vs_t5.py"),
        "--runs",
        "t5",
        "causal-padded",
        "causal-packed",
        "--steps",
        str(args.causal_steps),
        "--train_tables",
        "20",
        "--score_questions",
        "20",
        "--threads",
        "1",
        "--output",
        output,
    ]


def figures(setting: str, report: dict) -> dict:
    """{figure name: number} of one benchmark report: throughput's samples/s of each recipe and their ratio, peak
    memory; causal's samples/s, peak RSS and train loss per run."""
    if setting.startswith("throughput"):
        (result,) = report["results"]
        out = {"ratio_samples_per_second": result["ratio_samples_per_second"]}
        for recipe in ("walkthrough", "textsql"):
            out[f"{recipe}_samples_per_second"] = result[recipe]["samples_per_second"]
            out[f"{recipe}_samples_per_cpu_second"] = result[recipe]["samples_per_cpu_second"]
            out[f"{recipe}_peak_memory_gib"] = result[recipe]["peak_memory_gib"]
            out[f"{recipe}_train_loss"] = result[recipe]["train_loss"]
        return out
    out = {}
    for row in report["results"]:
        for key in ("samples_per_second", "peak_rss_mib", "train_loss"):
            out[f"{row['run']}_{key}"] = row[key]
    return out


def run_once(setting: str, python: str, args) -> dict:
    """One benchmark run under `python`: its figures, seconds and the load average around it."""
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    with tempfile.NamedTemporaryFile(suffix=".json") as output:
        before, started = os.getloadavg()[0], time.perf_counter()
        done = subprocess.run(command(setting, python, output.name, args), capture_output=True, text=True, env=env)
        if done.returncode != 0:
            raise SystemExit(f"{setting} under {python} failed:\n{done.stdout[-3000:]}\n{done.stderr[-5000:]}")
        report = json.loads(Path(output.name).read_text())
    return {
        "figures": figures(setting, report),
        "seconds": round(time.perf_counter() - started, 1),
        "load_average_before_after": [round(before, 2), round(os.getloadavg()[0], 2)],
    }


def side_by_side(rounds: list[dict]) -> dict:
    """{figure: {old, new, new_over_old}}: the medians over the rounds."""
    table = {}
    for name in rounds[0]["old"]["figures"]:
        old = statistics.median(r["old"]["figures"][name] for r in rounds)
        new = statistics.median(r["new"]["figures"][name] for r in rounds)
        table[name] = {"old": old, "new": new, "new_over_old": new / old if old else None}
    return table


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--old_python", required=True, help="The Python of the environment with the old pins.")
    parser.add_argument(
        "--new_python", default=sys.executable, help="The Python of the new pins (default: the one running this)."
    )
    parser.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=SETTINGS)
    parser.add_argument("--rounds", type=int, default=2, help="Runs per setting and environment, alternating.")
    parser.add_argument("--throughput_steps", type=int, default=12, help="train_throughput.py's measured steps.")
    parser.add_argument("--train_tables", type=int, default=200, help="train_throughput.py's generated tables.")
    parser.add_argument("--causal_steps", type=int, default=10, help="causal_vs_t5.py's steps per run.")
    parser.add_argument(
        "--workdir",
        default=str(Path(tempfile.gettempdir()) / "textsql-bench-pins"),
        help="Where generated data is built once and shared by both environments.",
    )
    parser.add_argument("--output", default=None, help="Also write the JSON here.")
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    pythons = {"old": args.old_python, "new": args.new_python}
    environments = {side: {"python": python, "versions": versions(python)} for side, python in pythons.items()}
    load_before, started = os.getloadavg(), time.perf_counter()
    results = {}
    for setting in args.settings:
        rounds = []
        for number in range(args.rounds):
            order = ("old", "new") if number % 2 == 0 else ("new", "old")
            rounds.append({side: run_once(setting, pythons[side], args) for side in order})
            print(f"[{setting} round {number + 1}/{args.rounds}] {json.dumps(rounds[-1])}", file=sys.stderr, flush=True)
        results[setting] = {"side_by_side": side_by_side(rounds), "rounds": rounds}
    emit(
        {
            "benchmark": "pins",
            "date": time.strftime("%Y-%m-%d"),
            "machine": machine(),
            "environments": environments,
            "settings": {k: v for k, v in vars(args).items() if k not in ("output", "old_python", "new_python")},
            "load_average_before": [round(x, 2) for x in load_before],
            "load_average_after": [round(x, 2) for x in os.getloadavg()],
            "wall_seconds": round(time.perf_counter() - started, 1),
            "results": results,
        },
        args.output,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
