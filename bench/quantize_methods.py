"""Every quantization method of `textsql quantize` side by side in one process: size, questions/s, execution accuracy
and agreement (identical SQL) with the unquantized model, on the same questions.

    python bench/quantize_methods.py --model_dir RUN_FOLDER --dataset_dir DATA [--questions 200] [--repeats 2]

RUN_FOLDER is a fine-tuned model (quantizing an untrained one says nothing about agreement): `textsql demo` writes one
(textsql-demo/runs/tiny-t5-none-ws1-bs16 with --deepspeed none). Each model is quantized into a temporary folder,
reloaded from it (the round trip `textsql quantize` does), warmed up on one batch, then timed; the models take turns
for --repeats rounds and the JSON reports the median questions/s and every round.
"""

from __future__ import annotations

import argparse
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model_dir", required=True, help="A fine-tuned model folder (a run folder or a merged adapter)."
    )
    parser.add_argument("--dataset_dir", required=True, help="The prepared dataset it was trained on.")
    parser.add_argument("--split", default="test")
    parser.add_argument("--questions", type=int, default=200)
    parser.add_argument("--batch_size", type=int, default=64)
    parser.add_argument("--max_new_tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--methods", default="torchao-int8,bnb-int8,bnb-nf4,dynamic-int8")
    parser.add_argument("--output", help="Also write the JSON here.")
    args = parser.parse_args()

    import torch

    from textsql.evaluate import decode_and_score, generate_sql, load_scoring_set
    from textsql.quantize import QuantizeArguments, load_for_inference, memory_bytes, quantize_and_save, weights_bytes

    load_before = os.getloadavg()
    scoring = load_scoring_set(args.dataset_dir, args.split, args.questions)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    methods = [m for m in args.methods.split(",") if m]
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="textsql-bench-quantize-") as tmp:
        models = {"unquantized": load_for_inference(args.model_dir, device.type)}
        results["unquantized"] = {
            "weights_bytes": weights_bytes(args.model_dir),
            "memory_bytes": memory_bytes(models["unquantized"][0]),
        }
        for method in methods:
            started = time.perf_counter()
            folder = quantize_and_save(
                QuantizeArguments(
                    model_dir=args.model_dir, method=method, output_dir=f"{tmp}/{method}", dataset_dir=args.dataset_dir
                ),
                device,
            )
            models[method] = load_for_inference(str(folder), device.type)
            results[method] = {
                "weights_bytes": weights_bytes(folder),
                "memory_bytes": memory_bytes(models[method][0]),
                "quantize_and_reload_seconds": round(time.perf_counter() - started, 2),
            }
        for model, tokenizer in models.values():  # warm-up: first-call costs (allocations, packing) out of the timings
            generate_sql(
                model,
                tokenizer,
                scoring.sources[: args.batch_size],
                batch_size=args.batch_size,
                max_new_tokens=args.max_new_tokens,
                progress=False,
            )
        rounds: dict[str, list[float]] = {name: [] for name in models}
        for _ in range(args.repeats):
            for name, (model, tokenizer) in models.items():
                started = time.perf_counter()
                records, metrics = decode_and_score(
                    model,
                    tokenizer,
                    scoring,
                    batch_size=args.batch_size,
                    max_new_tokens=args.max_new_tokens,
                    progress=False,
                )
                rounds[name].append(len(records) / (time.perf_counter() - started))
                results[name]["execution_accuracy"] = metrics["execution_accuracy"]
                results[name]["logical_form_accuracy"] = metrics["logical_form_accuracy"]
                results[name]["predictions"] = [r["predicted_sql"] for r in records]
    base = results["unquantized"]
    for name, row in results.items():
        row["questions_per_second"] = round(statistics.median(rounds[name]), 2)
        row["questions_per_second_rounds"] = [round(x, 2) for x in rounds[name]]
        row["speedup"] = round(row["questions_per_second"] / base["questions_per_second"], 2)
        row["size_vs_unquantized"] = round(row["memory_bytes"] / base["memory_bytes"], 3)
    for row in results.values():
        same = sum(a == b for a, b in zip(row["predictions"], base["predictions"], strict=True))
        row["agreement"] = same / len(base["predictions"])
        row["execution_accuracy_delta"] = row["execution_accuracy"] - base["execution_accuracy"]
    for row in results.values():
        del row["predictions"]
    emit(
        {
            "benchmark": "quantize_methods",
            "machine": machine(),
            "device": device.type,
            "model_dir": args.model_dir,
            "questions": len(scoring.sources),
            "split": args.split,
            "batch_size": args.batch_size,
            "max_new_tokens": args.max_new_tokens,
            "repeats": args.repeats,
            "load_average_before": load_before,
            "load_average_after": os.getloadavg(),
            "results": results,
        },
        args.output,
    )


if __name__ == "__main__":
    main()
