"""FSDP2 beside DeepSpeed: the shipped configs and their check, the strategy rows, the planner's prediction, and FSDP
refused on the CPU (decided from fed device facts)."""

import json
import warnings

import pytest

from textsql.arguments.plan import PlanArguments
from textsql.arguments.training import parse_arguments
from textsql.cli.check_config import check_config_cli
from textsql.errors import TextsqlError
from textsql.planner.phases import fsdp_units
from textsql.planner.recommend import plan_memory
from textsql.planner.shape import resolve_model
from textsql.strategy.devices import A100_40GB, NodeDevices
from textsql.strategy.fsdpconfig import (
    FsdpConfigWarning,
    check_fsdp_devices,
    describe_fsdp_strategy,
    hybrid_sizes,
    is_fsdp_config_name,
    load_fsdpconfig,
    shipped_fsdp_configs,
    trainer_fsdp_config,
)
from textsql.strategy.table import FSDP_LAYOUT, FSDP_STRATEGIES, STRATEGIES, strategy_rank
from textsql.train.fsdp import synced_generation
from textsql.train.run import set_up_run


def test_shipped_fsdp_configs_load_and_name_their_row():
    shipped = shipped_fsdp_configs()
    assert set(shipped) == set(FSDP_STRATEGIES)
    for name, path in shipped.items():
        config = load_fsdpconfig(path)
        strategy = describe_fsdp_strategy(config)
        assert strategy["label"] == name and strategy["zero_stage"] is None and strategy["strategy"] == "fsdp"
        assert FSDP_LAYOUT[name] == (
            strategy["reshard_after_forward"],
            strategy["offload_param"] == "cpu",
            strategy["hybrid_shard"],
        )
        # no class named: accelerate wraps each model's own decoder layers (T5Block, LlamaDecoderLayer, ...)
        assert config["version"] == 2 and "transformer_layer_cls_to_wrap" not in config
        assert "hybrid_shard" not in trainer_fsdp_config(config)  # textsql's key, not the Trainer's


def test_fsdp_rows_sit_in_the_strategy_table_after_their_deepspeed_twins():
    assert set(FSDP_STRATEGIES) <= set(STRATEGIES)
    assert (
        strategy_rank("zero2")
        < strategy_rank("fsdp_shard_grad_op")
        < strategy_rank("zero3")
        < strategy_rank("fsdp_full_shard")
    )
    assert strategy_rank("fsdp_full_shard_offload") < strategy_rank("zero3_offload")


def write(tmp_path, name, content) -> str:
    path = tmp_path / name
    path.write_text(content if isinstance(content, str) else json.dumps(content))
    return str(path)


def test_bad_fsdp_config_lists_every_problem_with_its_fix(tmp_path):
    path = write(
        tmp_path,
        "bad.json",
        {
            "version": 1,
            "sharding_strategy": "HYBRID_SHARD",
            "cpu_offload": "yes",
            "state_dict_type": "LOCAL_STATE_DICT",
            "reshard_after_foward": True,
            "transformer_layer_cls_to_wrap": "T5Block",
        },
    )
    with pytest.raises(TextsqlError) as caught:
        load_fsdpconfig(path)
    message = str(caught.value)
    for part in (
        "version is 1: textsql runs FSDP2 only",
        "sharding_strategy is an FSDP1 setting",
        "cpu_offload must be true or false, not 'yes'",
        "state_dict_type must be one of FULL_STATE_DICT",
        "reshard_after_foward is not an FSDP2 setting the Trainer reads (it would be ignored silently)",
        "transformer_layer_cls_to_wrap must be a list",
        "textsql check-config",
    ):
        assert part in message
    with pytest.raises(TextsqlError, match="is not valid JSON"):
        load_fsdpconfig(write(tmp_path, "broken.json", "{"))


