"""Activations: what one training step saves for its backward pass, T5's counted here, a causal LM's in
textsql.planner.causal; LoRA's adapters' on top."""

from __future__ import annotations

from textsql.planner import causal as causal_lm
from textsql.planner.shape import (
    ModelShape,
)


def activation_bytes(
    shape: ModelShape,
    batch: int,
    source_length: int,
    target_length: int,
    precision: str,
    gradient_checkpointing: bool,
    autocast: bool,
    frozen: bool = False,
    fused_loss: str = "none",
) -> dict:
    """Peak bytes of activations (everything saved for the backward pass) of one training step of a T5 model (a causal
    LM's: textsql.planner.causal.activation_bytes, where `frozen` says the base does not train: LoRA).

    Counted per token from the tensors HF's T5 saves: q/k/v and the attention output; the attention scores' fp32
    softmax output, dropout mask (1 byte) and dropout output; RMS layer norm inputs and outputs (fp32 when computed
    in fp32); the feed-forward hidden state (activation output, dropout mask and output); residual dropout masks.
    The loss over the vocabulary peaks at the start of the backward pass with three batch x target x vocab tensors
    (log-softmax output, its gradient, the logits' gradient). `autocast` is plain PyTorch mixed precision: 16-bit
    matmul outputs, fp32 layer norms and loss. `fused_loss` (a causal LM's, textsql train --fused_loss): the loss at
    the label positions (the SQL) only, in chunks.
    """
    if shape.causal:  # one sequence of prompt + SQL through one stack of decoder layers
        rows = None if fused_loss == "none" else causal_lm.loss_logit_rows(batch * target_length, shape.causal.vocab)
        return causal_lm.activation_bytes(
            shape.causal,
            batch,
            source_length + target_length,
            precision,
            gradient_checkpointing,
            shape.eager_attention,
            autocast=autocast,
            frozen=frozen,
            loss_rows=rows,
        )
    s = shape
    b, src, tgt = batch, source_length, target_length
    e = 4 if precision == "fp32" else 2
    wide = 4 if (precision == "fp32" or autocast) else 2  # layer norms and the loss
    d, f, inner = s.d_model, s.d_ff, s.num_heads * s.d_kv
    norm = 12 * d if wide == 4 else 8 * d  # fp32 input (copy), normed, output: 4+4+4 bytes, or 4+2+2 in 16-bit
    score = 4 + 1 + e  # per attention score: fp32 softmax output, dropout mask, dropout output
    hidden = (4 * e + 1) * f if s.gated else (2 * e + 1) * f
    feed_forward = norm + hidden + d
    self_attention = norm + 4 * inner * e + d
    cross_attention = norm + 2 * inner * e + d  # its keys and values are counted per source token below
    encoder_layer = b * src * (self_attention + feed_forward + s.num_heads * src * score)
    decoder_layer = (
        b * tgt * (self_attention + cross_attention + feed_forward + s.num_heads * (tgt + src) * score)
        + b * src * 2 * inner * e
    )
    # Embedding dropout, final layer norm and dropout of each stack; the decoder's scaled output feeds the lm head.
    stack_ends = b * src * (2 * d * (1 + e) + norm) + b * tgt * (2 * d * (1 + e) + norm + d * e)
    position_bias = b * s.num_heads * (src * src + tgt * tgt + tgt * src) * e  # bias + mask, one per attention kind
    gradient_flow = 3 * b * max(src, tgt) * d * e  # gradients of the hidden states and of the encoder output
    loss = 3 * b * tgt * s.vocab_size * wide
    if gradient_checkpointing:
        layers = (s.num_layers * b * src + s.num_decoder_layers * b * tgt) * d * e  # each block's input
        transient = max(loss, encoder_layer, decoder_layer)  # the loss first, then one block recomputed at a time
    else:
        layers = s.num_layers * encoder_layer + s.num_decoder_layers * decoder_layer
        transient = loss
    total = layers + transient + stack_ends + position_bias + gradient_flow
    return {
        "layers": int(layers),
        "transient": int(transient),
        "other": int(stack_ends + position_bias + gradient_flow),
        "loss_peak": int(loss),
        "total": int(total),
    }


def lora_activation_bytes(
    lora: dict,
    batch: int,
    source_length: int,
    target_length: int,
    precision: str,
    gradient_checkpointing: bool,
    shape: ModelShape,
) -> int:
    """LoRA's activations beyond the model's: per adapted layer and token, its input after dropout (and the 1-byte
    mask) and the r-wide output of A. With gradient checkpointing, those of one encoder and one decoder block."""
    if shape.causal:
        return causal_lm.lora_activation_bytes(
            shape.causal,
            lora["rank"],
            lora["targets"],
            batch,
            source_length + target_length,
            precision,
            gradient_checkpointing,
        )
    e = 4 if precision == "fp32" else 2
    tokens = {"source": batch * source_length, "target": batch * target_length}
    per_block = {"encoder": 0, "decoder": 0}
    for name, _count, n_in, _n_out, kind in lora["layers"]:
        per_block[name.split(" ", 1)[0]] += tokens[kind] * (n_in * (e + 1) + lora["rank"] * e)
    if gradient_checkpointing:
        return per_block["encoder"] + per_block["decoder"]
    return per_block["encoder"] * shape.num_layers + per_block["decoder"] * shape.num_decoder_layers
