"""The speed levers (textsql.train.speed) on the CPU: each refused with its reason where it cannot run, the loss at the
label positions equal to the full one in value and gradient, LoRA's frozen base in bf16, fused AdamW, the compiled
decoder layers, and the FLOPs a step computes against torch's own count."""

import copy

import pytest
import torch

from textsql.arguments.speed import SpeedArguments, speed_refusals
from textsql.arguments.training import TextsqlTrainingArguments
from textsql.errors import TextsqlError
from textsql.families import family_named
from textsql.hub import load_tokenizer
from textsql.planner import causal as causal_planner
from textsql.prepared import load_prepared
from textsql.tiny import build_tiny_causal
from textsql.train.collate import CausalLMCollator, CountTokens, PackedCausalLMCollator
from textsql.train.speed import (
    LabelPositions,
    compile_layers,
    example_counts,
    frozen_to,
    install_label_position_loss,
    training_flops,
)

FACTS = dict(
    device="cpu",
    family=family_named("qwen2"),
    zero_stage=None,
    fsdp=False,
    precision="bf16",
    lora=True,
    quantized=False,
    liger_installed=False,
)


@pytest.mark.parametrize(
    ("settings", "facts", "reason"),
    [
        ({"attention": "flex_attention"}, {}, "no FlexAttention backward on the CPU"),
        ({"attention": "flex_attention"}, {"device": "cuda", "flex_attention_in_torch": False}, "torch 2.5"),
        ({"fused_loss": "liger"}, {}, "Triton kernels, GPUs only"),
        ({"fused_loss": "liger"}, {"device": "cuda"}, "pip install liger-kernel"),
        ({"compile": "layers"}, {"zero_stage": 3}, "cannot run under ZeRO-3 or FSDP"),
        ({"compile": "layers"}, {"fsdp": True}, "cannot run under ZeRO-3 or FSDP"),
        ({"lora_base_dtype": "bfloat16"}, {"precision": "fp32"}, "needs --precision bf16"),
        ({"lora_base_dtype": "bfloat16"}, {"quantized": True}, "quantized base"),
        ({"fused_loss": "chunked"}, {"family": family_named("t5")}, "for causal LMs"),
        ({"attention": "sdpa"}, {"family": family_named("t5")}, "for causal LMs"),
        ({"fused_loss": "chunked"}, {"stage": "grpo"}, "GRPOTrainer, which computes its loss"),
        ({"compile": "layers"}, {"stage": "grpo"}, "GRPOTrainer, which computes its loss"),
    ],
)
def test_each_lever_is_refused_with_its_reason_where_it_cannot_run(settings, facts, reason):
    assert any(reason in problem for problem in speed_refusals(SpeedArguments(**settings), **(FACTS | facts)))


def test_the_levers_that_run_here_are_not_refused():
    on_cpu = SpeedArguments(compile="layers", fused_loss="chunked", lora_base_dtype="bfloat16", attention="eager")
    assert speed_refusals(on_cpu, **FACTS) == []
    on_gpu = SpeedArguments(attention="flex_attention", fused_loss="liger", compile="layers")
    assert speed_refusals(on_gpu, **(FACTS | {"device": "cuda", "liger_installed": True, "zero_stage": 2})) == []


def test_the_flags_are_checked_when_the_arguments_are_built():
    with pytest.raises(TextsqlError, match="--fused_loss must be one of none, chunked, liger"):
        TextsqlTrainingArguments(fused_loss="fused")
    with pytest.raises(TextsqlError, match="both compile the model"):
        TextsqlTrainingArguments(compile="layers", torch_compile=True)
    with pytest.raises(TextsqlError, match="pass --lora True too"):
        TextsqlTrainingArguments(lora_base_dtype="bfloat16")
    with pytest.raises(TextsqlError, match="no FlexAttention backward on the CPU"):  # the device known: at finalize
        TextsqlTrainingArguments(attention="flex_attention", output_dir="unused").finalize(use_cpu=True)


@pytest.fixture(scope="module")
def tokenizer_and_features(causal_assets):
    data_dir, model_dir = causal_assets
    dataset, _ = load_prepared(data_dir)
    rows = dataset["train"].select(range(6))
    features = [{key: row[key] for key in ("input_ids", "attention_mask", "labels")} for row in rows]
    return load_tokenizer(str(model_dir)), features


def loss_and_gradients(model, batch, tokens):
    model.zero_grad()
    loss = model(**batch, num_items_in_batch=torch.tensor(tokens)).loss
    loss.backward()
    return loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize(("model_type", "packed", "chunk_logits"), [
    ("qwen2", False, None), ("qwen2", True, None), ("llama", False, 4 * 2000), ("gpt2", False, None),
])  # fmt: skip
def test_the_loss_at_the_label_positions_is_the_full_loss_in_value_and_gradient(
    model_type, packed, chunk_logits, tokenizer_and_features, monkeypatch
):
    """The output layer at the label positions only (chunks of 4 rows recomputed in the backward pass for llama), on
    padded and packed batches: the full loss and every gradient, to rounding."""
    tokenizer, features = tokenizer_and_features
    if chunk_logits:
        monkeypatch.setattr(causal_planner, "LOSS_CHUNK_LOGITS", chunk_logits)  # several chunks: checkpointed
    full = build_tiny_causal(tokenizer, model_type, hidden_size=32, num_layers=2, num_heads=4, seed=1).eval()
    for module in full.modules():  # gpt2 drops out 10%: the two forwards must compute the same thing
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    at_labels = copy.deepcopy(full)
    install_label_position_loss(at_labels, "chunked")
    at_labels.train()  # the label-position path runs in training
    collator = PackedCausalLMCollator() if packed else CausalLMCollator(tokenizer.pad_token_id)
    batch = LabelPositions(collator)(features)
    tokens = int(batch["labels"][:, 1:].ne(-100).sum())
    assert batch["label_targets"].numel() == tokens
    plain = {k: v for k, v in batch.items() if k not in ("label_positions", "label_targets")}
    full_loss, full_gradients = loss_and_gradients(full, plain, tokens)
    label_loss, label_gradients = loss_and_gradients(at_labels, batch, tokens)
    assert label_loss.item() == pytest.approx(full_loss.item(), rel=1e-6)
    assert label_gradients.keys() == full_gradients.keys()
    for name, gradient in full_gradients.items():
        torch.testing.assert_close(label_gradients[name], gradient, rtol=1e-4, atol=1e-6, msg=name)
    at_labels.eval()  # evaluation and generation: the model's own forward, logits and all
    assert at_labels(**plain).logits.shape[-1] == len(tokenizer)


