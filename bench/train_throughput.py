"""Training throughput: the walkthrough's recipe against textsql's, same model, same data, same steps, on this machine.

    python bench/train_throughput.py                       # CPU: small T5 shape; GPU: t5-small and t5-large shapes
    python bench/train_throughput.py --shapes t5-small --repetitions 5 --output result.json

The walkthrough's recipe: every question and target padded to 96 tokens (padding="max_length"; to the longest example
instead where sources are longer, e.g. --source_format question+header, so both recipes train on the same tokens),
labels padded with the pad id 0 so padding is in the loss, no attention mask saved, fp32 (no TF32), random batches, a
non-fused AdamW.
textsql's recipe (the pieces `textsql train` uses): unpadded prepared data with attention masks, DataCollatorForSeq2Seq
(batch-wise padding, labels padded with -100), length-grouped batches (train_sampling_strategy="group_by_length"),
textsql's TextsqlTrainer; on a GPU with bf16 also bf16 autocast, TF32 matmuls, fused AdamW and padding to a multiple
of 8. Where the hardware lacks them (a CPU) both recipes run fp32 with the same optimizer.

Both train the same randomly initialised model (T5Config shape, seeded) for the same number of steps on the same
examples (a seeded sample of steps x batch training examples, i.e. one epoch of it), alternating, in a fresh
process per run so each run's peak memory is its own; every process first trains a few warm-up steps. It prints
one JSON object: per recipe samples/s, real (non-pad) tokens/s, step time and peak memory (medians over the
repetitions, and every repetition), their ratio, the machine, and the mean real tokens per example it ran on.
On a GPU also model FLOPs utilisation (MFU) against the GPU's dense bf16 peak and, for an fp32 run, against the
TF32/FP32 peak it could use (textsql.strategy.devices.GPU_PEAK_TFLOPS: SXM, PCIe and NVL parts differ). Every child process is
pinned to one GPU (the first visible one).

The data is generated WikiSQL-format data with a tokenizer trained on it (textsql.demo.tiny.build_assets), a dataset
prepared by `textsql prep` (--dataset_dir), or WikiSQL release files (--source, a folder or .tar.bz2) prepared here with
--tokenizer (a hub name, a model folder, or T5's spiece.model / tokenizer.json file), e.g.

    python bench/train_throughput.py --shapes t5-small --source ../shared/real/wikisql \
        --tokenizer ../shared/real/t5/spiece.model --t5_configs ../shared/real/t5

so t5-small's figures carry the real 32k-vocabulary output layer and real question and SQL lengths. The t5-small,
t5-base and t5-large shapes are random-weight models of the real configs (--t5_configs, else the same built-in numbers).
"""

from __future__ import annotations

import argparse
import gc
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

from bench.common import emit, machine, prepared_release  # noqa: E402  (the repository root is on sys.path now)
from bench.shapes import T5_NAMES, bench_config, build_t5, t5_config  # noqa: E402

RECIPES = ("walkthrough", "textsql")
WALKTHROUGH_LENGTH = 96  # the walkthrough padded (and truncated) questions and targets to 96 tokens
# Shapes (random init: throughput does not depend on the weights): a small one for CPUs, whose vocabulary is the
# tokenizer's, and the T5 checkpoints' (bench.shapes).
CPU_SMALL = dict(d_model=256, d_ff=1024, num_layers=4, num_heads=4, d_kv=64)
SHAPES = ("cpu-small",) + T5_NAMES
DEFAULT_STEPS = {"cpu-small": 16, "t5-small": 100, "t5-base": 60, "t5-large": 40}


# ---------------------------------------------------------------------------------------------------------------------
# Data and model (shared by both recipes)
# ---------------------------------------------------------------------------------------------------------------------


def prepared_data(args) -> Path:
    """The prepared dataset: --dataset_dir, --source prepared once in --workdir, or generated data built there."""
    if args.dataset_dir:
        return Path(args.dataset_dir)
    if args.source:
        return prepared_release(args.source, args.tokenizer, args.workdir, args.source_format)
    from textsql.demo.tiny import build_assets

    workdir = Path(args.workdir) / f"generated-{args.train_tables}x10"
    data_dir, _ = build_assets(
        workdir, train_tables=args.train_tables, questions_per_table=10, seed=0, source_format=args.source_format
    )
    return data_dir


