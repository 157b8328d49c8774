"""QLoRA on the CPU with bitsandbytes' CPU backend: every family it quantizes loaded in NF4 and int8 with its layers
checked and two optimizer steps of an adapter; `textsql train --quantize_base` without and with each DeepSpeed
strategy (trained or refused with the reason); falcon and full fine-tuning refused; resume; merge scored again."""

import json

import pytest
from conftest import tiny_train_argv
from test_causal_train import SHORT, summary_of, train_interrupt_and_resume

from textsql.errors import TextsqlError

pytestmark = pytest.mark.slow

TWO_STEPS = dict(SHORT, max_steps=2, per_device_train_batch_size=8, logging_steps=1)


def quantizable_families():
    from textsql.families import FAMILIES
    from textsql.tiny import CAUSAL_CONFIG_NAMES

    return [f.name for f in FAMILIES if not f.quantize_refusal and (f.name in CAUSAL_CONFIG_NAMES or f.name == "t5")]


@pytest.mark.parametrize("quantize_base", ["nf4", "int8"])
@pytest.mark.parametrize("model_type", quantizable_families())
def test_every_quantizable_family_loads_quantized_and_trains_an_fp32_adapter(
    model_type, quantize_base, causal_family_models
):
    """Every linear layer but the output (and T5's wo, which T5 keeps in fp32) swapped for bitsandbytes' (the layer
    check passes), LoRA on all of them in fp32, two optimizer steps move the adapter and leave the base as it was."""
    import torch

    from textsql.adapters import QUANTIZED_LAYER_TYPES, apply_lora
    from textsql.arguments.lora import LoraArguments
    from textsql.loading import load_quantized_base

    model = load_quantized_base(str(causal_family_models / model_type), quantize_base, "float32")
    layers = [n for n, m in model.named_modules() if type(m).__name__ == QUANTIZED_LAYER_TYPES[quantize_base]]
    assert len(layers) >= 4 and type(model.get_output_embeddings()).__name__ == "Linear"
    assert any(p.dtype in (torch.uint8, torch.int8) for p in model.parameters()), "no quantized weights"
    peft_model = apply_lora(model, LoraArguments(lora=True, lora_targets="all", quantize_base=quantize_base), [])
    trainable = {n: p for n, p in peft_model.named_parameters() if p.requires_grad}
    assert trainable and {p.dtype for p in trainable.values()} == {torch.float32}
    before = {n: p.detach().clone() for n, p in trainable.items()}
    optimizer = torch.optim.AdamW(trainable.values(), lr=1e-2)
    ids = torch.randint(0, model.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), peft_model.disable_adapter():  # the base alone (bitsandbytes' CPU backend repacks NF4
        base_before = peft_model(
            input_ids=ids, labels=ids
        ).logits  # weights on their first use: compare outputs, not bytes)
    for _ in range(2):
        loss = peft_model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    assert torch.isfinite(loss)
    assert any(not torch.equal(p, before[n]) for n, p in trainable.items())
    with torch.no_grad(), peft_model.disable_adapter():
        assert torch.equal(
            peft_model(input_ids=ids, labels=ids).logits, base_before
        )  # the quantized base did not train


def test_falcon_is_refused_and_the_layer_check_catches_what_transformers_leaves(causal_family_models):
    """Falcon's FalconLinear layers are left in full precision by transformers without a word: textsql refuses the
    family before loading (families.py), and its check after loading names the layers whatever the registry says."""
    import torch

    from textsql.hub import load_model
    from textsql.loading import bnb_config, check_quantized_layers, load_quantized_base

    with pytest.raises(TextsqlError, match="FalconLinear"):
        load_quantized_base(str(causal_family_models / "falcon"), "nf4", "float32")
    model = load_model(str(causal_family_models / "falcon"), quantization_config=bnb_config("nf4", "float32"))
    assert {type(m).__name__ for m in model.modules()} >= {"FalconLinear"}
    with pytest.raises(TextsqlError, match=r"left \d+ linear layers .*FalconLinear") as refused:
        check_quantized_layers(model, "nf4")
    assert "query_key_value" in str(refused.value)
    plain = load_model(str(causal_family_models / "qwen2"), dtype=torch.float32)
    with pytest.raises(TextsqlError, match="unquantized"):
        check_quantized_layers(plain, "int8")


