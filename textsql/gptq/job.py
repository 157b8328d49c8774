"""The GPTQ job textsql runs inside its GPTQ environment (llmcompressor): paths and numbers in, safetensors + JSON out.

Run as a script by that environment's Python (`textsql.gptq.environment.run_job`), never imported by textsql: it
imports only the standard library and the environment's own packages (torch, transformers, llmcompressor). It reads a
plain model folder (safetensors only, no remote code), calibrates GPTQ on the token ids textsql wrote, and saves the
compressed-tensors folder (config.json, *.safetensors) with a JSON record of what ran; textsql checks and loads it.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from importlib.metadata import version
from pathlib import Path

KEPT_SUFFIXES = (".json", ".safetensors")  # what the model folder may hold when the job ends
RECORD = "gptq_job.json"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model_dir", required=True, help="A plain model folder (config.json, *.safetensors).")
    parser.add_argument("--calibration", required=True, help='JSON: {"input_ids": [[int, ...], ...]}.')
    parser.add_argument("--output_dir", required=True, help="An empty folder for the quantized model.")
    parser.add_argument("--bits", type=int, choices=(4, 8), required=True)
    parser.add_argument("--group_size", type=int, required=True)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    args = parser.parse_args(argv)

    import warnings

    import torch
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from datasets import Dataset
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import GPTQModifier
    from transformers import AutoModelForCausalLM

    ids = json.loads(Path(args.calibration).read_text())["input_ids"]
    if not ids or not all(isinstance(row, list) and row for row in ids):
        print(f"{args.calibration} holds no calibration sequences", file=sys.stderr)
        return 2
    calibration = Dataset.from_dict({"input_ids": ids, "attention_mask": [[1] * len(row) for row in ids]})
    model = AutoModelForCausalLM.from_pretrained(
        args.model_dir, dtype=torch.float32, use_safetensors=True, trust_remote_code=False
    ).to(args.device)
    weights = QuantizationArgs(
        num_bits=args.bits, type="int", symmetric=True, strategy="group", group_size=args.group_size
    )
    # Every Linear layer but the output layer (its rows are the vocabulary; GPTQ's usual choice).
    recipe = GPTQModifier(
        config_groups={"group_0": QuantizationScheme(targets=["Linear"], weights=weights)}, ignore=["lm_head"]
    )
    started = time.perf_counter()
    oneshot(
        model=model,
        dataset=calibration,
        recipe=recipe,
        num_calibration_samples=len(ids),
        max_seq_length=max(len(row) for row in ids),
        shuffle_calibration_samples=False,  # textsql drew the sample already
    )
    seconds = time.perf_counter() - started
    output = Path(args.output_dir)
    # transformers warns of "offloaded modules" when saving after llmcompressor's layer-by-layer pipeline: on one
    # machine the model is whole in memory, so the warning (about a 50 GB shard) says nothing here.
    warnings.filterwarnings("ignore", message=".*offloaded modules.*")
    model.save_pretrained(output, save_compressed=True, safe_serialization=True)
    for path in output.iterdir():  # llmcompressor also writes its recipe as YAML; the record below says the same
        if path.suffix not in KEPT_SUFFIXES:
            path.unlink()
    record = {
        "bits": args.bits,
        "group_size": args.group_size,
        "calibration_sequences": len(ids),
        "calibration_tokens": sum(len(row) for row in ids),
        "calibration_seconds": round(seconds, 2),
        "device": args.device,
        "versions": {name: version(name) for name in ("llmcompressor", "compressed-tensors", "transformers", "torch")},
    }
    (output / RECORD).write_text(json.dumps(record, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
