"""`textsql quantize`: each method quantizes the tiny T5, saves safetensors, reloads, scores like `textsql infer`."""

import json

import pytest

from textsql.arguments.quantize import METHODS, QuantizeArguments
from textsql.errors import TextsqlError
from textsql.loading import check_method_device, load_for_inference
from textsql.quantize import quantize_model

SMALL = {"max_examples": 8, "max_new_tokens": 16, "batch_size": 8, "device": "cpu"}


def quantized_layer(model) -> object:
    return model.encoder.block[0].layer[0].SelfAttention.q


@pytest.mark.parametrize("method", ["torchao-int8", "dynamic-int8", "bnb-int8", "bnb-nf4"])
def test_quantize_saves_safetensors_reloads_and_scores_like_infer(method, assets, tmp_path):
    from textsql.arguments.infer import InferArguments
    from textsql.infer import run_inference

    data_dir, model_dir = assets
    output = tmp_path / method
    lines = []
    result = quantize_model(
        QuantizeArguments(
            model_dir=str(model_dir), method=method, output_dir=str(output), dataset_dir=str(data_dir), **SMALL
        ),
        echo=lines.append,
    )
    # Saved as safetensors only: no pickle to load from a shared folder.
    assert (output / "model.safetensors").is_file() and not list(output.glob("*.bin")) and not list(output.glob("*.pt"))
    record = json.loads((output / "textsql_quantization.json").read_text())
    assert record["method"] == method and record["scored"]["examples"] == 8
    assert result["quantized"]["weights_bytes"] == sum(p.stat().st_size for p in output.glob("*.safetensors"))
    # The printed comparison: size, questions/s and the execution-accuracy delta against the unquantized model.
    assert "questions/s" in lines[0] and "execution accuracy" in lines[0] and "same SQL for" in lines[0]
    assert result["execution_accuracy_delta"] == pytest.approx(
        result["quantized"]["execution_accuracy"] - result["unquantized"]["execution_accuracy"]
    )
    if method != "dynamic-int8":  # dynamic-int8 keeps the fp32 weights on disk and quantizes them when loaded
        assert result["quantized"]["weights_bytes"] < result["unquantized"]["weights_bytes"]
    assert result["quantized"]["memory_bytes"] < result["unquantized"]["memory_bytes"]

    # The reloaded folder holds quantized layers, and `textsql infer` scores it to the same figures.
    model, _ = load_for_inference(str(output), "cpu")
    layer = quantized_layer(model)
    expected = {
        "torchao-int8": "Int8Tensor",
        "dynamic-int8": "quantized.dynamic",
        "bnb-int8": "Linear8bitLt",
        "bnb-nf4": "Linear4bit",
    }[method]
    weight = layer.weight() if callable(layer.weight) else layer.weight  # torch's quantized Linear packs its weight
    assert expected in f"{type(layer).__module__}.{type(layer).__name__} {type(weight).__name__}"
    metrics = run_inference(
        InferArguments(
            model_dir=str(output),
            dataset_dir=str(data_dir),
            max_examples=8,
            max_new_tokens=16,
            device="cpu",
            output_dir=str(tmp_path / "infer"),
            show_examples=0,
        ),
        echo=lambda *_: None,
    )
    assert metrics["execution_accuracy"] == result["quantized"]["execution_accuracy"]
    predictions = [
        json.loads(line)["predicted_sql"]
        for line in (tmp_path / "infer" / "predictions.jsonl").read_text().splitlines()
    ]
    assert len(predictions) == 8


def test_nf4_computes_in_fp32_on_the_cpu_never_fp16(assets, tmp_path):
    import torch

    from textsql.quantize import compute_dtype, quantization_config

    assert compute_dtype(torch.device("cpu")) == "float32"
    assert quantization_config("bnb-nf4", torch.device("cpu")).bnb_4bit_compute_dtype == torch.float32


