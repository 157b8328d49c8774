"""Packed (padding-free) batches for causal LMs: the layout, the loss and gradient equal to padding's on the same
examples for every family that packs (sdpa and eager attention; FlexAttention's mask and loss), and the refusals, with
their reasons measured."""

import pytest
import torch

from textsql.errors import TextsqlError
from textsql.families import FAMILIES, family_named
from textsql.hub import load_tokenizer
from textsql.prepared import load_prepared
from textsql.tiny import CAUSAL_CONFIG_NAMES, build_tiny_causal
from textsql.train.collate import (
    CausalLMCollator,
    PackedCausalLMCollator,
    check_packing,
    make_collator,
    packing_refusal,
    padding_fraction,
)

PACKING_FAMILIES = sorted(t for t in CAUSAL_CONFIG_NAMES if not family_named(t).packing_refusal)
REFUSED_FAMILIES = sorted(t for t in CAUSAL_CONFIG_NAMES if family_named(t).packing_refusal)


@pytest.fixture(scope="module")
def tokenizer_and_rows(causal_assets):
    """The tiny Qwen2's tokenizer (EOS is its pad token) and six prepared examples of different lengths."""
    data_dir, model_dir = causal_assets
    dataset, _ = load_prepared(data_dir)
    rows = sorted(dataset["train"].select(range(24)), key=lambda row: len(row["input_ids"]))[::4]
    features = [{key: row[key] for key in ("input_ids", "attention_mask", "labels")} for row in rows]
    assert len({len(f["input_ids"]) for f in features}) > 2
    return load_tokenizer(str(model_dir)), features


def test_a_packed_batch_is_one_row_with_positions_restarting_and_the_padded_batch_s_labels(tokenizer_and_rows):
    tokenizer, features = tokenizer_and_rows
    eos = tokenizer.eos_token_id
    packed = PackedCausalLMCollator()(features)
    padded = CausalLMCollator(tokenizer.pad_token_id)(features)
    lengths = [len(f["input_ids"]) for f in features]
    assert packed["input_ids"].shape == packed["labels"].shape == packed["position_ids"].shape == (1, sum(lengths))
    assert "attention_mask" not in packed and packed["use_cache"] is False
    assert packed["position_ids"][0].tolist() == [i for n in lengths for i in range(n)]
    # Row by row, the label tokens the padded batch learns, in the same places; each example's EOS kept (pad == EOS)
    start = 0
    for row, length in enumerate(lengths):
        assert packed["input_ids"][0, start : start + length].tolist() == features[row]["input_ids"]
        assert packed["labels"][0, start : start + length].tolist() == padded["labels"][row, :length].tolist()
        assert packed["labels"][0, start + length - 1].item() == eos
        start += length
    assert packed["labels"].ne(-100).sum() == padded["labels"].ne(-100).sum()
    assert padding_fraction(packed) == 0.0 and 0 < padding_fraction(padded) < 1


