"""Each speed lever on and off, and the best combination, with textsql's own Trainer (built by the functions `textsql
train` uses), in one process: steps per second, real tokens per second, MFU on a GPU, peak memory, the first loss.

    python bench/speed_levers.py --model ~/.cache/textsql/models/smollm2-135m-instruct --dataset_dir DATA \\
        --precision bf16 --lora --batch 16 --steps 3 --repetitions 3          # the CPU, a real 135M llama
    python bench/speed_levers.py --model tiny-qwen2 --steps 2 --repetitions 1  # the code path (the GPU check's --cpu)
    python bench/speed_levers.py --model DIR --dataset_dir DATA --device cuda --precision bf16 --lora   # a GPU

Every setting is textsql's defaults plus one lever (`--levers`: NAME=VALUE of `textsql train`'s flags, comma-separated
within a setting, settings separated by spaces), each trained for --warmup + --steps steps on a fresh copy of the same
model and batches; the settings alternate (A B C, C B A, ...) over --repetitions rounds, so the machine's load falls
on all of them alike, and the JSON gives each round, the median, the min and the load average. A lever that cannot
run here is recorded with textsql's reason. Then the levers faster than the baseline are combined into one setting and
measured against the baseline the same way. Faster means: on the CPU (one torch thread) less CPU time per step, which
a shared machine's other work disturbs far less than the wall clock; on a GPU less wall time per step. A benchmark:
nothing here is asserted.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))  # runs from a checkout without installing the package

from bench.common import emit, machine  # noqa: E402  (the repository root is on sys.path now)
from bench.step_profile import build_assets, textsql_setup  # noqa: E402

# What each lever sets (`textsql train` flags), causal LMs first; T5 leaves out what is for causal LMs.
CAUSAL_LEVERS = (
    "fused_loss=chunked",
    "fused_loss=liger",
    "lora_base_dtype=bfloat16",
    "attention=eager",
    "attention=flex_attention",
    "packing=True",
    "packing=True,attention=flex_attention",
    "compile=layers",
    "optim=adamw_torch",
    "dataloader_num_workers=2",
)
T5_LEVERS = ("compile=layers", "optim=adamw_torch", "dataloader_num_workers=2")


def parse_setting(text: str) -> dict:
    values = {}
    for part in filter(None, text.split(",")):
        name, _, value = part.partition("=")
        values[name] = {"True": True, "False": False}.get(value, int(value) if value.isdigit() else value)
    return values


def measure(args, model_dir: Path, data_dir: Path, levers: dict, workdir: Path) -> dict:
    """One setting: textsql's run set up as `textsql train` would (set_up_run, the model as it loads it, the
    collator), its Trainer trained for warm-up + measured steps; the measured steps' time, tokens and FLOPs."""
    import torch
    from transformers import TrainerCallback

    from textsql.errors import TextsqlError
    from textsql.train.sft import trainer_class
    from textsql.train.speed import mfu_figures, training_flops

    run_args = copy.copy(args)
    run_args.levers = dict(args.base, **levers)
    try:
        finalized, train_set, tokenizer, model, family, collator = textsql_setup(run_args, model_dir, data_dir, workdir)
        if finalized.lora:
            from textsql.arguments.training import ModelArguments
            from textsql.hub import load_tokenizer
            from textsql.train.objective import wrap_for_lora

            model, _ = wrap_for_lora(
                model, ModelArguments(model_id=str(model_dir)), finalized, tokenizer, load_tokenizer(str(model_dir))
            )
        marks = {}

        class Marks(TrainerCallback):
            def on_step_end(self, targs, state, control, **kwargs):
                if state.global_step in (args.warmup, args.warmup + args.steps):
                    if torch.cuda.is_available():
                        torch.cuda.synchronize()
                    marks[state.global_step] = (time.perf_counter(), time.process_time(), dict(trainer.token_counts))

        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        trainer = trainer_class(family)(
            model=model, args=finalized, train_dataset=train_set, data_collator=collator, processing_class=tokenizer
        )
        trainer.add_callback(Marks())
        result = trainer.train()
    except TextsqlError as error:
        return {"status": "refused", "reason": str(error)}
    (t0, c0, n0), (t1, c1, n1) = marks[args.warmup], marks[args.warmup + args.steps]
    counts = {k: n1[k] - n0[k] for k in n1}
    seconds = t1 - t0
    flops = training_flops(model.config, counts, logits_at_labels=finalized.fused_loss != "none")
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    precision = "bf16" if finalized.bf16 else "fp32"
    real = counts["source"] + (0 if family.causal else counts["target"])
    first_loss = next((h["loss"] for h in trainer.state.log_history if "loss" in h), None)
    return {
        "status": "ok",
        "step_ms": 1000 * seconds / args.steps,
        "cpu_ms_per_step": 1000 * (c1 - c0) / args.steps,
        "real_tokens_per_second": real / seconds,
        "samples_per_second": args.batch * args.steps / seconds,
        "mfu": mfu_figures(flops, seconds, gpu, precision, False),
        "first_loss": first_loss,
        "train_loss": result.metrics.get("train_loss"),
        "cuda_max_reserved_bytes": torch.cuda.max_memory_reserved() if torch.cuda.is_available() else None,
    }


