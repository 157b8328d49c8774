"""Batched SQL generation (textsql infer) against the walkthrough's one-question-at-a-time loop: same model, same questions.

    python bench/infer_batching.py [--model_dir RUN_FOLDER --dataset_dir DATA] [--questions 256] [--repeats 3] [--output F]

Without --model_dir it builds the demo's generated data and tiny T5 in a temporary folder (untrained: it measures
speed, not quality); `--shape t5-small --dataset_dir DATA` measures a random model of t5-small's shape instead. Prints one JSON object: questions/s of each way, the speed-up, and whether the outputs agree.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))  # runs from a checkout without installing the package

from bench.common import emit, machine  # noqa: E402  (the repository root is on sys.path now)


def one_at_a_time(model, tokenizer, sources: list[str], max_new_tokens: int) -> list[str]:
    """The walkthrough's loop: tokenize one question, generate, decode, next."""
    import torch

    outputs = []
    for source in sources:
        encoded = tokenizer(source, return_tensors="pt").to(model.device)
        with torch.no_grad():
            generated = model.generate(**encoded, max_new_tokens=max_new_tokens)
        outputs.append(" ".join(tokenizer.decode(generated[0], skip_special_tokens=True).split()))
    return outputs


def timed(function) -> tuple[float, list[str]]:
    started = time.perf_counter()
    result = function()
    return time.perf_counter() - started, result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model_dir", help="A fine-tuned run folder; default: an untrained tiny T5 on generated data.")
    parser.add_argument("--dataset_dir", help="Prepared dataset (with --model_dir or --shape).")
    parser.add_argument("--shape", choices=["t5-small", "t5-large"], help="A random model of this shape (speed only).")
    parser.add_argument("--questions", type=int, default=256)
    parser.add_argument("--batch_size", type=int, default=64)
    parser.add_argument("--max_new_tokens", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--output", help="Also write the JSON here.")
    args = parser.parse_args()

    from textsql.evaluate import generate_sql, load_scoring_set
    from textsql.loading import load_for_inference

    with tempfile.TemporaryDirectory(prefix="textsql-bench-") as tmp:
        if args.model_dir:
            model_dir, data_dir = args.model_dir, args.dataset_dir
        elif args.shape:
            from bench.shapes import save_random_t5

            model_dir, data_dir = save_random_t5(f"{tmp}/{args.shape}", args.dataset_dir, args.shape), args.dataset_dir
        else:
            from textsql.demo.tiny import build_assets

            data_path, model_path = build_assets(Path(tmp), train_tables=60, questions_per_table=8)
            model_dir, data_dir = str(model_path), str(data_path)
        model, tokenizer = load_for_inference(model_dir, "auto")
        scoring = load_scoring_set(data_dir, "test" if args.model_dir or args.shape else "train", args.questions)
        sources = scoring.sources
        rounds = {"one_at_a_time": [], "batched": []}
        for _ in range(args.repeats):  # alternate, so drifts in machine load hit both ways alike
            seconds, loop_outputs = timed(lambda: one_at_a_time(model, tokenizer, sources, args.max_new_tokens))
            rounds["one_at_a_time"].append(seconds)
            seconds, batched_outputs = timed(
                lambda: [
                    top
                    for top, *_ in generate_sql(
                        model,
                        tokenizer,
                        sources,
                        batch_size=args.batch_size,
                        max_new_tokens=args.max_new_tokens,
                        progress=False,
                    )
                ]
            )
            rounds["batched"].append(seconds)
        agree = sum(a == b for a, b in zip(loop_outputs, batched_outputs))
    best = {way: min(times) for way, times in rounds.items()}
    emit(
        {
            "benchmark": "infer_batching",
            "questions": len(sources),
            "batch_size": args.batch_size,
            "max_new_tokens": args.max_new_tokens,
            "model": model_dir
            if args.model_dir
            else f"random {args.shape} shape"
            if args.shape
            else "untrained tiny T5 (demo shape) on generated data",
            "device": str(model.device),
            "questions_per_second": {way: round(len(sources) / s, 2) for way, s in best.items()},
            "seconds_per_round": {way: [round(s, 3) for s in times] for way, times in rounds.items()},
            "median_seconds": {way: round(statistics.median(times), 3) for way, times in rounds.items()},
            "speedup": round(best["one_at_a_time"] / best["batched"], 2),
            "outputs_identical": f"{agree}/{len(sources)}",
            "machine": machine(),
        },
        args.output,
    )


if __name__ == "__main__":
    main()
