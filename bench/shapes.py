"""T5 shapes for benchmarks: t5-small, t5-base and t5-large with random weights, from the real Hugging Face configs
when a folder of them is given (nothing is downloaded), else from textsql.planner.shape.T5_SHAPES (the same numbers)."""

from __future__ import annotations

import json
from pathlib import Path

from textsql.planner.shape import T5_SHAPES, T5_VOCAB_SIZE

T5_NAMES = ("t5-small", "t5-base", "t5-large")
SHAPE_KEYS = ("d_model", "d_ff", "num_layers", "num_heads", "d_kv")


def t5_config(name: str, tokenizer, configs_dir: str | Path | None = None):
    """(T5Config of `name`, where its shape came from): `configs_dir/{name}/config.json` when that file exists (a
    checkpoint's own config, e.g. ../shared/real/t5/t5-large), else the built-in shape. The vocabulary is the
    checkpoint's 32,128 rows, grown to the tokenizer where it has more ids (characters prep added); pad, eos and decoder
    start come from the tokenizer."""
    from transformers import T5Config

    if name not in T5_NAMES:
        raise SystemExit(f"unknown T5 shape {name!r}; choose from {', '.join(T5_NAMES)}")
    path = Path(configs_dir) / name / "config.json" if configs_dir else None
    if path is not None and path.is_file():
        fields = json.loads(path.read_text())
        fields.pop("task_specific_params", None)  # summarization/translation prefixes: nothing to do with the shape
    else:
        fields = dict(T5_SHAPES[name], vocab_size=T5_VOCAB_SIZE)
    fields.update(
        vocab_size=max(fields.get("vocab_size", T5_VOCAB_SIZE), len(tokenizer)),
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        decoder_start_token_id=tokenizer.pad_token_id,
    )
    return T5Config(**fields), (str(path) if path is not None and path.is_file() else "textsql.planner.shape.T5_SHAPES")


def bench_config(shape: str, tokenizer, small_shapes: dict[str, dict], configs_dir: str | Path | None = None):
    """The T5Config a benchmark trains: one of its own small shapes (sizes by name), else a real T5 shape (t5_config)."""
    from transformers import T5Config

    if shape in small_shapes:
        sizes = small_shapes[shape]
        return T5Config(
            vocab_size=len(tokenizer),
            num_decoder_layers=sizes["num_layers"],
            **sizes,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id,
            decoder_start_token_id=tokenizer.pad_token_id,
        )
    return t5_config(shape, tokenizer, configs_dir)[0]


def shape_summary(config) -> dict:
    """The shape's numbers as the benchmarks report them."""
    return {key: getattr(config, key) for key in SHAPE_KEYS + ("vocab_size",)}


def build_t5(config, seed: int, device: str | None = None):
    """A randomly initialised T5ForConditionalGeneration of `config` (seeded), on `device` (the CPU by default)."""
    import torch
    from transformers import T5ForConditionalGeneration

    torch.manual_seed(seed)
    with torch.device(device or "cpu"):
        return T5ForConditionalGeneration(config)


def save_random_t5(folder: str, dataset_dir: str, shape: str = "t5-small") -> str:
    """A seeded random T5 of `shape` with a prepared dataset's tokenizer, saved in `folder` (fp32): for measuring size
    and speed where no fine-tuned model of that shape exists (quantize_methods.py, infer_batching.py, bench/gpu)."""
    from transformers import AutoTokenizer

    from textsql.prepared import load_prepared

    metadata = load_prepared(dataset_dir)[1]
    tokenizer_dir = (
        Path(dataset_dir) / metadata["tokenizer_dir"] if metadata.get("tokenizer_dir") else metadata["tokenizer"]
    )
    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    config = t5_config(shape, tokenizer)[0]
    build_t5(config, seed=0).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder
