"""`textsql quantize --method gptq`: llmcompressor run in textsql's GPTQ environment on a tiny causal LM, calibrated on
the prepared dataset, the result reloaded in textsql's own stack (compressed-tensors) and scored like every method;
T5 and a group size that does not divide the layers refused before anything is created."""

import json

import pytest

from textsql.arguments.quantize import QuantizeArguments
from textsql.errors import TextsqlError
from textsql.loading import load_for_inference
from textsql.quantize import quantize_model

SMALL = {"max_examples": 8, "max_new_tokens": 16, "batch_size": 8, "device": "cpu", "calibration_samples": 16}


@pytest.fixture(scope="session")
def gptq_environment():
    """textsql's GPTQ environment, created once in the user's cache (keyed by its pins, so later sessions and CI runs on
    the same machine reuse it; a new machine creates it once: minutes)."""
    from textsql.gptq.environment import ensure_environment

    return ensure_environment()


@pytest.mark.slow
def test_gptq_4bit_quantizes_reloads_in_textsqls_stack_and_scores_like_infer(gptq_environment, causal_assets, tmp_path):
    data_dir, model_dir = causal_assets
    output = tmp_path / "gptq"
    lines = []
    result = quantize_model(
        QuantizeArguments(
            model_dir=str(model_dir), method="gptq", output_dir=str(output), dataset_dir=str(data_dir), **SMALL
        ),
        echo=lines.append,
    )
    # What it said before it ran: the group chosen from the layer widths (hidden 64, MLP 256) and the calibration.
    assert any(
        "GPTQ 4-bit, groups of 64" in line and "64, 256" in line and "16 training examples" in line for line in lines
    )
    # safetensors and JSON only, compressed-tensors' format; the job's record folded into textsql's.
    assert all(path.suffix in (".json", ".safetensors") for path in output.iterdir())  # the tokenizer's files are JSON
    assert (
        not list(output.glob("*.bin")) and not list(output.glob("*.yaml")) and not (output / "gptq_job.json").exists()
    )
    config = json.loads((output / "config.json").read_text())["quantization_config"]
    assert config["quant_method"] == "compressed-tensors" and config["ignore"] == ["lm_head"]
    weights = config["config_groups"]["group_0"]["weights"]
    assert (weights["num_bits"], weights["group_size"], weights["strategy"]) == (4, 64, "group")
    record = json.loads((output / "textsql_quantization.json").read_text())
    assert record["method"] == "gptq" and record["bits"] == 4 and record["group_size"] == 64
    assert record["gptq"]["calibration_sequences"] == 16 and record["gptq"]["layers"] == 14
    assert record["gptq"]["versions"]["torch"] == __import__("torch").__version__  # textsql's own torch build
    assert record["scored"]["examples"] == 8 and result["label"] == "gptq-4bit"
    # The comparison printed as for every method: size, questions/s, the execution-accuracy delta, agreement.
    assert "gptq-4bit" in lines[-1] and "questions/s" in lines[-1] and "same SQL for" in lines[-1]
    assert result["quantized"]["weights_bytes"] < result["unquantized"]["weights_bytes"]
    assert result["execution_accuracy_delta"] == pytest.approx(
        result["quantized"]["execution_accuracy"] - result["unquantized"]["execution_accuracy"]
    )

    # Reloaded in textsql's stack: packed 4-bit weights (int32 words of eight) until the first forward.
    model, _ = load_for_inference(str(output), "cpu")
    q_proj = model.model.layers[0].self_attn.q_proj
    assert q_proj.quantization_scheme.weights.num_bits == 4 and q_proj.weight_packed.shape == (64, 64 // 8)
    assert not hasattr(model.lm_head, "quantization_scheme")


@pytest.mark.slow
def test_gptq_8bit_from_the_command_line(gptq_environment, causal_assets, tmp_path, textsql_in_process):
    data_dir, model_dir = causal_assets
    output = tmp_path / "gptq8"
    # The same scoring flags for both commands: infer then scores the folder to the figure quantize recorded.
    flags = ["--dataset_dir", str(data_dir), "--max_examples", "4", "--max_new_tokens", "8", "--device", "cpu"]
    gptq = "--method gptq --bits 8 --group_size 32 --calibration_samples 8".split()
    status, out, err = textsql_in_process(["quantize", str(model_dir), *gptq, *flags, "--output_dir", str(output)])
    assert status == 0, err[-3000:]
    assert "GPTQ 8-bit, groups of 32 (as asked)" in out and "gptq-8bit" in out and "execution accuracy" in out
    weights = json.loads((output / "config.json").read_text())["quantization_config"]["config_groups"]["group_0"]
    assert (weights["weights"]["num_bits"], weights["weights"]["group_size"]) == (8, 32)
    model, _ = load_for_inference(str(output), "cpu")
    assert model.model.layers[1].mlp.down_proj.quantization_scheme.weights.num_bits == 8
    status, out, err = textsql_in_process(["infer", "--model_dir", str(output), *flags, "--output_dir", str(tmp_path)])
    assert status == 0, err[-3000:]
    recorded = json.loads((output / "textsql_quantization.json").read_text())["scored"]["quantized"]
    assert (
        json.loads((tmp_path / "eval_metrics.json").read_text())["execution_accuracy"] == recorded["execution_accuracy"]
    )


def test_gptq_refuses_t5_and_a_group_size_that_does_not_divide_before_creating_anything(
    assets, causal_assets, tmp_path
):
    """Both refusals come before the GPTQ environment is looked at (an empty --gptq_env_dir stays empty)."""
    env_dir = tmp_path / "env"
    t5_data, t5_model = assets
    with pytest.raises(TextsqlError, match="--method gptq quantizes causal LMs, and this is a t5"):
        quantize_model(
            QuantizeArguments(
                model_dir=str(t5_model), method="gptq", dataset_dir=str(t5_data), gptq_env_dir=str(env_dir), **SMALL
            )
        )
    data_dir, model_dir = causal_assets
    with pytest.raises(TextsqlError, match=r"--group_size 48 does not divide every layer's input width \(64, 256\)"):
        quantize_model(
            QuantizeArguments(
                model_dir=str(model_dir),
                method="gptq",
                dataset_dir=str(data_dir),
                group_size=48,
                gptq_env_dir=str(env_dir),
                output_dir=str(tmp_path / "out"),
                **SMALL,
            )
        )
    assert not env_dir.exists() and not (tmp_path / "out").exists()