def test_compute_dtype_is_bf16_on_ampere_and_fp32_before_and_on_the_cpu():
    from textsql.strategy.devices import A100_40GB, H100_SXM, T4, V100, quantized_compute_dtype

    assert quantized_compute_dtype((A100_40GB,)) == quantized_compute_dtype((H100_SXM, A100_40GB)) == "bfloat16"
    assert quantized_compute_dtype((V100,)) == quantized_compute_dtype((T4,)) == "float32"
    assert quantized_compute_dtype((A100_40GB, V100)) == "float32" and quantized_compute_dtype(()) == "float32"


def test_nf4_config_stores_in_the_compute_dtype_only_where_zero3_or_fsdp_shards():
    import torch

    from textsql.loading import bnb_config

    plain, sharded = bnb_config("nf4", "bfloat16"), bnb_config("nf4", "bfloat16", sharded=True)
    assert plain.bnb_4bit_quant_type == "nf4" and plain.bnb_4bit_use_double_quant
    assert plain.bnb_4bit_compute_dtype == torch.bfloat16 and plain.bnb_4bit_quant_storage == torch.uint8
    assert sharded.bnb_4bit_quant_storage == torch.bfloat16
    assert bnb_config("int8", "bfloat16").load_in_8bit


# ZeRO-2 on every family: test_every_quantizable_causal_family_trains_qlora_under_zero2 below.
STRATEGIES = [("nf4", None), ("int8", None), ("nf4", "zero1"), ("nf4", "zero3")]
STRATEGIES += [("int8", "zero3_offload")]  # ZeRO-2 offload and int8 + ZeRO-3 trained too when tried (docs/lora.md)


@pytest.mark.parametrize("quantize_base, deepspeed", STRATEGIES)
def test_qlora_trains_through_textsql_train(quantize_base, deepspeed, causal_assets, tmp_path, textsql_in_process):
    """Without DeepSpeed and under every ZeRO stage, offload included (ZeRO-Infinity's NVMe trained the same way when
    tried: docs/lora.md); FSDP is refused on the CPU before any model loads (textsql.strategy.fsdpconfig)."""
    extra = ["--lora", "True", "--quantize_base", quantize_base] + (["--deepspeed", deepspeed] if deepspeed else [])
    status, out, err = textsql_in_process(["train", *tiny_train_argv(causal_assets, tmp_path, *extra, **TWO_STEPS)])
    assert status == 0, err[-3000:]
    summary = summary_of(out)
    assert summary["run"].startswith(f"tiny-qwen2-{deepspeed or 'none'}-qlora-{quantize_base}-r8-")
    assert summary["strategy"]["lora"]["quantize_base"] == quantize_base and summary["global_step"] == 2
    assert f"on an {quantize_base} base (QLoRA)" in out
    record = json.loads(open(f"{summary['output_dir']}/textsql_adapter.json").read())
    assert record["lora"]["quantize_base"] == quantize_base


def test_full_fine_tuning_of_a_quantized_base_is_refused_from_every_entry_point(
    causal_assets, tmp_path, textsql_in_process
):
    """The command line, a recipe and tune's arguments after -- all meet LoraArguments' check."""
    argv = tiny_train_argv(causal_assets, tmp_path, "--quantize_base", "nf4", **TWO_STEPS)
    status, _, err = textsql_in_process(["train", *argv])
    assert status == 2 and "needs --lora True" in err
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(f"model_id: {causal_assets[1]}\ndataset_dir: {causal_assets[0]}\nquantize_base: int8\n")
    status, _, err = textsql_in_process(["train", str(recipe)])
    assert status == 2 and "needs --lora True" in err
    status, _, err = textsql_in_process(
        ["tune", "--model_id", str(causal_assets[1]), "--dataset_dir", str(causal_assets[0]), "--", "--quantize_base",
         "nf4"]
    )  # fmt: skip
    assert status == 2 and "needs --lora True" in err
    assert not list(tmp_path.glob("*qlora*"))


@pytest.fixture(scope="module")
def qlora_run(causal_assets, tmp_path_factory):
    """A four-step NF4 QLoRA run of the tiny Qwen2 saving at steps 2 and 4, trained in this process."""
    return tmp_path_factory.mktemp("qlora-run")


