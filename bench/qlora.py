"""LoRA on an fp32 base against QLoRA (NF4, int8) on the same causal LM: samples/s and peak memory, side by side.

    python bench/qlora.py                                  # the tiny and small Qwen2 shapes, CPU
    python bench/qlora.py --shapes small --steps 8 --output result.json

A randomly initialised Qwen2 of the shape (seeded) is saved once; each (shape, mode) then loads it in a fresh process,
so its peak resident memory (ru_maxrss) is its own: lora-fp32 (the base in fp32, textsql.hub.load_model), qlora-nf4
and qlora-int8 (textsql.loading.load_quantized_base: what `textsql train --lora True --quantize_base nf4|int8` loads,
computing in fp32 on the CPU). textsql.adapters.apply_lora puts adapters of rank --rank on every linear layer
(--lora_targets all), AdamW trains them on random token ids of --length; the median step time over --steps timed steps
(after --warmup) gives samples/s. Prints one JSON object with the machine and its load.
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

# tiny: the tests' causal model; small: a ~0.1B Qwen2 whose linear layers dominate, as in a 7B model.
SHAPES = {
    "tiny": dict(hidden_size=64, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4, vocab_size=2000),
    "small": dict(
        hidden_size=768, intermediate_size=2048, num_hidden_layers=8, num_attention_heads=12, vocab_size=16000
    ),
}
MODES = ("lora-fp32", "qlora-nf4", "qlora-int8")


def save_model(shape: str, folder: Path) -> None:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(**SHAPES[shape], num_key_value_heads=SHAPES[shape]["num_attention_heads"] // 2)
    Qwen2ForCausalLM(config).save_pretrained(folder)


def train_once(folder: str, mode: str, batch: int, length: int, steps: int, warmup: int, rank: int) -> dict:
    """One measurement, in this process (the parent runs each in a child)."""
    import resource

    import torch

    from textsql.adapters import apply_lora, parameter_counts
    from textsql.arguments.lora import LoraArguments
    from textsql.hub import load_model
    from textsql.loading import load_quantized_base

    quantize_base = "none" if mode == "lora-fp32" else mode.split("-")[1]
    rss_start = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    if quantize_base == "none":
        model = load_model(folder, dtype=torch.float32)
    else:
        model = load_quantized_base(folder, quantize_base, "float32")
    lora = LoraArguments(
        lora=True, lora_rank=rank, lora_alpha=2 * rank, lora_targets="all", quantize_base=quantize_base
    )
    model = apply_lora(model, lora, [])
    model.train()
    rss_loaded = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    trainable, total = parameter_counts(model)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    generator = torch.Generator().manual_seed(1)
    vocab = model.config.vocab_size
    batches = [torch.randint(2, vocab, (batch, length), generator=generator) for _ in range(4)]
    times = []
    for step in range(warmup + steps):
        ids = batches[step % len(batches)]
        started = time.perf_counter()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step >= warmup:
            times.append(time.perf_counter() - started)
    step_time = statistics.median(times)
    return {
        "mode": mode,
        "trainable_parameters": trainable,
        "weights_bytes": weights,
        "step_seconds_median": round(step_time, 4),
        "samples_per_second": round(batch / step_time, 2),
        "rss_at_start_bytes": rss_start,
        "rss_after_load_bytes": rss_loaded,
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "final_loss": round(float(loss), 4),
        "threads": torch.get_num_threads(),
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--length", type=int, default=64)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--output")
    parser.add_argument("--child", help=argparse.SUPPRESS)  # one measurement: "folder,mode"
    args = parser.parse_args(argv)
    settings = [str(v) for v in (args.batch, args.length, args.steps, args.warmup, args.rank)]
    if args.child:
        folder, mode = args.child.rsplit(",", 1)
        print(json.dumps(train_once(folder, mode, *map(int, settings))))
        return 0
    load_at_start = os.getloadavg()
    results = {}
    with tempfile.TemporaryDirectory() as workdir:
        for shape in args.shapes:
            folder = Path(workdir) / shape
            save_model(shape, folder)
            runs = []
            for mode in args.modes:
                child = [sys.executable, __file__, "--child", f"{folder},{mode}", "--batch", settings[0], "--length"]
                child += [settings[1], "--steps", settings[2], "--warmup", settings[3], "--rank", settings[4]]
                done = subprocess.run(child, capture_output=True, text=True, check=True)
                runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
            base = next((r for r in runs if r["mode"] == "lora-fp32"), None)
            for run in runs:
                if base and run is not base:
                    run["peak_rss_vs_lora_fp32"] = round(run["peak_rss_bytes"] / base["peak_rss_bytes"], 3)
                    run["weights_vs_lora_fp32"] = round(run["weights_bytes"] / base["weights_bytes"], 3)
                    run["speed_vs_lora_fp32"] = round(run["samples_per_second"] / base["samples_per_second"], 3)
            results[shape] = {"shape": SHAPES[shape], "runs": runs}
    emit(
        {
            "benchmark": "qlora",
            "machine": machine(),
            "load_average_at_start": load_at_start,
            "load_average_at_end": os.getloadavg(),  # a shared machine: what else ran beside the measurements
            "settings": {k: v for k, v in vars(args).items() if k not in ("output", "child")},
            "shapes": results,
        },
        args.output,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
