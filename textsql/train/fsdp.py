"""The part of FSDP2 textsql owns around the Trainer: the units checked against the model's own decoder layers, T5's
tied embeddings in one FSDP unit before accelerate wraps the model, generation with every rank stepping together, and
the full state dict gathered for the final save."""

from __future__ import annotations

from textsql.errors import TextsqlError
from textsql.families import decoder_layer_classes, family_of

# torch is imported inside the functions: textsql.train.run imports this module in processes (the CLI, a notebook)
# that decide a run before any rank starts.


def wrapped_layer_classes(model, fsdpconfig: dict) -> list[str]:
    """The classes accelerate makes FSDP units of: the config's transformer_layer_cls_to_wrap, else the model's own
    decoder layers (its _no_split_modules: T5Block, LlamaDecoderLayer, BloomBlock, ...). A class the model lacks is
    refused here, with the model's own, instead of deep inside accelerate once the ranks have loaded the model."""
    names = fsdpconfig.get("transformer_layer_cls_to_wrap") or decoder_layer_classes(model)
    present = {type(module).__name__ for module in model.modules()}
    missing = [name for name in names if name not in present]
    if missing:
        family = family_of(model.config)
        raise TextsqlError(
            f"The FSDP config's transformer_layer_cls_to_wrap names {', '.join(missing)}, which this {family.name} "
            f"model does not have; its decoder layers are {', '.join(decoder_layer_classes(model)) or 'not declared'}. "
            "Leave the key out (each model's own decoder layers become the units) or name those."
        )
    return list(names)


def tied_embedding_modules(model) -> list:
    """Every module holding the input embedding's weight, each once, in the model's order: for T5 `shared`,
    `encoder.embed_tokens`, `decoder.embed_tokens` and (tied) `lm_head`. Empty when the model has no input embedding."""
    embedding = getattr(model, "get_input_embeddings", lambda: None)()
    weight = getattr(embedding, "weight", None)
    if weight is None:
        return []
    found, seen = [], set()
    for module in model.modules():
        if getattr(module, "weight", None) is weight and id(module) not in seen:
            seen.add(id(module))
            found.append(module)
    return found


def group_tied_embeddings(model, **fully_shard_kwargs) -> list:
    """Make T5's tied embedding modules one FSDP unit (torch's fully_shard on the list of them), so that accelerate's
    FSDP2 wrapping, which groups only get_input_embeddings() with get_output_embeddings(), leaves them alone: otherwise
    the root unit also claims the weight through encoder.embed_tokens and the first forward pass stops with "Parameter
    'shared.weight' is shared with a parameter already managed by another FSDP group". Returns the grouped modules
    (none when the model ties nothing or they are FSDP units already)."""
    from torch.distributed.fsdp import FSDPModule, fully_shard

    modules = tied_embedding_modules(model)
    if len(modules) < 2 or any(isinstance(m, FSDPModule) for m in modules):
        return []
    fully_shard(modules, **fully_shard_kwargs)
    return modules


def accelerate_fsdp2_kwargs(accelerator) -> dict:
    """The fully_shard arguments accelerate's fsdp2_prepare_model gives the model's units (mixed precision, CPU offload,
    the device mesh, hybrid included), with reshard_after_forward False as accelerate gives its embedding unit: it is
    used at both ends of the forward pass, so resharding it would only gather it again at once."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    plugin = accelerator.state.fsdp_plugin
    mesh = getattr(accelerator, "torch_device_mesh", None)
    return {
        "reshard_after_forward": False,
        "offload_policy": plugin.cpu_offload,
        "mp_policy": plugin.mixed_precision_policy or MixedPrecisionPolicy(),
        "mesh": mesh[tuple(accelerator.parallelism_config.fsdp_dim_names)] if mesh is not None else None,
    }


def synced_generation(zero3: bool, fsdp: bool, world_size: int) -> bool:
    """Whether generate() needs synced_gpus: under ZeRO-3 and FSDP every forward pass gathers parameters collectively,
    so a rank done with its sequences must keep stepping until every rank is, or the others wait for it for ever."""
    return (zero3 or fsdp) and world_size > 1


def full_state_dict(model, dtype) -> dict:
    """The model's parameters gathered whole on rank 0 (on the CPU, in `dtype`; an empty dict on the other ranks), by
    name as named_parameters gives them (a tied weight once). Every rank must call it: the gathering is collective."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    names = [name for name, _ in model.named_parameters()]
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if dist.is_initialized() and dist.get_rank() != 0:
        return {}
    return {name: state[name].detach().to("cpu", dtype) for name in names}
