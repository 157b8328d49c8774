"""Both demos' trainings side by side on this machine: samples/s (and real tokens/s) per family, the load, and each
demo's printed estimate of its training against the time the training took.

    python bench/demo_speed.py --output demo_speed.json                # the demos' own sizes; about 12 minutes on 2 cores
    python bench/demo_speed.py --epochs 1 --before /tmp/textsql-49d0816  # and an older checkout's demo trainings beside

Each training is the demo's own (textsql.demo.tiny.demo_train: the demo's generated data, tiny model, ZeRO-2, settings and
thread count, timed by its first steps), in a fresh process, after its data and model were built; the families
alternate (t5, causal, t5, causal with --repeats 2), so that both see the same load. The estimate is the whole
training's (steps and evaluations) as the demo prints it; `estimate_over_actual` divides it by the Trainer's
train_runtime (the training from its first step to its last, evaluations and checkpoints included) and is within a
factor of 1.5 when `estimate_within_1_5` says so. With --before, another checkout's demo trainings run alternately with
these (its textsql.demo: `train(*demo_training(...))` as that demo ran them, in its own data folder, its printed
estimate read from its demo_estimate). Prints one JSON object with the machine and the load before and after each run.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))  # runs from a checkout without installing the package

from bench.common import emit, run_report  # noqa: E402  (the repository root is on sys.path now)

FAMILIES = ("t5", "causal")
# One training in a fresh process, run by the checkout on PYTHONPATH: the demo's assets (built or reused), then its
# training, timed; a JSON line at the end.
CHILD = """
import json, os, re, sys, time
from pathlib import Path
try:
    from textsql.demo import tiny as demo
except ImportError:  # a checkout from before the real demo
    from textsql import demo

workdir, family, epochs, build_only = sys.argv[1], sys.argv[2], float(sys.argv[3]), sys.argv[4] == "build"
args = demo.DemoArguments(workdir=workdir, family=family, epochs=epochs)
data_dir, model_dir = demo.build_assets(Path(workdir), family=family)
if build_only:
    sys.exit(0)
load, started = os.getloadavg()[0], time.perf_counter()
if hasattr(demo, "demo_train"):
    summary, estimate_s = demo.demo_train(args, data_dir, model_dir, echo=lambda line: print(line, file=sys.stderr))
else:  # an older demo: it printed its estimate before training, from the cores and the load
    text = demo.demo_estimate(os.cpu_count() or 1, load, demo.DEMO_IDLE_MINUTES[family])
    estimate_s = 60 * float(re.search(r"about (\\d+) minutes", text).group(1))
    summary = demo.train(*demo.demo_training(args, data_dir, model_dir))
meta = json.loads((data_dir / "textsql_data.json").read_text())
print("demo-speed: " + json.dumps({
    "wall_s": round(time.perf_counter() - started, 1),
    "estimate_s": estimate_s,
    "train_runtime_s": summary.train_runtime,
    "samples_per_second": summary.train_samples_per_second,
    "real_tokens_per_second": summary.real_tokens_per_second,
    "steps": summary.global_step,
    "mean_real_tokens_per_example": meta["lengths"]["train"]["mean_tokens_per_example"],
    "parameters": summary.parameters,
    "strategy": summary.strategy.get("label"),
    "eval_loss": summary.eval_loss,
    "execution_accuracy": summary.execution_accuracy,
}))
"""


def run_child(tree: Path, workdir: Path, family: str, epochs: float, build: bool = False) -> dict | None:
    env = dict(os.environ, DS_ACCELERATOR="cpu", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    env["PYTHONPATH"] = os.pathsep.join([str(tree), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.pop("OMP_NUM_THREADS", None)  # each demo decides its own threads, as it does for a user
    # as in an activated environment: its ninja builds DeepSpeed's ops for both checkouts (two ninjas rebuild each other's)
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    command = [sys.executable, "-c", CHILD, str(workdir), family, str(epochs), "build" if build else "train"]
    workdir.parent.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(command, capture_output=True, text=True, env=env, cwd=workdir.parent)
    if done.returncode != 0:
        raise SystemExit(f"{family} ({tree}) failed:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}")
    if build:
        return None
    line = next(line for line in done.stdout.splitlines() if line.startswith("demo-speed: "))
    return json.loads(line.split(": ", 1)[1])


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epochs", type=float, default=8.0, help="The demo's --epochs (its default: 8).")
    parser.add_argument("--repeats", type=int, default=2, help="Trainings of each family, alternating.")
    parser.add_argument("--before", help="Another checkout (a folder holding textsql/) whose demo trains beside.")
    parser.add_argument("--workdir", help="Where the demos' folders go (default: a temporary folder).")
    parser.add_argument("--output", help="Also write the JSON here.")
    args = parser.parse_args(argv)

    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="demo-speed-"))
    trees = {"after": REPO} | ({"before": Path(args.before).resolve()} if args.before else {})
    for label, tree in trees.items():
        for family in FAMILIES:
            run_child(tree, workdir / label / "textsql-demo", family, args.epochs, build=True)
    load_before, started = os.getloadavg(), time.perf_counter()
    results = []
    for repeat in range(args.repeats):
        for family in FAMILIES:
            for label, tree in trees.items():
                before = os.getloadavg()
                row = run_child(tree, workdir / label / "textsql-demo", family, args.epochs)
                ratio = row["estimate_s"] / row["train_runtime_s"] if row["estimate_s"] else None
                row = {
                    "checkout": label,
                    "family": family,
                    "repeat": repeat,
                    **row,
                    "estimate_over_actual": round(ratio, 3) if ratio else None,
                    "estimate_within_1_5": bool(ratio and 1 / 1.5 <= ratio <= 1.5),
                    "load_average_before": [round(x, 2) for x in before],
                    "load_average_after": [round(x, 2) for x in os.getloadavg()],
                }
                results.append(row)
                print(json.dumps(row), file=sys.stderr, flush=True)
    emit(run_report("demo_speed", args, started, load_before, results), args.output)


if __name__ == "__main__":
    main()