def test_fsdp_config_whose_layer_classes_would_be_ignored_is_warned_about(tmp_path):
    path = write(
        tmp_path,
        "size.json",
        {
            "version": 2,
            "auto_wrap_policy": "SIZE_BASED_WRAP",
            "transformer_layer_cls_to_wrap": ["T5Block"],
            "fsdp_cpu_offload": False,
        },
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", FsdpConfigWarning)
        config = load_fsdpconfig(path)
    assert config["cpu_offload"] is False  # the Trainer's fsdp_ prefix is read as the Trainer reads it
    assert any("read only with auto_wrap_policy TRANSFORMER_BASED_WRAP" in str(w.message) for w in caught)


def test_check_config_tells_fsdp_files_from_deepspeed_ones(tmp_path, capsys):
    mine = write(
        tmp_path,
        "mine.json",
        {"version": 2, "reshard_after_forward": False, "transformer_layer_cls_to_wrap": ["T5Block"]},
    )
    assert is_fsdp_config_name(mine) and is_fsdp_config_name("fsdp_full_shard") and not is_fsdp_config_name("zero2")
    assert check_config_cli(["fsdp_full_shard", "fsdp_full_shard_offload", "fsdp_hybrid_shard", mine, "zero2"]) == 0
    out = capsys.readouterr().out
    assert "fsdp_full_shard: OK (FSDP2 full shard, offload: none)" in out
    assert "fsdp_full_shard_offload: OK (FSDP2 full shard, offload: cpu)" in out
    assert f"{mine}: OK (FSDP2 shard-grad-op, offload: none)" in out and "zero2: OK (zero2" in out
    bad = write(tmp_path, "bad.json", {"version": 2, "backward_prefetch": "BACKWARD_PRE"})
    assert check_config_cli([bad]) == 2
    assert "backward_prefetch is an FSDP1 setting" in capsys.readouterr().err


def test_fsdp_is_refused_on_the_cpu_with_its_reason():
    strategy = describe_fsdp_strategy(load_fsdpconfig(shipped_fsdp_configs()["fsdp_full_shard"]))
    with pytest.raises(TextsqlError) as caught:
        check_fsdp_devices(strategy, "cpu", NodeDevices((), 8))
    message = str(caught.value)
    assert "fsdp_full_shard needs GPUs" in message and "no GPU" in message
    assert "silently falls back to plain data parallel" in message and "--deepspeed zero2" in message
    with pytest.raises(TextsqlError, match="--accelerator cpu was given"):
        check_fsdp_devices(strategy, "cpu", NodeDevices((A100_40GB,), 8))
    check_fsdp_devices(strategy, "cuda", NodeDevices((A100_40GB,), 8))  # GPUs: accepted
    check_fsdp_devices(
        {"strategy": "zero2", "label": "zero2"}, "cpu", NodeDevices((), 8)
    )  # DeepSpeed shards on the CPU


def test_train_refuses_fsdp_before_loading_anything_on_a_cpu_node(tmp_path, restored_environ, monkeypatch):
    model, data, training = parse_arguments(
        ["--model_id", "t5-small", "--runs_root", str(tmp_path), "--fsdp_config", "fsdp_shard_grad_op"]
    )
    with pytest.raises(TextsqlError, match="fsdp_shard_grad_op needs GPUs"):
        set_up_run(model, training, devices=NodeDevices((), 2))
    monkeypatch.delenv("DS_ACCELERATOR")  # set for the CPU above; the facts below are a GPU node's
    model, data, training = parse_arguments(
        ["--runs_root", str(tmp_path), "--fsdp_config", "fsdp_full_shard", "--deepspeed", "zero2"]
    )
    with pytest.raises(TextsqlError, match="either with DeepSpeed ZeRO or with PyTorch FSDP"):
        set_up_run(model, training, devices=NodeDevices((A100_40GB,), 2))
    model, data, training = parse_arguments(["--runs_root", str(tmp_path), "--fsdp"])
    with pytest.raises(TextsqlError, match="--fsdp was given without --fsdp_config"):
        set_up_run(model, training, devices=NodeDevices((A100_40GB,), 2))


def test_set_up_run_hands_the_trainer_fsdp2_and_hybrid_sizes(tmp_path, restored_environ, monkeypatch):
    monkeypatch.delenv("DS_ACCELERATOR", raising=False)  # the fed facts are a GPU node's
    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setenv("CROSS_SIZE", "2")  # the DeepSpeed launcher's node count
    model, data, training = parse_arguments(
        ["--model_id", "t5-small", "--runs_root", str(tmp_path), "--fsdp_config", "fsdp_hybrid_shard"]
    )
    setup = set_up_run(model, training, devices=NodeDevices((A100_40GB,) * 4, 16))
    settings = setup.trainer_settings
    assert (
        settings["fsdp"] is True
        and settings["fsdp_config"]["version"] == 2
        and "hybrid_shard" not in settings["fsdp_config"]
    )
    parallelism = settings["parallelism_config"]
    assert (parallelism.dp_replicate_size, parallelism.dp_shard_size) == (2, 4)
    assert setup.dsconfig is None and setup.strategy["label"] == "fsdp_hybrid_shard"
    assert setup.output_dir.name.startswith("t5-small-fsdp_hybrid_shard-ws8-bs32")


def test_hybrid_sizes_and_synced_generation():
    assert hybrid_sizes(8, 2) == (2, 4) and hybrid_sizes(4, 1) == (1, 4)
    with pytest.raises(TextsqlError, match="shards nothing"):
        hybrid_sizes(2, 2)
    with pytest.raises(TextsqlError, match="same number of ranks on every pod"):
        hybrid_sizes(6, 4)
    assert synced_generation(zero3=False, fsdp=True, world_size=2)
    assert synced_generation(zero3=True, fsdp=False, world_size=2)
    assert not synced_generation(zero3=False, fsdp=False, world_size=2) and not synced_generation(False, True, 1)


def test_planner_predicts_fsdp_rows_sharded_in_fp32():
    plan = plan_memory(PlanArguments(model_id="t5-large", gpus_per_node=4, precision="bf16"))
    rows = plan["strategies"]
    assert set(FSDP_STRATEGIES) <= set(rows)
    P = plan["model"]["parameters"]
    full = rows["fsdp_full_shard"]
    assert full["gpu_bytes"]["parameters"] == pytest.approx(4 * P / 4, rel=1e-6)
    assert full["gpu_bytes"]["optimizer_states"] == pytest.approx(8 * P / 4, rel=1e-6)
    # shard-grad-op keeps every block gathered after the forward pass; full shard two at a time
    assert rows["fsdp_shard_grad_op"]["gpu_total_bytes"] > full["gpu_total_bytes"]
    assert rows["fsdp_full_shard_offload"]["gpu_bytes"]["optimizer_states"] == 0
    assert rows["fsdp_full_shard_offload"]["cpu_per_node_bytes"] > full["cpu_per_node_bytes"]
    # on one pod hybrid sharding is full sharding; across pods it shards over one pod's GPUs only
    assert rows["fsdp_hybrid_shard"]["gpu_total_bytes"] == full["gpu_total_bytes"]
    two_pods = plan_memory(PlanArguments(model_id="t5-large", nodes=2, gpus_per_node=4))["strategies"]
    assert two_pods["fsdp_hybrid_shard"]["gpu_total_bytes"] > two_pods["fsdp_full_shard"]["gpu_total_bytes"]
    units = fsdp_units(resolve_model("t5-small"))
    assert units["embeddings"] >= 32128 * 512  # the tied embedding unit


def test_planner_check_predicts_an_fsdp_run_with_its_own_model():
    from textsql.planner.check import run_setup
    from textsql.run_summary import RunSummary

    summary = RunSummary(
        model_id="t5-small",
        world_size=2,
        precision="bf16",
        strategy=describe_fsdp_strategy(load_fsdpconfig(shipped_fsdp_configs()["fsdp_shard_grad_op"])),
        arguments={"training": {"per_device_train_batch_size": 8}},
    )
    run = run_setup(summary, 64, 64)
    assert run["fsdp_layout"] == (False, False, False) and run["strategy"] == "fsdp_shard_grad_op"
