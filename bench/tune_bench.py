"""`textsql tune` on this machine: the tiny T5, the t5-small shape (random weights) and the causal demo's tiny Qwen2-shaped
model on generated WikiSQL-format data, each shape's table, winner and the winner's speed against textsql train's
default settings, as a candidate and re-measured from its recipe, measured in one run.

    python bench/tune_bench.py --output tune.json                 # both shapes, into a temporary folder
    python bench/tune_bench.py --shapes tiny --workdir /tmp/tb      # one shape; the folder keeps results (resumable)

The t5-small shape is t5-small's config (d_model 512, d_ff 2048, 6 layers, 8 heads, d_kv 64, vocabulary 32128) with
random weights and the generated data's tokenizer: nothing is downloaded. On a CPU the candidates are the strategies
that run there (none, ZeRO-1, ZeRO-2; FSDP is refused on the CPU and shown so); on a GPU every planner row that fits.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import emit, machine  # noqa: E402
from textsql.arguments.tune import TuneArguments
from textsql.demo.tiny import build_assets  # noqa: E402
from textsql.tune import run_tune
from textsql.tune.report import as_dict, format_table

T5_SMALL = dict(d_model=512, d_ff=2048, num_layers=6, num_heads=8, d_kv=64, vocab_size=32128)
# Per shape: the global batch, micro-batches, timed steps and strategies tried on a CPU (minutes, not hours).
CPU_PLAN = {
    "tiny": dict(global_batch_size=32, micro_batches="8,32", timed_steps=20, strategies="none,zero2,fsdp_full_shard"),
    "t5-small": dict(global_batch_size=16, micro_batches="4,16", timed_steps=10, strategies="none,zero2"),
    # The causal demo's tiny Qwen2-shaped model (150 tables: no epoch ends inside the steps) with the causal LMs'
    # levers: where a tune once said 1.71x the default and its recipe, trained for real, gave 1.10x (issue 41): the
    # winner is re-measured from its recipe (--confirm).
    "causal": dict(
        global_batch_size=32,
        micro_batches="8,16,32",
        timed_steps=20,
        strategies="none,zero2",
        levers="fused_loss,packing",
    ),
}


def t5_small_shape(tiny_model: Path, folder: Path) -> Path:
    """A random t5-small-shaped model with the tiny model's tokenizer (its ids fit t5-small's 32128 embeddings)."""
    import torch
    from transformers import AutoConfig, T5ForConditionalGeneration

    if (folder / "config.json").exists():
        return folder
    tiny = AutoConfig.from_pretrained(tiny_model)
    config = tiny.__class__(**{**tiny.to_dict(), **T5_SMALL})
    torch.manual_seed(0)
    T5ForConditionalGeneration(config).save_pretrained(folder)
    for path in tiny_model.iterdir():
        if "token" in path.name or path.name.endswith(".model") or path.name == "special_tokens_map.json":
            shutil.copy(path, folder / path.name)
    return folder


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="tiny,t5-small", help="Comma-separated: tiny, t5-small, causal.")
    parser.add_argument(
        "--workdir", default=None, help="Where data, models and tune folders go (default: a temporary folder)."
    )
    parser.add_argument("--warmup_steps", type=int, default=3)
    parser.add_argument("--repeat_top", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3, help="Measurements of each repeated candidate.")
    parser.add_argument("--lora", action="store_true", help="Also measure every setting with a LoRA adapter.")
    parser.add_argument("--retry_failed", action="store_true", help="Measure again the candidates that failed before.")
    parser.add_argument("--output", default=None, help="Also write the JSON report here.")
    args = parser.parse_args(argv)
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="textsql-tune-bench-"))
    report = {"machine": machine(), "shapes": {}}
    for shape in args.shapes.split(","):
        if shape == "causal":  # the causal demo's model and data layout, smaller
            data, model = build_assets(
                workdir / "assets", train_tables=150, questions_per_table=8, num_layers=2, seed=1, family="causal"
            )
        else:  # the tiny T5's data and tokenizer (built once, then found in the folder)
            data, model = build_assets(
                workdir / "assets", train_tables=60, questions_per_table=8, d_model=64, num_layers=2, seed=1
            )
            model = t5_small_shape(model, workdir / "t5-small-shape") if shape == "t5-small" else model
        tune = TuneArguments(
            model_id=str(model),
            dataset_dir=str(data),
            tune_dir=str(workdir / f"tune-{shape}"),
            warmup_steps=args.warmup_steps,
            repeat_top=args.repeat_top,
            repeats=args.repeats,
            lora=args.lora,
            retry_failed=args.retry_failed,
            accelerator="cpu",
            **CPU_PLAN[shape],
        )
        result = run_tune(tune, ["--learning_rate", "1e-3"], echo=lambda line: print(line, file=sys.stderr, flush=True))
        print(f"\n## {shape}\n\n{format_table(result)}\n", file=sys.stderr, flush=True)
        report["shapes"][shape] = as_dict(result) | {"settings": CPU_PLAN[shape]}
    emit(report, args.output)
    return 0


if __name__ == "__main__":
    sys.exit(main())
