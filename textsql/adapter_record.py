"""A LoRA adapter's record (textsql_adapter.json): what it holds, written and read here alone, and an adapter folder
checked against it (its tokenizer, the base model's tokenizer and weights, its pickles) before peft reads it."""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path

from textsql.checkpoints import CHECKPOINT, verify_model_folder
from textsql.errors import TextsqlError
from textsql.paths import ADAPTER_CONFIG_FILE, ADAPTER_RECORD_FILE
from textsql.vocabulary import added_token_ids, tokenizer_fingerprint

logger = logging.getLogger("textsql.adapter_record")

RECORD_VERSION = 1


def is_adapter_folder(path) -> bool:
    return (Path(path) / ADAPTER_CONFIG_FILE).is_file()


def is_lora_checkpoint(path) -> bool:
    """A checkpoint-N folder (the Trainer's save, with peft's adapter files) inside a `textsql train --lora True` run."""
    path = Path(path)
    return bool(CHECKPOINT.match(path.name)) and (path.parent / ADAPTER_RECORD_FILE).is_file()


def adapter_record(model, lora, base_model_id: str, tokenizer, token_ids: list[int], fingerprint: str) -> dict:
    """What textsql keeps beside an adapter to load and merge it safely: the base model and its fingerprint, the
    tokenizer's, the LoRA settings (`lora`: textsql.arguments.lora.LoraArguments), the trained token rows and the
    embedding's size."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return {
        "base_model": base_model_id,
        "base_fingerprint": fingerprint,
        "tokenizer_fingerprint": tokenizer_fingerprint(tokenizer),
        "lora": lora.lora_settings(),
        "trainable_token_ids": list(token_ids),
        "vocab_rows": len(tokenizer),
        "source_settings": (getattr(base.config, "task_specific_params", None) or {}),
    }


def write_adapter_record(adapter_dir, record: dict) -> Path:
    """The record beside the adapter, under this textsql's record version; returns its path."""
    path = Path(adapter_dir) / ADAPTER_RECORD_FILE
    path.write_text(json.dumps({"version": RECORD_VERSION, **record}, indent=2) + "\n")
    return path


def read_adapter_record(adapter_dir) -> dict:
    adapter_dir = Path(adapter_dir)
    if not is_adapter_folder(adapter_dir):
        raise TextsqlError(
            f"'{adapter_dir}' is not a LoRA adapter folder (no {ADAPTER_CONFIG_FILE}). Pass the run folder "
            "of a `textsql train --lora True` run."
        )
    path = adapter_dir / ADAPTER_RECORD_FILE
    if not path.is_file() and is_lora_checkpoint(adapter_dir):
        path = adapter_dir.parent / ADAPTER_RECORD_FILE  # a checkpoint-N of a LoRA run: the run's record says it all
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise TextsqlError(
            f"'{adapter_dir}' has no {ADAPTER_RECORD_FILE}: it was not written by `textsql train --lora True`, so "
            "its base model cannot be checked. Merge it with peft directly (PeftModel.from_pretrained, "
            "merge_and_unload)."
        ) from None
    except (OSError, ValueError) as error:
        raise TextsqlError(f"{path} cannot be read ({error}).") from None


def quantized_base(record: dict) -> str:
    """'nf4', 'int8' or 'none': the base format an adapter trained on (QLoRA's bitsandbytes quantization or none)."""
    return (record.get("lora") or {}).get("quantize_base", "none")


def _weight_files(model_id: str) -> list[Path]:
    """The safetensors files of a model folder or of a hub model in the local cache; empty when there are none."""
    folder = Path(model_id)
    if folder.is_dir():
        return sorted(folder.glob("*.safetensors"))
    from transformers.utils import cached_file

    try:
        single = cached_file(model_id, "model.safetensors", _raise_exceptions_for_missing_entries=False)
        if single:
            return [Path(single)]
        index = cached_file(model_id, "model.safetensors.index.json", _raise_exceptions_for_missing_entries=False)
        if index:
            names = sorted(set(json.loads(Path(index).read_text())["weight_map"].values()))
            return [Path(cached_file(model_id, name)) for name in names]
    except (OSError, ValueError):
        pass
    return []


def base_fingerprint(model_id: str) -> str | None:
    """A short hash of a base model's checkpoint: every tensor's name and shape and the first values of its first row,
    rounded to bf16, read from its safetensors files (whatever a training strategy made of the weights in memory:
    bf16, partitioned, grown embeddings). None when the model has no safetensors files to read."""
    import torch
    from safetensors import safe_open

    files = _weight_files(model_id)
    if not files:
        return None
    digest = hashlib.sha256()
    for path in files:
        with safe_open(str(path), framework="pt") as weights:
            for name in sorted(weights.keys()):
                piece = weights.get_slice(name)
                shape = tuple(piece.get_shape())
                first = (piece[0:1] if shape else weights.get_tensor(name)).reshape(-1)[:64]
                digest.update(f"{name}:{shape};".encode())
                digest.update(first.to(torch.bfloat16).view(torch.int16).numpy().tobytes())
    return digest.hexdigest()[:16]


def check_adapter_folder(adapter_dir, record: dict, tokenizer, base_id: str, base_tokenizer) -> None:
    """Refuse an adapter folder whose tokenizer (`tokenizer`, read from it) or base model (`base_id`, its tokenizer
    `base_tokenizer`) is not the one its record says it trained with, the fix in the message; its own pickles are
    checked before peft reads them (textsql.checkpoints)."""
    found, recorded = base_fingerprint(base_id), record.get("base_fingerprint")  # read first: a wrong base fails
    if tokenizer_fingerprint(tokenizer) != record.get("tokenizer_fingerprint"):
        raise TextsqlError(
            f"The tokenizer in '{adapter_dir}' is not the one the adapter was trained with (its vocabulary "
            f"differs from the record in {ADAPTER_RECORD_FILE}). Put the run's own tokenizer files back "
            "(train again with --lora True to get them)."
        )
    if not set(added_token_ids(tokenizer, base_tokenizer)) <= set(record.get("trainable_token_ids") or []):
        raise TextsqlError(
            f"The adapter's tokenizer has pieces the base model '{base_id}' has no trained rows for, and "
            f"the adapter did not train them: '{base_id}' is not the base model the adapter was trained on "
            f"('{record['base_model']}'). Pass --base_model {record['base_model']} (or its local folder)."
        )
    if found is None or recorded is None:
        logger.warning(
            "The weights of '%s' cannot be compared with those the adapter was trained on (no safetensors "
            "files); loading it without that check.",
            base_id,
        )
    elif found != recorded:
        raise TextsqlError(
            f"'{base_id}' is not the base model the adapter in '{adapter_dir}' was trained on (its weights "
            f"differ: fingerprint {found}, the adapter's record says {recorded}). Pass --base_model with the model "
            f"the run trained from ('{record['base_model']}', or a local copy of it)."
        )
    verify_model_folder(adapter_dir)  # peft loads an adapter_model.bin with torch.load; the base's: hub.load_model