def test_lora_s_frozen_base_in_bf16_trains_its_fp32_adapter_close_to_the_fp32_base(tokenizer_and_features):
    from textsql.adapters import apply_lora
    from textsql.arguments.lora import LoraArguments

    tokenizer, features = tokenizer_and_features
    batch = CausalLMCollator(tokenizer.pad_token_id)(features)
    losses = {}
    for dtype in (torch.float32, torch.bfloat16):
        model = apply_lora(build_tiny_causal(tokenizer, "qwen2", hidden_size=32, seed=1), LoraArguments(lora=True), [])
        cast = frozen_to(model, dtype)
        trainable = {p.dtype for p in model.parameters() if p.requires_grad}
        frozen = {p.dtype for p in model.parameters() if not p.requires_grad}
        assert trainable == {torch.float32} and frozen == {dtype}
        assert (cast > 0) == (dtype == torch.bfloat16)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(**batch).loss
        loss.backward()
        assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in model.parameters() if p.requires_grad)
        losses[dtype] = loss.item()
    assert losses[torch.bfloat16] == pytest.approx(losses[torch.float32], rel=2e-2)


def test_fused_adamw_runs_on_the_cpu_and_updates_as_adamw():
    torch.manual_seed(0)
    weights = [torch.randn(64, 32, requires_grad=True) for _ in range(3)]
    copies = [w.detach().clone().requires_grad_() for w in weights]
    for group, fused in ((weights, True), (copies, False)):
        optimizer = torch.optim.AdamW(group, lr=1e-2, fused=fused, foreach=None if fused else True)
        for step in range(3):
            for w in group:
                w.grad = torch.full_like(w, 0.1 * (step + 1)) + w.detach() * 0.01
            optimizer.step()
    for fused, plain in zip(weights, copies):
        torch.testing.assert_close(fused, plain)


@pytest.mark.slow
def test_compiled_decoder_layers_give_the_same_loss_and_still_generate(tokenizer_and_features):
    tokenizer, features = tokenizer_and_features
    model = build_tiny_causal(tokenizer, "qwen2", hidden_size=32, num_layers=2, num_heads=4, seed=1).eval()
    batch = CausalLMCollator(tokenizer.pad_token_id)(features)
    with torch.no_grad():
        eager = model(**batch).loss
    assert compile_layers(model) == 2
    compiled = model(**batch).loss
    compiled.backward()
    assert compiled.item() == pytest.approx(eager.item(), rel=1e-5)
    assert model.model.embed_tokens.weight.grad is not None
    prompt = torch.tensor([features[0]["input_ids"][:10]])
    with torch.no_grad():
        generated = model.generate(prompt, max_new_tokens=4, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    assert generated.shape == (1, 14)


def counted_flops(model, batch) -> int:
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter:
        model(**batch).loss.backward()
    return counter.get_total_flops()


def test_a_causal_lm_s_training_flops_are_what_torch_counts(tokenizer_and_features):
    """One unpadded example through the tiny Qwen2: every matmul and attention product, forward and backward, as
    torch's FlopCounterMode counts them (eager attention: it has no count for the CPU's sdpa backward); also the
    examples' counts as the trainer's collator sums them."""
    tokenizer, features = tokenizer_and_features
    model = build_tiny_causal(tokenizer, "qwen2", hidden_size=64, num_layers=2, num_heads=4, seed=1)
    model.set_attn_implementation("eager")
    batch = CausalLMCollator(tokenizer.pad_token_id)(features[:1])
    length = len(features[0]["input_ids"])
    predicted = training_flops(model.config, example_counts(length, 0))
    assert predicted == pytest.approx(counted_flops(model, batch), rel=0.02)
    counts = CountTokens(CausalLMCollator(tokenizer.pad_token_id))(features)["textsql_token_counts"]
    lengths = [len(f["input_ids"]) for f in features]
    assert counts[0] == sum(lengths) and counts[2] == sum(n * n for n in lengths)
    assert counts[1] == sum(sum(1 for label in f["labels"] if label != -100) for f in features)


def test_t5_s_training_flops_are_what_torch_counts(assets):
    from transformers import DataCollatorForSeq2Seq

    from textsql.hub import load_model

    data_dir, model_dir = assets
    tokenizer, model = load_tokenizer(str(model_dir)), load_model(str(model_dir))
    dataset, _ = load_prepared(data_dir)
    row = dataset["train"][0]
    feature = {key: row[key] for key in ("input_ids", "attention_mask", "labels")}
    batch = DataCollatorForSeq2Seq(tokenizer, model=model, label_pad_token_id=-100)([feature])
    predicted = training_flops(model.config, example_counts(len(row["input_ids"]), len(row["labels"])))
    assert predicted == pytest.approx(counted_flops(model, batch), rel=0.03)
