"""Model families: what every layer needs to know about a model, decided from its config, never from its name."""

from __future__ import annotations

from dataclasses import dataclass, field

from textsql.errors import TextsqlError

SEQ2SEQ = "seq2seq"  # an encoder reads the source, a decoder writes the target (T5)
CAUSAL = "causal"  # one decoder reads the prompt and continues it with the answer (Llama, Qwen2, GPT-2, ...)
ALL_LINEAR = "all-linear"  # peft's every nn.Linear (and GPT-2's Conv1D) but the output layer

# The settings "auto" stands for (prep's --source_format, infer's --decoding, train's --execution_accuracy_decoding,
# the demo's): the best a family was measured with (best_settings). The spellings are textsql.wikisql.format's and
# textsql.arguments.decoding's (a test checks them against those lists; this module sits below both).
AUTO = "auto"
WALKTHROUGH_FORMAT = "question"  # the original walkthrough's: the question alone
VALUES_FORMAT = "question+header+values"
CONSTRAINED = "constrained"
GREEDY = "greedy"


@dataclass(frozen=True)
class Family:
    """One model family: how textsql loads, prompts, adapts and trains it.

    `lora_targets` maps textsql's LoRA presets (--lora_targets) to peft's target_modules: the module names of the
    attention's query and value projections ("qv": fused query-key-value layers where the family fuses them) or
    `all-linear`. `fp16_safe` is False where the family's checkpoints overflow fp16 (T5 was pretrained in bf16).
    `packing_refusal` says why the family cannot train on packed batches (textsql.train.collate.check_packing); empty
    where it can. `best_source_format` and `best_decoding` are the best the family was measured with (best_settings),
    `best_why` says, per setting, why where a family's best differs (--help shows it)."""

    name: str
    model_types: tuple[str, ...]
    kind: str
    lora_targets: dict = field(default_factory=dict)
    fp16_safe: bool = True
    fp16_reason: str = ""
    # The memory planner's reading of a causal family's config (textsql.planner.causal), checked against the model
    # built on the meta device for every family: the config keys of the feed-forward width (none set: 4 x hidden), of
    # the key-value heads (none set: one per query head; `multi_query` without falcon's new decoder architecture: 1),
    # whether the feed-forward block is gated (gate, up and down projections), whether rotary embeddings save q, k, and
    # whether its norms are RMS norms.
    ffn_keys: tuple[str, ...] = ()
    kv_heads_keys: tuple[str, ...] = ()
    gated_mlp: bool = False
    rotary: bool = False
    rms_norm: bool = False  # transformers' RMS norm in Python (what it keeps differs from LayerNorm's one kernel)
    # What one decoder layer keeps per token beyond the planner's count, in hidden widths: measured by
    # bench/causal_activations.py on an H200 (bench/gpu/results/2026-11-26-h200-causal-calibration.json), the larger
    # of full fine-tuning's and LoRA's residual, rounded up; only where the count falls short, never to shrink it.
    saved_beyond_count: int = 0
    packing_refusal: str = ""
    quantize_refusal: str = ""  # why bitsandbytes cannot quantize the family's layers (--quantize_base); "" if it can
    best_source_format: str = VALUES_FORMAT
    best_decoding: str = CONSTRAINED
    best_why: dict = field(default_factory=dict)  # setting -> why the family's best differs from the others'

    @property
    def causal(self) -> bool:
        return self.kind == CAUSAL

    @property
    def peft_task_type(self) -> str:
        return "CAUSAL_LM" if self.causal else "SEQ_2_SEQ_LM"

    @property
    def trainer_class_name(self) -> str:
        """The transformers Trainer textsql subclasses: Seq2SeqTrainer (generation-aware evaluation) or Trainer."""
        return "Trainer" if self.causal else "Seq2SeqTrainer"


def _causal(name: str, qv: tuple[str, ...], *model_types: str, **extra) -> Family:
    return Family(name, model_types or (name,), CAUSAL, {"qv": list(qv), "all": ALL_LINEAR}, **extra)


_LLAMA_LIKE = {
    "ffn_keys": ("intermediate_size",),
    "kv_heads_keys": ("num_key_value_heads",),
    "gated_mlp": True,
    "rms_norm": True,
}


