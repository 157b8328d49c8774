"""GRPO rewarded by executing the SQL, on questions the supervised model did not learn, against that same supervised
checkpoint: both scored on the real test slice with the same decoding, with a paired bootstrap interval of the
difference per seed so a gain is told from noise, each run's per-step curve and the learnable questions' statistics
before and after.

    python bench/grpo.py --output grpo.json                 # after bench/real_model.py's prep (its work folder)
    python bench/grpo.py --select --output sel.json         # GRPO's learning rate, on validation only
    python bench/grpo.py --max_steps 3 --seeds 0 --variants heldout --output estimate.json   # a time estimate

Variants (VARIANTS): `heldout` trains a supervised run on the first HEAD train questions only (bench/real_model.py's
`full` recipe with --max_train_samples HEAD) and runs GRPO on the rest (--grpo_questions_from HEAD), keeping the
questions that run gets right some of the time (--learnable_only: 0 < success < 1 in LEARNABLE_SAMPLES samples at the
training temperature); `learnable` runs GRPO from bench/real_model.py's `full` run (all of train) on its learnable train
questions. Each GRPO run is `textsql train --stage grpo` with GRPO's flags below (constant learning rate after warm-up,
8 generations, 8 prompts a step, hundreds of steps), one per seed (SEEDS), then `textsql infer` on the whole test slice
exactly as its supervised run was scored (greedy, bf16 weights). A step that finished is not run again. The model is
SmolLM2-135M-Instruct whose weights llama.cpp rounded to 4 bits.
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
from bench.real_model import RECIPES, TRAINED, Bench, bench_parser, executions  # noqa: E402
from textsql.evaluate import paired_bootstrap  # noqa: E402

HEAD = 600  # of the 898 real train questions: the supervised run of `heldout` learns these, GRPO gets the rest
LEARNABLE_SAMPLES = 8
# The learning rate is chosen with --select on validation (SELECT); published execution-reward runs use 3e-7 to 1e-6
# at 3B-7B, a 135M model may want more. Constant after 10 warm-up steps; no KL (--beta 0); TRL's dapo loss and group
# scaling, recorded in each run summary. 64 completions a step (8 prompts x 8) are generated together and trained on in
# 4 micro-batches of 16: one batch of 64 held its logits (64 x 128 tokens x 49,152 words) several times over and was
# killed at 15 GiB of host memory on this machine.
GRPO = [
    "--stage", "grpo", "--learning_rate", "1e-6", "--lr_scheduler_type", "constant_with_warmup",
    "--warmup_steps", "10", "--num_generations", "8", "--per_device_train_batch_size", "16",
    "--gradient_accumulation_steps", "4",
    "--max_completion_length", "64", "--max_steps", "300", "--temperature", "1.0", "--beta", "0",
    "--loss_type", "dapo", "--scale_rewards", "group", "--learnable_only", "True",
    "--learnable_samples", str(LEARNABLE_SAMPLES), "--precision", "bf16", "--save_strategy", "steps",
    "--save_steps", "50", "--save_total_limit", "1", "--logging_steps", "1", "--execution_accuracy_samples", "0",
]  # fmt: skip
SEEDS = (0, 1)
# name: (the supervised run it starts from, the flags that run needs over the `full` recipe, GRPO's flags over GRPO)
VARIANTS = {
    "heldout": (f"full_head{HEAD}", ["--max_train_samples", str(HEAD)], ["--grpo_questions_from", str(HEAD)]),
    "learnable": ("full", list(TRAINED["full"][2]), []),
}
# --select's candidates (learning rates), each against its supervised run on the validation split (102 questions:
# too few to tell 1-2 points; the paired interval says so)
SELECT = {"lr3e-7": ["--learning_rate", "3e-7"], "lr1e-6": [], "lr3e-6": ["--learning_rate", "3e-6"]}


def sft_run(bench: Bench, name: str, flags: list[str], dataset: Path) -> dict:
    """A supervised checkpoint, scored on test and validation (bench/real_model.py's `full` recipe; trained when missing)."""
    trained = bench.train(name, dataset, *flags, recipe=RECIPES["full"])
    run_dir = Path(trained["run_dir"])
    return {
        "train": trained,
        "test": bench.score(name, run_dir, dataset),
        "validation": bench.score(f"{name}_validation", run_dir, dataset, "--split", "validation"),
    }


def grpo_record(run_dir: Path) -> dict:
    """The GRPO run summary's grpo block: its knobs, the curve (steps), the learnable statistics before training."""
    return json.loads((run_dir / "run_summary.json").read_text()).get("grpo") or {}


def learnable_after(bench: Bench, name: str, run_dir: Path, dataset: Path) -> dict:
    """The learnable questions' success rates after GRPO: the same questions (those its --learnable_only kept), sampled
    as before (LEARNABLE_SAMPLES at the training temperature, the same seed), by the GRPO run's model."""

    def work():
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from textsql.train.grpo import grpo_dataset, learnable_statistics, success_rates

        record = grpo_record(run_dir)
        before = json.loads(Path(record["learnable"]["file"]).read_text())["rates"]
        train, tables = grpo_dataset(str(dataset), None, record.get("grpo_questions_from") or 0)
        kept = train.select([i for i, rate in enumerate(before) if 0 < rate < 1])
        model = AutoModelForCausalLM.from_pretrained(run_dir, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(run_dir)
        rates = success_rates(model, tokenizer, kept, tables, LEARNABLE_SAMPLES, record["temperature"], 64)
        return {"kept_questions": learnable_statistics(rates, LEARNABLE_SAMPLES)}

    return bench.step(f"learnable-after-{name}", work)


def grpo_runs(bench: Bench, dataset: Path, variants: list[str], seeds, extra: list[str]) -> dict:
    results = {}
    for variant in variants:
        sft_name, sft_flags, flags = VARIANTS[variant]
        sft = sft_run(bench, sft_name, sft_flags, dataset)
        before = executions(bench, sft_name)
        runs = {}
        for seed in seeds:
            name = f"grpo_{variant}_seed{seed}"
            trained = bench.train(
                name, dataset, *GRPO, *flags, *extra, "--seed", str(seed), model_id=Path(sft["train"]["run_dir"])
            )
            run_dir = Path(trained["run_dir"])
            record = grpo_record(run_dir)
            runs[name] = {
                "train": trained,
                "test": bench.score(name, run_dir, dataset),
                "gain": paired_bootstrap(before, executions(bench, name)),  # the same questions in the same order
                "settings": {k: v for k, v in record.items() if k not in ("steps", "learnable")},
                "steps": record.get("steps", []),
                "learnable_before": record.get("learnable"),
                "learnable_after": learnable_after(bench, name, run_dir, dataset),
            }
        results[variant] = {"sft": sft, "grpo": runs}
    return results


def selection(bench: Bench, dataset: Path, variants: list[str], extra: list[str]) -> dict:
    """GRPO's learning rate on the validation split: each candidate's validation execution accuracy and paired gain
    against its supervised run's."""
    results = {}
    for variant in variants:
        sft_name, sft_flags, flags = VARIANTS[variant]
        sft = sft_run(bench, sft_name, sft_flags, dataset)
        before = executions(bench, f"{sft_name}_validation")
        results[variant] = {"sft": sft["validation"]}
        for name, candidate in SELECT.items():
            run = f"select-grpo-{variant}-{name}"
            trained = bench.train(
                run, dataset, *GRPO, *flags, *candidate, *extra, model_id=Path(sft["train"]["run_dir"])
            )
            scored = bench.score(f"{run}_validation", Path(trained["run_dir"]), dataset, "--split", "validation")
            results[variant][name] = {
                "train": trained,
                "validation": scored,
                "gain": paired_bootstrap(before, executions(bench, f"{run}_validation")),
            }
    return results


def main(argv=None) -> None:
    parser = bench_parser(__doc__.split("\n\n")[0], "choose GRPO's learning rate on validation instead")
    parser.add_argument("--output", help="also write the JSON here")
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, of {', '.join(VARIANTS)}")
    parser.add_argument("--seeds", default=",".join(map(str, SEEDS)), help="comma-separated GRPO seeds")
    parser.add_argument("--max_steps", type=int, help="GRPO steps instead of GRPO's (a short run for a time estimate)")
    args = parser.parse_args(argv)
    variants = args.variants.split(",")
    unknown = set(variants) - set(VARIANTS)
    if unknown:
        parser.error(f"--variants takes names of {', '.join(VARIANTS)}; not {', '.join(sorted(unknown))}")
    seeds = [int(seed) for seed in args.seeds.split(",")]
    extra = ["--max_steps", str(args.max_steps)] if args.max_steps else []
    bench = Bench(args)
    bench.model()  # imported (or its record read back): the JSON names the model it measured
    started, load_before = time.perf_counter(), os.getloadavg()
    dataset = bench.dataset(TRAINED["full"][0])
    if args.select:
        body = {"selection": selection(bench, dataset, variants, extra)}
    else:
        body = {"variants": grpo_runs(bench, dataset, variants, seeds, extra)}
    emit(
        {
            "benchmark": "grpo" + ("_select" if args.select else ""),
            "model": bench.imported["record"],
            "grpo_flags": [*GRPO, *extra],
            "variant_settings": {n: {"sft": v[0], "sft_flags": v[1], "grpo_flags": v[2]} for n, v in VARIANTS.items()},
            "seeds": seeds,
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
