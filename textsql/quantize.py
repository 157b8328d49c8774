"""Post-training quantization of a model folder (torchao, bitsandbytes, torch's dynamic int8, GPTQ for causal LMs),
scored like `textsql infer` against the unquantized model (the folder is loaded back by textsql.loading)."""

from __future__ import annotations

import io
import logging
import time
from dataclasses import asdict
from pathlib import Path

from textsql.arguments.quantize import METHODS, QuantizeArguments
from textsql.errors import TextsqlError
from textsql.evaluate import decode_and_score, generate_sql, load_scoring_set
from textsql.extras import require_lifecycle_extra
from textsql.gptq.calibrate import quantize_with_gptq
from textsql.hub import load_config, load_model, load_tokenizer
from textsql.loading import (
    check_method_device,
    folder_kind,
    load_for_inference,
    pick_device,
    read_record,
    write_record,
)
from textsql.paths import short_name
from textsql.prepared import load_prepared
from textsql.prompts import check_source_settings
from textsql.strategy.devices import NodeDevices, quantized_compute_dtype

logger = logging.getLogger("textsql.quantize")


def compute_dtype(device) -> str:
    """bf16 on a GPU with native bf16 (Ampere and newer), fp32 elsewhere (older GPUs, the CPU); never fp16, which T5's
    activations overflow."""
    if getattr(device, "type", str(device)) != "cuda":
        return "float32"
    gpus = NodeDevices.local().gpus
    index = min(getattr(device, "index", None) or 0, len(gpus) - 1)
    return quantized_compute_dtype(gpus[index : index + 1])


def quantization_config(method: str, device):
    """The transformers quantization config for `method` (None for dynamic-int8, applied after loading)."""
    import torch

    if method == "torchao-int8":
        require_lifecycle_extra("torchao", "--method torchao-int8")
        from torchao.quantization import Int8WeightOnlyConfig
        from transformers import TorchAoConfig

        return TorchAoConfig(quant_type=Int8WeightOnlyConfig())
    if method in ("bnb-int8", "bnb-nf4"):
        require_lifecycle_extra("bitsandbytes", f"--method {method}")
        from transformers import BitsAndBytesConfig

        if method == "bnb-int8":
            return BitsAndBytesConfig(load_in_8bit=True)
        return BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=getattr(torch, compute_dtype(device))
        )
    return None


def layers_left_unquantized(model) -> list[str]:
    """Names of the model's own linear layers still in full precision after quantizing: subclasses of nn.Linear that a
    model family defines (falcon's FalconLinear) and GPT-2's Conv1D. transformers' bitsandbytes and torchao swaps and
    torch's dynamic int8 replace only layers whose type is exactly nn.Linear and leave these as they are, silently (the
    model's size then hardly changes). On an unquantized model: what dynamic int8 will leave."""
    import torch

    left = []
    for name, module in model.named_modules():
        own = type(module).__module__.startswith("transformers.")
        linear = isinstance(module, torch.nn.Linear) or type(module).__name__ == "Conv1D"
        weight = getattr(module, "weight", None)
        if own and linear and isinstance(weight, torch.Tensor) and weight.dtype.is_floating_point:
            left.append(name)
    return left


def weights_bytes(model_dir: str | Path) -> int:
    """Bytes of the weight files in a folder (*.safetensors)."""
    return sum(path.stat().st_size for path in Path(model_dir).glob("*.safetensors"))


def memory_bytes(model) -> int:
    """Bytes of the model's state as torch would serialize it: quantized weights at their real width."""
    import torch

    buffer = io.BytesIO()
    torch.save(model.state_dict(), buffer)
    return buffer.tell()


