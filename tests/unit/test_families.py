"""The model-family registry on tiny random configs of every family it knows: decided from the config, never the name."""

import pytest

from textsql.errors import TextsqlError
from textsql.families import (
    ALL_LINEAR,
    CAUSAL,
    FAMILIES,
    SEQ2SEQ,
    auto_model_class,
    decoder_layer_classes,
    family_of,
    lora_target_modules,
    pad_token_id,
    t5_lora_module_names,
    tied_embeddings,
)
from textsql.tiny import CAUSAL_CONFIG_NAMES, build_tiny_causal

CAUSAL_TYPES = sorted(CAUSAL_CONFIG_NAMES)
# The decoder layer each family's FSDP unit is, as transformers names it (read from _no_split_modules, checked here).
DECODER_LAYERS = {
    "llama": "LlamaDecoderLayer",
    "qwen2": "Qwen2DecoderLayer",
    "mistral": "MistralDecoderLayer",
    "opt": "OPTDecoderLayer",
    "bloom": "BloomBlock",
    "falcon": "FalconDecoderLayer",
    "gpt_bigcode": "GPTBigCodeBlock",
    "codegen": "CodeGenBlock",
    "gpt2": "GPT2Block",
}


@pytest.fixture(scope="module")
def causal_tokenizer(causal_assets):
    from textsql.hub import load_tokenizer

    return load_tokenizer(str(causal_assets[1]))


def test_every_listed_family_is_known_and_has_a_tiny_config():
    names = {family.name for family in FAMILIES}
    assert names == {"t5", *CAUSAL_TYPES} == {"t5", *DECODER_LAYERS}


@pytest.mark.parametrize("model_type", CAUSAL_TYPES)
def test_causal_family_on_a_tiny_random_model(model_type, causal_tokenizer):
    """Each causal family: its Auto class builds it, its FSDP unit is the model's own decoder layer, tied embeddings are
    read from the config as the model really ties them, and both LoRA presets adapt real layers, never lm_head."""
    import torch

    from textsql.adapters import adapted_modules, apply_lora
    from textsql.arguments.lora import LoraArguments

    model = build_tiny_causal(causal_tokenizer, model_type, hidden_size=32, num_layers=1, num_heads=4)
    family = family_of(model.config)
    assert (family.name, family.kind, family.peft_task_type) == (model_type, CAUSAL, "CAUSAL_LM")
    assert isinstance(model, tuple(auto_model_class(family)._model_mapping.values()))
    assert decoder_layer_classes(model) == [DECODER_LAYERS[model_type]]
    assert DECODER_LAYERS[model_type] in {type(module).__name__ for module in model.modules()}
    shared = model.get_output_embeddings().weight is model.get_input_embeddings().weight
    assert tied_embeddings(model.config) == shared
    assert lora_target_modules(family, "all") == ALL_LINEAR
    for preset in ("qv", "all"):
        wrapped = apply_lora(
            build_tiny_causal(causal_tokenizer, model_type, hidden_size=32, num_layers=1, num_heads=4),
            LoraArguments(lora=True, lora_rank=2, lora_targets=preset),
            [],
        )
        adapted = adapted_modules(wrapped)
        assert adapted and not any(name.endswith("lm_head") for name in adapted), (preset, adapted)
        if preset == "qv":
            assert {name.rsplit(".", 1)[-1] for name in adapted} == set(family.lora_targets["qv"])
        trainable = [name for name, p in wrapped.named_parameters() if p.requires_grad]
        assert trainable and all("lora_" in name for name in trainable)
    with torch.no_grad():
        assert model(input_ids=torch.tensor([[1, 2, 3]])).logits.shape == (1, 3, len(causal_tokenizer))


def test_t5_family_from_its_config_not_its_name(tmp_path, causal_tokenizer):
    """A T5 config is seq2seq with fp16 refused, its presets T5's module names; a folder's name means nothing: a tiny
    Qwen2 saved as 't5-small' loads as a causal LM, and hub.model_family reads the config."""
    from transformers import T5Config

    from textsql.hub import load_model, model_family

    t5 = family_of(T5Config(d_model=32, num_layers=1, num_heads=2, d_kv=16, d_ff=64))
    assert (t5.name, t5.kind, t5.fp16_safe, t5.trainer_class_name) == ("t5", SEQ2SEQ, False, "Seq2SeqTrainer")
    assert t5_lora_module_names("qv") == ("q", "v")
    assert set(t5_lora_module_names("all")) >= {"q", "k", "v", "o", "wi", "wo"}
    assert family_of({"model_type": "mt5", "is_encoder_decoder": True}).name == "t5"
    folder = tmp_path / "t5-small"
    build_tiny_causal(causal_tokenizer, "llama", hidden_size=32, num_layers=1).save_pretrained(folder)
    assert model_family(str(folder)).name == "llama"
    assert type(load_model(str(folder))).__name__ == "LlamaForCausalLM"


def test_unknown_families_are_refused_with_the_known_ones():
    with pytest.raises(TextsqlError, match="encoder-decoder 'bart' model.*t5, mt5.*qwen2"):
        family_of({"model_type": "bart", "is_encoder_decoder": True})
    with pytest.raises(TextsqlError, match="a 'bert' model"):
        family_of({"model_type": "bert"})
    with pytest.raises(TextsqlError, match="--lora_targets must be one of qv, all"):
        lora_target_modules(family_of({"model_type": "llama"}), "attention")


def test_pad_token_falls_back_to_eos_and_is_required():
    from types import SimpleNamespace

    assert pad_token_id(SimpleNamespace(pad_token_id=None, eos_token_id=7)) == 7
    assert pad_token_id(SimpleNamespace(pad_token_id=3, eos_token_id=7)) == 3
    with pytest.raises(TextsqlError, match="neither a pad nor an end-of-sequence token"):
        pad_token_id(SimpleNamespace(pad_token_id=None, eos_token_id=None))


def test_fsdp_units_are_the_model_s_own_decoder_layers_and_a_class_it_lacks_is_refused(causal_tokenizer):
    from textsql.train.fsdp import wrapped_layer_classes

    model = build_tiny_causal(causal_tokenizer, "llama", hidden_size=32, num_layers=1)
    assert wrapped_layer_classes(model, {"version": 2}) == ["LlamaDecoderLayer"]
    assert wrapped_layer_classes(model, {"transformer_layer_cls_to_wrap": ["LlamaMLP"]}) == ["LlamaMLP"]
    with pytest.raises(
        TextsqlError,
        match="names T5Block, which this llama model does not have; its decoder layers are LlamaDecoderLayer",
    ):
        wrapped_layer_classes(model, {"transformer_layer_cls_to_wrap": ["T5Block"]})
