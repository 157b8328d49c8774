"""The planner's rows for 1B- and 7B-class causal LMs (full fine-tuning, LoRA, QLoRA NF4 and int8) beside T5's on one
A100-40GB, and a tiny causal LM's quantized base measured on this CPU against the planner's bytes.

    python bench/plan_rows.py                      # A100-40GB, 64 GB host, batch 8, prompt 160 + SQL 64, bf16
    python bench/plan_rows.py --gpu_memory_gb 80 --output rows.json

Nothing is downloaded: the causal models come from the planner's built-in table (their hub config.json facts), T5's
from its own. The measured part loads a randomly initialised tiny Qwen2 (hidden 128, 2 layers, 1000 ids) with
bitsandbytes (NF4 with double quantization, int8) on its CPU backend and sums the storage the loaded model holds
(parameters, buffers, bitsandbytes' quantization state). It prints one JSON object and asserts nothing.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import emit, machine  # noqa: E402

MODELS = (
    "meta-llama/Llama-3.2-1B",
    "Qwen/Qwen2.5-1.5B",
    "bigscience/bloom-1b1",
    "Qwen/Qwen2.5-7B",
    "meta-llama/Llama-3.1-8B",
    "mistralai/Mistral-7B-v0.1",
    "bigscience/bloom-7b1",
    "tiiuae/falcon-7b",
    "t5-large",
    "t5-3b",
)


def best(rows: dict) -> dict | None:
    """The fastest strategy that fits with the margin, and its peak."""
    for name, row in rows.items():
        if row["fits_with_margin"]:
            return {"strategy": name, "gpu_gb": row["gpu_total_gb"], "peak_phase": row["peak_phase"]}
    return None


def planner_rows(args) -> list[dict]:
    from textsql.arguments.plan import PlanArguments
    from textsql.planner.recommend import plan_memory

    found = []
    for model in MODELS:
        causal = not model.startswith("t5")
        common = dict(
            model_id=model,
            gpu_memory_gb=args.gpu_memory_gb,
            cpu_memory_gb=args.cpu_memory_gb,
            per_device_train_batch_size=args.batch,
            per_device_eval_batch_size=args.batch,
            max_source_length=args.prompt,
            max_target_length=args.sql,
            activation_checkpointing=True,
            lora=True,
        )
        row = {"model": model}
        for quantize in ("nf4", "int8") if causal else ("none",):
            plan = plan_memory(PlanArguments(**common, quantize_base=quantize))
            recommendation = (
                {
                    k: plan["recommendation"].get(k, False if k == "lora" else "none")
                    for k in ("strategy", "lora", "quantize_base", "predicted_gpu_gb")
                }
                if plan["recommendation"]
                else None
            )
            if quantize == "int8":  # the same full and LoRA rows as with nf4; only the QLoRA rows differ
                row["recommendation_with_int8"] = recommendation
            else:
                row["recommendation"] = recommendation
            row |= {
                "parameters": plan["model"]["parameters"],
                "full_none_gb": plan["strategies"]["none"]["gpu_total_gb"],
                "full_best": best(plan["strategies"]),
                "lora_none_gb": plan["lora"]["strategies"]["none"]["gpu_total_gb"],
                "lora_best": best(plan["lora"]["strategies"]),
            }
            if quantize != "none":
                qlora = plan["qlora"]
                row[f"qlora_{quantize}_base_gb"] = round(qlora["quantized_base"]["total"] / 2**30, 2)
                row[f"qlora_{quantize}_none_gb"] = qlora["strategies"]["none"]["gpu_total_gb"]
                row[f"qlora_{quantize}_best"] = best(qlora["strategies"])
        if causal and args.small_gpu_memory_gb:  # where LoRA on a bf16 base stops fitting: QLoRA's turn
            small = plan_memory(
                PlanArguments(**(common | {"gpu_memory_gb": args.small_gpu_memory_gb}), quantize_base="nf4")
            )
            rec = small["recommendation"]
            row["recommendation_on_small_gpu"] = (
                {
                    k: rec.get(k, False if k == "lora" else "none")
                    for k in ("strategy", "lora", "quantize_base", "predicted_gpu_gb")
                }
                if rec
                else None
            )
        found.append(row)
    return found


def load_quantized(folder, name: str):
    """The model in `folder` loaded by bitsandbytes in `name`'s format (nf4: double quantization; fp32 compute, as on
    a CPU); tests/unit/test_memory_causal.py loads its models through this too."""
    import torch
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    if name == "nf4":
        quantization = BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type="nf4",
            bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=torch.float32,
        )
    else:
        quantization = BitsAndBytesConfig(load_in_8bit=True)
    return AutoModelForCausalLM.from_pretrained(folder, quantization_config=quantization, dtype=torch.float32)


def measured_tiny() -> list[dict]:
    """A tiny Qwen2 loaded by bitsandbytes on this CPU: the planner's bytes against the storage the model holds."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from textsql.planner import causal
    from textsql.planner.shape import resolve_model

    config = AutoConfig.for_model(
        "qwen2",
        hidden_size=128,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=1000,
        tie_word_embeddings=False,
    )
    results = []
    with tempfile.TemporaryDirectory() as folder:
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(config).save_pretrained(folder)
        shape = resolve_model(folder)
        weights = sum(n for n, _ in shape.quantizable)
        for name in causal.QUANTIZED_FORMATS:
            model = load_quantized(folder, name)
            predicted = causal.quantized_bytes(name, shape.quantizable) + 4 * (shape.parameters - weights)
            measured = causal.loaded_model_bytes(model)
            results.append(
                {
                    "format": name,
                    "parameters": shape.parameters,
                    "quantized_weights": weights,
                    "predicted_bytes": predicted,
                    "measured_bytes": measured,
                    "get_memory_footprint": model.get_memory_footprint(),
                    "error": round(measured / predicted - 1, 5),
                }
            )
    return results


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpu_memory_gb", type=float, default=40.0)
    parser.add_argument("--cpu_memory_gb", type=float, default=64.0, help="host memory of the pod (offload rows)")
    parser.add_argument(
        "--small_gpu_memory_gb", type=float, default=16.0, help="a smaller GPU for the causal LMs' recommendation too"
    )
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=160, help="prompt tokens (question + columns); T5's source")
    parser.add_argument("--sql", type=int, default=64, help="SQL tokens; T5's target")
    parser.add_argument("--output")
    args = parser.parse_args(argv)
    started = time.time()
    report = {
        "machine": machine(),
        "load_average": list(__import__("os").getloadavg()),
        "inputs": vars(args) | {"precision": "bf16", "gradient_checkpointing": True, "lora_rank": 8, "lora": "qv"},
        "rows": planner_rows(args),
        "tiny_quantized_base_on_this_cpu": measured_tiny(),
    }
    report["seconds"] = round(time.time() - started, 1)
    emit(report, args.output)


if __name__ == "__main__":
    main()
