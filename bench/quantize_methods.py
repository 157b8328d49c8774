"""Every quantization method of `textsql quantize` side by side in one process: size, questions/s, execution accuracy
and agreement (identical SQL) with the unquantized model, on the same questions.

    python bench/quantize_methods.py --model_dir RUN_FOLDER --dataset_dir DATA [--questions 200] [--repeats 2]

RUN_FOLDER is a fine-tuned model (quantizing an untrained one says nothing about agreement): `textsql demo` writes one
(textsql-demo/runs/tiny-t5-none-ws1-bs16 with --deepspeed none); a fine-tuned causal LM goes through GPTQ too
(gptq-4bit, gptq-8bit: llmcompressor in textsql's GPTQ environment, created first when missing, calibrated on
--calibration_samples training examples of DATA). A method `textsql quantize` refuses for the model (GPTQ for T5) is
reported with its reason instead of figures. `--shape t5-small` instead measures size and speed on a
randomly initialised model of t5-small's shape (its layers, the dataset's tokenizer): every question generates
exactly --max_new_tokens tokens, so questions/s compare; it has no accuracy, and its agreement says little (random
weights tend to repeat a few tokens). Each model is quantized into a
temporary folder, reloaded from it (the round trip `textsql quantize` does), warmed up on one batch, then timed; the
models take turns for --repeats rounds and the JSON reports the median questions/s and every round.
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
from bench.shapes import save_random_t5  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model_dir", help="A fine-tuned model folder (a run folder or a merged adapter).")
    parser.add_argument("--shape", choices=["t5-small"], help="Instead of --model_dir: a random model of this shape.")
    parser.add_argument("--dataset_dir", required=True, help="The prepared dataset it was trained on.")
    parser.add_argument("--split", default="test")
    parser.add_argument("--questions", type=int, default=200)
    parser.add_argument("--batch_size", type=int, default=64)
    parser.add_argument("--max_new_tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--methods", default="torchao-int8,bnb-int8,bnb-nf4,dynamic-int8,gptq-4bit,gptq-8bit")
    parser.add_argument("--calibration_samples", type=int, default=128, help="GPTQ's calibration examples.")
    parser.add_argument("--output", help="Also write the JSON here.")
    args = parser.parse_args()
    if bool(args.model_dir) == bool(args.shape):
        parser.error("pass --model_dir (a fine-tuned model) or --shape t5-small (random weights, for size and speed)")

    import torch

    from textsql.arguments.quantize import QuantizeArguments
    from textsql.errors import TextsqlError
    from textsql.evaluate import decode_and_score, generate_sql, load_scoring_set
    from textsql.loading import load_for_inference
    from textsql.quantize import memory_bytes, quantize_and_save, weights_bytes

    load_before = os.getloadavg()
    scoring = load_scoring_set(args.dataset_dir, args.split, args.questions)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    methods = [m for m in args.methods.split(",") if m]
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="textsql-bench-quantize-") as tmp:
        if args.shape:
            args.model_dir = save_random_t5(f"{tmp}/{args.shape}", args.dataset_dir)
        models = {"unquantized": load_for_inference(args.model_dir, device.type)}
        results["unquantized"] = {
            "weights_bytes": weights_bytes(args.model_dir),
            "memory_bytes": memory_bytes(models["unquantized"][0]),
        }
        refused = {}
        for method in methods:
            started = time.perf_counter()
            try:
                folder = quantize_and_save(
                    QuantizeArguments(
                        model_dir=args.model_dir,
                        output_dir=f"{tmp}/{method}",
                        dataset_dir=args.dataset_dir,
                        **method_arguments(method, args.calibration_samples),
                    ),
                    device,
                    echo=lambda line: print(line, file=sys.stderr),
                )
            except TextsqlError as error:  # GPTQ for T5: the reason, not figures
                refused[method] = str(error)
                continue
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
        for name, (model, _) in models.items():  # GPTQ's compressed-tensors weights decompress at the first forward
            results[name]["memory_bytes_in_use"] = memory_bytes(model)
        rounds: dict[str, list[float]] = {name: [] for name in models}
        for _ in range(args.repeats):
            for name, (model, tokenizer) in models.items():
                started = time.perf_counter()
                if args.shape:
                    predictions = fixed_length_generation(model, tokenizer, scoring.sources, args)
                    metrics = {"execution_accuracy": None, "logical_form_accuracy": None}
                else:
                    records, metrics = decode_and_score(
                        model,
                        tokenizer,
                        scoring,
                        batch_size=args.batch_size,
                        max_new_tokens=args.max_new_tokens,
                        progress=False,
                    )
                    predictions = [r["predicted_sql"] for r in records]
                rounds[name].append(len(predictions) / (time.perf_counter() - started))
                results[name]["execution_accuracy"] = metrics["execution_accuracy"]
                results[name]["logical_form_accuracy"] = metrics["logical_form_accuracy"]
                results[name]["predictions"] = predictions
    base = results["unquantized"]
    for name, row in results.items():
        row["questions_per_second"] = round(statistics.median(rounds[name]), 2)
        row["questions_per_second_rounds"] = [round(x, 2) for x in rounds[name]]
        row["speedup"] = round(row["questions_per_second"] / base["questions_per_second"], 2)
        row["size_vs_unquantized"] = round(row["memory_bytes"] / base["memory_bytes"], 3)
        row["in_use_vs_unquantized"] = round(row["memory_bytes_in_use"] / base["memory_bytes_in_use"], 3)
    for row in results.values():
        same = sum(a == b for a, b in zip(row["predictions"], base["predictions"], strict=True))
        row["agreement"] = same / len(base["predictions"])
        if row["execution_accuracy"] is not None:
            row["execution_accuracy_delta"] = row["execution_accuracy"] - base["execution_accuracy"]
    for row in results.values():
        del row["predictions"]
    results.update({method: {"refused": reason} for method, reason in refused.items()})
    emit(
        {
            "benchmark": "quantize_methods",
            "machine": machine(),
            "device": device.type,
            "model_dir": None if args.shape else args.model_dir,
            "shape": args.shape,
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


def method_arguments(method: str, calibration_samples: int) -> dict:
    """QuantizeArguments' fields for a --methods entry: a method's name, or gptq-4bit / gptq-8bit."""
    if method.startswith("gptq-"):
        bits = int(method.removeprefix("gptq-").removesuffix("bit"))
        return {"method": "gptq", "bits": bits, "calibration_samples": calibration_samples}
    return {"method": method}


def fixed_length_generation(model, tokenizer, sources: list[str], args) -> list[str]:
    """Greedy generation of exactly --max_new_tokens tokens per question (random weights stop at random places)."""
    import torch

    outputs = []
    for start in range(0, len(sources), args.batch_size):
        encoded = tokenizer(sources[start : start + args.batch_size], return_tensors="pt", padding=True)
        with torch.no_grad():
            generated = model.generate(
                **encoded.to(next(model.parameters()).device),
                min_new_tokens=args.max_new_tokens,
                max_new_tokens=args.max_new_tokens,
            )
        outputs += tokenizer.batch_decode(generated, skip_special_tokens=True)
    return outputs


if __name__ == "__main__":
    main()
