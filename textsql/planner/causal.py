"""The memory planner's model of decoder-only causal LMs: built-in configs, layer widths, activations, quantized bases."""

from __future__ import annotations

import math
from dataclasses import dataclass

# The config facts of common causal LMs, so that `textsql plan --model Qwen/Qwen2.5-7B` needs no download. Each row is
# the hub repository's config.json (https://huggingface.co/<name>/blob/main/config.json), the keys that decide the
# shape only; the rest takes transformers' defaults. Checked against copies of those files (the Qwen2.5-0.5B and
# codegen2-1B config.json, falcon-7b's printed module tree) and against the parameter counts their model cards state
# (tests/unit/test_memory_causal.py builds every row on the meta device).
CAUSAL_CONFIGS = {
    # Qwen/Qwen2.5-*: GQA, gated SiLU feed-forward, q/k/v biases; 0.5B and 1.5B tie the output layer to the embedding.
    "Qwen/Qwen2.5-0.5B": {
        "model_type": "qwen2",
        "hidden_size": 896,
        "intermediate_size": 4864,
        "num_hidden_layers": 24,
        "num_attention_heads": 14,
        "num_key_value_heads": 2,
        "vocab_size": 151936,
        "tie_word_embeddings": True,
    },
    "Qwen/Qwen2.5-1.5B": {
        "model_type": "qwen2",
        "hidden_size": 1536,
        "intermediate_size": 8960,
        "num_hidden_layers": 28,
        "num_attention_heads": 12,
        "num_key_value_heads": 2,
        "vocab_size": 151936,
        "tie_word_embeddings": True,
    },
    "Qwen/Qwen2.5-7B": {
        "model_type": "qwen2",
        "hidden_size": 3584,
        "intermediate_size": 18944,
        "num_hidden_layers": 28,
        "num_attention_heads": 28,
        "num_key_value_heads": 4,
        "vocab_size": 152064,
        "tie_word_embeddings": False,
    },
    # HuggingFaceTB/SmolLM2-135M-Instruct: the real model textsql measures on (`textsql import smollm2-135m-instruct`,
    # docs/real-model.md): a llama, GQA with 3 key-value heads, tied; its imported config.json gives these keys.
    "HuggingFaceTB/SmolLM2-135M-Instruct": {
        "model_type": "llama",
        "hidden_size": 576,
        "intermediate_size": 1536,
        "num_hidden_layers": 30,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "head_dim": 64,
        "vocab_size": 49152,
        "tie_word_embeddings": True,
    },
    # meta-llama/Llama-3.*: GQA with 8 key-value heads, 128,256 ids; 3.2-1B ties its output layer.
    "meta-llama/Llama-3.2-1B": {
        "model_type": "llama",
        "hidden_size": 2048,
        "intermediate_size": 8192,
        "num_hidden_layers": 16,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "vocab_size": 128256,
        "tie_word_embeddings": True,
    },
    "meta-llama/Llama-3.1-8B": {
        "model_type": "llama",
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "vocab_size": 128256,
        "tie_word_embeddings": False,
    },
    "mistralai/Mistral-7B-v0.1": {
        "model_type": "mistral",
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "vocab_size": 32000,
        "tie_word_embeddings": False,
    },
    # bigscience/bloom-*: fused query-key-value, ALiBi (eager attention: the scores are kept), 250,880 ids, tied.
    "bigscience/bloom-1b1": {
        "model_type": "bloom",
        "hidden_size": 1536,
        "n_layer": 24,
        "n_head": 16,
        "vocab_size": 250880,
    },
    "bigscience/bloom-7b1": {
        "model_type": "bloom",
        "hidden_size": 4096,
        "n_layer": 30,
        "n_head": 32,
        "vocab_size": 250880,
    },
    # tiiuae/falcon-7b: multi-query attention (one key-value head), attention and MLP in parallel, no biases, tied.
    "tiiuae/falcon-7b": {
        "model_type": "falcon",
        "hidden_size": 4544,
        "num_hidden_layers": 32,
        "num_attention_heads": 71,
        "multi_query": True,
        "parallel_attn": True,
        "new_decoder_architecture": False,
        "bias": False,
        "vocab_size": 65024,
    },
    # Salesforce/codegen2-1B: model_type codegen (its own modeling code on the hub; the shape is transformers').
    "Salesforce/codegen2-1B": {
        "model_type": "codegen",
        "n_embd": 2048,
        "n_layer": 16,
        "n_head": 16,
        "rotary_dim": 64,
        "n_positions": 2048,
        "n_ctx": 2048,
        "vocab_size": 51200,
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
    },
    # bigcode/starcoderbase-1b: gpt_bigcode, multi-query attention, learned positions up to 8192.
    "bigcode/starcoderbase-1b": {
        "model_type": "gpt_bigcode",
        "n_embd": 2048,
        "n_layer": 24,
        "n_head": 16,
        "n_inner": 8192,
        "multi_query": True,
        "n_positions": 8192,
        "vocab_size": 49152,
        "bos_token_id": 0,
        "eos_token_id": 0,
    },
    "openai-community/gpt2": {"model_type": "gpt2", "n_embd": 768, "n_layer": 12, "n_head": 12, "vocab_size": 50257},
    "facebook/opt-1.3b": {
        "model_type": "opt",
        "hidden_size": 2048,
        "ffn_dim": 8192,
        "num_hidden_layers": 24,
        "num_attention_heads": 32,
        "max_position_embeddings": 2048,
        "word_embed_proj_dim": 2048,
        "vocab_size": 50272,
    },
}
# Hub names that resolve to the same repository.
CAUSAL_ALIASES = {"gpt2": "openai-community/gpt2"}

