"""LoRA adapters (peft): their arguments, a model wrapped for training under any strategy, the adapter saved (fp32,
gathered under ZeRO-3) with what it was trained on, loaded back, and merged into its base model."""

from __future__ import annotations

import hashlib
import json
import logging
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from textsql.checkpoints import CHECKPOINT
from textsql.errors import TextsqlError
from textsql.families import LORA_PRESETS, family_of, lora_target_modules
from textsql.hub import load_model, load_tokenizer
from textsql.paths import ADAPTER_CONFIG_FILE, ADAPTER_RECORD_FILE, short_name
from textsql.prep import tokenizer_fingerprint
from textsql.vocabulary import fit_embeddings

logger = logging.getLogger("textsql.adapters")

PEFT_EXTRA = "textsql[peft]"
# The target presets (--lora_targets) and each family's module names for them are in textsql.families (LORA_PRESETS,
# Family.lora_targets): qv, the query and value projections; all, peft's "all-linear" (every nn.Linear but lm_head).
RECORD_VERSION = 1


QUANTIZED_BASES = ("none", "nf4", "int8")  # --quantize_base: the base's bitsandbytes format under a LoRA adapter


@dataclass
class LoraArguments:
    """LoRA on top of any strategy: the base model stays frozen (in the training dtype), only the adapter trains."""

    lora: bool = field(
        default=False,
        metadata={
            "help": "Train a LoRA adapter (peft) on the frozen model instead of every weight, with or without "
            "DeepSpeed. The run saves the adapter (fp32) and the tokenizer; `textsql merge RUN` makes a plain model "
            "of it. Needs the peft extra (pip install 'textsql[peft]')."
        },
    )
    lora_rank: int = field(
        default=8, metadata={"help": "LoRA rank r: each adapted weight W (out x in) learns B (out x r) A (r x in)."}
    )
    lora_alpha: float = field(default=16.0, metadata={"help": "LoRA scaling alpha: the update is (alpha / r) B A."})
    lora_dropout: float = field(default=0.05, metadata={"help": "Dropout on the adapter's input, from 0 to below 1."})
    lora_targets: str = field(
        default="qv",
        metadata={
            "help": "Which layers get adapters: qv (the query and value projections of every attention; the fused "
            "query-key-value layer of bloom, falcon, gpt2, gpt_bigcode and codegen) or all (every linear layer of "
            "every attention and feed-forward block; never the lm head). The characters prep added to the tokenizer "
            "always train their embedding rows."
        },
    )

    quantize_base: str = field(
        default="none",
        metadata={
            "help": "QLoRA: load the frozen base quantized with bitsandbytes, nf4 (4-bit NormalFloat with double "
            "quantization) or int8, so a 7B causal LM fits on one A100-40GB; none keeps it in the training dtype. "
            "Needs --lora True (a quantized base cannot be fully fine-tuned) and the lifecycle extra."
        },
    )

    def __post_init__(self):
        self.check_lora()

    def check_lora(self) -> None:
        if isinstance(self.lora_rank, bool) or not isinstance(self.lora_rank, int) or self.lora_rank < 1:
            raise TextsqlError(
                f"--lora_rank must be a whole number of at least 1 (8 or 16 are common), not {self.lora_rank!r}."
            )
        if not self.lora_alpha > 0:
            raise TextsqlError(f"--lora_alpha must be positive (commonly twice --lora_rank), not {self.lora_alpha!r}.")
        if not 0 <= self.lora_dropout < 1:
            raise TextsqlError(
                f"--lora_dropout is a probability from 0 to below 1 (e.g. 0.05), not {self.lora_dropout!r}."
            )
        if self.lora_targets not in LORA_PRESETS:
            raise TextsqlError(f"--lora_targets must be one of {', '.join(LORA_PRESETS)}, not '{self.lora_targets}'.")
        if self.quantize_base not in QUANTIZED_BASES:
            raise TextsqlError(
                f"--quantize_base must be one of {', '.join(QUANTIZED_BASES)}, not '{self.quantize_base}'."
            )
        if self.quantize_base != "none" and not self.lora:
            raise TextsqlError(
                f"--quantize_base {self.quantize_base} needs --lora True: a quantized base's weights cannot be "
                "trained, only an adapter beside them (QLoRA). Add --lora True, or drop --quantize_base to fine-tune "
                "every weight."
            )

    def lora_settings(self) -> dict | None:
        """What the run summary's strategy records: None without --lora."""
        if not self.lora:
            return None
        return {
            "rank": self.lora_rank,
            "alpha": self.lora_alpha,
            "dropout": self.lora_dropout,
            "targets": self.lora_targets,
        }

    def lora_label(self) -> str:
        """The run folder's part for LoRA ('-lora-r8'), empty without it."""
        return f"-lora-r{self.lora_rank}" if self.lora else ""


