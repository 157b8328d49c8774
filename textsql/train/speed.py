"""Training speed levers (attention that skips packed padding, regional compile, the loss at the label positions only,
LoRA's frozen base in bf16) applied to the Trainer's model, their flags and checks being textsql.arguments.speed's; and the
FLOPs a step computes, for MFU."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from textsql.arguments.speed import check_speed_here
from textsql.families import Family, decoder_layer_classes, family_of
from textsql.planner import causal as causal_planner
from textsql.planner.causal import causal_widths
from textsql.strategy.devices import peak_tflops

logger = logging.getLogger("textsql.train")

IGNORE_INDEX = -100


# ---------------------------------------------------------------------------------------------------------------------
# Applying the levers to the Trainer's model
# ---------------------------------------------------------------------------------------------------------------------


def base_model(model):
    """The transformers model inside peft's wrapper (the same object; peft injects its layers in place)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def apply_speed(trainer, family: Family) -> None:
    """Refuse what cannot run here, then apply each lever to the Trainer's model before its optimizer exists: the
    attention, the frozen base's dtype, the loss at the label positions (the trainer's collator finds them on the host:
    with_label_positions) and the compiled layers."""
    import torch

    args, model = trainer.args, trainer.model
    if not hasattr(args, "fused_loss"):  # the Trainer's own arguments (a benchmark's plain Trainer): no levers
        return
    deepspeed = trainer.is_deepspeed_enabled
    check_speed_here(args, family)
    inner = base_model(model)
    if args.attention != "auto":
        inner.set_attn_implementation(args.attention)
    if args.lora_base_dtype == "bfloat16" and not deepspeed:
        cast = frozen_to(model, torch.bfloat16)
        logger.info("LoRA: the frozen base in bf16 (%d parameters); the adapter trains in fp32", cast)
    if args.fused_loss != "none":
        install_label_position_loss(inner, args.fused_loss)
    if args.compile == "layers":
        compiled = compile_layers(model)
        logger.info("torch.compile: %d decoder layers (%s), compiled in the first steps", compiled, family.name)


def with_label_positions(args, collator):
    """The collator, wrapped in LabelPositions (the label positions found on the host) where --fused_loss computes the
    loss at those positions alone."""
    return LabelPositions(collator) if getattr(args, "fused_loss", "none") != "none" else collator


def frozen_to(model, dtype) -> int:
    """Cast every parameter that does not train to `dtype` (LoRA's frozen base); the trainable ones stay as they are.
    Returns the elements cast."""
    cast = 0
    for param in model.parameters():
        if not param.requires_grad and param.is_floating_point() and param.dtype != dtype:
            param.data = param.data.to(dtype)
            cast += param.numel()
    return cast


def compile_layers(model) -> int:
    """torch.compile each repeated block (the model's own _no_split_modules classes: LlamaDecoderLayer, T5Block, ...)
    in place: one graph reused by every layer of the same shapes."""
    names = set(decoder_layer_classes(model))
    layers = [module for module in model.modules() if type(module).__name__ in names]
    for layer in layers:
        layer.compile()
    return len(layers)


@dataclass
class LabelPositions:
    """The wrapped collator's batch plus where its loss is: the flat indices of the positions whose next token is a
    label (`label_positions`, over batch x (length - 1)) and those labels (`label_targets`), found on the host while
    the batch is made, so the step never waits on the device to learn how many there are."""

    collator: object

    def __call__(self, features):
        batch = self.collator(features)
        labels = batch["labels"][..., 1:]
        positions = (labels != IGNORE_INDEX).flatten().nonzero().squeeze(-1)
        batch["label_positions"] = positions
        batch["label_targets"] = labels.flatten()[positions]
        return batch


def install_label_position_loss(model, kind: str) -> None:
    """Give this causal LM (the object, not its class) a forward that, when the batch says where its labels are
    (LabelPositions), runs the decoder and computes the loss from the output layer at those positions alone: chunked
    (textsql's) or liger (Liger Kernel's fused linear cross-entropy). Without them (evaluation, generation) the
    model's own forward runs. The loss is the sum over the label tokens divided by `num_items_in_batch` (the step's
    label tokens, as transformers' loss divides) or by their count."""
    from transformers.modeling_outputs import CausalLMOutputWithPast

    decoder = getattr(model, model.base_model_prefix)
    head = model.get_output_embeddings()
    original = model.forward

    def forward(
        input_ids=None,
        attention_mask=None,
        position_ids=None,
        labels=None,
        label_positions=None,
        label_targets=None,
        num_items_in_batch=None,
        **kwargs,
    ):
        if label_positions is None or not model.training:
            return original(
                input_ids=input_ids,
                attention_mask=attention_mask,
                position_ids=position_ids,
                labels=labels,
                **({"num_items_in_batch": num_items_in_batch} if num_items_in_batch is not None else {}),
                **kwargs,
            )
        kwargs["use_cache"] = False
        hidden = decoder(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, **kwargs)[0]
        hidden = hidden[:, :-1].reshape(-1, hidden.shape[-1]).index_select(0, label_positions)
        total = output_layer_loss(hidden, head.weight, getattr(head, "bias", None), label_targets, kind)
        divisor = num_items_in_batch if num_items_in_batch is not None else max(label_targets.numel(), 1)
        return CausalLMOutputWithPast(loss=total / divisor)

    model.forward = forward