# Packed batches keep examples apart through the position ids, which restart at each example: transformers' mask
# builder (masking_utils.create_causal_mask) turns them into a block-diagonal mask for sdpa and eager attention,
# and flash-attention reads them as the examples' boundaries. These families call it without the position ids
# (measured: the loss of a packed batch differs from the padded one's, and a packed example's logits from its own).
# falcon passes them since transformers 5.24 (5.23 did not; hence pyproject's floor), rotary and ALiBi alike.
MASK_WITHOUT_POSITIONS = (
    "its transformers modeling code builds the attention mask without the position ids, so the examples packed "
    "into one row would attend to the ones before them"
)


# T5's module names: q, k, v, o in every attention, wi (wi_0, wi_1 when gated: T5 v1.1, flan-t5) and wo in every
# feed-forward block; on T5 peft's all-linear is exactly these (tests check it).
T5_LINEAR_NAMES = ("q", "k", "v", "o", "wi", "wi_0", "wi_1", "wo")
FAMILIES = (
    Family(
        "t5",
        ("t5", "mt5", "umt5"),
        SEQ2SEQ,
        {"qv": ["q", "v"], "all": ALL_LINEAR},
        fp16_safe=False,
        fp16_reason="T5 checkpoints were pretrained in bf16 and their activations overflow fp16, giving NaN losses "
        "(t5-large and larger)",
        packing_refusal="T5 is an encoder-decoder: packing flattens one sequence per batch, which only a decoder-only "
        "model reads (T5's encoder and decoder each need the examples' own lengths)",
    ),
    _causal("llama", ("q_proj", "v_proj"), rotary=True, **_LLAMA_LIKE),
    _causal("qwen2", ("q_proj", "v_proj"), rotary=True, **_LLAMA_LIKE),
    _causal("mistral", ("q_proj", "v_proj"), rotary=True, **_LLAMA_LIKE),
    _causal("opt", ("q_proj", "v_proj"), ffn_keys=("ffn_dim",), packing_refusal=MASK_WITHOUT_POSITIONS),
    _causal("bloom", ("query_key_value",), packing_refusal=MASK_WITHOUT_POSITIONS),  # fused query-key-value
    _causal(
        "falcon",
        ("query_key_value",),
        ffn_keys=("ffn_hidden_size",),
        kv_heads_keys=("num_kv_heads",),
        rotary=True,
        saved_beyond_count=12,  # one norm for the parallel attention and MLP; fp32 attention tensors
        quantize_refusal="falcon's linear layers are FalconLinear, a subclass of nn.Linear that transformers' "
        "bitsandbytes swap skips silently (it swaps only layers whose type is exactly nn.Linear): the base would stay "
        "in full precision under a QLoRA name",
    ),
    _causal("gpt_bigcode", ("c_attn",), ffn_keys=("n_inner",), kv_heads_keys=("num_key_value_heads",)),
    # codegen's eager attention upcasts the query and key to fp32
    _causal("codegen", ("qkv_proj",), ffn_keys=("n_inner",), rotary=True, saved_beyond_count=16),
    # a Conv1D, which peft adapts too; with attention dropout (0.1) the attention's probabilities are kept
    _causal("gpt2", ("c_attn",), ffn_keys=("n_inner",), saved_beyond_count=29),
)
LORA_PRESETS = ("qv", "all")


def best_settings(family: Family, has_tables: bool = True) -> dict[str, str]:
    """What "auto" means for a model of `family`: {"source_format": ..., "decoding": ...}, the best it was measured
    with (docs/sql-quality.md): the table's matched cells in the source and constrained decoding. Without tables (a hub
    copy holding only questions and SQL) the question alone and greedy decoding: the other two read the table."""
    if not has_tables:
        return {"source_format": WALKTHROUGH_FORMAT, "decoding": GREEDY}
    return {"source_format": family.best_source_format, "decoding": family.best_decoding}


def best_setting(name: str, value: str, family: Family, has_tables: bool = True) -> str:
    """`value` of the setting `name` (source_format or decoding), with "auto" made the family's best (best_settings)."""
    return best_settings(family, has_tables)[name] if value == AUTO else value