def dataset_tokenizer(dataset_dir: Path):
    """The tokenizer the dataset was prepared with (with any characters prep added)."""
    from textsql.hub import load_tokenizer
    from textsql.prepared import load_prepared, tokenizer_for_training

    _, metadata = load_prepared(dataset_dir)
    return tokenizer_for_training(load_tokenizer(metadata["tokenizer"]), dataset_dir, metadata)


def training_subset(dataset_dir: Path, examples: int, seed: int):
    """The same seeded sample of the training split for every run."""
    from textsql.prepared import load_prepared

    dataset, _ = load_prepared(dataset_dir)
    train = dataset["train"]
    if examples > len(train):
        raise SystemExit(
            f"steps x batch = {examples} examples, but the training split has {len(train)}; use fewer --steps or more --train_tables."
        )
    return train.shuffle(seed=seed).select(range(examples)).select_columns(["input_ids", "attention_mask", "labels"])


def build_model(shape: str, tokenizer, seed: int, t5_configs: str | None = None):
    """A randomly initialised model of the shape: cpu-small with the tokenizer's vocabulary, or a T5 checkpoint's shape
    (bench.shapes: from the real config.json files in `t5_configs` when given)."""
    import torch

    config = bench_config(shape, tokenizer, {"cpu-small": CPU_SMALL}, t5_configs)
    # t5-large initialises in seconds on a GPU
    return build_t5(config, seed, "cuda" if torch.cuda.is_available() else "cpu")


# ---------------------------------------------------------------------------------------------------------------------
# The two recipes
# ---------------------------------------------------------------------------------------------------------------------


def walkthrough_length(subset) -> int:
    """The walkthrough's fixed length, 96, or the longest example where that is longer (nothing is cut)."""
    return max(
        [WALKTHROUGH_LENGTH] + [len(ids) for ids in subset["input_ids"]] + [len(ids) for ids in subset["labels"]]
    )


def walkthrough_dataset(subset, pad_id: int):
    """As the walkthrough tokenized: padding="max_length" to one fixed length, labels padded with the pad id, no attention mask."""
    length = walkthrough_length(subset)

    def pad(ids):
        return ids + [pad_id] * (length - len(ids))

    return subset.map(
        lambda row: {"input_ids": pad(row["input_ids"]), "labels": pad(row["labels"])},
        remove_columns=["attention_mask"],
    )


class CountingCollator:
    """Wraps a collator to record the padded shape of every batch (what the model actually computes on)."""

    def __init__(self, collate):
        self.collate = collate
        self.shapes: list[tuple[int, int, int]] = []

    def __call__(self, features):
        batch = self.collate(features)
        batch_size, source = batch["input_ids"].shape
        self.shapes.append((batch_size, source, batch["labels"].shape[1]))
        return batch


