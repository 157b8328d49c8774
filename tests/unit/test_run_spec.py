"""The run spec (textsql/arguments/): one Setup for one run, whether `textsql plan`, tune or the run's own memory check
builds it, and `textsql plan` taking textsql train's flags for what the planner models."""

import json
from dataclasses import asdict, replace

import pytest

from textsql.arguments.plan import PlanArguments
from textsql.arguments.training import arguments_dict, parse_arguments
from textsql.arguments.tune import TuneArguments
from textsql.cli.plan import plan_cli
from textsql.errors import TextsqlError
from textsql.planner.check import run_setup
from textsql.planner.phases import predict_strategy
from textsql.planner.recommend import plan_setup
from textsql.planner.shape import resolve_model
from textsql.planner.states import zero_settings
from textsql.run_summary import RunSummary
from textsql.tune.space import candidate_setup

CAUSAL = "Qwen/Qwen2.5-0.5B"  # the planner's built-in table: nothing downloaded
SOURCE, TARGET = 40, 24


def test_plan_tune_and_the_runs_memory_check_build_one_setup_for_one_run(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    lengths = {"source_percentiles": {"p100": SOURCE}, "target_percentiles": {"p100": TARGET}}
    (data / "textsql_data.json").write_text(json.dumps({"lengths": {"train": lengths}}))
    flags = ["--lora", "True", "--lora_rank", "16", "--lora_targets", "all", "--fused_loss", "chunked"]
    flags += ["--lora_base_dtype", "bfloat16", "--activation_checkpointing", "True", "--precision", "bf16"]
    flags += ["--per_device_eval_batch_size", "8", "--execution_accuracy_num_beams", "2"]
    model, data_args, training = parse_arguments(["--model_id", CAUSAL, "--dataset_dir", str(data), *flags])
    trained = arguments_dict(model, data_args, training)

    planned = plan_setup(
        PlanArguments(
            model_id=CAUSAL,
            lora=True,
            lora_rank=16,
            lora_targets="all",
            fused_loss="chunked",
            lora_base_dtype="bfloat16",
            activation_checkpointing=True,
            precision="bf16",
            per_device_eval_batch_size=8,
            execution_accuracy_num_beams=2,
            max_source_length=SOURCE,
            max_target_length=TARGET,
        ),
        zero_settings(None),
    )
    tuned = candidate_setup(TuneArguments(model_id=CAUSAL, dataset_dir=str(data)), 1, "bf16", trained, "lora")
    summary = RunSummary(
        model_id=CAUSAL,
        world_size=1,
        precision="bf16",
        strategy={"label": "none", "zero_stage": 0},
        arguments={"model": {"model_id": CAUSAL}, "data": asdict(data_args), "training": trained},
    )
    checked = run_setup(summary, SOURCE, TARGET)["setup"]
    assert planned == tuned == checked
    # every flag the planner models reached it
    assert (planned.lora_rank, planned.lora_targets, planned.fused_loss, planned.lora_base_dtype) == (
        16,
        "all",
        "chunked",
        "bfloat16",
    )
    assert planned.gradient_checkpointing and (planned.eval_batch, planned.eval_num_beams) == (8, 2)


def plan_json(capsys, *flags) -> dict:
    assert plan_cli(["--model_id", CAUSAL, "--gpu_memory_gb", "80", "--json", *flags]) == 0
    return json.loads(capsys.readouterr().out)


def test_textsql_plan_takes_the_speed_levers_it_models(capsys):
    """--fused_loss chunked and --lora_base_dtype bfloat16 change the plan by what the planner predicts for them."""
    shape = resolve_model(CAUSAL)
    without = plan_json(capsys)["strategies"]["none"]
    chunked = plan_json(capsys, "--fused_loss", "chunked")
    setup = plan_setup(PlanArguments(model_id=CAUSAL), zero_settings(None))
    predicted = predict_strategy(shape, replace(setup, fused_loss="chunked"), "none", 32)
    assert chunked["strategies"]["none"]["gpu_total_bytes"] == predicted["gpu_total_bytes"]
    assert chunked["strategies"]["none"]["gpu_total_bytes"] < without["gpu_total_bytes"]  # most logits never exist
    assert "--fused_loss chunked" in chunked["recommendation"]["command"]  # the command trains what was planned

    lora = ["--lora", "True", "--precision", "bf16"]
    fp32_base = plan_json(capsys, *lora)["lora"]["strategies"]["none"]
    bf16_base = plan_json(capsys, *lora, "--lora_base_dtype", "bfloat16")["lora"]["strategies"]["none"]
    lora_setup = replace(setup, lora_rank=8, lora_base_dtype="bfloat16")
    assert bf16_base["gpu_total_bytes"] == predict_strategy(shape, lora_setup, "none", 32)["gpu_total_bytes"]
    assert bf16_base["gpu_total_bytes"] < fp32_base["gpu_total_bytes"]  # no fp32 base, no autocast copies


def test_textsql_plan_refuses_what_textsql_train_refuses():
    with pytest.raises(TextsqlError, match="--fused_loss must be one of"):
        PlanArguments(model_id=CAUSAL, fused_loss="fused")
    with pytest.raises(TextsqlError, match="pass --lora True too"):
        PlanArguments(model_id=CAUSAL, lora_base_dtype="bfloat16")
    with pytest.raises(TextsqlError, match="needs --precision bf16"):
        PlanArguments(model_id=CAUSAL, lora=True, lora_base_dtype="bfloat16", precision="fp32")
