"""LoRA adapters (peft; their flags: textsql.arguments.lora): a model wrapped for training under any strategy, the adapter
saved (fp32, gathered under ZeRO-3) with what it was trained on, loaded back, and merged into its base model."""

from __future__ import annotations

import hashlib
import json
import logging
from contextlib import contextmanager
from pathlib import Path

from textsql.arguments.lora import LoraArguments, lora_arguments
from textsql.arguments.merge import MergeArguments
from textsql.checkpoints import CHECKPOINT, verify_model_folder
from textsql.errors import TextsqlError
from textsql.extras import require_lifecycle_extra
from textsql.families import family_of, lora_target_modules
from textsql.hub import load_model, load_tokenizer, model_family
from textsql.paths import ADAPTER_CONFIG_FILE, ADAPTER_RECORD_FILE, short_name
from textsql.vocabulary import fit_embeddings, tokenizer_fingerprint

logger = logging.getLogger("textsql.adapters")

PEFT_EXTRA = "textsql[peft]"
# The target presets (--lora_targets) and each family's module names for them are in textsql.families (LORA_PRESETS,
# Family.lora_targets): qv, the query and value projections; all, peft's "all-linear" (every nn.Linear but lm_head).
RECORD_VERSION = 1


QUANTIZED_LAYER_TYPES = {"nf4": "Linear4bit", "int8": "Linear8bitLt"}  # what bitsandbytes swaps nn.Linear for


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


# ---------------------------------------------------------------------------------------------------------------------
# QLoRA: the frozen base quantized by bitsandbytes
# ---------------------------------------------------------------------------------------------------------------------


def quantized_base(values) -> str:
    """'nf4', 'int8' or 'none': the base format of a run's arguments, a summary's arguments or an adapter's record."""
    if isinstance(values, dict) and "lora" in values and "base_model" in values:  # an adapter record
        return (values.get("lora") or {}).get("quantize_base", "none")
    return lora_arguments(values).quantize_base


def bnb_config(quantize_base: str, compute_dtype: str, sharded: bool = False):
    """transformers' BitsAndBytesConfig for --quantize_base: NF4 with double quantization (the constants quantized
    too, ~0.4 bit per weight less) computing in `compute_dtype` (textsql.strategy.devices.quantized_compute_dtype), or
    LLM.int8. Where ZeRO-3 or FSDP shards the model (`sharded`) the 4-bit weights are stored in the compute dtype:
    both flatten the parameters of a unit into one tensor of one dtype, and uint8 storage would not join them."""
    import torch
    from transformers import BitsAndBytesConfig

    if quantize_base == "int8":
        return BitsAndBytesConfig(load_in_8bit=True)
    dtype = getattr(torch, compute_dtype)
    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=dtype,
        bnb_4bit_quant_storage=dtype if sharded else torch.uint8,
    )


def check_quantizable(model_id: str, quantize_base: str) -> None:
    """Refuse a model family bitsandbytes cannot quantize (textsql.families: Family.quantize_refusal), before loading."""
    family = model_family(model_id)
    if family.quantize_refusal:
        raise TextsqlError(
            f"--quantize_base {quantize_base} cannot quantize '{model_id}': {family.quantize_refusal}. Train a LoRA "
            "adapter on the unquantized base (leave --quantize_base out), or choose a model of another family."
        )


def load_quantized_base(model_id: str, quantize_base: str, compute_dtype: str, sharded: bool = False, **kwargs):
    """The base model with its linear layers quantized by bitsandbytes (bnb_config), the rest (embeddings, norms, the
    output layer) in `compute_dtype`; its layers checked to be really swapped (check_quantized_layers)."""
    import torch

    check_quantizable(model_id, quantize_base)
    require_lifecycle_extra("bitsandbytes", f"--quantize_base {quantize_base}")
    config = bnb_config(quantize_base, compute_dtype, sharded)
    model = load_model(model_id, quantization_config=config, dtype=getattr(torch, compute_dtype), **kwargs)
    check_quantized_layers(model, quantize_base)
    return model


def unquantized_linear_layers(model) -> list[str]:
    """Names of the linear layers of a bitsandbytes-loaded model that transformers meant to swap and did not: a
    family's own subclass of nn.Linear (falcon's FalconLinear) stays in full precision without a word. The layers it
    skips on purpose (the output layer, a family's _keep_in_fp32_modules such as T5's wo) are not counted."""
    import torch
    from transformers.pytorch_utils import Conv1D
    from transformers.quantizers.quantizers_utils import should_convert_module

    skipped = list(getattr(getattr(model, "hf_quantizer", None), "modules_to_not_convert", None) or [])
    return [
        name
        for name, module in model.named_modules()
        if isinstance(module, (torch.nn.Linear, Conv1D))
        and type(module).__name__ not in QUANTIZED_LAYER_TYPES.values()
        and should_convert_module(name, skipped)
    ]