def make_trainer(recipe: str, model, tokenizer, subset, steps: int, batch_size: int, output_dir: str, callbacks=()):
    import torch
    from transformers import DataCollatorForSeq2Seq, Seq2SeqTrainer, Seq2SeqTrainingArguments, default_data_collator

    from textsql.arguments.training import TextsqlTrainingArguments
    from textsql.families import family_of
    from textsql.strategy.devices import NodeDevices, resolve_precision
    from textsql.train.sft import trainer_class

    gpu = torch.cuda.is_available()
    precision = resolve_precision("auto", "t5", NodeDevices.local().gpus)  # what `textsql train` picks here
    common = dict(
        output_dir=output_dir,
        max_steps=steps,
        per_device_train_batch_size=batch_size,
        learning_rate=3e-4,
        lr_scheduler_type="constant",
        logging_steps=steps,
        report_to="none",
        save_strategy="no",
        eval_strategy="no",
        disable_tqdm=True,
        dataloader_num_workers=0,
        seed=42,
        use_cpu=not gpu,
    )
    if recipe == "walkthrough":
        args = Seq2SeqTrainingArguments(
            **common, bf16=False, tf32=False, optim="adamw_torch", train_sampling_strategy="random"
        )
        collator = CountingCollator(default_data_collator)
        return Seq2SeqTrainer(
            model=model,
            args=args,
            train_dataset=walkthrough_dataset(subset, tokenizer.pad_token_id),
            data_collator=collator,
            callbacks=list(callbacks),
        ), collator
    args = Seq2SeqTrainingArguments(
        **common,
        **precision.trainer_flags(),
        optim="adamw_torch_fused" if gpu else "adamw_torch",
        train_sampling_strategy=TextsqlTrainingArguments.train_sampling_strategy,  # textsql's defaults
        average_tokens_across_devices=TextsqlTrainingArguments.average_tokens_across_devices,
    )
    collator = CountingCollator(
        DataCollatorForSeq2Seq(tokenizer, model=model, label_pad_token_id=-100, pad_to_multiple_of=8 if gpu else None)
    )
    return trainer_class(family_of(model.config))(
        model=model,
        args=args,
        train_dataset=subset,
        data_collator=collator,
        processing_class=tokenizer,
        callbacks=list(callbacks),
    ), collator


def step_timer():
    """A TrainerCallback timing from the first step's start to the last step's end (CUDA synchronised)."""
    import torch
    from transformers import TrainerCallback

    def sync():
        if torch.cuda.is_available():
            torch.cuda.synchronize()

    class StepTimer(TrainerCallback):
        start = end = cpu_start = cpu_end = None

        def on_step_begin(self, args, state, control, **kwargs):
            if self.start is None:
                sync()
                self.start, self.cpu_start = time.perf_counter(), time.process_time()

        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step >= state.max_steps:
                sync()
                self.end, self.cpu_end = time.perf_counter(), time.process_time()

    return StepTimer()


def run_one(args) -> dict:
    """Child process: warm up, then train `steps` steps with one recipe and return its measurements."""
    import torch

    from textsql.train.speed import example_counts, training_flops
    from textsql.train.trainer import peak_memory, tf32_enabled

    threads = args.threads if args.threads is not None else (0 if torch.cuda.is_available() else 1)
    if threads:
        torch.set_num_threads(threads)
    dataset_dir = prepared_data(args)
    tokenizer = dataset_tokenizer(dataset_dir)
    subset = training_subset(dataset_dir, args.steps * args.batch_size, args.seed)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with tempfile.TemporaryDirectory() as output_dir:
        warmup_model = build_model(args.shape, tokenizer, args.seed, args.t5_configs)
        warmup, _ = make_trainer(
            args.child, warmup_model, tokenizer, subset, args.warmup_steps, args.batch_size, output_dir
        )
        warmup.train()
        del warmup
        gc.collect()  # free the warm-up model and optimizer before measuring memory
        if device == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        model = build_model(args.shape, tokenizer, args.seed, args.t5_configs)
        timer = step_timer()
        trainer, collator = make_trainer(
            args.child, model, tokenizer, subset, args.steps, args.batch_size, output_dir, [timer]
        )
        rss_before = peak_memory()["cpu_peak_rss_bytes"]
        result = trainer.train()
    seconds = timer.end - timer.start
    source_lengths = [len(ids) for ids in subset["input_ids"]]
    target_lengths = [len(ids) for ids in subset["labels"]]
    real_tokens = sum(source_lengths) + sum(target_lengths)
    config = model.config
    memory = peak_memory()
    return {
        "recipe": args.child,
        "seconds": seconds,
        # CPU time of this process over the same span: on a shared machine, with one thread, the work done
        # regardless of what else runs (with several threads it also counts OpenMP's spin-waiting).
        "cpu_seconds": timer.cpu_end - timer.cpu_start,
        "steps": args.steps,
        "examples": len(subset),
        "samples_per_second": len(subset) / seconds,
        "real_tokens_per_second": real_tokens / seconds,
        "step_time_ms": 1000 * seconds / args.steps,
        "real_tokens": real_tokens,
        "computed_tokens": sum(b * (s + t) for b, s, t in collator.shapes[-args.steps :]),
        "walkthrough_padded_length": walkthrough_length(subset),
        "trainer_counted_real_tokens": getattr(trainer, "real_tokens", None),
        "train_loss": result.metrics.get("train_loss"),
        "peak_rss_bytes": memory["cpu_peak_rss_bytes"],
        "rss_before_training_bytes": rss_before,
        "cuda_max_allocated_bytes": memory.get("cuda_max_allocated_bytes"),
        "cuda_max_reserved_bytes": memory.get("cuda_max_reserved_bytes"),
        "parameters": sum(p.numel() for p in model.parameters()),
        "precision": "bf16" if trainer.args.bf16 else "fp32",
        "tf32": tf32_enabled(),
        "optimizer": trainer.args.optim.value if hasattr(trainer.args.optim, "value") else str(trainer.args.optim),
        "useful_flops": sum(
            training_flops(config, example_counts(s, t)) for s, t in zip(source_lengths, target_lengths)
        ),
        "computed_flops": sum(
            b * training_flops(config, example_counts(s, t)) for b, s, t in collator.shapes[-args.steps :]
        ),
        "model_config": {
            k: getattr(config, k) for k in ("d_model", "d_ff", "num_layers", "num_heads", "d_kv", "vocab_size")
        },
        "shape_from": (
            t5_config(args.shape, tokenizer, args.t5_configs)[1]
            if args.shape in T5_NAMES
            else "CPU_SMALL (bench/train_throughput.py)"
        ),
        "torch_threads": torch.get_num_threads(),
    }


