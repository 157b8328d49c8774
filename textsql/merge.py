"""`textsql merge`: a LoRA adapter folded into its base model (onto its full-precision base, or the base rounded as
QLoRA's bitsandbytes rounds it); a QLoRA adapter's merge scored again against the adapter on its quantized base, the
difference printed and kept in the merged folder."""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, replace
from pathlib import Path

from textsql.adapter_record import is_lora_checkpoint
from textsql.adapters import QUANTIZED_LAYER_TYPES
from textsql.arguments.merge import MergeArguments
from textsql.errors import TextsqlError
from textsql.evaluate import load_scoring_set
from textsql.loading import load_folder, load_for_inference, load_quantized_base, read_folder
from textsql.paths import MERGE_RECORD_FILE, SUMMARY_FILE, short_name
from textsql.quantize import comparison, score_model

logger = logging.getLogger("textsql.merge")

HEADLINE = ("execution_accuracy", "logical_form_accuracy", "exact_match", "queries_per_second")


def merged_dir(args: MergeArguments) -> Path:
    """--output_dir, else <run>-merged beside the run; a checkpoint's merge beside the run too (<run>-checkpoint-N-merged),
    never inside the run folder, where it would sit among the checkpoints."""
    if args.output_dir:
        return Path(args.output_dir)
    adapter = Path(str(args.adapter).rstrip("/"))
    if is_lora_checkpoint(adapter):
        return adapter.parent.parent / short_name(adapter.parent.name, f"{adapter.name}-merged")
    return adapter.parent / short_name(adapter.name, "merged")


def round_to_quantized(model, quantized) -> int:
    """Replace the weights of `model` (full precision) by those of the same model loaded quantized, dequantized: the
    NF4- or int8-rounded values a QLoRA adapter learned against. Returns how many layers were rounded."""
    import torch
    from transformers.integrations.bitsandbytes import dequantize_bnb_weight

    rounded = 0
    for name, module in quantized.named_modules():
        if type(module).__name__ not in QUANTIZED_LAYER_TYPES.values():
            continue
        weight = dequantize_bnb_weight(module.weight, getattr(module, "state", None)).to(torch.float32)
        target = model.get_submodule(name).weight  # an adapted layer's is its base layer's
        with torch.no_grad():  # GPT-2's Conv1D keeps its weight transposed (in x out)
            target.copy_(weight if weight.shape == target.shape else weight.T)
        rounded += 1
    return rounded


def merge_adapter(args: MergeArguments) -> Path:
    """Base + adapter -> a plain model folder (fp32 weights, config, tokenizer) that from_pretrained and `textsql infer`
    load without peft. On the CPU, offline when the base model is a folder or cached."""
    import torch

    output_dir = merged_dir(args)
    if (output_dir / "config.json").exists() and not args.overwrite:
        raise TextsqlError(
            f"'{output_dir}' holds a model already. Pass --overwrite True to replace it, or another --output_dir."
        )
    folder = read_folder(args.adapter, args.base_model)
    if args.merge_onto == "rounded" and folder.quantize_base == "none":
        raise TextsqlError(
            f"--merge_onto rounded is for a QLoRA adapter, and '{args.adapter}' was trained on an unquantized "
            "base: its merge into that base is exact. Leave --merge_onto out."
        )
    with torch.device("cpu"):
        model, tokenizer = load_folder(replace(folder, quantize_base="none"))  # on the full-precision base, fp32
        if args.merge_onto == "rounded":
            quantized = load_quantized_base(folder.weights, folder.quantize_base, "float32")
            rounded = round_to_quantized(model.get_base_model(), quantized)
            logger.info("Rounded %d layers of the base as %s rounds them", rounded, folder.quantize_base)
            del quantized
        merged = model.merge_and_unload()
    merged = merged.to(torch.float32)
    merged.config.dtype = "float32"
    output_dir.mkdir(parents=True, exist_ok=True)
    merged.save_pretrained(str(output_dir), safe_serialization=True)
    tokenizer.save_pretrained(str(output_dir))
    logger.info("Merged %s into %s: %s", args.adapter, folder.record["base_model"], output_dir)
    return output_dir


def scoring_dataset(args: MergeArguments) -> str:
    """--dataset_dir, else the dataset the run trained on (its run summary)."""
    if args.dataset_dir:
        return args.dataset_dir
    adapter = Path(args.adapter)
    for folder in (adapter, adapter.parent):
        summary = folder / SUMMARY_FILE
        if summary.is_file():
            return json.loads(summary.read_text())["dataset"]["dir"]
    raise TextsqlError(
        f"'{args.adapter}' has no {SUMMARY_FILE} saying which dataset the run trained on, and a QLoRA merge is scored "
        "again on it. Pass --dataset_dir (the prepared dataset folder)."
    )


def merge_and_score(args: MergeArguments, echo=print) -> dict:
    """Merge (merge_adapter); for a QLoRA adapter, score the merged model and the adapter on its quantized base on the
    same validation questions, write the comparison into the merged folder (textsql_merge.json), return it."""
    quantize_base = read_folder(args.adapter).quantize_base
    if quantize_base == "none":
        output = merge_adapter(args)
        echo(
            f"merged {args.adapter} into its base model: {output} (fp32; `textsql infer --model_dir {output}` and "
            "from_pretrained load it without peft)"
        )
        return {"output_dir": str(output), "quantize_base": "none"}
    dataset_dir = scoring_dataset(args)
    scoring = load_scoring_set(dataset_dir, "validation", args.score_examples)  # fails before the merge is written
    output = merge_adapter(args)
    model, tokenizer = load_for_inference(args.adapter, args.device, base_model=args.base_model)
    before = score_model(model, tokenizer, scoring, args)
    del model
    model, tokenizer = load_for_inference(str(output), args.device)
    after = score_model(model, tokenizer, scoring, args)
    result = {
        "output_dir": str(output),
        "quantize_base": quantize_base,
        "merge_onto": args.merge_onto,
        "dataset_dir": dataset_dir,
        "split": "validation",
        "adapter_on_quantized_base": {key: before[1][key] for key in HEADLINE},
        "merged": {key: after[1][key] for key in HEADLINE},
        **comparison(before, after),
        "arguments": asdict(args),
    }
    (Path(output) / MERGE_RECORD_FILE).write_text(json.dumps(result, indent=2) + "\n")
    echo(format_merge_result(result))
    return result


def format_merge_result(result: dict) -> str:
    onto = (
        "its full-precision base" if result["merge_onto"] == "full" else f"its {result['quantize_base']}-rounded base"
    )
    before, after = result["adapter_on_quantized_base"], result["merged"]
    return "\n".join(
        [
            f"merged the QLoRA adapter into {onto}: {result['output_dir']} (fp32; from_pretrained loads it without peft)",
            f"scored again on {result['examples']} validation questions of {result['dataset_dir']}:",
            f"  adapter on the {result['quantize_base']} base  execution accuracy {before['execution_accuracy']:.3f}",
            f"  merged model              execution accuracy {after['execution_accuracy']:.3f} "
            f"({result['execution_accuracy_delta']:+.3f})",
            f"  the same SQL for {result['agreement']:.0%} of the questions"
            + ("" if result["merge_onto"] == "rounded" else "; --merge_onto rounded keeps the weights the adapter saw"),
        ]
    )
