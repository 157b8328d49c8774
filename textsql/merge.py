"""`textsql merge`: a LoRA adapter folded into its base model; a QLoRA adapter's merge scored again against the adapter
on its quantized base, the difference printed and kept in the merged folder."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

from textsql.adapters import load_adapter_model, merge_adapter, quantized_base, read_adapter_record
from textsql.arguments.merge import MergeArguments
from textsql.errors import TextsqlError
from textsql.evaluate import load_scoring_set
from textsql.loading import load_for_inference, pick_device, quantized_base_loading
from textsql.paths import MERGE_RECORD_FILE, SUMMARY_FILE
from textsql.quantize import comparison, score_model

HEADLINE = ("execution_accuracy", "logical_form_accuracy", "exact_match", "queries_per_second")


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
    """Merge (adapters.merge_adapter); for a QLoRA adapter, score the merged model and the adapter on its quantized base
    on the same validation questions, write the comparison into the merged folder (textsql_merge.json), return it."""
    quantize_base = quantized_base(read_adapter_record(args.adapter))
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
    device = pick_device(args.device)
    model, tokenizer = load_adapter_model(args.adapter, args.base_model, quantized=quantized_base_loading(device))
    before = score_model(model, tokenizer, scoring, args)
    del model
    model, tokenizer = load_for_inference(str(output), device.type)
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