def quantize_and_save(args: QuantizeArguments, device, echo=print) -> Path:
    """Quantize args.model_dir with args.method on `device`; save the model, tokenizer and record; return the folder."""
    import torch

    kind = folder_kind(args.model_dir)
    if kind == "adapter":
        raise TextsqlError(
            f"'{args.model_dir}' is a LoRA adapter: merge it into its base model first "
            f"(`textsql merge {args.model_dir}`), then quantize the merged folder."
        )
    if kind == "quantized":
        raise TextsqlError(
            f"'{args.model_dir}' is already quantized ({read_record(args.model_dir)['method']}); quantize the "
            "unquantized model it came from."
        )
    check_method_device(args.method, device)
    source = Path(str(args.model_dir).rstrip("/"))
    output = Path(args.output_dir) if args.output_dir else source.parent / short_name(source.name, args.label)
    tokenizer = load_tokenizer(args.model_dir)
    if args.method == "gptq":
        return _save_gptq(args, device, output, tokenizer, echo)
    config = quantization_config(args.method, device)
    if config is None:  # dynamic-int8: the fp32 weights are what is saved
        model = load_model(args.model_dir, dtype=torch.float32)
    else:
        model = load_model(
            args.model_dir,
            quantization_config=config,
            device_map=str(device),
            dtype=getattr(torch, compute_dtype(device)),
        )
    left = layers_left_unquantized(model)
    if left:
        logger.warning(
            "%s leaves %d of this model's linear layers in full precision: their type is the model's own subclass of "
            "nn.Linear (or GPT-2's Conv1D), which the quantizer does not replace (%s, ...).",
            args.method,
            len(left),
            ", ".join(left[:3]),
        )
    output.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(output, safe_serialization=True)
    return _finish_folder(output, args, device, tokenizer, left, compute_dtype(device))


def _finish_folder(output: Path, args: QuantizeArguments, device, tokenizer, left: list[str], dtype: str, **extra):
    """The tokenizer and the record (method, source, layers left in full precision, what else the method ran)."""
    tokenizer.save_pretrained(output)
    record = {
        "method": args.method,
        "summary": METHODS[args.method].summary,
        "source_model": str(args.model_dir),
        "quantized_on": device.type,
        "compute_dtype": dtype,
        "layers_left_unquantized": left,
        **extra,
    }
    write_record(output, record)
    return output


def _save_gptq(args: QuantizeArguments, device, output: Path, tokenizer, echo) -> Path:
    """GPTQ in textsql's GPTQ environment (textsql.gptq), then the tokenizer and the record, as the other methods.
    The data must suit the model before it calibrates on it (the check `textsql quantize` makes before scoring)."""
    check_source_settings(load_config(args.model_dir), load_prepared(args.dataset_dir)[1], args.dataset_dir)
    ran = quantize_with_gptq(
        str(args.model_dir),
        output,
        bits=args.bits,
        group_size=args.group_size,
        samples=args.calibration_samples,
        dataset_dir=args.dataset_dir,
        device=device.type,
        env_dir=args.gptq_env_dir,
        wheels=args.gptq_wheels,
        echo=echo,
    )
    left = ran.pop("layers_left_unquantized")
    if left:
        logger.warning(
            "GPTQ leaves %d of this model's linear layers in full precision: GPT-2's Conv1D is not an nn.Linear, which "
            "llmcompressor's recipe targets (%s, ...).",
            len(left),
            ", ".join(left[:3]),
        )
    # llmcompressor calibrates in fp32, and loaded, the weights decompress to fp32.
    return _finish_folder(
        output, args, device, tokenizer, left, "float32", bits=args.bits, group_size=ran["group_size"], gptq=ran
    )


def score_model(model, tokenizer, scoring, args: QuantizeArguments) -> tuple[list[dict], dict]:
    """Greedy decoding and WikiSQL scoring exactly as `textsql infer` does, timed after one warm-up batch."""
    warm_up = scoring.sources[: args.batch_size]
    generate_sql(
        model, tokenizer, warm_up, batch_size=args.batch_size, max_new_tokens=args.max_new_tokens, progress=False
    )
    started = time.perf_counter()
    records, metrics = decode_and_score(
        model, tokenizer, scoring, batch_size=args.batch_size, max_new_tokens=args.max_new_tokens, progress=False
    )
    seconds = time.perf_counter() - started
    metrics.update(generation_seconds=round(seconds, 3), queries_per_second=round(len(records) / seconds, 2))
    return records, metrics


