"""Whether bf16 pays on this CPU: one decoder layer of SmolLM2-135M's shape (the real model's recipe trains in bf16
autocast) forward and backward, at the recipe's batch (16 questions of the real lines' mean 88 tokens), in fp32 and
in bf16 autocast, one thread, side by side; and what a whole step of 30 layers would take at that rate.

    python bench/cpu_precision.py --output bench/results/DATE-cpu-precision.json

A CPU with AMX or AVX-512-BF16 runs bf16 matmuls natively (several times fp32's rate); one with AVX2 only emulates
them, and `--precision bf16` then trains several times slower than `--precision fp32` (docs/real-model.md).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.common import emit, machine  # noqa: E402

# SmolLM2-135M-Instruct (docs/real-model.md): hidden 576, MLP 1536, 9 query and 3 key-value heads, 30 layers.
SHAPE = {"hidden_size": 576, "intermediate_size": 1536, "num_attention_heads": 9, "num_key_value_heads": 3}
LAYERS = 30


def cpu_flags() -> list[str]:
    """The matmul-relevant flags /proc/cpuinfo lists (empty where it cannot be read)."""
    wanted = {"avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile", "avx512_vnni", "avx_vnni"}
    try:
        line = next(line for line in open("/proc/cpuinfo") if line.startswith("flags"))
    except (OSError, StopIteration):
        return []
    return sorted(wanted & set(line.split(":", 1)[1].split()))


def layer_step_seconds(precision: str, batch: int, tokens: int, repeats: int) -> list[float]:
    """Seconds of one decoder layer's forward and backward at (batch, tokens), `repeats` times after one warm-up."""
    import torch
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    config = LlamaConfig(**SHAPE, num_hidden_layers=1, attn_implementation="eager")
    layer, rotary = LlamaDecoderLayer(config, layer_idx=0), LlamaRotaryEmbedding(config)
    hidden = torch.randn(batch, tokens, SHAPE["hidden_size"], requires_grad=True)
    positions = torch.arange(tokens).unsqueeze(0).expand(batch, -1)
    mask = torch.full((tokens, tokens), float("-inf")).triu(1)[None, None].expand(batch, 1, -1, -1)
    times = []
    for attempt in range(repeats + 1):
        started = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
            embeddings = rotary(hidden, positions)
            output = layer(hidden, attention_mask=mask, position_ids=positions, position_embeddings=embeddings)
            output = output[0] if isinstance(output, tuple) else output
        output.float().sum().backward()
        if attempt:
            times.append(time.perf_counter() - started)
    return times


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=88, help="the real lines' mean tokens an example (prep)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--output")
    args = parser.parse_args(argv)
    import torch

    torch.set_num_threads(1)  # as the benchmark's lanes run: one thread a process
    torch.manual_seed(0)
    load_before = os.getloadavg()
    results = {}
    for _ in range(2):  # alternating, so a change of load falls on both
        for precision in ("fp32", "bf16"):
            results.setdefault(precision, []).extend(
                layer_step_seconds(precision, args.batch, args.tokens, args.repeats)
            )
    figures = {
        precision: {
            "layer_seconds_min_median_max": [round(min(t), 4), round(statistics.median(t), 4), round(max(t), 4)],
            "step_seconds_estimate": round(statistics.median(t) * LAYERS, 1),
        }
        for precision, t in results.items()
    }
    bf16_over_fp32 = statistics.median(results["bf16"]) / statistics.median(results["fp32"])
    emit(
        {
            "benchmark": "cpu_precision",
            "date": time.strftime("%Y-%m-%d"),
            "shape": {**SHAPE, "layers": LAYERS, "batch": args.batch, "tokens": args.tokens},
            "cpu_flags": cpu_flags(),
            "results": figures,
            "bf16_seconds_over_fp32": round(bf16_over_fp32, 2),
            "note": "a step's estimate is one layer's forward and backward times the 30 layers (the embedding, the "
            "output layer and the optimizer left out)",
            "machine": machine(),
            "load_average_before_after": [round(load_before[0], 2), round(os.getloadavg()[0], 2)],
        },
        args.output,
    )


if __name__ == "__main__":
    main()