def rounds(args, model_dir, data_dir, settings: dict[str, dict], workdir: Path) -> dict:
    """Every setting measured --repetitions times, alternating their order (A B C, C B A, ...)."""
    names = list(settings)
    measured: dict[str, list] = {name: [] for name in names}
    refused = {}
    for repetition in range(args.repetitions):
        for name in names if repetition % 2 == 0 else names[::-1]:
            if name in refused:
                continue
            print(f"== {name} (round {repetition + 1})", flush=True)
            row = measure(args, model_dir, data_dir, settings[name], workdir / name)
            if row["status"] == "refused":
                refused[name] = row["reason"]
            else:
                row["load_average"] = round(os.getloadavg()[0], 2)
                measured[name].append(row)
    results = {}
    for name in names:
        if name in refused:
            results[name] = {"status": "refused", "reason": refused[name], "setting": settings[name]}
            continue
        rows = measured[name]
        steps = [r["step_ms"] for r in rows]
        results[name] = {
            "status": "ok",
            "setting": settings[name],
            "step_ms_median": statistics.median(steps),
            "step_ms_min": min(steps),
            "cpu_ms_per_step_median": statistics.median(r["cpu_ms_per_step"] for r in rows),
            "real_tokens_per_second_median": statistics.median(r["real_tokens_per_second"] for r in rows),
            "mfu_median": statistics.median(r["mfu"]["mfu"] for r in rows) if rows[0]["mfu"]["mfu"] else None,
            "first_loss": rows[0]["first_loss"],
            "cuda_max_reserved_bytes": max((r["cuda_max_reserved_bytes"] or 0) for r in rows) or None,
            "rounds": rows,
        }
    # On the CPU (one torch thread) the process's CPU time per step, which the other work of a shared machine inflates
    # far less than the wall clock; on a GPU the wall clock.
    metric = "cpu_ms_per_step_median" if args.device == "cpu" else "step_ms_median"
    baseline = results.get("baseline", {}).get(metric)
    for result in results.values():
        if baseline and result["status"] == "ok":
            result["speedup_over_baseline"] = baseline / result[metric]
            result["speedup_measured_by"] = metric
    return results


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny-qwen2", help="tiny-t5, tiny-qwen2, or a model folder")
    parser.add_argument("--dataset_dir", default=None, help="A folder `textsql prep` wrote for that model.")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--precision", default="fp32", help="As textsql train's --precision.")
    parser.add_argument("--lora", action="store_true", help="Every setting trains a LoRA adapter (r 8, qv).")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--steps", type=int, default=3, help="Measured steps per setting and round.")
    parser.add_argument("--warmup", type=int, default=1, help="Steps before the measured ones (compile happens here).")
    parser.add_argument("--repetitions", type=int, default=3)
    parser.add_argument("--levers", default=None, help="Settings to measure against the baseline (see above).")
    parser.add_argument("--no_combination", action="store_true", help="Skip the best combination's rounds.")
    parser.add_argument("--threads", type=int, default=0, help="torch threads on the CPU (0: torch's default).")
    parser.add_argument("--workdir", default=str(Path(tempfile.gettempdir()) / "textsql-bench"))
    parser.add_argument("--output", default=None)
    args = parser.parse_args(argv)
    from textsql.strategy.devices import use_accelerator

    use_accelerator(args.device)
    import torch

    if args.device == "cpu" and args.threads:
        torch.set_num_threads(args.threads)
    args.logging_steps = 1  # the first loss of every setting, to compare
    args.base = {"lora": True} if args.lora else {}
    load_before = os.getloadavg()
    started = time.perf_counter()
    data_dir, model_dir = build_assets(args)
    from textsql.families import family_of
    from textsql.hub import load_config

    causal = family_of(load_config(str(model_dir))).causal
    levers = args.levers.split() if args.levers else list(CAUSAL_LEVERS if causal else T5_LEVERS)
    if not args.lora:
        levers = [lever for lever in levers if "lora_base_dtype" not in lever]
    settings = {"baseline": {}} | {lever: parse_setting(lever) for lever in levers}
    with tempfile.TemporaryDirectory() as work:
        results = rounds(args, model_dir, data_dir, settings, Path(work))
        faster = [
            name
            for name, r in results.items()
            if name != "baseline" and r["status"] == "ok" and r.get("speedup_over_baseline", 0) > 1.02
        ]
        combination = {}
        for name in faster:  # one value per flag: the fastest lever that sets it
            for flag, value in settings[name].items():
                speedup = results[name]["speedup_over_baseline"]
                if flag not in combination or speedup > combination[flag][1]:
                    combination[flag] = (value, speedup)
        best = None
        if len(faster) > 1 and not args.no_combination:
            best = rounds(
                args,
                model_dir,
                data_dir,
                {"baseline": {}, "best": {k: v for k, (v, _) in combination.items()}},
                Path(work),
            )
    report = {
        "benchmark": "speed_levers",
        "date": time.strftime("%Y-%m-%d"),
        "machine": machine(),
        "load_average_before_after": [round(load_before[0], 2), round(os.getloadavg()[0], 2)],
        "model": str(args.model),
        "model_dir": str(model_dir),
        "device": args.device,
        "precision": args.precision,
        "lora": args.lora,
        "batch": args.batch,
        "steps": args.steps,
        "warmup": args.warmup,
        "repetitions": args.repetitions,
        "torch_threads": torch.get_num_threads(),
        "wall_seconds": round(time.perf_counter() - started, 1),
        "results": results,
        "faster_than_baseline": faster,
        "best_combination": best,
    }
    emit(report, args.output)
    return 0


if __name__ == "__main__":
    sys.exit(main())
