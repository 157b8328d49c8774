"""`textsql demo` (both families) as a user runs it, on one checkout's defaults: its printed figures and its time.

    python bench/demo_defaults.py --tree /tmp/textsql-before --label before --output before.json   # an older checkout
    python bench/demo_defaults.py --label after --output after.json                                # this one
    python bench/demo_defaults.py --compare before.json after.json --output both.json              # paired, per family

Each run is the whole `textsql demo` (`--family t5`, then `--family causal`; the two side by side, each on one thread
as the demo trains and scores), with no flag but --workdir: the checkout's own defaults (source format, decoding).
It records the wall time, each demo step's time, the load before and after, the printed test-split figures and the
scored predictions. --compare pairs two runs' test predictions per family (the same generated questions: the
generator is seeded) with a paired bootstrap interval of the execution-accuracy difference, and, where a run's
decoding was compared against greedy (infer's --compare_to_greedy), that decoding against greedy on the same model.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))  # runs from a checkout without installing the package

from bench.common import emit, machine  # noqa: E402  (the repository root is on sys.path now)
from textsql.evaluate import paired_bootstrap  # noqa: E402

FAMILIES = ("t5", "causal")
RUN_FOLDERS = {"t5": "tiny-t5", "causal": "tiny-qwen2"}
STEP = re.compile(r"== \[(\d)/4\] done in (\d+) s")


def start(tree: Path, workdir: Path, family: str) -> tuple[subprocess.Popen, float]:
    env = dict(os.environ, DS_ACCELERATOR="cpu", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    env["PYTHONPATH"] = os.pathsep.join([str(tree), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env["OMP_NUM_THREADS"] = "1"  # the demo's own choice (textsql.demo.tiny.DEMO_THREADS), for its start-up too
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    workdir.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "textsql", "demo", "--family", family, "--workdir", str(workdir / "textsql-demo")]
    log = open(workdir / "demo.log", "w")
    return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=workdir), time.perf_counter()


def result(workdir: Path, family: str, wall_s: float, returncode: int) -> dict:
    text = (workdir / "demo.log").read_text()
    run = workdir / "textsql-demo" / "runs" / RUN_FOLDERS[family]
    record = {"family": family, "returncode": returncode, "wall_s": round(wall_s, 1)}
    record["step_seconds"] = {int(n): int(s) for n, s in STEP.findall(text)}
    record["printed"] = [
        line
        for line in text.splitlines()
        if line.startswith(("test split:", "parts right:", "against greedy")) or " examples (test, " in line
    ]
    if returncode:
        record["log_tail"] = text[-3000:]
        return record
    metrics = json.loads((run / "eval_metrics.json").read_text())
    summary = json.loads((run / "run_summary.json").read_text())
    data = json.loads((Path(metrics["dataset_dir"]) / "textsql_data.json").read_text())
    record.update(
        source_format=metrics.get("source_format"),
        decoding=metrics["decoding"],
        execution_accuracy=metrics["execution_accuracy"],
        logical_form_accuracy=metrics["logical_form_accuracy"],
        parse_errors=metrics["parse_errors"],
        components=metrics["components"],
        test_questions=metrics["examples"],
        queries_per_second=metrics["queries_per_second"],
        train_runtime_s=summary.get("train_runtime"),
        train_samples_per_second=summary.get("train_samples_per_second"),
        mean_real_tokens_per_example=data["lengths"]["train"]["mean_tokens_per_example"],
        predictions=str(run / "predictions.jsonl"),
    )
    return record


def run_checkout(args) -> dict:
    tree = Path(args.tree).resolve()
    load_before, started = os.getloadavg(), time.perf_counter()
    children = {family: start(tree, Path(args.workdir) / args.label / family, family) for family in FAMILIES}
    results = []
    for family, (child, began) in children.items():
        returncode = child.wait()
        results.append(
            result(Path(args.workdir) / args.label / family, family, time.perf_counter() - began, returncode)
        )
    commit = subprocess.run(["git", "-C", str(tree), "rev-parse", "HEAD"], capture_output=True, text=True).stdout
    return {
        "benchmark": "demo_defaults",
        "label": args.label,
        "tree": str(tree),
        "commit": commit.strip() or args.commit,
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "wall_seconds": round(time.perf_counter() - started, 1),
        "machine": machine(),
        "load_average_before": [round(x, 2) for x in load_before],
        "load_average_after": [round(x, 2) for x in os.getloadavg()],
        "results": results,
    }


def executions(path: str, key: str = "execution_match") -> list:
    records = [json.loads(line) for line in open(path)]
    return [((r["table_id"], r["question"]), bool(r[key])) for r in records]


def compare(before: dict, after: dict) -> dict:
    """Per family: after against before on the same test questions, and each run's decoding against its greedy."""
    pairs = []
    for old, new in zip(before["results"], after["results"]):
        entry = {"family": new["family"]}
        if old.get("predictions") and new.get("predictions"):
            entry["after_vs_before"] = paired_bootstrap(executions(old["predictions"]), executions(new["predictions"]))
        for label, run in (("before", old), ("after", new)):
            if run.get("predictions") and "against_greedy" in run.get("decoding", {}):
                greedy = executions(run["predictions"], "greedy_execution_match")
                entry[f"{label}_decoding_vs_greedy"] = paired_bootstrap(greedy, executions(run["predictions"]))
        pairs.append(entry)
    return {"benchmark": "demo_defaults", "before": before, "after": after, "paired": pairs}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tree", default=str(REPO), help="The checkout whose demo runs (PYTHONPATH).")
    parser.add_argument("--label", default="after")
    parser.add_argument("--commit", default=None, help="The tree's commit, where it is no git checkout (git archive).")
    parser.add_argument("--workdir", default=str(Path(tempfile.gettempdir()) / "textsql-bench-demo-defaults"))
    parser.add_argument("--compare", nargs=2, metavar=("BEFORE", "AFTER"), help="Two runs' JSON to pair.")
    parser.add_argument("--output", default=None, help="Also write the JSON here.")
    args = parser.parse_args(argv)
    if args.compare:
        before, after = (json.loads(Path(path).read_text()) for path in args.compare)
        emit(compare(before, after), args.output)
    else:
        emit(run_checkout(args), args.output)
    return 0


if __name__ == "__main__":
    sys.exit(main())