@pytest.mark.gpu
@pytest.mark.skipif(
    "not __import__('torch').cuda.is_available()",
    reason="needs a CUDA GPU (the CPU path: test_quantize_saves_safetensors_reloads_and_scores_like_infer)",
)
@pytest.mark.parametrize("method", ["torchao-int8", "bnb-int8", "bnb-nf4"])
def test_quantize_on_a_gpu_computes_in_bf16_on_ampere(method, assets, tmp_path):
    import torch

    from textsql.quantize import compute_dtype, quantization_config
    from textsql.strategy.devices import NodeDevices

    data_dir, model_dir = assets
    native = NodeDevices.local().gpus[0].native_bf16
    assert compute_dtype(torch.device("cuda")) == ("bfloat16" if native else "float32")
    if method == "bnb-nf4":
        assert quantization_config(method, torch.device("cuda")).bnb_4bit_compute_dtype == (
            torch.bfloat16 if native else torch.float32
        )
    result = quantize_model(
        QuantizeArguments(
            model_dir=str(model_dir),
            method=method,
            output_dir=str(tmp_path / method),
            dataset_dir=str(data_dir),
            **{**SMALL, "device": "cuda"},
        ),
        echo=lambda *_: None,
    )
    assert result["device"] == "cuda" and result["quantized"]["weights_bytes"] < result["unquantized"]["weights_bytes"]
    model, _ = load_for_inference(str(tmp_path / method), "cuda")
    assert next(model.parameters()).device.type == "cuda"


def test_refusals_name_the_fix(assets, lora_adapter, tmp_path):
    import torch

    data_dir, model_dir = assets
    with pytest.raises(TextsqlError, match="--method must be one of"):
        QuantizeArguments(model_dir=str(model_dir), method="awq")
    with pytest.raises(TextsqlError, match="textsql merge"):
        quantize_model(QuantizeArguments(model_dir=str(lora_adapter), dataset_dir=str(data_dir), **SMALL))
    with pytest.raises(TextsqlError, match="CPU only.*--device cpu"):
        check_method_device("dynamic-int8", torch.device("cuda"))
    assert set(METHODS) == {"torchao-int8", "bnb-int8", "bnb-nf4", "dynamic-int8", "gptq"}


def test_the_quantization_record_is_written_and_read_in_one_module(tmp_path):
    from textsql.loading import RECORD_VERSION, folder_kind, read_record, write_record

    write_record(tmp_path, {"method": "dynamic-int8", "source_model": "m"})
    assert folder_kind(tmp_path) == "quantized"
    assert read_record(tmp_path) == {"version": RECORD_VERSION, "method": "dynamic-int8", "source_model": "m"}
    # The score added later: the record rewritten whole, its version still first.
    write_record(tmp_path, {**read_record(tmp_path), "scored": {"examples": 1}})
    assert list(read_record(tmp_path)) == ["version", "method", "source_model", "scored"]
    write_record(tmp_path, {"method": "awq"})
    with pytest.raises(TextsqlError, match="does not know"):
        read_record(tmp_path)


def test_a_lora_adapter_loads_on_its_base_for_inference(assets, lora_adapter):
    """The adapter folder loads with its base (peft), and its outputs are the adapted model's, not the base's."""
    import torch
    from peft import PeftModel

    from textsql.evaluate import generate_sql

    _, model_dir = assets
    adapted, tokenizer = load_for_inference(str(lora_adapter), "cpu")
    base, _ = load_for_inference(str(model_dir), "cpu")
    assert isinstance(adapted, PeftModel)
    sources = ["translate English to SQL: How many wins when the team is red?"]
    with torch.no_grad():
        encoded = tokenizer(sources, return_tensors="pt")
        assert not torch.allclose(
            adapted(**encoded, decoder_input_ids=encoded.input_ids[:, :3]).logits,
            base(**encoded, decoder_input_ids=encoded.input_ids[:, :3]).logits,
        )
    assert generate_sql(adapted, tokenizer, sources, max_new_tokens=8, progress=False)[0][0] is not None


@pytest.mark.parametrize("model_type", ["falcon", "qwen2"])
def test_layers_a_quantizer_leaves_in_full_precision_are_named_and_recorded(model_type, causal_assets, tmp_path):
    """torch's dynamic int8 replaces layers of exactly nn.Linear: falcon's FalconLinear layers stay fp32, silently
    unless textsql names them; a Qwen2's are all quantized."""
    import torch

    from textsql.hub import load_tokenizer
    from textsql.quantize import layers_left_unquantized, quantize_and_save
    from textsql.tiny import build_tiny_causal

    data_dir, qwen2_dir = causal_assets
    tokenizer = load_tokenizer(str(qwen2_dir))
    folder = tmp_path / model_type
    tokenizer.save_pretrained(folder)
    build_tiny_causal(tokenizer, model_type, hidden_size=32, num_layers=1).save_pretrained(folder)
    args = QuantizeArguments(model_dir=str(folder), method="dynamic-int8", dataset_dir=str(data_dir), **SMALL)
    output = quantize_and_save(args, torch.device("cpu"))
    left = json.loads((output / "textsql_quantization.json").read_text())["layers_left_unquantized"]
    model, _ = load_for_inference(str(output), "cpu")
    assert layers_left_unquantized(model) == left
    if model_type == "falcon":
        assert "transformer.h.0.self_attention.query_key_value" in left and len(left) == 4
        assert type(model.transformer.h[0].self_attention.query_key_value).__name__ == "FalconLinear"
    else:
        assert left == [] and "quantized" in type(model.model.layers[0].self_attn.q_proj).__module__