def quantized_layer_count(model, quantize_base: str) -> int:
    return sum(type(module).__name__ == QUANTIZED_LAYER_TYPES[quantize_base] for module in model.modules())


def check_quantized_layers(model, quantize_base: str) -> None:
    """Refuse a model whose linear layers were not all swapped for bitsandbytes' (the base would train as QLoRA in
    full precision, its memory unchanged), naming the layers left."""
    left = unquantized_linear_layers(model)
    if left or not quantized_layer_count(model, quantize_base):
        shown = ", ".join(left[:4]) + (f" and {len(left) - 4} more" if len(left) > 4 else "")
        raise TextsqlError(
            f"--quantize_base {quantize_base}: bitsandbytes left {len(left)} linear layers of "
            f"{type(model).__name__} unquantized ({shown or 'all of them'}; their type is "
            f"{type(model.get_submodule(left[0])).__name__ if left else 'not nn.Linear'}, and transformers swaps only "
            "layers of type nn.Linear). Train LoRA on the unquantized base (leave --quantize_base out), or add the "
            "family's quantize_refusal to textsql/families.py."
        )


def prepare_quantized_for_training(model):
    """peft's prepare_model_for_kbit_training on a quantized base (the other parameters, norms and embeddings, in fp32;
    the input embedding's output requiring grad); a model that is not quantized is returned as it is. Activation
    checkpointing is left to --activation_checkpointing."""
    if not getattr(model, "is_quantized", False):
        return model
    for module in model.modules():
        if type(module).__name__ == QUANTIZED_LAYER_TYPES["nf4"]:
            # bitsandbytes' CPU backend repacks NF4 weights for its inference kernel on the first forward without
            # gradients (an evaluation) and keeps them so: later training steps then run a kernel without autograd
            # (wrong gradients below it, and an in-place error on layers with a bias). Training never repacks.
            module.support_avx512bf16_for_cpu = False
    return require_peft().prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)


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
        target = model.get_submodule(name).weight
        with torch.no_grad():  # GPT-2's Conv1D keeps its weight transposed (in x out)
            target.copy_(weight if weight.shape == target.shape else weight.T)
        rounded += 1
    return rounded


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
    model = prepare_quantized_for_training(model)
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


def load_base_for_adapter(adapter_dir, base_model: str | None = None, quantized: dict | None = None):
    """(base model fp32 on the CPU with its embeddings grown to the adapter's tokenizer, that tokenizer, the record),
    refusing a base or tokenizer other than the adapter was trained on, with the fix in the message. A QLoRA adapter's
    base quantized as it trained, with `quantized` = load_quantized_base's compute_dtype and placement."""
    import torch

    adapter_dir = Path(adapter_dir)
    verify_model_folder(adapter_dir)  # peft loads an adapter_model.bin with torch.load; the base: hub.load_model
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
    if quantized is not None and quantized_base(record) != "none":
        model = load_quantized_base(base_id, quantized_base(record), **quantized)
    else:
        model = load_model(base_id, dtype=torch.float32)
    fit_embeddings(model, tokenizer)
    return model, tokenizer, record


def load_adapter_model(
    adapter_dir, base_model: str | None = None, quantized: dict | None = None, trainable: bool = False
):
    """(base model + adapter, fp32 on the CPU, for generation (`trainable`: to train on, as --stage grpo does); its
    tokenizer), checked as load_base_for_adapter; a QLoRA adapter on its quantized base with `quantized`
    (load_quantized_base's compute_dtype and placement)."""
    peft = require_peft()
    model, tokenizer, _ = load_base_for_adapter(adapter_dir, base_model, quantized)
    model = peft.PeftModel.from_pretrained(model, str(adapter_dir), is_trainable=trainable)
    return (model if trainable else model.eval()), tokenizer


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
        quantize_base = quantized_base(record)
        if args.merge_onto == "rounded":
            if quantize_base == "none":
                raise TextsqlError(
                    f"--merge_onto rounded is for a QLoRA adapter, and '{args.adapter}' was trained on an unquantized "
                    "base: its merge into that base is exact. Leave --merge_onto out."
                )
            quantized = load_quantized_base(args.base_model or record["base_model"], quantize_base, "float32")
            logger.info(
                "Rounded %d layers of the base as %s rounds them", round_to_quantized(base, quantized), quantize_base
            )
            del quantized
        model = peft.PeftModel.from_pretrained(base, str(args.adapter), is_trainable=False)
        merged = model.merge_and_unload()
    merged = merged.to(torch.float32)
    merged.config.dtype = "float32"
    output_dir.mkdir(parents=True, exist_ok=True)
    merged.save_pretrained(str(output_dir), safe_serialization=True)
    tokenizer.save_pretrained(str(output_dir))
    logger.info("Merged %s into %s: %s", args.adapter, record["base_model"], output_dir)
    return output_dir