# ---------------------------------------------------------------------------------------------------------------------
# Parent: alternate the recipes, aggregate, print JSON
# ---------------------------------------------------------------------------------------------------------------------


def summarize(runs: list[dict], peak) -> dict:
    """Medians over the repetitions of one recipe; MFU against `peak` (textsql.strategy.devices.PeakTflops) on a GPU."""

    def median(key):
        values = [r[key] for r in runs if r.get(key) is not None]
        return statistics.median(values) if values else None

    result = {
        key: median(key)
        for key in (
            "samples_per_second",
            "real_tokens_per_second",
            "step_time_ms",
            "peak_rss_bytes",
            "cuda_max_allocated_bytes",
            "train_loss",
        )
    }
    result["samples_per_cpu_second"] = statistics.median(r["examples"] / r["cpu_seconds"] for r in runs)
    result["peak_memory_gib"] = (result["cuda_max_allocated_bytes"] or result["peak_rss_bytes"]) / 2**30
    result["peak_memory_measure"] = (
        "CUDA max allocated" if result["cuda_max_allocated_bytes"] else "peak RSS of the process"
    )
    first = runs[0]
    result.update(
        precision=first["precision"],
        optimizer=first["optimizer"],
        padding_overhead=first["computed_tokens"] / first["real_tokens"],
        repetitions=[
            {k: round(r[k], 2) for k in ("samples_per_second", "step_time_ms", "seconds", "cpu_seconds")} for r in runs
        ],
    )
    result["tf32"] = first["tf32"]
    if peak:
        seconds = median("seconds")
        usable, usable_name = peak.for_precision(first["precision"], first["tf32"])
        for name, tflops in (("bf16_peak", peak.bf16), ("usable_peak", usable)):
            if tflops:  # MFU against the bf16 peak, and (fp32 runs) against the TF32 or FP32 peak the run could use
                result[f"mfu_vs_{name}"] = first["useful_flops"] / seconds / (tflops * 1e12)
                result[f"hardware_flops_utilization_vs_{name}"] = first["computed_flops"] / seconds / (tflops * 1e12)
        result["usable_peak"] = {"tflops": usable, "kind": usable_name}
        result["mfu_6nd_vs_bf16_peak"] = (
            6 * first["parameters"] * first["real_tokens"] / seconds / (peak.bf16 * 1e12) if peak.bf16 else None
        )
    return result