def test_gptq_group_size_is_chosen_from_the_layer_widths_or_refused():
    """128 where it divides every quantized layer's input width, else 64, else 32; a requested size must divide them
    all (each group holds whole rows of a weight's input)."""
    from textsql.gptq.calibrate import choose_group_size

    assert choose_group_size([4096, 11008]) == 128  # a 7B llama: hidden 4096, MLP 11008 = 86 x 128
    assert choose_group_size([896, 4864]) == 128  # Qwen2.5-0.5B
    assert choose_group_size([64, 256]) == 64  # the tiny test model
    assert choose_group_size([96, 384]) == 32
    assert choose_group_size([64, 256], requested=32) == 32
    with pytest.raises(TextsqlError, match=r"--group_size 48 does not divide.*64, 256.*\(64, 32 would do\)"):
        choose_group_size([64, 256], requested=48)
    with pytest.raises(TextsqlError, match="None of the group sizes 128, 64, 32 divides.*48"):
        choose_group_size([48, 192])
    with pytest.raises(TextsqlError, match="no Linear layer"):
        choose_group_size([])


def test_gptq_refuses_t5_from_the_family_registry():
    from textsql.families import FAMILIES, family_named
    from textsql.gptq.calibrate import refuse_unless_causal

    with pytest.raises(TextsqlError, match="causal LMs, and this is a t5 .seq2seq. model.*encoder-decoder.*bnb-nf4"):
        refuse_unless_causal(family_named("t5"))
    for family in FAMILIES:
        if family.causal:
            refuse_unless_causal(family)


def test_gptq_arguments_default_refuse_and_name_the_folder():
    args = QuantizeArguments(model_dir="m", method="gptq")
    assert (args.bits, args.group_size, args.calibration_samples, args.label) == (4, 0, 128, "gptq-4bit")
    assert QuantizeArguments(model_dir="m", method="gptq", bits=8).label == "gptq-8bit"
    assert QuantizeArguments(model_dir="m").label == "torchao-int8"
    with pytest.raises(TextsqlError, match="--bits must be 4 or 8"):
        QuantizeArguments(model_dir="m", method="gptq", bits=3)
    with pytest.raises(TextsqlError, match="--bits, --gptq_wheels only apply to --method gptq"):
        QuantizeArguments(model_dir="m", method="bnb-nf4", bits=4, gptq_wheels="w")
    with pytest.raises(TextsqlError, match="--calibration_samples must be at least 1"):
        QuantizeArguments(model_dir="m", method="gptq", calibration_samples=0)


def test_gptq_environment_is_named_by_its_pins_and_the_job_imports_nothing_of_textsql():
    """The environment's folder changes with any pin, the torch build or the Python; the job script run in it
    imports only the standard library and that environment's packages (it cannot import textsql there)."""
    import ast

    from textsql.gptq import environment

    text = environment.REQUIREMENTS_FILE.read_text()
    pins = environment.pinned_requirements(text)
    assert pins["llmcompressor"] and pins["transformers"] and "torch" not in pins  # torch: textsql's own build
    name = environment.environment_name("2.13.0+cpu", text, (3, 11))
    assert name.startswith(
        f"llmcompressor-{pins['llmcompressor']}_transformers-{pins['transformers']}_torch-2.13.0+cpu"
    )
    assert environment.environment_name("2.13.0", text, (3, 11)) != name
    assert environment.environment_name("2.13.0+cpu", text, (3, 12)) != name
    assert environment.environment_name("2.13.0+cpu", text + "loguru==0.7.3\n", (3, 11)) != name
    tree = ast.parse(environment.JOB_SCRIPT.read_text())
    imported = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    imported |= {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert not any(name.startswith("textsql") for name in imported) and "llmcompressor" in imported