def lora_arguments(values) -> LoraArguments:
    """The LoRA arguments of anything that has their fields (the training arguments, a run summary's arguments dict)."""
    get = values.get if isinstance(values, dict) else lambda name, default: getattr(values, name, default)
    defaults = LoraArguments()
    return LoraArguments(**{name: get(name, getattr(defaults, name)) for name in defaults.__dataclass_fields__})


def require_peft():
    """peft, or a TextsqlError naming the extra."""
    try:
        import peft
    except ImportError as error:
        raise TextsqlError(
            f"LoRA needs peft, which is part of the optional peft extra: install it with `pip install "
            f"'{PEFT_EXTRA}'` (from a checkout: `pip install '.[peft]'`). ({error})"
        ) from error
    return peft


def added_token_ids(tokenizer, base_tokenizer) -> list[int]:
    """Ids of the pieces `tokenizer` has and the model's own `base_tokenizer` lacks: the characters prep added, whose
    embedding rows the base model never trained."""
    base = base_tokenizer.get_vocab()
    return sorted(i for piece, i in tokenizer.get_vocab().items() if piece not in base)


def _zero3_enabled() -> bool:
    from transformers.integrations import is_deepspeed_zero3_enabled

    return is_deepspeed_zero3_enabled()


@contextmanager
def _embedding_gathered_for_peft(model, token_ids):
    """Under ZeRO-3 the embedding is a (0,) placeholder on every rank: gather it while peft copies the rows it will
    train. peft's own ZeRO-3 path gathers on rank 0 and broadcasts from a CUDA device only, so it is bypassed:
    gathered on every rank, the copy is the same everywhere, on any accelerator."""
    if not (token_ids and _zero3_enabled()):
        yield
        return
    import deepspeed
    from peft.tuners.trainable_tokens import layer as trainable_tokens_layer

    weight = model.get_input_embeddings().weight
    saved = trainable_tokens_layer.check_deepspeed_zero3_enabled
    trainable_tokens_layer.check_deepspeed_zero3_enabled = lambda: False
    try:
        with deepspeed.zero.GatheredParameters([weight], modifier_rank=None):
            yield
    finally:
        trainable_tokens_layer.check_deepspeed_zero3_enabled = saved


def input_embedding_name(model) -> str:
    """The name of the module holding the input embedding, the first of those sharing its weight: T5's `shared`, a
    Llama's `model.embed_tokens`, GPT-2's `transformer.wte`. peft's trainable_token_indices trains rows there."""
    weight = model.get_input_embeddings().weight
    return next(name for name, module in model.named_modules() if getattr(module, "weight", None) is weight)


def apply_lora(model, lora: LoraArguments, token_ids: list[int]):
    """`model` wrapped by peft for training: LoRA on the preset's layers of the model's family (textsql.families), the
    rows of `token_ids` in the input embedding trainable (peft's trainable_token_indices), everything else frozen."""
    peft = require_peft()
    family = family_of(model.config)
    config = peft.LoraConfig(
        r=lora.lora_rank,
        lora_alpha=lora.lora_alpha,
        lora_dropout=lora.lora_dropout,
        target_modules=lora_target_modules(family, lora.lora_targets),
        task_type=family.peft_task_type,
        trainable_token_indices={input_embedding_name(model): list(token_ids)} if token_ids else None,
    )
    with _embedding_gathered_for_peft(model, token_ids):
        return peft.get_peft_model(model, config)


