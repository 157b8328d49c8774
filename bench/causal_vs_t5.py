"""A tiny causal LM against the tiny T5 on the same data, and padded against packed batches for the causal LM, in one
run on this machine.

    python bench/causal_vs_t5.py --output causal_vs_t5.json     # 10-16 minutes on 2 CPU cores
    python bench/causal_vs_t5.py --runs t5 causal-padded          # the two families only

Generated WikiSQL-format data (question+header prompts, textsql.wikisql.synthetic) is prepared twice: for a tiny T5
(textsql.tiny.make_tiny_model) and for a tiny Qwen2 (textsql.tiny.make_tiny_causal_model), each with its own tokenizer
trained on the same text. Every run is `textsql train` in a fresh process (its peak resident memory is its own), the
same steps, batch, learning rate and seed, no evaluation, no checkpoints; its run_summary.json gives samples/s, real
(non-padding) tokens/s, peak memory and the loss. Each trained model then scores the same generated test questions
(`textsql infer`'s scoring, greedy): the whole query (execution, logical form, exact match) and each of its parts.
The defaults (1,000 steps of 16 on 1,500 questions from 150 tables, learning rate 3e-3) are about what a tiny model
from scratch needs before any held-out query executes right: after 10 steps every score was 0, after 300 steps on 400
questions still 0 (only the parts moved). Runs:

- t5: the tiny T5, padded batches (textsql's default, batches grouped by length);
- causal-padded / causal-packed: the tiny Qwen2 with padded batches, and with --packing True (one row per batch, no
  padding, the position ids restarting at each example), batches grouped by length (textsql's default);
- causal-padded-random / causal-packed-random: the same with random batches (--train_sampling_strategy random), where
  padding costs the most.

The padding fraction is the padded collator's share of padding positions over the first --steps batches that the
run's own sampler draws (the Trainer's train dataloader, same seed); a packed batch has none. Prints one JSON object
with the machine and its load average before and after.
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

RUNS = {  # name: (model, extra `textsql train` flags)
    "t5": ("t5", []),
    "causal-padded": ("causal", []),
    "causal-packed": ("causal", ["--packing", "True"]),
    "causal-padded-random": ("causal", ["--train_sampling_strategy", "random"]),
    "causal-packed-random": ("causal", ["--train_sampling_strategy", "random", "--packing", "True"]),
}


def build_data(workdir: Path, train_tables: int, seed: int) -> dict:
    """{"t5": (data_dir, model_dir), "causal": (data_dir, model_dir)} on the same generated release files."""
    from textsql.arguments.prep import PrepArguments
    from textsql.demo.tiny import DEMO_PREFIX, release_records
    from textsql.prep import prepare_dataset
    from textsql.tiny import corpus_for_tokenizer, make_tiny_causal_model, make_tiny_model
    from textsql.wikisql.synthetic import generate_wikisql

    held_out = max(2, train_tables // 5)
    raw = generate_wikisql(
        workdir / "wikisql-generated",
        train_tables=train_tables,
        dev_tables=held_out,
        test_tables=held_out,
        questions_per_table=10,
        seed=seed,
    )
    questions, tables = release_records(raw)
    # Similar sizes: T5's 2 encoder + 2 decoder blocks against 4 decoder blocks, width 64, feed-forward 256.
    t5_dir = make_tiny_model(
        workdir / "tiny-t5",
        corpus_for_tokenizer(questions, tables, prefix=DEMO_PREFIX),
        d_model=64,
        num_layers=2,
        d_ff=256,
        dropout_rate=0.0,
        seed=seed,
    )
    causal_dir = make_tiny_causal_model(
        workdir / "tiny-qwen2", corpus_for_tokenizer(questions, tables, prefix=""), hidden_size=64, num_layers=4
    )
    assets = {}
    for name, model_dir in (("t5", t5_dir), ("causal", causal_dir)):
        data_dir = prepare_dataset(
            PrepArguments(
                source=str(raw),
                model_id=str(model_dir),
                output_dir=str(workdir / f"data-{name}"),
                source_format="question+header",
                source_prefix=DEMO_PREFIX,  # T5's task prefix; a causal LM's prompt has none
                overwrite=True,  # the benchmark's own folder
            )
        )
        assets[name] = (Path(data_dir), Path(model_dir))
    return assets


def train_flags(args) -> list[str]:
    return [
        "--max_steps", str(args.steps),
        "--per_device_train_batch_size", str(args.batch_size),
        "--learning_rate", str(args.learning_rate),
        "--lr_scheduler_type", "constant_with_warmup",
        "--warmup_steps", str(min(20, args.steps // 5)),
        "--logging_steps", str(max(1, args.steps // 10)),
        "--eval_strategy", "no",
        "--save_strategy", "no",
        "--dataloader_num_workers", "0",
        "--seed", str(args.seed),
        "--report_to", "none",
        "--disable_tqdm", "True",
    ]  # fmt: skip


def train_run(name: str, assets: dict, runs_root: Path, args) -> dict:
    """`textsql train` in a fresh process; its run_summary.json."""
    kind, extra = RUNS[name]
    data_dir, model_dir = assets[kind]
    command = [sys.executable, "-m", "textsql", "train", "--model_id", str(model_dir), "--dataset_dir", str(data_dir)]
    command += ["--runs_root", str(runs_root / name), *train_flags(args), *extra, "--overwrite", "True"]
    env = dict(os.environ, DS_ACCELERATOR="cpu", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    if args.threads:
        env["OMP_NUM_THREADS"] = str(args.threads)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    runs_root.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(command, capture_output=True, text=True, env=env, cwd=runs_root)
    if done.returncode != 0:
        raise SystemExit(f"{name} failed:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}")
    line = next(line for line in done.stdout.splitlines() if line.startswith("textsql-run-summary: "))
    return json.loads(Path(line.split(": ", 1)[1]).read_text())


def padding_fraction_of_run(name: str, assets: dict, args) -> float:
    """The padded collator's padding share over the batches this run's sampler draws (its first --steps)."""
    from transformers import AutoModelForCausalLM, set_seed

    from textsql.arguments.training import DataArguments, TextsqlTrainingArguments
    from textsql.families import family_named
    from textsql.hub import load_tokenizer
    from textsql.train.collate import CausalLMCollator, padding_fraction
    from textsql.train.objective import load_training_data
    from textsql.train.sft import trainer_class

    data_dir, model_dir = assets["causal"]
    train_set, _, _, tokenizer = load_training_data(
        DataArguments(dataset_dir=str(data_dir)), load_tokenizer(str(model_dir))
    )
    sampling = "random" if "random" in name else "group_by_length"
    training = TextsqlTrainingArguments(
        output_dir=tempfile.mkdtemp(),
        per_device_train_batch_size=args.batch_size,
        train_sampling_strategy=sampling,
        seed=args.seed,
        eval_strategy="no",
        dataloader_num_workers=0,
        report_to="none",
    ).finalize(use_cpu=True)
    set_seed(args.seed)
    trainer = trainer_class(family_named("qwen2"))(
        model=AutoModelForCausalLM.from_pretrained(model_dir),
        args=training,
        train_dataset=train_set,
        data_collator=CausalLMCollator(tokenizer.pad_token_id),
    )
    padding = positions = 0
    batches = 0
    while batches < args.steps:
        for batch in trainer.get_train_dataloader():
            share = padding_fraction(batch)
            padding += share * batch["input_ids"].numel()
            positions += batch["input_ids"].numel()
            batches += 1
            if batches == args.steps:
                break
    return round(padding / positions, 4)


def score(summary: dict, data_dir: Path, questions: int) -> dict:
    """Greedy scores of the trained model on the first `questions` generated test questions."""
    from textsql.arguments.infer import InferArguments
    from textsql.infer import run_inference

    metrics = run_inference(
        InferArguments(
            model_dir=summary["output_dir"],
            dataset_dir=str(data_dir),
            split="test",
            max_examples=questions,
            show_examples=0,
            device="cpu",
            max_new_tokens=48,  # an untrained model writes until the limit: the SQL here is shorter
        ),
        echo=lambda *_: None,
    )
    keep = ("execution_accuracy", "logical_form_accuracy", "exact_match", "parse_errors", "queries_per_second")
    scores = {key: metrics[key] for key in keep if key in metrics}
    # the share of each part of the query right (select column, aggregation, number of conditions, ...): what a tiny
    # model learns first, long before whole queries execute right
    scores["components"] = {name: round(share, 4) for name, share in metrics.get("components", {}).items()}
    return scores


def row(name: str, summary: dict) -> dict:
    rss = max(r["cpu_peak_rss_bytes"] for r in summary["peak_memory_per_rank"])
    return {
        "run": name,
        "parameters": summary["parameters"],
        "steps": summary["global_step"],
        "train_runtime_s": round(summary["train_runtime"], 2),
        "samples_per_second": summary["train_samples_per_second"],
        "real_tokens_per_second": round(summary["real_tokens_per_second"], 1),
        "real_tokens": summary["real_tokens"],
        "peak_rss_mib": round(rss / 2**20, 1),
        "first_logged_loss": summary["first_logged_loss"],
        "last_logged_loss": summary["last_logged_loss"],
        "train_loss": round(summary["train_loss"], 4),
        "packing": summary["strategy"].get("packing", False),
    }


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=1000, help="Optimizer steps of every run.")
    parser.add_argument("--batch_size", type=int, default=16)
    parser.add_argument("--learning_rate", type=float, default=3e-3)
    parser.add_argument("--train_tables", type=int, default=150, help="Generated training tables (10 questions each).")
    parser.add_argument("--score_questions", type=int, default=200, help="Generated test questions scored.")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, help="OMP_NUM_THREADS of every run (default: torch's own choice).")
    parser.add_argument("--runs", nargs="+", default=list(RUNS), choices=list(RUNS))
    parser.add_argument("--workdir", help="Where the data, models and runs go (default: a temporary folder).")
    parser.add_argument("--output", help="Also write the JSON here.")
    args = parser.parse_args(argv)

    load_before, started = os.getloadavg(), time.perf_counter()
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="causal-vs-t5-"))
    workdir.mkdir(parents=True, exist_ok=True)
    assets = build_data(workdir, args.train_tables, args.seed)
    results = []
    for name in args.runs:
        summary = train_run(name, assets, workdir / "runs", args)
        result = row(name, summary)
        if name.startswith("causal-padded"):
            result["padding_fraction"] = padding_fraction_of_run(name, assets, args)
        elif name.startswith("causal-packed"):
            result["padding_fraction"] = 0.0
        result["scores"] = score(summary, assets[RUNS[name][0]][0], args.score_questions)
        results.append(result)
        print(json.dumps(result), file=sys.stderr, flush=True)
    data = f"generated WikiSQL-format, {args.train_tables} training tables x 10 questions, question+header"
    emit(run_report("causal_vs_t5", args, started, load_before, results, data=data), args.output)


if __name__ == "__main__":
    main()