def bench_shape(args, shape: str) -> dict:
    steps = args.steps or DEFAULT_STEPS[shape]
    runs = {recipe: [] for recipe in RECIPES}
    for repetition in range(args.repetitions):
        order = RECIPES if repetition % 2 == 0 else RECIPES[::-1]  # alternate which recipe goes first
        for recipe in order:
            with tempfile.NamedTemporaryFile(suffix=".json") as result_file:
                command = [
                    sys.executable,
                    __file__,
                    "--child",
                    recipe,
                    "--shape",
                    shape,
                    "--steps",
                    str(steps),
                    "--result",
                    result_file.name,
                    *_shared_flags(args),
                ]
                done = subprocess.run(command, capture_output=True, text=True, env=_child_env())
                if done.returncode != 0:
                    raise SystemExit(f"{recipe} run failed:\n{done.stdout[-3000:]}\n{done.stderr[-5000:]}")
                run = json.loads(Path(result_file.name).read_text())
            runs[recipe].append(run)
            print(
                f"[{shape} repetition {repetition + 1}/{args.repetitions}] {recipe}: {run['samples_per_second']:.1f} samples/s, "
                f"{run['step_time_ms']:.0f} ms/step",
                file=sys.stderr,
                flush=True,
            )
    import torch

    from textsql.strategy.devices import peak_tflops

    peak = peak_tflops(torch.cuda.get_device_name() if torch.cuda.is_available() else None, args.peak_tflops)
    summary = {recipe: summarize(runs[recipe], peak) for recipe in RECIPES}
    first = runs["textsql"][0]
    examples = first["examples"]
    result = {
        "shape": shape,
        "model_config": first["model_config"],
        "parameters": first["parameters"],
        "steps": steps,
        "torch_threads": first["torch_threads"],
        "batch_size": args.batch_size,
        "examples_per_run": examples,
        "repetitions": args.repetitions,
        "warmup_steps": args.warmup_steps,
        "mean_real_tokens_per_example": first["real_tokens"] / examples,
        "source_format": args.source_format if not args.dataset_dir else "as prepared",
        "shape_from": first["shape_from"],
        "walkthrough_padded_length": runs["walkthrough"][0]["walkthrough_padded_length"],
        **summary,
        "ratio_samples_per_second": summary["textsql"]["samples_per_second"]
        / summary["walkthrough"]["samples_per_second"],
        "ratio_real_tokens_per_second": summary["textsql"]["real_tokens_per_second"]
        / summary["walkthrough"]["real_tokens_per_second"],
        "ratio_samples_per_cpu_second": summary["textsql"]["samples_per_cpu_second"]
        / summary["walkthrough"]["samples_per_cpu_second"],
        "trainer_counted_real_tokens_match": first["trainer_counted_real_tokens"] == first["real_tokens"],
    }
    if peak:
        result["gpu_peak_tflops"] = {
            "gpu": peak.gpu,
            "bf16": peak.bf16,
            "tf32": peak.tf32,
            "fp32": peak.fp32,
            "source": peak.source,
        }
    return result


def _shared_flags(args) -> list[str]:
    flags = [
        "--batch_size",
        str(args.batch_size),
        "--warmup_steps",
        str(args.warmup_steps),
        "--seed",
        str(args.seed),
        "--workdir",
        args.workdir,
        "--train_tables",
        str(args.train_tables),
        "--source_format",
        args.source_format,
    ] + (["--threads", str(args.threads)] if args.threads is not None else [])
    flags += ["--tokenizer", args.tokenizer] + (["--t5_configs", args.t5_configs] if args.t5_configs else [])
    flags += ["--dataset_dir", args.dataset_dir] if args.dataset_dir else []
    return flags + (["--source", args.source] if args.source else [])


