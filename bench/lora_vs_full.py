"""LoRA against full fine-tuning on this machine: samples/s, peak memory and trainable parameters, same model and data.

    python bench/lora_vs_full.py                                   # tiny and t5-small shapes, CPU
    python bench/lora_vs_full.py --shapes t5-small --steps 20 --output result.json

Each (shape, mode) trains in a fresh process, so its peak resident memory (the process's ru_maxrss) is its own: a
randomly initialised T5 of the shape (seeded; throughput and memory do not depend on the weights), random token ids of
fixed lengths (--source_length, --target_length), AdamW over the parameters that train, fp32 on the CPU (bf16 autocast
on a GPU). Modes: full (every weight), lora-qv and lora-all (textsql.adapters.apply_lora, rank --rank: what `textsql
train --lora True --lora_targets qv|all` wraps the model with). A few warm-up steps run first; the median step time over
--steps timed steps gives samples/s. Prints one JSON object with the machine.

    python bench/lora_vs_full.py --plan t5-small t5-large t5-3b     # the planner's rows instead (A100-40GB by default)

prints `textsql plan --lora`'s GB per GPU and host GB per pod for every strategy, full fine-tuning beside LoRA.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))  # runs from a checkout without installing the package

from bench.common import emit, machine  # noqa: E402  (the repository root is on sys.path now)

# The tiny model of the tests and the demo (textsql.demo.tiny.build_assets: d_model 64, 2 layers, d_ff 256, 4 heads, a
# 4000-piece tokenizer), and t5-small's config (textsql.planner.shape.T5_SHAPES).
SHAPES = {
    "tiny": dict(d_model=64, d_ff=256, num_layers=2, num_heads=4, d_kv=16, vocab_size=4000),
    "t5-small": dict(d_model=512, d_ff=2048, num_layers=6, num_heads=8, d_kv=64, vocab_size=32128),
}
MODES = ("full", "lora-qv", "lora-all")


def train_once(
    shape: str, mode: str, batch: int, source_length: int, target_length: int, steps: int, warmup: int, rank: int
) -> dict:
    """One measurement, in this process (the parent runs each in a child)."""
    import resource

    import torch
    from transformers import T5Config, T5ForConditionalGeneration

    from textsql.adapters import apply_lora, parameter_counts
    from textsql.arguments.lora import LoraArguments

    torch.manual_seed(0)
    config = T5Config(**SHAPES[shape], decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)
    model = T5ForConditionalGeneration(config)
    if mode != "full":
        model = apply_lora(
            model, LoraArguments(lora=True, lora_rank=rank, lora_alpha=2 * rank, lora_targets=mode.split("-")[1]), []
        )
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model.to(device).train()
    trainable, total = parameter_counts(model)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    generator = torch.Generator().manual_seed(1)
    vocab = config.vocab_size
    batches = [
        (
            torch.randint(2, vocab, (batch, source_length), generator=generator),
            torch.randint(2, vocab, (batch, target_length), generator=generator),
        )
        for _ in range(4)
    ]
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    times = []
    for step in range(warmup + steps):
        inputs, labels = (t.to(device) for t in batches[step % len(batches)])
        started = time.perf_counter()
        with torch.autocast(device, dtype=torch.bfloat16, enabled=device == "cuda"):
            loss = model(input_ids=inputs, labels=labels).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if device == "cuda":
            torch.cuda.synchronize()
        if step >= warmup:
            times.append(time.perf_counter() - started)
    step_time = statistics.median(times)
    result = {
        "shape": shape,
        "mode": mode,
        "trainable_parameters": trainable,
        "total_parameters": total,
        "trainable_fraction": round(trainable / total, 5),
        "step_seconds_median": round(step_time, 4),
        "samples_per_second": round(batch / step_time, 2),
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "rss_before_training_bytes": rss_before,
        "threads": torch.get_num_threads(),
    }
    if device == "cuda":
        result["cuda_max_allocated_bytes"] = torch.cuda.max_memory_allocated()
    return result


def planner_rows(models: list[str], gpu_memory_gb: float, batch: int, rank: int, targets: str) -> dict:
    """The planner's full fine-tuning and LoRA rows for each model (bf16, 96/96 tokens, one GPU)."""
    from textsql.arguments.plan import PlanArguments
    from textsql.planner.recommend import plan_memory

    rows = {}
    for model in models:
        plan = plan_memory(
            PlanArguments(
                model_id=model,
                gpu_memory_gb=gpu_memory_gb,
                per_device_train_batch_size=batch,
                lora=True,
                lora_rank=rank,
                lora_targets=targets,
            )
        )
        rows[model] = {
            "parameters": plan["model"]["parameters"],
            "lora_trainable_parameters": plan["lora"]["trainable_parameters"],
            "strategies": {
                name: {
                    "full_gpu_gb": row["gpu_total_gb"],
                    "lora_gpu_gb": plan["lora"]["strategies"][name]["gpu_total_gb"],
                    "full_host_gb": row["cpu_per_node_gb"],
                    "lora_host_gb": plan["lora"]["strategies"][name]["cpu_per_node_gb"],
                    "full_fits": row["fits_with_margin"],
                    "lora_fits": plan["lora"]["strategies"][name]["fits_with_margin"],
                }
                for name, row in plan["strategies"].items()
            },
            "recommendation": plan["recommendation"],
            "lora_recommendation": plan["lora"]["recommendation"],
        }
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--source_length", type=int, default=48)
    parser.add_argument("--target_length", type=int, default=32)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--plan", nargs="+", metavar="MODEL", help="Print the planner's rows for these models instead.")
    parser.add_argument("--gpu_memory_gb", type=float, default=40.0)
    parser.add_argument("--plan_batch", type=int, default=32)
    parser.add_argument("--targets", default="qv")
    parser.add_argument("--output")
    parser.add_argument("--child", help=argparse.SUPPRESS)  # one measurement: "shape,mode"
    args = parser.parse_args(argv)
    if args.child:
        shape, mode = args.child.split(",")
        print(
            json.dumps(
                train_once(
                    shape, mode, args.batch, args.source_length, args.target_length, args.steps, args.warmup, args.rank
                )
            )
        )
        return 0
    if args.plan:
        rows = planner_rows(args.plan, args.gpu_memory_gb, args.plan_batch, args.rank, args.targets)
        emit(
            {
                "benchmark": "lora_vs_full --plan",
                "gpu_memory_gb": args.gpu_memory_gb,
                "per_device_train_batch_size": args.plan_batch,
                "lora_rank": args.rank,
                "lora_targets": args.targets,
                "models": rows,
            },
            args.output,
        )
        return 0
    runs = []
    for shape in args.shapes:
        for mode in args.modes:
            child = [
                sys.executable,
                __file__,
                "--child",
                f"{shape},{mode}",
                "--batch",
                str(args.batch),
                "--source_length",
                str(args.source_length),
                "--target_length",
                str(args.target_length),
                "--steps",
                str(args.steps),
                "--warmup",
                str(args.warmup),
                "--rank",
                str(args.rank),
            ]
            done = subprocess.run(child, capture_output=True, text=True, check=True)
            runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
    by_key = {(r["shape"], r["mode"]): r for r in runs}
    ratios = {
        f"{shape} {mode} / full": {
            "samples_per_second": round(
                by_key[(shape, mode)]["samples_per_second"] / by_key[(shape, "full")]["samples_per_second"], 3
            ),
            "peak_rss": round(by_key[(shape, mode)]["peak_rss_bytes"] / by_key[(shape, "full")]["peak_rss_bytes"], 3),
        }
        for shape in args.shapes
        for mode in args.modes
        if mode != "full" and (shape, "full") in by_key
    }
    emit(
        {
            "benchmark": "lora_vs_full",
            "machine": machine(),
            "load_average_at_end": os.getloadavg(),  # a shared machine: what else ran beside the measurements
            "settings": {k: v for k, v in vars(args).items() if k not in ("output", "child")},
            "runs": runs,
            "ratios": ratios,
        },
        args.output,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