# bitsandbytes' storage (0.50.2, measured on this CPU backend; the same layout on CUDA): NF4 packs two 4-bit codes per
# byte; each block of 64 weights has an absmax constant, which double quantization stores as one uint8 per block plus,
# per 256 blocks, an fp32 absmax of those, and per tensor an fp32 offset, the 16-entry NF4 code and the 256-entry
# second-level code (fp32). Int8 (LLM.int8) stores one int8 per weight and an fp32 scale per output row (SCB).
NF4_BLOCK = 64
NF4_NESTED_BLOCK = 256
NF4_TENSOR_CONSTANTS = 4 + 16 * 4 + 256 * 4  # offset, NF4 code, second-level code: bytes per quantized tensor
QUANTIZED_FORMATS = ("nf4", "int8")
# Tensors an activation function keeps for its backward pass, in feed-forward widths: transformers' gelu_new and
# gelu_fast are written in Python (x, tanh output, 0.5 x, 1 + tanh); torch's own activations keep one.
ACTIVATION_SAVES = {"gelu_new": 4, "gelu_fast": 4}


@dataclass(frozen=True)
class CausalWidths:
    """A causal LM's widths as its family reads its config (textsql.families.Family's planner facts)."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    vocab: int
    gated: bool
    fused_qkv: bool
    activation_saves: int  # tensors of the feed-forward width the activation keeps
    rms_norm: bool = False
    saved_beyond_count: int = 0  # hidden widths per token and layer (textsql.families.Family)

    @property
    def attention(self) -> int:
        return self.heads * self.head_dim

    @property
    def key_value(self) -> int:
        return self.kv_heads * self.head_dim


def builtin_config(name: str) -> dict | None:
    """The built-in config of `name` (a hub id or its part after the slash), or None."""
    name = CAUSAL_ALIASES.get(name, name)
    if name in CAUSAL_CONFIGS:
        return dict(CAUSAL_CONFIGS[name])
    by_short = {key.split("/")[-1]: key for key in CAUSAL_CONFIGS}
    return dict(CAUSAL_CONFIGS[by_short[name]]) if name in by_short else None


def causal_widths(config, family) -> CausalWidths:
    """The widths of `config` (a transformers config) as `family` reads them: feed-forward width from the family's keys
    (4 x hidden where none is set), key-value heads from its keys (one per query head where none is set; 1 for
    multi-query attention outside falcon's new decoder architecture)."""

    def first(keys):
        return next((getattr(config, key) for key in keys if getattr(config, key, None)), None)

    hidden, heads = config.hidden_size, config.num_attention_heads
    kv_heads = first(family.kv_heads_keys) or heads
    if getattr(config, "multi_query", False) and not getattr(config, "new_decoder_architecture", False):
        kv_heads = 1
    activation = getattr(config, "hidden_act", None) or getattr(config, "activation_function", None) or ""
    return CausalWidths(
        hidden=hidden,
        layers=config.num_hidden_layers,
        heads=heads,
        kv_heads=kv_heads,
        head_dim=getattr(config, "head_dim", None) or hidden // heads,
        ffn=first(family.ffn_keys) or 4 * hidden,
        vocab=config.vocab_size,
        gated=family.gated_mlp,
        fused_qkv=len(family.lora_targets.get("qv", ())) == 1,  # one fused query-key-value layer
        activation_saves=ACTIVATION_SAVES.get(str(activation), 1),
        rms_norm=family.rms_norm,
        saved_beyond_count=family.saved_beyond_count,
    )


def block_linears(w: CausalWidths) -> list[tuple[str, int, int]]:
    """(role, in, out) of every matmul in one decoder layer: the fused or separate query/key/value projections, the
    attention output, and the feed-forward block (gate, up and down where gated)."""
    if w.fused_qkv:
        attention = [("qkv", w.hidden, w.attention + 2 * w.key_value)]
    else:
        attention = [("q", w.hidden, w.attention), ("k", w.hidden, w.key_value), ("v", w.hidden, w.key_value)]
    attention.append(("o", w.attention, w.hidden))
    feed_forward = [("gate", w.hidden, w.ffn)] if w.gated else []
    feed_forward += [("up", w.hidden, w.ffn), ("down", w.ffn, w.hidden)]
    return attention + feed_forward


def lora_block_layers(w: CausalWidths, preset: str) -> list[tuple[str, int, int]]:
    """The decoder layer's matmuls a LoRA preset adapts: qv, the query and value projections (the fused query-key-value
    layer where the family fuses them); all, every one (peft's all-linear; never the output layer)."""
    layers = block_linears(w)
    return layers if preset == "all" else [layer for layer in layers if layer[0] in ("q", "v", "qkv")]


def layer_activation_bytes(
    w: CausalWidths,
    tokens: int,
    sequence: int,
    e: int,
    eager: bool,
    padded: bool,
    autocast: bool = False,
    frozen: bool = False,
) -> dict:
    """Bytes one decoder layer keeps for the backward pass, for `tokens` = batch x sequence positions, counted from
    what autograd saves (bench/causal_activations.py counts it; an H200's census of every family calibrated this).

    `autocast`: plain PyTorch mixed precision (no DeepSpeed, --precision bf16/fp16): the weights and the residual
    stream stay fp32, and every matmul casts its input to its own 16-bit copy. `frozen`: the base model does not
    train (LoRA, QLoRA): a matmul whose weight is frozen keeps no input, nor does an RMS norm its output.

    Per token: the two norms (an RMS norm keeps its fp32 input and, when its weight trains, its output: fp32 under
    autocast, 16-bit otherwise; a LayerNorm its input, in the residual stream's dtype) and the inputs of the matmuls
    after them (under autocast, one 16-bit copy per trained matmul; otherwise the LayerNorm's output, shared); the
    attention's query, keys and values as the attention kernel keeps them, its output (which the output projection
    reads as it is) and the log-sum-exp (fp32 per head); with eager attention (bloom, codegen: no sdpa) the fp32
    softmax and the probabilities, heads x sequence each, and the output's contiguous copy; the feed-forward hidden
    states (gate, activation output and up where gated, and their product where the down projection trains; the
    activation's saved tensors, and its output where the down projection trains, otherwise); and what the family's
    layers were measured to keep beyond this count (textsql.families.Family.saved_beyond_count).

    Keys and values: transformers 5.23 and 5.24 pass grouped-query (and multi-query) heads to sdpa as they are only
    when the batch has no attention mask; a padded batch (textsql pads each batch to its longest) gets them repeated to
    every query head first (repeat_kv), and sdpa keeps the repeated copies. `padded` False models the unpadded case.
    """
    kv = w.attention if padded else w.key_value
    stream = 4 if autocast else e  # the residual stream's bytes per element
    if w.rms_norm:
        norm = 4 + (0 if frozen else 4 if autocast else e)
    else:
        norm = stream
    if frozen:
        inputs = 0
    elif autocast:
        inputs = ((1 if w.fused_qkv else 3) + (2 if w.gated else 1)) * e
    else:
        inputs = 0 if w.rms_norm else 2 * e
    norms = (2 * norm + inputs) * w.hidden
    attention = (2 * w.attention + 2 * kv) * e + 4 * w.heads
    scores = w.heads * sequence * (4 + e) + (0 if frozen else w.attention * e) if eager else 0
    if w.gated:
        feed_forward = (3 if frozen else 4) * w.ffn * e
    else:
        feed_forward = (w.activation_saves + (0 if frozen else 1)) * w.ffn * e
    measured = w.saved_beyond_count * w.hidden
    return {
        "norms": tokens * norms,
        "attention": tokens * (attention + scores),
        "attention_key_value": tokens * 2 * kv * e,
        "feed_forward": tokens * feed_forward,
        "measured_beyond_count": tokens * measured,
        "total": tokens * (norms + attention + scores + feed_forward + measured),
    }


# Logits the loss at the label positions (textsql train --fused_loss chunked) computes at once: 2**26 (256 MiB in fp32)
# whatever the vocabulary, 441 rows of Qwen's 151,936 ids; more rows are done in chunks, each recomputed in the
# backward pass. Liger Kernel's fused linear cross-entropy chunks its rows likewise.
LOSS_CHUNK_LOGITS = 2**26


def loss_logit_rows(label_tokens: int, vocab: int) -> int:
    """The rows of logits that exist at once when the loss is computed at `label_tokens` positions in chunks."""
    return min(label_tokens, max(1, LOSS_CHUNK_LOGITS // vocab))


def activation_bytes(
    w: CausalWidths,
    batch: int,
    sequence: int,
    precision: str,
    gradient_checkpointing: bool,
    eager: bool,
    padded: bool = True,
    autocast: bool = False,
    frozen: bool = False,
    loss_rows: int | None = None,
) -> dict:
    """Peak bytes of activations of one training step of a causal LM over batch x sequence (prompt + SQL) tokens.

    Every layer's saved tensors (layer_activation_bytes), or with gradient checkpointing each layer's input plus one
    layer recomputed at a time; the embedding output, final norm and output layer's input; the gradients flowing
    back through the hidden states; and the logits term: transformers' ForCausalLMLoss upcasts the logits of every
    position to fp32 and takes their log-softmax, so the loss peaks at the start of the backward pass with the fp32
    log-softmax, its gradient and the logits' fp32 gradient (batch x sequence x vocabulary each, 12 bytes: measured on
    an H200, the 16-bit gradient comes after the first two are freed; 5.7 GB for bloom's 250,880 ids at batch 8 x 256
    tokens). `autocast` and `frozen`: layer_activation_bytes. `loss_rows`: the positions whose logits exist at once
    when the loss is computed at the label positions only (--fused_loss: loss_logit_rows); None: every position."""
    e = 4 if precision == "fp32" else 2
    tokens = batch * sequence
    layer = layer_activation_bytes(w, tokens, sequence, e, eager, padded, autocast, frozen)
    loss = (tokens if loss_rows is None else loss_rows) * w.vocab * 12
    if gradient_checkpointing:
        layers = w.layers * tokens * w.hidden * e  # each layer's input
        transient = max(loss, layer["total"])  # the loss first, then one layer recomputed at a time
    else:
        layers = w.layers * layer["total"]
        transient = loss
    stack_ends = tokens * w.hidden * (e + 4 + e)  # embedding output, final norm's fp32 input and its output
    gradient_flow = 3 * tokens * w.hidden * e
    return {
        "layers": int(layers),
        "transient": int(transient),
        "other": int(stack_ends + gradient_flow),
        "loss_peak": int(loss),
        "per_layer": layer,
        "total": int(layers + transient + stack_ends + gradient_flow),
    }


def lora_activation_bytes(
    w: CausalWidths, rank: int, preset: str, batch: int, sequence: int, precision: str, checkpointing: bool
) -> int:
    """LoRA's activations beyond the model's: per adapted layer and token, its input after dropout (and the 1-byte
    mask) and the r-wide output of A; with gradient checkpointing, one layer's."""
    e = 4 if precision == "fp32" else 2
    per_layer = batch * sequence * sum(n_in * (e + 1) + rank * e for _, n_in, _ in lora_block_layers(w, preset))
    return per_layer if checkpointing else per_layer * w.layers


def int8_matmul_input_bytes(w: CausalWidths, tokens: int) -> int:
    """What bitsandbytes' int8 matmuls (MatMul8bitLt) keep beyond a 16-bit matmul, per decoder layer: a 16-bit copy
    of every matmul's input (measured on an H200, Qwen2.5-0.5B's shape: 1.58 GiB over 24 layers x 3,072 tokens, one
    copy of the layer's 10,240 input widths)."""
    return tokens * 2 * sum(n_in for _, n_in, _ in block_linears(w))


def generation_bytes(w: CausalWidths, eval_batch: int, beams: int, sequence: int, precision: str, fp32_module: bool):
    """GPU bytes an evaluation adds: the evaluation loss's forward pass over the vocabulary (eval batch x sequence:
    the logits, their fp32 copy in 16-bit training, the fp32 log-softmax) or generate()'s working set, whichever is
    larger: the key-value cache of every layer for eval batch x beams rows over prompt + SQL (key-value heads x head
    width: grouped-query and multi-query attention shrink it), and each step's scores over the vocabulary in fp32."""
    e = 4 if precision == "fp32" else 2
    detail = {"loss_forward": int(eval_batch * sequence * w.vocab * (e + 4 + (4 if e == 2 else 0)))}
    if beams:
        rows = eval_batch * beams
        e = 4 if fp32_module else e
        detail |= {
            "key_value_cache": w.layers * 2 * rows * sequence * w.key_value * e,
            "step_scores": 3 * rows * w.vocab * 4,
        }
    generate = sum(v for k, v in detail.items() if k != "loss_forward")
    detail["total"] = int(max(detail["loss_forward"], generate))
    return detail


def quantized_bytes(quantize: str, weights) -> int:
    """Bytes of the quantized weights, `weights` being (elements, output rows) per quantized tensor: NF4 with double
    quantization about 4.13 bits per weight (4 bits, a uint8 absmax per 64 weights, an fp32 absmax per 256 blocks)
    plus each tensor's constants; int8 one byte per weight plus an fp32 scale per output row."""
    if quantize == "int8":
        return sum(n + 4 * rows for n, rows in weights)
    if quantize == "nf4":
        total = 0
        for n, _rows in weights:
            blocks = math.ceil(n / NF4_BLOCK)
            total += math.ceil(n / 2) + blocks + 4 * math.ceil(blocks / NF4_NESTED_BLOCK) + NF4_TENSOR_CONSTANTS
        return total
    raise ValueError(f"quantize {quantize!r}")


def quantized_base_bytes(quantize: str, weights, other_parameters: int, other_bytes_each: int) -> dict:
    """A quantized base's parameter bytes: its quantized weights, and the parameters bitsandbytes leaves alone
    (embeddings, norms, biases, the output layer) at `other_bytes_each` bytes."""
    quantized = quantized_bytes(quantize, weights)
    return {
        "quantized": quantized,
        "other": other_parameters * other_bytes_each,
        "total": quantized + other_parameters * other_bytes_each,
    }


def loaded_model_bytes(model) -> int:
    """Bytes a loaded model holds, each storage once: its parameters and buffers and bitsandbytes' quantization state
    (NF4's absmax, nested absmax, codes and offset; int8's row scales), which get_memory_footprint() leaves out."""
    import torch

    tensors = [*model.parameters(), *model.buffers()]
    for module in model.modules():
        weight = getattr(module, "weight", None)
        state = getattr(weight, "quant_state", None)
        if state is not None:
            tensors += [state.absmax, state.code, state.offset]
            if state.nested:
                tensors += [state.state2.absmax, state.state2.code]
        if getattr(weight, "SCB", None) is not None:
            tensors.append(weight.SCB)
    storages = {t.data_ptr(): t.untyped_storage().nbytes() for t in tensors if isinstance(t, torch.Tensor)}
    return sum(storages.values())