def _child_env() -> dict:
    """A child's environment: CPU-only DeepSpeed without a GPU; with GPUs, pinned to the first visible one (the
    Trainer would make one process on several GPUs nn.DataParallel, and the figures would not be one GPU's)."""
    import torch

    from textsql.strategy.devices import use_accelerator

    env = dict(os.environ, TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE=os.environ.get("HF_HUB_OFFLINE", "1"))
    if not torch.cuda.is_available():
        use_accelerator("cpu", env)
    else:
        visible = [d.strip() for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
        env["CUDA_VISIBLE_DEVICES"] = visible[0] if visible else "0"
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--shapes",
        default=None,
        help=f"Comma-separated, from {', '.join(SHAPES)} (default: cpu-small on a CPU, t5-small,t5-large on a GPU).",
    )
    parser.add_argument(
        "--steps", type=int, default=None, help=f"Measured steps per run (default per shape: {DEFAULT_STEPS})."
    )
    parser.add_argument("--batch_size", type=int, default=32, help="Per-device batch size (the walkthrough's 32).")
    parser.add_argument("--repetitions", type=int, default=3, help="Runs per recipe, alternating.")
    parser.add_argument("--warmup_steps", type=int, default=2, help="Unmeasured steps each process trains first.")
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch threads per run. Default on a CPU: 1, because on a shared machine OpenMP threads spin-waiting "
        "for a busy core made step times 3-20x slower and erratic; 0 = torch's default (one per core).",
    )
    parser.add_argument(
        "--dataset_dir", default=None, help="A dataset prepared by `textsql prep` (default: generated data)."
    )
    parser.add_argument(
        "--source",
        default=None,
        help="WikiSQL release files (a folder or .tar.bz2), prepared once in "
        "--workdir with --tokenizer and --source_format (instead of generated data).",
    )
    parser.add_argument(
        "--tokenizer",
        default="t5-small",
        help="With --source: a hub name, a model folder, or T5's spiece.model or tokenizer.json file.",
    )
    parser.add_argument(
        "--t5_configs",
        default=None,
        help="A folder of t5-base/config.json, t5-large/config.json (the real checkpoints' configs) "
        "for the T5 shapes; default: the same numbers built in (textsql.planner.shape.T5_SHAPES).",
    )
    parser.add_argument(
        "--train_tables", type=int, default=600, help="Generated data: training tables (10 questions each)."
    )
    parser.add_argument(
        "--source_format",
        default="question",
        choices=("question", "question+header"),
        help="Generated data or --source: what the model reads (both recipes read the same).",
    )
    parser.add_argument(
        "--workdir",
        default=str(Path(tempfile.gettempdir()) / "textsql-bench"),
        help="Where generated data is built and reused.",
    )
    parser.add_argument(
        "--peak_tflops",
        type=float,
        default=None,
        help="The GPU's dense bf16 peak, for MFU on GPUs not in textsql.strategy.devices.GPU_PEAK_TFLOPS.",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", default=None, help="Also write the JSON here.")
    parser.add_argument("--child", choices=RECIPES, help=argparse.SUPPRESS)
    parser.add_argument("--shape", default="cpu-small", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.child:
        Path(args.result).write_text(json.dumps(run_one(args)))
        return 0
    import torch

    shapes = (args.shapes or ("t5-small,t5-large" if torch.cuda.is_available() else "cpu-small")).split(",")
    unknown = [s for s in shapes if s not in SHAPES]
    if unknown:
        raise SystemExit(f"unknown shape(s) {unknown}; choose from {list(SHAPES)}")
    prepared_data(args)  # build generated data once, before the timed children
    load_before = os.getloadavg()
    started = time.time()
    results = [bench_shape(args, shape) for shape in shapes]
    report = {
        "benchmark": "train_throughput",
        "date": time.strftime("%Y-%m-%d"),
        "machine": machine(),
        "data": args.dataset_dir
        or (
            f"WikiSQL release files {args.source} prepared with {args.tokenizer} ({args.source_format})"
            if args.source
            else f"generated WikiSQL-format ({args.train_tables} training tables x 10 questions, locally trained "
            "tokenizer)"
        ),
        "load_average_before_after": [round(load_before[0], 2), round(os.getloadavg()[0], 2)],
        "wall_seconds": round(time.time() - started, 1),
        "results": results,
    }
    emit(report, args.output)
    return 0


if __name__ == "__main__":
    sys.exit(main())
