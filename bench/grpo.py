"""GRPO rewarded by executing the SQL, on top of the real model's best supervised run: both scored on the real test slice
with the same decoding, side by side, with a paired bootstrap interval of the difference so a gain is told from noise.

    python bench/grpo.py --output grpo.json           # after bench/real_model.py (its work folder and best full run)
    python bench/grpo.py --select --output sel.json   # GRPO's learning rate and reward weights, on validation only

The supervised checkpoint is bench/real_model.py's fully fine-tuned run (`full`, SmolLM2-135M-Instruct whose weights
llama.cpp rounded to 4 bits), trained there if it is not yet. Each GRPO run is `textsql train --stage grpo --model_id
<that run>` on the real train lines (the same prepared dataset), one per seed, then `textsql infer` on the whole test
slice exactly as the supervised run was scored (greedy, bf16 weights). A step that finished is not run again.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))  # runs from a checkout without installing the package

from bench.common import emit, machine  # noqa: E402
from bench.real_model import RECIPES, TRAINED, Bench, bench_parser, executions, paired_bootstrap  # noqa: E402

# Chosen with --select on the validation split (bench/README.md); never on test.
GRPO = [
    "--stage", "grpo", "--learning_rate", "2e-6", "--num_generations", "8", "--per_device_train_batch_size", "16",
    "--max_completion_length", "64", "--max_steps", "30", "--temperature", "1.0", "--precision", "bf16",
    "--save_strategy", "no", "--logging_steps", "1", "--execution_accuracy_samples", "0",
]  # fmt: skip
SEEDS = (0,)
# --select's candidates beside GRPO's own settings above (whose comparison run is scored on validation too)
SELECT = {
    "lr1e-5": ["--learning_rate", "1e-5"],
}


def sft_run(bench: Bench) -> tuple[Path, dict]:
    """The supervised checkpoint and its test score (bench/real_model.py's `full` run, trained here when missing)."""
    result = bench.trained_and_scored("full")
    return Path(result["train"]["run_dir"]), result["test"]


def grpo_runs(bench: Bench, sft: Path, dataset: Path) -> dict:
    runs = {}
    for seed in SEEDS:
        name = f"grpo_seed{seed}"
        trained = bench.train(name, dataset, *GRPO, "--seed", str(seed), model_id=sft)
        runs[name] = {"train": trained, "test": bench.score(name, Path(trained["run_dir"]), dataset)}
    return runs


def selection(bench: Bench, sft: Path, dataset: Path) -> dict:
    """GRPO's settings on the validation split: each candidate's validation execution accuracy against the SFT run's."""
    results = {"sft": bench.score("sft_validation", sft, dataset, "--split", "validation")}
    for name in (f"grpo_seed{seed}" for seed in SEEDS):
        if bench.done(f"train-{name}"):  # the comparison's run, with GRPO's own settings
            run_dir = Path(json.loads((bench.work / "results" / f"train-{name}.json").read_text())["run_dir"])
            results[name] = {"validation": bench.score(f"{name}_validation", run_dir, dataset, "--split", "validation")}
    for name, flags in SELECT.items():
        trained = bench.train(f"select-grpo-{name}", dataset, *GRPO, *flags, model_id=sft)
        results[name] = {
            "train": trained,
            "validation": bench.score(
                f"select-grpo-{name}", Path(trained["run_dir"]), dataset, "--split", "validation"
            ),
        }
    return results


def main(argv=None) -> None:
    parser = bench_parser(__doc__.split("\n\n")[0], "choose GRPO's settings on validation instead")
    parser.add_argument("--output", help="also write the JSON here")
    args = parser.parse_args(argv)
    bench = Bench(args)
    bench.model()  # imported (or its record read back): the JSON names the model it measured
    started, load_before = time.perf_counter(), os.getloadavg()
    dataset = bench.dataset(TRAINED["full"][0])
    sft, sft_test = sft_run(bench)
    if args.select:
        body = {"selection": selection(bench, sft, dataset)}
    else:
        runs = grpo_runs(bench, sft, dataset)
        before = executions(bench, "full")
        body = {
            "sft": {"run_dir": str(sft), "recipe": str(RECIPES["full"].relative_to(REPO)), "test": sft_test},
            "grpo": runs,
            "gain": {name: paired_bootstrap(before, executions(bench, name)) for name in runs},
        }
    emit(
        {
            "benchmark": "grpo" + ("_select" if args.select else ""),
            "model": bench.imported["record"],
            "grpo_flags": GRPO,
            **body,
            "machine": machine(),
            "wall_seconds": round(time.perf_counter() - started, 1),
            "load_average_start_end": [round(load_before[0], 2), round(os.getloadavg()[0], 2)],
            "note": "the model's weights were rounded to 4 bits (Q4_1) by llama.cpp before fine-tuning",
        },
        args.output,
    )


if __name__ == "__main__":
    main()