def loss_and_gradient(model, batch, label_tokens):
    model.zero_grad()
    # The Trainer's way: the step's label tokens given, the loss their sum divided by that count
    loss = model(**batch, num_items_in_batch=torch.tensor(label_tokens)).loss
    loss.backward()
    return loss.item(), {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


# Every family under sdpa (the default); eager once: transformers builds both masks in one place (masking_utils).
@pytest.mark.parametrize(
    ("model_type", "attention"), [(family, "sdpa") for family in PACKING_FAMILIES] + [("llama", "eager")]
)
def test_packing_gives_padding_s_loss_and_gradient(model_type, attention, tokenizer_and_rows):
    tokenizer, features = tokenizer_and_rows
    model = build_tiny_causal(tokenizer, model_type, hidden_size=32, num_layers=2, num_heads=4, seed=1)
    model.set_attn_implementation(attention)  # codegen keeps its own (eager) attention: the same mask either way
    model.eval()  # no dropout (some families drop attention weights functionally): both batches see the same model
    check_packing(model.config)
    padded = make_collator(family_named(model_type), tokenizer, model)(features)
    packed = make_collator(family_named(model_type), tokenizer, model, packing=True)(features)
    tokens = int(padded["labels"][:, 1:].ne(-100).sum())
    padded_loss, padded_grad = loss_and_gradient(model, padded, tokens)
    packed_loss, packed_grad = loss_and_gradient(model, packed, tokens)
    assert packed_loss == pytest.approx(padded_loss, rel=1e-5)
    assert padded_grad.keys() == packed_grad.keys()
    for name, grad in padded_grad.items():
        torch.testing.assert_close(packed_grad[name], grad, rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("model_type", REFUSED_FAMILIES)
def test_families_whose_packed_examples_would_attend_to_each_other_are_refused(model_type, tokenizer_and_rows):
    """The reason measured: a packed example's logits are not its own (it sees the examples before it)."""
    tokenizer, features = tokenizer_and_rows
    model = build_tiny_causal(tokenizer, model_type, hidden_size=32, num_layers=2, num_heads=4, seed=1).eval()
    with pytest.raises(TextsqlError, match=f"the {model_type} family cannot.*attend to the ones before them"):
        check_packing(model.config)
    first, second = features[0], features[-1]
    packed = PackedCausalLMCollator()([first, second])
    with torch.no_grad():
        together = model(**packed).logits[0, len(first["input_ids"]) :]
        alone = model(input_ids=torch.tensor([second["input_ids"]]), use_cache=False).logits[0]
    assert (together - alone).abs().max() > 1e-3


def test_t5_and_unchecked_attention_implementations_are_refused_with_the_reason():
    from transformers import LlamaConfig, T5Config

    with pytest.raises(TextsqlError, match="T5 is an encoder-decoder"):
        check_packing(T5Config())
    config = LlamaConfig()
    check_packing(config)  # the attention is decided when the model loads: the family alone is judged before
    config._attn_implementation = "paged|sdpa"
    with pytest.raises(TextsqlError, match="'paged\\|sdpa'.*sdpa, eager, flex_attention"):
        check_packing(config)
    assert {f.name for f in FAMILIES if packing_refusal(f, "sdpa")} == {"t5", *REFUSED_FAMILIES}


def packed_and_padded_masks(model_type, tokenizer, features, pad_to_multiple_of=None):
    """transformers' masks for one packed row under flex_attention (a BlockMask, made dense) and sdpa (dense)."""
    from torch.nn.attention.flex_attention import create_mask
    from transformers.masking_utils import create_causal_mask

    model = build_tiny_causal(tokenizer, model_type, hidden_size=32, num_layers=1, num_heads=4)
    packed = PackedCausalLMCollator(pad_to_multiple_of, tokenizer.pad_token_id)(features)
    length = packed["input_ids"].shape[1]
    masks = {}
    for attention in ("flex_attention", "sdpa"):
        model.set_attn_implementation(attention)
        mask = create_causal_mask(
            config=model.config,
            inputs_embeds=torch.zeros(1, length, 32),
            attention_mask=None,
            cache=None,
            position_ids=packed["position_ids"],
        )
        masks[attention] = create_mask(mask.mask_mod, 1, 1, length, length) if attention == "flex_attention" else mask
    return packed, masks


def test_flex_attention_s_block_mask_keeps_each_packed_example_to_itself(tokenizer_and_rows):
    """FlexAttention's BlockMask for a packed row (filled to a multiple of 128, its blocks) is the block-diagonal
    causal mask: each position sees its own example's earlier positions and nothing else; the same as sdpa's."""
    tokenizer, features = tokenizer_and_rows
    packed, masks = packed_and_padded_masks("qwen2", tokenizer, features, pad_to_multiple_of=128)
    length = packed["input_ids"].shape[1]
    assert length % 128 == 0 and length > sum(len(f["input_ids"]) for f in features)
    segment = (packed["position_ids"][0] == 0).cumsum(0)
    causal = torch.ones(length, length, dtype=torch.bool).tril()
    expected = causal & (segment[:, None] == segment[None, :])
    assert torch.equal(masks["flex_attention"][0, 0], expected)
    assert torch.equal(masks["sdpa"][0, 0], expected)


@pytest.mark.slow
def test_packing_with_flex_attention_gives_padding_s_loss(tokenizer_and_rows):
    """The model's loss on a packed row through FlexAttention (compiled by transformers; forward only: torch has no
    FlexAttention backward on the CPU, so training with it is refused here) equals the padded batch's."""
    tokenizer, features = tokenizer_and_rows
    model = build_tiny_causal(tokenizer, "qwen2", hidden_size=32, num_layers=2, num_heads=4, seed=1).eval()
    padded = make_collator(family_named("qwen2"), tokenizer, model)(features)
    tokens = torch.tensor(int(padded["labels"][:, 1:].ne(-100).sum()))
    with torch.no_grad():
        padded_loss = model(**padded, num_items_in_batch=tokens).loss
        model.set_attn_implementation("flex_attention")
        check_packing(model.config)
        packed = make_collator(family_named("qwen2"), tokenizer, model, packing=True, pad_to_multiple_of=128)(features)
        packed_loss = model(**packed, num_items_in_batch=tokens).loss
    assert packed_loss.item() == pytest.approx(padded_loss.item(), rel=1e-5)