def test_an_interrupted_qlora_run_resumes_and_its_merges_are_scored_again(causal_assets, qlora_run, textsql_in_process):
    """Resume: the run whose last checkpoint and summary are gone ends as the whole one did. Merge: into the full
    base and onto the NF4-rounded base, each scored against the adapter on its NF4 base, the difference printed and
    recorded; the rounded merge's weights are the dequantized base plus the adapter's update."""

    import torch

    argv = tiny_train_argv(
        causal_assets, qlora_run, "--lora", "True", "--quantize_base", "nf4", "--lora_targets", "all",
        **dict(TWO_STEPS, max_steps=4, save_strategy="steps", save_steps=2, save_total_limit=3),
    )  # fmt: skip
    run = train_interrupt_and_resume(argv, qlora_run, textsql_in_process)
    assert run.name.startswith("tiny-qwen2-none-qlora-nf4-r8-")

    results = {}
    for onto in ("full", "rounded"):
        status, out, err = textsql_in_process(
            ["merge", str(run), "--merge_onto", onto, "--output_dir", str(qlora_run / f"merged-{onto}"),
             "--score_examples", "8", "--max_new_tokens", "16", "--device", "cpu"]
        )  # fmt: skip
        assert status == 0, err[-3000:]
        assert "scored again on 8 validation questions" in out and "the same SQL for" in out
        results[onto] = json.loads((qlora_run / f"merged-{onto}" / "textsql_merge.json").read_text())
        assert results[onto]["merge_onto"] == onto and results[onto]["examples"] == 8
        assert 0.0 <= results[onto]["agreement"] <= 1.0
        assert -1.0 <= results[onto]["execution_accuracy_delta"] <= 1.0
    accuracy = {onto: result["adapter_on_quantized_base"]["execution_accuracy"] for onto, result in results.items()}
    assert accuracy["full"] == accuracy["rounded"]  # the same adapter on the same NF4 base, greedy: the same answers

    from dataclasses import replace

    from textsql.hub import load_model
    from textsql.loading import load_folder, load_quantized_base, read_folder

    rounded = load_model(str(qlora_run / "merged-rounded"), dtype=torch.float32)
    full = load_model(str(qlora_run / "merged-full"), dtype=torch.float32)
    adapter, _ = load_folder(replace(read_folder(str(run)), quantize_base="none"))  # on the full-precision base
    quantized = load_quantized_base(str(causal_assets[1]), "nf4", "float32")
    name = "model.layers.0.self_attn.q_proj"
    from transformers.integrations.bitsandbytes import dequantize_bnb_weight

    dequantized = dequantize_bnb_weight(quantized.get_submodule(name).weight, None).float()
    layer = adapter.base_model.model.get_submodule(name)
    delta = layer.get_delta_weight("default")
    assert torch.allclose(rounded.get_submodule(name).weight, dequantized + delta, atol=1e-5)
    assert torch.allclose(full.get_submodule(name).weight, layer.base_layer.weight + delta, atol=1e-5)
    assert not torch.allclose(rounded.get_submodule(name).weight, full.get_submodule(name).weight)
    status, _, err = textsql_in_process(["merge", str(run), "--merge_onto", "sideways"])
    assert status == 2 and "--merge_onto must be one of full, rounded" in err
    # infer, the compare app and quantize load the adapter on its base as it trained: NF4, not the full-precision one
    from textsql.loading import load_for_inference

    served, _ = load_for_inference(str(run), "cpu")
    assert type(served.base_model.model.get_submodule(name).base_layer).__name__ == "Linear4bit"


@pytest.mark.parametrize("quantize_base", ["nf4", "int8"])
@pytest.mark.parametrize("model_type", [name for name in quantizable_families() if name != "t5"])
def test_every_quantizable_causal_family_trains_qlora_under_zero2(
    model_type, quantize_base, causal_family_models, causal_assets, tmp_path, textsql_in_process
):
    """`textsql train --quantize_base ... --deepspeed zero2` on every causal family bitsandbytes quantizes (the family
    models share the tiny Qwen2's tokenizer, so its prepared data serves them all)."""
    assets = (causal_assets[0], causal_family_models / model_type)
    extra = ["--lora", "True", "--quantize_base", quantize_base, "--deepspeed", "zero2"]
    status, out, err = textsql_in_process(["train", *tiny_train_argv(assets, tmp_path, *extra, **TWO_STEPS)])
    assert status == 0, err[-3000:]
    summary = summary_of(out)
    assert summary["strategy"]["lora"]["quantize_base"] == quantize_base and summary["global_step"] == 2
    assert summary["strategy"]["zero_stage"] == 2 and f"on an {quantize_base} base (QLoRA)" in out
