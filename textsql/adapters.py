"""LoRA adapters to train (peft; their flags: textsql.arguments.lora): a model wrapped for training under any strategy
(QLoRA's quantized base prepared for it), the adapter saved (fp32, gathered under ZeRO-3) with its record
(textsql.adapter_record). textsql.loading loads an adapter back; textsql.merge folds one into its base."""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path

from textsql.adapter_record import write_adapter_record
from textsql.arguments.lora import LoraArguments
from textsql.errors import TextsqlError
from textsql.families import family_of, lora_target_modules

PEFT_EXTRA = "textsql[peft]"
# The target presets (--lora_targets) and each family's module names for them are in textsql.families (LORA_PRESETS,
# Family.lora_targets): qv, the query and value projections; all, peft's "all-linear" (every nn.Linear but lm_head).

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
    write_adapter_record(output_dir, record)