def parameter_counts(model) -> tuple[int, int]:
    """(trainable, total) parameters; under ZeRO-3 each parameter is a placeholder and ds_numel holds its real size."""
    trainable = total = 0
    for param in model.parameters():
        n = getattr(param, "ds_numel", param.numel())
        total += n
        trainable += n if param.requires_grad else 0
    return trainable, total


def adapted_modules(model) -> list[str]:
    """Names of the modules peft put a LoRA adapter on (the model's names, without peft's prefix)."""
    from peft.tuners.lora import LoraLayer

    names = [name for name, module in model.named_modules() if isinstance(module, LoraLayer)]
    return [n.removeprefix("base_model.model.") for n in names]


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


def adapter_state(model, deepspeed_enabled: bool) -> dict:
    """The trainable parameters in fp32 on the CPU, by name; every rank calls it. Under DeepSpeed they are read from
    the fp32 master weights (safe_get_full_fp32_param, collective under ZeRO-3), so the adapter has real shapes and
    the values the optimizer holds whatever the strategy."""
    import torch

    state = {}
    for name, param in model.named_parameters():  # the same order on every rank: each call is a collective
        if not param.requires_grad:
            continue
        full = None
        if deepspeed_enabled:
            from deepspeed.utils import safe_get_full_fp32_param

            full = safe_get_full_fp32_param(param)
        state[name] = (param if full is None else full).detach().to("cpu", torch.float32).clone()
    return state


def save_adapter(model, state: dict, output_dir: Path, tokenizer, record: dict) -> None:
    """Write the adapter (peft's adapter_config.json + adapter_model.safetensors from `state`, never the frozen base),
    the tokenizer and textsql's record of what it was trained on (rank 0 only)."""
    output_dir = Path(output_dir)
    # The embedding is not saved even when prep grew it: the added rows are the trainable tokens' values.
    model.save_pretrained(str(output_dir), state_dict=state, safe_serialization=True, save_embedding_layers=False)
    tokenizer.save_pretrained(str(output_dir))
    (output_dir / ADAPTER_RECORD_FILE).write_text(json.dumps({"version": RECORD_VERSION, **record}, indent=2) + "\n")


def adapter_record(
    model, lora: LoraArguments, base_model_id: str, tokenizer, token_ids: list[int], fingerprint: str
) -> dict:
    """What textsql keeps beside an adapter to merge it safely: the base model and its fingerprint, the tokenizer's,
    the LoRA settings, the trained token rows and the embedding's size."""
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


def is_adapter_folder(path) -> bool:
    return (Path(path) / ADAPTER_CONFIG_FILE).is_file()


def is_lora_checkpoint(path) -> bool:
    """A checkpoint-N folder (the Trainer's save, with peft's adapter files) inside a `textsql train --lora True` run."""
    path = Path(path)
    return bool(CHECKPOINT.match(path.name)) and (path.parent / ADAPTER_RECORD_FILE).is_file()


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