def output_layer_loss(hidden, weight, bias, targets, kind: str = "chunked"):
    """The summed cross-entropy of `targets` given the output layer (weight, bias) applied to `hidden` (one row per
    target): logits in the compute dtype upcast to fp32, as transformers' loss does; several chunks of rows each
    recomputed in the backward pass (torch.utils.checkpoint) so that one chunk's logits exist at a time."""
    import torch.nn.functional as F

    if kind == "liger":
        from liger_kernel.transformers.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyLoss

        return LigerFusedLinearCrossEntropyLoss(reduction="sum")(weight, hidden, targets, bias)

    def chunk_loss(rows, chunk_targets):
        logits = F.linear(rows, weight, bias).float()
        return F.cross_entropy(logits, chunk_targets, reduction="sum")

    # the planner's chunk (LOSS_CHUNK_LOGITS): a WikiSQL micro-batch's few hundred label tokens are one chunk
    rows = causal_planner.loss_logit_rows(hidden.shape[0], weight.shape[0])
    if hidden.shape[0] <= rows:
        return chunk_loss(hidden, targets)
    from torch.utils.checkpoint import checkpoint

    return sum(
        checkpoint(chunk_loss, hidden[start : start + rows], targets[start : start + rows], use_reentrant=False)
        for start in range(0, hidden.shape[0], rows)
    )


# ---------------------------------------------------------------------------------------------------------------------
# FLOPs and MFU
# ---------------------------------------------------------------------------------------------------------------------

# What a step's batch counts, summed over its examples, from which its FLOPs follow exactly (training_flops): the
# source and target tokens (a causal LM's sequence is its source), their squares (attention) and their products
# (T5's cross-attention). Kept on the device by the trainer, read at log time.
TOKEN_COUNTS = ("source", "target", "source_squared", "target_squared", "source_target")


def flops_coefficients(config, logits_at_labels: bool = False) -> dict:
    """Training FLOPs (3 x the forward's: the backward costs two forwards) per unit of each TOKEN_COUNTS entry: every
    matmul (2 FLOPs per multiply-add), attention scores and their weighted sum included, embedding lookups not.
    T5: the encoder's weights per source token, the decoder's and the output layer per target token, the
    cross-attention's keys and values per source token of each decoder layer. A causal LM: every layer's weights and
    the output layer per token (with `logits_at_labels`, the output layer only at the label tokens: the target).
    Attention counted dense per example (QK^T and AV: 2 x 2 x width FLOPs per pair of positions), as sdpa computes it."""
    if getattr(config, "is_encoder_decoder", False):
        d, inner = config.d_model, config.num_heads * config.d_kv
        ffn = (3 if getattr(config, "is_gated_act", False) else 2) * d * config.d_ff
        enc, dec = config.num_layers, config.num_decoder_layers or config.num_layers
        forward = {
            "source": 2 * (enc * (4 * d * inner + ffn) + dec * 2 * d * inner),
            "target": 2 * (dec * (6 * d * inner + ffn) + d * config.vocab_size),
            "source_squared": 2 * 2 * inner * enc,
            "target_squared": 2 * 2 * inner * dec,
            "source_target": 2 * 2 * inner * dec,
        }
    else:
        w = causal_widths(config, family_of(config))
        kv = w.kv_heads * w.head_dim
        attention_weights = w.hidden * w.heads * w.head_dim * 2 + w.hidden * kv * 2  # q, o and k, v
        ffn = (3 if w.gated else 2) * w.hidden * w.ffn
        head = 2 * w.hidden * w.vocab
        forward = {
            "source": 2 * w.layers * (attention_weights + ffn) + (0 if logits_at_labels else head),
            "target": head if logits_at_labels else 0,
            "source_squared": 2 * 2 * w.heads * w.head_dim * w.layers,
            "target_squared": 0,
            "source_target": 0,
        }
    return {name: 3 * value for name, value in forward.items()}


def training_flops(config, counts: dict, logits_at_labels: bool = False) -> float:
    """The training FLOPs of examples whose TOKEN_COUNTS sums are `counts`."""
    coefficients = flops_coefficients(config, logits_at_labels)
    return float(sum(coefficients[name] * counts.get(name, 0) for name in TOKEN_COUNTS))


def example_counts(source_length: int, target_length: int) -> dict:
    """TOKEN_COUNTS of one example (a causal LM's: its sequence as the source, its label tokens as the target)."""
    s, t = source_length, target_length
    return {"source": s, "target": t, "source_squared": s * s, "target_squared": t * t, "source_target": s * t}


def mfu_figures(flops: float, seconds: float, gpu: str | None, precision: str, tf32: bool) -> dict:
    """run_summary.json's `mfu`: one GPU's model FLOPs (at its examples' real lengths) per second against the GPU's
    dense peak for its precision (textsql.strategy.devices.GPU_PEAK_TFLOPS); no MFU on the CPU or an unknown card."""
    tflops = flops / seconds / 1e12 if seconds else None
    figures = {"model_flops": flops, "seconds": seconds, "tflops_per_gpu": tflops}
    peak = peak_tflops(gpu) if gpu else None
    usable, kind = peak.for_precision(precision, tf32) if peak else (None, None)
    if usable and tflops is not None:
        return figures | {"peak_tflops": usable, "peak": f"{peak.gpu} {kind} ({peak.source})", "mfu": tflops / usable}
    return figures | {"peak_tflops": None, "peak": f"no peak known ({gpu or 'CPU'})", "mfu": None}
