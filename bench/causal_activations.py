"""What one training step of a causal LM keeps for its backward pass, measured, beside the planner's activation terms.

    python bench/causal_activations.py --device cpu                        # a dry run: the saved-tensor census only
    python bench/causal_activations.py --device cuda --output acts.json    # on a GPU: the census and torch's peak

For each built-in causal config (textsql/planner/causal.py, cut to --layers decoder layers: every layer keeps the same,
so a few stand for all), full fine-tuning and LoRA (textsql's own apply_lora, the qv preset the planner assumes), one
forward and backward over batch x sequence tokens as the Trainer runs them (the model in fp32, autocast to bf16 with
--precision bf16; one row one token short, so the batch is padded as textsql's are). Measured:
- `saved_bytes`: every tensor autograd saves during the forward pass, counted once per storage (saved_tensors_hooks),
  in three parts: autocast's 16-bit weight copies the matmuls keep, the vocabulary-wide tensors of the loss, and the
  activations, whose prediction is the planner's `layers + other` (+ LoRA's): `saved_ratio` = measured / predicted;
- on a GPU, `step_peak_bytes`: torch's peak allocated memory during forward and backward above what was held before
  (the model), against the planner's activations + autocast copies + gradients (all counted at once, as `plan` does).
A benchmark, not a test: the planner's causal terms are calibrated from it (docs/planner.md).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))  # runs from a checkout without installing the package

from bench.common import emit, machine  # noqa: E402

SHAPES = (
    "Qwen/Qwen2.5-0.5B",
    "meta-llama/Llama-3.2-1B",
    "bigscience/bloom-1b1",
    "openai-community/gpt2",
    "facebook/opt-1.3b",
    "bigcode/starcoderbase-1b",
    "Salesforce/codegen2-1B",
    "tiiuae/falcon-7b",
)


def shape_folder(name: str, layers: int, folder: Path):
    """A config.json of the built-in `name` with `layers` decoder layers, and the transformers config itself."""
    from transformers import AutoConfig

    from textsql.planner.causal import builtin_config

    values = builtin_config(name)
    model_type = values.pop("model_type")
    layers_key = next(key for key in ("num_hidden_layers", "n_layer", "num_layers") if key in values)
    values[layers_key] = min(layers, values[layers_key])
    config = AutoConfig.for_model(model_type, **values)
    folder.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(folder)
    return config


def planned(folder: Path, batch: int, sequence: int, precision: str, lora_rank: int) -> dict:
    """The planner's terms for this step: activations (layers, loss peak, the rest, LoRA's), autocast's weight copies,
    gradients; `saved_activations` is what the decoder layers and the stack's ends keep in the forward pass (LoRA's
    too), `step` what the step adds at its peak."""
    from textsql.planner.phases import predict
    from textsql.planner.shape import resolve_model
    from textsql.planner.states import Setup, zero_settings

    shape = resolve_model(str(folder))
    setup = Setup(1, 1, sequence, 0, precision, False, tuple(zero_settings(None).items()), lora_rank=lora_rank)
    row = predict(shape, setup, 0, False, False, batch)
    acts, gpu = row["activations_detail"], row["gpu_bytes"]
    copies = gpu["weight_copies"]
    return {
        "layers": acts["layers"],
        "other": acts["other"],
        "loss_peak": acts["loss_peak"],
        "lora": acts.get("lora", 0),
        "weight_copies": copies,
        "gradients": gpu["gradients"],
        "saved_activations": acts["layers"] + acts["other"] + acts.get("lora", 0),
        "step": gpu["activations"] + copies + gpu["gradients"],
    }


def measure(config, device: str, batch: int, sequence: int, precision: str, lora_rank: int) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from textsql.adapters import apply_lora
    from textsql.arguments.lora import LoraArguments

    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if lora_rank:
        model = apply_lora(model, LoraArguments(lora=True, lora_rank=lora_rank), [])
    model.train()
    ids = torch.randint(0, config.vocab_size, (batch, sequence), device=device)
    mask = torch.ones_like(ids)
    mask[-1, -1] = 0  # one row a token shorter: a padded batch, as textsql's collator makes them
    labels = ids.masked_fill(mask == 0, -100)
    weight_shapes = {tuple(p.shape) for p in model.parameters() if p.dim() == 2}
    weight_shapes |= {shape[::-1] for shape in weight_shapes}
    seen = {(p.untyped_storage().data_ptr(), p.untyped_storage().nbytes()) for p in model.parameters()}
    saved = {"activations": 0, "vocabulary_wide": 0, "weight_copies": 0}

    def pack(tensor):
        storage = tensor.untyped_storage()
        key = (storage.data_ptr(), storage.nbytes())
        if key not in seen:  # the model's own weights (and views of them) add nothing
            seen.add(key)
            # a 2-D activation is tokens x width (a Conv1D's input, the flat logits): its first size is batch x
            # sequence, which --sequence keeps off every weight's sizes
            if tensor.dim() == 2 and tuple(tensor.shape) in weight_shapes and tensor.shape[0] != ids.numel():
                saved["weight_copies"] += storage.nbytes()  # autocast's 16-bit copy a matmul keeps
            elif tensor.shape[-1:] == (config.vocab_size,):
                saved["vocabulary_wide"] += storage.nbytes()  # the loss's log-softmax and the logits
            else:
                saved["activations"] += storage.nbytes()
        return tensor

    on_gpu = device.startswith("cuda")
    if on_gpu:
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    autocast = torch.autocast(device_type=device.split(":")[0], dtype=torch.bfloat16, enabled=precision == "bf16")
    started = time.perf_counter()
    with autocast, torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
    after_forward = torch.cuda.memory_allocated() - before if on_gpu else None
    loss.backward()
    result = {"saved_bytes": saved, "loss": round(loss.item(), 4)}
    if on_gpu:
        torch.cuda.synchronize()
        result |= {"step_peak_bytes": torch.cuda.max_memory_allocated() - before, "after_forward_bytes": after_forward}
    result["seconds"] = round(time.perf_counter() - started, 3)
    del model, loss
    if on_gpu:
        torch.cuda.empty_cache()
    return result


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default=",".join(SHAPES), help="built-in causal configs, comma-separated")
    parser.add_argument("--layers", type=int, default=4, help="decoder layers kept of each config")
    parser.add_argument("--batches", default="4,16", help="batch sizes, comma-separated")
    parser.add_argument(
        "--sequence",
        type=int,
        default=200,
        help="tokens per row (prompt + SQL); 200 keeps batch x sequence off every built-in shape's widths (192 x 16 = "
        "GPT-2's 3,072-wide feed-forward layer, whose weights a census by shape then cannot tell from activations)",
    )
    parser.add_argument("--precision", choices=("bf16", "fp32"), default="bf16")
    parser.add_argument("--lora_rank", type=int, default=8, help="the LoRA rows' rank (0: full fine-tuning only)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--output")
    args = parser.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory(prefix="textsql-acts-") as tmp:
        for name in args.shapes.split(","):
            folder = Path(tmp) / name.replace("/", "--")
            config = shape_folder(name, args.layers, folder)
            for batch in (int(b) for b in args.batches.split(",")):
                for rank in (0, args.lora_rank) if args.lora_rank else (0,):
                    row = {"shape": name, "layers": config.num_hidden_layers, "batch": batch, "lora_rank": rank}
                    try:
                        got = measure(config, args.device, batch, args.sequence, args.precision, rank)
                    except Exception as error:  # one shape that fails is a finding; the others still run
                        rows.append(row | {"failed": f"{type(error).__name__}: {error}"[:500]})
                        continue
                    plan = planned(folder, batch, args.sequence, args.precision, rank)
                    ratio = got["saved_bytes"]["activations"] / plan["saved_activations"]
                    row |= {"measured": got, "planned": plan, "saved_ratio": round(ratio, 3)}
                    if "step_peak_bytes" in got:
                        row["step_ratio"] = round(got["step_peak_bytes"] / plan["step"], 3)
                    rows.append(row)
                    print(json.dumps({k: row.get(k) for k in ("shape", "batch", "lora_rank", "saved_ratio", "step_ratio")}),
                          file=sys.stderr, flush=True)  # fmt: skip
    emit({"benchmark": "causal_activations", "machine": machine(), "settings": vars(args), "rows": rows}, args.output)
    return 0


if __name__ == "__main__":
    sys.exit(main())