def load_base_for_adapter(adapter_dir, base_model: str | None = None):
    """(base model fp32 on the CPU with its embeddings grown to the adapter's tokenizer, that tokenizer, the record),
    refusing a base or tokenizer other than the adapter was trained on, with the fix in the message."""
    import torch

    adapter_dir = Path(adapter_dir)
    record = read_adapter_record(adapter_dir)
    base_id = base_model or record["base_model"]
    tokenizer = load_tokenizer(str(adapter_dir))
    if tokenizer_fingerprint(tokenizer) != record.get("tokenizer_fingerprint"):
        raise TextsqlError(
            f"The tokenizer in '{adapter_dir}' is not the one the adapter was trained with (its vocabulary "
            f"differs from the record in {ADAPTER_RECORD_FILE}). Put the run's own tokenizer files back "
            "(train again with --lora True to get them)."
        )
    base_tokenizer = load_tokenizer(base_id)
    extra = set(added_token_ids(tokenizer, base_tokenizer))
    if not extra <= set(record.get("trainable_token_ids") or []):
        raise TextsqlError(
            f"The adapter's tokenizer has pieces the base model '{base_id}' has no trained rows for, and "
            f"the adapter did not train them: '{base_id}' is not the base model the adapter was trained on "
            f"('{record['base_model']}'). Pass --base_model {record['base_model']} (or its local folder)."
        )
    found, recorded = base_fingerprint(base_id), record.get("base_fingerprint")
    if found is None or recorded is None:
        logger.warning(
            "The weights of '%s' cannot be compared with those the adapter was trained on (no safetensors "
            "files); merging without that check.",
            base_id,
        )
    elif found != recorded:
        raise TextsqlError(
            f"'{base_id}' is not the base model the adapter in '{adapter_dir}' was trained on (its weights "
            f"differ: fingerprint {found}, the adapter's record says {record.get('base_fingerprint')}). "
            f"Pass --base_model with the model the run trained from ('{record['base_model']}', or a "
            "local copy of it)."
        )
    model = load_model(base_id, dtype=torch.float32)
    fit_embeddings(model, tokenizer)
    return model, tokenizer, record


def load_adapter_model(adapter_dir, base_model: str | None = None):
    """(base model + adapter, fp32 on the CPU, for generation; its tokenizer), checked as load_base_for_adapter."""
    peft = require_peft()
    model, tokenizer, _ = load_base_for_adapter(adapter_dir, base_model)
    model = peft.PeftModel.from_pretrained(model, str(adapter_dir), is_trainable=False)
    return model.eval(), tokenizer


@dataclass
class MergeArguments:
    """What `textsql merge` folds together."""

    adapter: str = field(
        metadata={
            "help": "The adapter: the run folder of a `textsql train --lora True` run, or one of its checkpoint-N "
            "folders (the best or an earlier step); also the first argument."
        }
    )
    output_dir: str | None = field(
        default=None, metadata={"help": "Where the merged model goes; default: <adapter>-merged beside it."}
    )
    base_model: str | None = field(
        default=None,
        metadata={"help": "The base model (hub name or folder) if it moved; default: the one the run trained from."},
    )
    overwrite: bool = field(default=False, metadata={"help": "Replace a merged model already in --output_dir."})

    def __post_init__(self):
        if not str(self.adapter).strip():
            raise TextsqlError("Pass the adapter folder: the run folder of a `textsql train --lora True` run.")


def merged_dir(args: MergeArguments) -> Path:
    """--output_dir, else <run>-merged beside the run; a checkpoint's merge beside the run too (<run>-checkpoint-N-merged),
    never inside the run folder, where it would sit among the checkpoints."""
    if args.output_dir:
        return Path(args.output_dir)
    adapter = Path(str(args.adapter).rstrip("/"))
    if is_lora_checkpoint(adapter):
        return adapter.parent.parent / short_name(adapter.parent.name, f"{adapter.name}-merged")
    return adapter.parent / short_name(adapter.name, "merged")


def merge_adapter(args: MergeArguments) -> Path:
    """Base + adapter -> a plain model folder (fp32 weights, config, tokenizer) that from_pretrained and `textsql infer`
    load without peft. On the CPU, offline when the base model is a folder or cached."""
    import torch

    output_dir = merged_dir(args)
    if (output_dir / "config.json").exists() and not args.overwrite:
        raise TextsqlError(
            f"'{output_dir}' holds a model already. Pass --overwrite True to replace it, or another --output_dir."
        )
    peft = require_peft()
    with torch.device("cpu"):
        base, tokenizer, record = load_base_for_adapter(args.adapter, args.base_model)
        model = peft.PeftModel.from_pretrained(base, str(args.adapter), is_trainable=False)
        merged = model.merge_and_unload()
    merged = merged.to(torch.float32)
    merged.config.dtype = "float32"
    output_dir.mkdir(parents=True, exist_ok=True)
    merged.save_pretrained(str(output_dir), safe_serialization=True)
    tokenizer.save_pretrained(str(output_dir))
    logger.info("Merged %s into %s: %s", args.adapter, record["base_model"], output_dir)
    return output_dir