def comparison(base: tuple[list[dict], dict], quantized: tuple[list[dict], dict]) -> dict:
    """What quantizing changed on the same questions: agreement (identical SQL), execution-accuracy delta, speed-up."""
    base_records, base_metrics = base
    records, metrics = quantized
    same = sum(a["predicted_sql"] == b["predicted_sql"] for a, b in zip(base_records, records, strict=True))
    return {
        "examples": len(records),
        "agreement": same / len(records) if records else 0.0,
        "execution_accuracy_delta": metrics["execution_accuracy"] - base_metrics["execution_accuracy"],
        "speedup": metrics["queries_per_second"] / base_metrics["queries_per_second"]
        if base_metrics["queries_per_second"]
        else None,
    }


def quantize_model(args: QuantizeArguments, echo=print) -> dict:
    """`textsql quantize`: quantize, save, reload the saved folder (the round trip), score it and the unquantized
    model on the same questions; write the comparison into the folder's record and return it."""
    prepared = load_prepared(args.dataset_dir)
    device = pick_device(args.device)
    check_method_device(args.method, device)
    output = quantize_and_save(args, device, echo)
    scoring = load_scoring_set(args.dataset_dir, args.split, args.max_examples or None, prepared=prepared)
    base_model, base_tokenizer = load_for_inference(args.model_dir, str(device.type))
    check_source_settings(base_model.config, prepared[1], args.dataset_dir)
    base = score_model(base_model, base_tokenizer, scoring, args)
    base_memory = memory_bytes(base_model)
    del base_model
    model, tokenizer = load_for_inference(str(output), str(device.type))
    quantized = score_model(model, tokenizer, scoring, args)
    result = {
        "method": args.method,
        "label": args.label,
        "output_dir": str(output),
        "device": device.type,
        "split": args.split,
        "unquantized": {
            "model_dir": str(args.model_dir),
            "weights_bytes": weights_bytes(args.model_dir) or None,
            "memory_bytes": base_memory,
            **_headline(base[1]),
        },
        "quantized": {
            "weights_bytes": weights_bytes(output),
            "memory_bytes": memory_bytes(model),
            **_headline(quantized[1]),
        },
        **comparison(base, quantized),
        "arguments": asdict(args),
    }
    write_record(output, {**read_record(output), "scored": result})
    echo(format_quantize_result(result))
    return result


def _headline(metrics: dict) -> dict:
    keys = ("execution_accuracy", "logical_form_accuracy", "exact_match", "parse_errors", "queries_per_second")
    return {key: metrics[key] for key in keys}


def format_quantize_result(result: dict) -> str:
    """Size, questions/s and the execution-accuracy delta, unquantized against quantized, in a few lines."""

    def size(n):
        return f"{n / 2**20:.1f} MiB" if n else "-"

    rows = [("unquantized", result["unquantized"]), (result.get("label", result["method"]), result["quantized"])]
    lines = [f"{'model':<14} {'weights on disk':>15} {'in memory':>10} {'questions/s':>12} {'execution':>10}"]
    for label, row in rows:
        lines.append(
            f"{label:<14} {size(row['weights_bytes']):>15} {size(row['memory_bytes']):>10} "
            f"{row['queries_per_second']:>12.1f} "
            f"{row['execution_accuracy']:>10.1%}"
        )
    delta = result["execution_accuracy_delta"]
    speedup = f"{result['speedup']:.2f}x" if result["speedup"] else "-"
    lines.append(
        f"{result['examples']} {result['split']} questions on {result['device']}: execution accuracy {delta:+.1%} "
        f"({delta * 100:+.1f} points), same SQL for {result['agreement']:.1%}, speed {speedup}; "
        f"saved in {result['output_dir']}"
    )
    return "\n".join(lines)