def best_settings_help(name: str) -> str:
    """The --help words saying what "auto" means for the setting `name` (source_format or decoding), per family."""

    def best(family: Family) -> str:
        why = family.best_why.get(name)
        return getattr(family, f"best_{name}") + (f" ({why})" if why else "")

    t5, causal = best(family_named("t5")), {best(f) for f in FAMILIES if f.causal}
    says = f"{t5} for T5 and causal LMs alike" if {t5} == causal else f"T5: {t5}; causal LMs: {', '.join(causal)}"
    without = "a source without tables: question" if name == "source_format" else "questions without a table: greedy"
    return f"auto (the default): the best measured for the model's family, {says} ({without})"


def family_named(name: str) -> Family:
    """The family called `name` ("t5", "llama", ...)."""
    for family in FAMILIES:
        if family.name == name:
            return family
    raise TextsqlError(f"textsql knows no model family '{name}'; it knows {', '.join(f.name for f in FAMILIES)}.")


def t5_lora_module_names(preset: str) -> tuple[str, ...]:
    """T5's module names a LoRA preset adapts (all-linear spelled out), for the planner's T5 layer model."""
    targets = lora_target_modules(family_named("t5"), preset)
    return T5_LINEAR_NAMES if targets == ALL_LINEAR else tuple(targets)


def family_of(config) -> Family:
    """The family of a model config (a transformers PretrainedConfig or its dict), by `model_type`; an encoder-decoder
    model that is not T5, or a model type textsql does not know, is refused with the list of those it knows."""
    get = config.get if isinstance(config, dict) else lambda key, default=None: getattr(config, key, default)
    model_type = get("model_type")
    for family in FAMILIES:
        if model_type in family.model_types:
            return family
    known = ", ".join(t for family in FAMILIES for t in family.model_types)
    kind = "an encoder-decoder" if get("is_encoder_decoder", False) else "a"
    raise TextsqlError(
        f"The model is {kind} '{model_type}' model, a family textsql does not know; it fine-tunes these model types: "
        f"{known}. Choose a model of one of them (its config.json names the type), or add its family to "
        "textsql/families.py (its LoRA module names, whether fp16 is safe)."
    )


def auto_model_class(family: Family):
    """transformers' Auto class that loads the family's language model."""
    import transformers

    return transformers.AutoModelForCausalLM if family.causal else transformers.AutoModelForSeq2SeqLM


def decoder_layer_classes(model) -> list[str]:
    """The class names of the model's repeated blocks, which FSDP wraps one unit each: the model's own
    `_no_split_modules` (T5Block, LlamaDecoderLayer, BloomBlock, GPT2Block, ...), as accelerate's
    TRANSFORMER_BASED_WRAP reads it."""
    model = model.get_base_model() if hasattr(model, "get_base_model") else model
    names = getattr(model, "_no_split_modules", None) or []
    return sorted(names)


def tied_embeddings(config) -> bool:
    """Whether the output layer shares the input embedding's weight (T5, bloom, gpt2, opt, tiny Qwen2 models)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return bool(getattr(text, "tie_word_embeddings", False))


def lora_target_modules(family: Family, preset: str):
    """peft's target_modules for a LoRA preset (textsql.arguments.lora.LoraArguments.lora_targets) on this family."""
    if preset not in family.lora_targets:
        raise TextsqlError(f"--lora_targets must be one of {', '.join(LORA_PRESETS)}, not '{preset}'.")
    return family.lora_targets[preset]


def pad_token_id(tokenizer) -> int:
    """The id that pads batches: the tokenizer's pad token, else its EOS (GPT-2 has no pad token). Padding is always
    masked by position (the attention mask, -100 labels), never by this id, which may equal EOS."""
    if tokenizer.pad_token_id is not None:
        return tokenizer.pad_token_id
    if tokenizer.eos_token_id is None:
        raise TextsqlError(
            "The tokenizer has neither a pad nor an end-of-sequence token, so batches cannot be padded and the model "
            "cannot learn where a query ends. Use a tokenizer that defines eos_token (tokenizer_config.json)."
        )
    return tokenizer.eos_token_id


def ensure_pad_token(tokenizer):
    """The tokenizer with a pad token (its EOS when it has none, as GPT-2's): batched tokenizer calls need one."""
    if tokenizer.pad_token is None:
        pad_token_id(tokenizer)  # refuses a tokenizer without EOS
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer
