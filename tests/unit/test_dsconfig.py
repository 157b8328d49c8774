"""Tests for textsql.strategy.dsconfig: shipped configs pass the Trainer and DeepSpeed, bad files give clear errors."""

import json
import os
import warnings

os.environ.setdefault("DS_ACCELERATOR", "cpu")  # no GPU on the test machines; must precede importing deepspeed

import pytest

from textsql.cli.check_config import check_config_cli
from textsql.errors import TextsqlError
from textsql.strategy import dsconfig_rules
from textsql.strategy.dsconfig import (
    DsConfigWarning,
    check_batch_settings,
    describe_strategy,
    load_dsconfig,
    resolve_for_run,
    shipped_configs,
    with_nvme_path,
)

SHIPPED = ["zero1", "zero2", "zero2_offload", "zero3", "zero3_nvme", "zero3_offload"]
EXPECTED = {
    "zero1": {
        "strategy": "zero1",
        "zero_stage": 1,
        "offload_optimizer": "none",
        "offload_param": "none",
        "label": "zero1",
    },
    "zero2": {
        "strategy": "zero2",
        "zero_stage": 2,
        "offload_optimizer": "none",
        "offload_param": "none",
        "label": "zero2",
    },
    "zero2_offload": {
        "strategy": "zero2",
        "zero_stage": 2,
        "offload_optimizer": "cpu",
        "offload_param": "none",
        "label": "zero2_offload",
    },
    "zero3": {
        "strategy": "zero3",
        "zero_stage": 3,
        "offload_optimizer": "none",
        "offload_param": "none",
        "label": "zero3",
    },
    "zero3_nvme": {
        "strategy": "zero3",
        "zero_stage": 3,
        "offload_optimizer": "nvme",
        "offload_param": "nvme",
        "label": "zero3_nvme",
    },
    "zero3_offload": {
        "strategy": "zero3",
        "zero_stage": 3,
        "offload_optimizer": "cpu",
        "offload_param": "cpu",
        "label": "zero3_offload",
    },
}
BATCH, ACCUM, CLIP = 4, 2, 0.5


@pytest.fixture(scope="module")
def tiny_t5():
    from transformers import T5Config, T5ForConditionalGeneration

    config = T5Config(
        d_model=32,
        num_layers=1,
        num_heads=2,
        d_kv=16,
        d_ff=64,
        vocab_size=100,
        decoder_start_token_id=0,
        pad_token_id=0,
        eos_token_id=1,
    )
    return T5ForConditionalGeneration(config)


def fill_like_trainer(cfg, model, output_dir, spy=None):
    """Run the Trainer's own "auto" filling (process + finalize) on cfg and return the filled dict."""
    from transformers import Seq2SeqTrainingArguments
    from transformers.integrations.deepspeed import HfTrainerDeepSpeedConfig, unset_hf_deepspeed_config

    args = Seq2SeqTrainingArguments(
        output_dir=str(output_dir),
        use_cpu=True,
        per_device_train_batch_size=BATCH,
        gradient_accumulation_steps=ACCUM,
        max_grad_norm=CLIP,
        report_to="none",
    )
    hf_config = HfTrainerDeepSpeedConfig(cfg)  # built after the model: a ZeRO-3 config would wrap model creation
    try:
        if spy is not None:
            original = hf_config.find_config_node

            def recording(ds_key_long):
                spy.add(ds_key_long)
                return original(ds_key_long)

            hf_config.find_config_node = recording
        hf_config.trainer_config_process(args)
        hf_config.trainer_config_finalize(args, model, num_training_steps=10)
        return hf_config.config
    finally:
        unset_hf_deepspeed_config()


def auto_paths(node, prefix=""):
    items = node.items() if isinstance(node, dict) else enumerate(node)
    found = []
    for key, value in items:
        path = f"{prefix}.{key}" if prefix else str(key)
        if value == "auto":
            found.append(path)
        elif isinstance(value, (dict, list)):
            found += auto_paths(value, path)
    return found


def write(tmp_path, cfg, name="ds.json"):
    path = tmp_path / name
    path.write_text(json.dumps(cfg, indent=2) if not isinstance(cfg, str) else cfg)
    return path


def zero2(**zero):
    cfg = json.loads(shipped_configs()["zero2"].read_text())
    cfg["zero_optimization"].update(zero)
    return cfg


def problems_of(tmp_path, cfg):
    with pytest.raises(TextsqlError) as info:
        load_dsconfig(write(tmp_path, cfg))
    return str(info.value)


def warnings_of(tmp_path, cfg) -> str:
    """Load cfg (it must be accepted, unchanged) and return its DsConfigWarnings, one per line."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", DsConfigWarning)
        assert load_dsconfig(write(tmp_path, cfg)) == cfg
    return "\n".join(str(w.message) for w in caught if issubclass(w.category, DsConfigWarning))


# --- shipped configs ------------------------------------------------------------------------------------------------


def test_shipped_configs_are_found():
    configs = shipped_configs()
    assert set(SHIPPED) <= set(configs)
    assert all(path.is_file() and path.suffix == ".json" for path in configs.values())


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_config_loads_unchanged_without_warnings(name):
    path = shipped_configs()[name]
    with warnings.catch_warnings():
        warnings.simplefilter("error", DsConfigWarning)
        cfg = load_dsconfig(path)
    assert cfg == json.loads(path.read_text())


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_config_is_accepted_by_trainer_and_deepspeed(name, tiny_t5, tmp_path):
    from deepspeed.runtime.config import DeepSpeedConfig

    cfg = load_dsconfig(shipped_configs()[name])
    filled = fill_like_trainer(
        with_nvme_path(cfg, tmp_path / "nvme" if name == "zero3_nvme" else None), tiny_t5, tmp_path
    )
    assert auto_paths(filled) == []
    assert cfg == json.loads(shipped_configs()[name].read_text())  # the Trainer worked on a copy
    ds = DeepSpeedConfig(filled)
    assert ds.zero_optimization_stage == EXPECTED[name]["zero_stage"]
    assert (ds.train_micro_batch_size_per_gpu, ds.gradient_accumulation_steps) == (BATCH, ACCUM)
    assert ds.train_batch_size == BATCH * ACCUM * ds.world_size
    assert ds.gradient_clipping == CLIP
    assert not ds.bfloat16_config.enabled and not ds.float16_config.enabled
    assert ds.zero_config.reduce_bucket_size == 32 * 32  # "auto" = d_model²
    if ds.zero_optimization_stage < 3:  # ZeRO-3 gathers by stage3_prefetch_bucket_size instead
        assert ds.zero_config.allgather_bucket_size <= 2e8
    assert ds.optimizer_name is None and ds.scheduler_name is None  # the Trainer's AdamW and schedule
    assert not ds.flops_profiler_config.enabled and not ds.monitor_config.tensorboard.enabled
    assert not ds.wall_clock_breakdown and ds.steps_per_print >= 100


def test_zero3_offload_details(tiny_t5, tmp_path):
    from deepspeed.runtime.config import DeepSpeedConfig

    ds = DeepSpeedConfig(fill_like_trainer(load_dsconfig(shipped_configs()["zero3_offload"]), tiny_t5, tmp_path))
    zero = ds.zero_config
    assert zero.offload_optimizer.device == "cpu" and zero.offload_optimizer.pin_memory
    assert zero.offload_param.device == "cpu" and zero.offload_param.pin_memory
    assert zero.gather_16bit_weights_on_model_save
    assert zero.prefetch_bucket_size == int(0.9 * 32 * 32) and zero.param_persistence_threshold == 10 * 32


def test_zero3_nvme_swaps_to_the_nvme_path_it_is_given(tiny_t5, tmp_path):
    """zero3_nvme is zero3_offload's file with both offloads on NVMe at "auto", which --nvme_path fills (nothing else)."""
    from deepspeed.runtime.config import DeepSpeedConfig

    nvme = load_dsconfig(shipped_configs()["zero3_nvme"])
    offload = load_dsconfig(shipped_configs()["zero3_offload"])
    assert {k: v for k, v in nvme.items() if k not in ("zero_optimization", "aio", "tensorboard")} == {
        k: v for k, v in offload.items() if k not in ("zero_optimization", "tensorboard")
    }
    with pytest.raises(TextsqlError, match="names no folder to swap to.*--nvme_path DIR.*zero3_offload"):
        with_nvme_path(nvme, None)
    filled = with_nvme_path(nvme, tmp_path / "nvme")
    assert nvme == load_dsconfig(shipped_configs()["zero3_nvme"])  # a copy was filled
    zero = DeepSpeedConfig(fill_like_trainer(filled, tiny_t5, tmp_path)).zero_config
    assert zero.offload_optimizer.device == "nvme" and zero.offload_param.device == "nvme"
    assert str(zero.offload_optimizer.nvme_path) == str(zero.offload_param.nvme_path) == str(tmp_path / "nvme")
    with pytest.raises(TextsqlError, match="contradicts|but --nvme_path is"):
        with_nvme_path(filled, tmp_path / "elsewhere")
    with pytest.raises(TextsqlError, match="offloads nothing to NVMe"):
        with_nvme_path(offload, tmp_path / "nvme")
    (tmp_path / "a-file").write_text("")
    with pytest.raises(TextsqlError, match="is a file, not a folder"):
        with_nvme_path(nvme, tmp_path / "a-file")


def test_zero2_overlaps_communication():
    zero = load_dsconfig(shipped_configs()["zero2"])["zero_optimization"]
    assert zero["overlap_comm"] is True and zero["contiguous_gradients"] is True


@pytest.mark.parametrize("name", SHIPPED)
def test_profiler_and_monitor_blocks_are_present_and_off(name, tmp_path):
    cfg = load_dsconfig(shipped_configs()[name])
    assert cfg["flops_profiler"] == {
        "enabled": False,
        "profile_step": cfg["flops_profiler"]["profile_step"],
        "module_depth": -1,
        "top_modules": 1,
        "detailed": True,
        "output_file": None,
    }
    assert cfg["tensorboard"]["enabled"] is False and cfg["tensorboard"]["output_path"] == ""
    cfg["flops_profiler"]["enabled"] = True  # the one-word edit a user makes
    cfg["tensorboard"]["enabled"] = True
    assert load_dsconfig(write(tmp_path, cfg)) == cfg


@pytest.mark.parametrize("name", SHIPPED)
def test_describe_strategy_of_shipped_configs(name):
    assert describe_strategy(load_dsconfig(shipped_configs()[name])) == EXPECTED[name]


def test_describe_strategy_without_deepspeed_and_nvme():
    assert describe_strategy(None) == {
        "strategy": "none",
        "zero_stage": None,
        "offload_optimizer": "none",
        "offload_param": "none",
        "label": "none",
    }
    nvme = {
        "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "nvme"}, "offload_param": {"device": "cpu"}}
    }
    info = describe_strategy(nvme)
    assert info["label"] == "zero2_nvme" and info["offload_param"] == "none"  # param offload needs stage 3


def test_resolve_for_run_points_outputs_into_run_folder(tmp_path):
    from deepspeed.runtime.config import DeepSpeedConfig

    cfg = load_dsconfig(shipped_configs()["zero2"])
    resolved = resolve_for_run(cfg, tmp_path / "run1")
    assert resolved["flops_profiler"]["output_file"] == str(tmp_path / "run1" / "flops_profile.txt")
    assert resolved["tensorboard"]["output_path"] == str(tmp_path / "run1" / "ds_monitor")
    assert cfg["flops_profiler"]["output_file"] is None and cfg["tensorboard"]["output_path"] == ""
    resolved["train_micro_batch_size_per_gpu"] = resolved["gradient_accumulation_steps"] = 1
    del resolved["train_batch_size"]
    resolved["gradient_clipping"], resolved["bf16"], resolved["fp16"] = 1.0, {"enabled": False}, {"enabled": False}
    resolved["zero_optimization"]["reduce_bucket_size"] = 1000
    assert DeepSpeedConfig(resolved).flops_profiler_config.output_file.endswith("flops_profile.txt")


def test_resolve_for_run_keeps_explicit_locations(tmp_path):
    cfg = {
        "flops_profiler": {"enabled": True, "output_file": "/elsewhere/p.txt"},
        "tensorboard": {"enabled": True, "output_path": "/elsewhere/tb"},
    }
    assert resolve_for_run(cfg, tmp_path) == cfg


# --- the "auto" list matches the Trainer ----------------------------------------------------------------------------


def test_auto_list_matches_what_the_trainer_fills(tiny_t5, tmp_path):
    cfg = {
        "train_micro_batch_size_per_gpu": "auto",
        "train_batch_size": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "optimizer": {"type": "AdamW", "params": {k: "auto" for k in ("lr", "betas", "eps", "weight_decay")}},
        "scheduler": {
            "type": "WarmupDecayLR",
            "params": {k: "auto" for k in ("warmup_min_lr", "warmup_max_lr", "total_num_steps", "warmup_num_steps")},
        },
        "fp16": {"enabled": "auto"},
        "bf16": {"enabled": "auto"},
        "zero_optimization": {
            "stage": 3,
            "reduce_bucket_size": "auto",
            "stage3_prefetch_bucket_size": "auto",
            "stage3_param_persistence_threshold": "auto",
        },
    }
    assert sorted(auto_paths(cfg)) == sorted(dsconfig_rules.HF_AUTO_PLACEHOLDERS)
    assert load_dsconfig(write(tmp_path, cfg)) == cfg
    touched = set()
    filled = fill_like_trainer(cfg, tiny_t5, tmp_path, spy=touched)
    assert auto_paths(filled) == []
    assert touched <= set(dsconfig_rules.HF_AUTO_PLACEHOLDERS), touched - set(dsconfig_rules.HF_AUTO_PLACEHOLDERS)


def test_top_level_keys_come_from_deepspeed():
    keys = dsconfig_rules.top_level_keys()
    assert {
        "zero_optimization",
        "train_batch_size",
        "flops_profiler",
        "tensorboard",
        "bf16",
        "optimizer",
        "steps_per_print",
        "wall_clock_breakdown",
        "activation_checkpointing",
    } <= keys
    assert "nebula" not in keys and "amp" not in keys  # removed features: DeepSpeed rejects them


# --- errors ---------------------------------------------------------------------------------------------------------


def test_invalid_json_names_line_column_and_shows_the_line(tmp_path):
    path = write(tmp_path, '{\n  "train_batch_size": "auto"\n  "steps_per_print": 1000\n}\n')
    with pytest.raises(TextsqlError) as info:
        load_dsconfig(path)
    message = str(info.value)
    assert str(path) in message and "line 3, column 3" in message
    assert '"steps_per_print": 1000' in message and "^" in message


def test_missing_file(tmp_path):
    with pytest.raises(TextsqlError, match="does not exist"):
        load_dsconfig(tmp_path / "nope.json")


def test_misspelt_zero_optimization_is_named_with_the_right_key(tmp_path):
    cfg = {
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "zero_optimisation": {"stage": 2},
    }
    message = problems_of(tmp_path, cfg)
    assert '"zero_optimisation", which DeepSpeed does not know: did you mean zero_optimization?' in message


def test_unknown_nested_key_suggests_the_right_one(tmp_path):
    cfg = zero2(reduce_bucket_sise=50000000)
    message = problems_of(tmp_path, cfg)
    assert "zero_optimization.reduce_bucket_sise: unknown key; did you mean reduce_bucket_size?" in message


def test_unknown_offload_key_and_device(tmp_path):
    message = problems_of(tmp_path, zero2(offload_optimizer={"device": "gpu", "pin_memry": True}))
    assert "zero_optimization.offload_optimizer.pin_memry: unknown key; did you mean pin_memory?" in message
    assert "zero_optimization.offload_optimizer.device: must be one of 'none', 'cpu', 'nvme'; got 'gpu'" in message


def test_unknown_top_level_key_suggests_the_right_one(tmp_path):
    cfg = zero2()
    cfg["gradient_acumulation_steps"] = cfg.pop("gradient_accumulation_steps")
    message = problems_of(tmp_path, cfg)
    assert "gradient_acumulation_steps: unknown key; did you mean gradient_accumulation_steps?" in message


def test_unknown_key_in_profiler_block_warns(tmp_path):
    # DeepSpeed reads the profiler block key by key and ignores the rest: the run goes on, without the setting.
    cfg = zero2()
    cfg["flops_profiler"]["profile_stepp"] = 3
    assert "flops_profiler.profile_stepp: unknown key; did you mean profile_step? DeepSpeed ignores it" in warnings_of(
        tmp_path, cfg
    )


def test_unknown_top_level_key_with_a_value_warns(tmp_path):
    cfg = zero2()
    cfg["steps_per_prnt"] = 10  # DeepSpeed ignores unknown top-level keys; "auto" under one would stop accelerate
    assert "steps_per_prnt: unknown key; did you mean steps_per_print? DeepSpeed ignores it" in warnings_of(
        tmp_path, cfg
    )


def test_removed_deepspeed_feature_is_reported_with_deepspeeds_reason(tmp_path):
    cfg = zero2()
    cfg["amp"] = {"enabled": True}
    assert "amp: DeepSpeed rejects this block: NVIDIA Apex AMP" in problems_of(tmp_path, cfg)


@pytest.mark.parametrize("stage", [4, -1, "two"])
def test_bad_stage(tmp_path, stage):
    message = problems_of(tmp_path, zero2(stage=stage))
    assert f"zero_optimization.stage: must be one of 0, 1, 2, 3; got {stage!r}" in message


@pytest.mark.parametrize(
    "key, value, expected",
    [
        ("overlap_comm", "maybe", "zero_optimization.overlap_comm: must be true or false"),
        ("allgather_bucket_size", "big", "zero_optimization.allgather_bucket_size: input should be a valid integer"),
        ("allgather_bucket_size", -5, "zero_optimization.allgather_bucket_size: input should be greater than or equal"),
    ],
)
def test_wrong_type_or_value_in_zero_block(tmp_path, key, value, expected):
    assert expected in problems_of(tmp_path, zero2(**{key: value}))


def test_quoted_boolean_that_deepspeed_reads_warns(tmp_path):
    cfg = zero2(contiguous_gradients="false")  # pydantic reads "false" as false: it runs
    assert (
        "zero_optimization.contiguous_gradients: 'false' is not a JSON boolean; DeepSpeed reads it as false"
        in warnings_of(tmp_path, cfg)
    )


def test_wrong_top_level_types(tmp_path):
    cfg = zero2()
    cfg.update(wall_clock_breakdown="no", gradient_clipping="1.0", gradient_accumulation_steps=0)
    message = problems_of(tmp_path, cfg)
    assert "wall_clock_breakdown: must be true or false" in message and "DeepSpeed stops on it" in message
    assert "gradient_clipping: must be a number >= 0" in message
    assert "gradient_accumulation_steps: must be a whole number >= 1" in message


def test_top_level_values_that_run_anyway_warn(tmp_path):
    cfg = zero2()
    cfg.update(steps_per_print=0, gradient_clipping=-1)
    found = warnings_of(tmp_path, cfg)
    assert "steps_per_print: must be a whole number >= 1; got 0. It has no effect under the Trainer" in found
    assert "gradient_clipping: -1 is negative, which DeepSpeed treats as 0" in found


def test_auto_where_the_trainer_does_not_fill_it(tmp_path):
    message = problems_of(tmp_path, zero2(allgather_bucket_size="auto"))
    assert 'zero_optimization.allgather_bucket_size: "auto" is not allowed here' in message
    assert "train_micro_batch_size_per_gpu" in message and "reduce_bucket_size" in message  # where auto is allowed


def test_stage3_auto_keys_below_stage3_warn(tmp_path):
    # accelerate fills these "auto" at every stage (the Trainer only at stage 3), and DeepSpeed ignores them below 3.
    found = warnings_of(tmp_path, zero2(stage3_prefetch_bucket_size="auto"))
    assert "zero_optimization.stage3_prefetch_bucket_size: used only by ZeRO stage 3 (this file has stage 2)" in found


def test_all_problems_are_reported_together_and_numbered(tmp_path):
    cfg = zero2(stage=7, reduce_bucket_sise=1)
    cfg["gradient_accumulation_steps"] = 0
    message = problems_of(tmp_path, cfg)
    assert "has 3 problems" in message
    assert "\n  1. " in message and "\n  2. " in message and "\n  3. " in message


def test_duplicate_keys_warn(tmp_path):
    # JSON keeps the last value and the Trainer runs with it: a warning, not a refusal.
    path = write(
        tmp_path,
        '{"zero_optimization": {"stage": 1, "reduce_bucket_size": "auto"}, '
        '"train_micro_batch_size_per_gpu": 4, "train_micro_batch_size_per_gpu": "auto"}',
    )
    with pytest.warns(DsConfigWarning, match="train_micro_batch_size_per_gpu: duplicate key; JSON keeps only the last"):
        assert load_dsconfig(path)["train_micro_batch_size_per_gpu"] == "auto"


def test_fp16_and_bf16_together(tmp_path):
    cfg = zero2()
    cfg["fp16"]["enabled"] = cfg["bf16"]["enabled"] = True
    assert "both true" in problems_of(tmp_path, cfg)


def test_deepspeeds_own_parser_runs_last(tmp_path):
    cfg = zero2()
    cfg["communication_data_type"] = "int8"
    message = problems_of(tmp_path, cfg)
    assert "DeepSpeed rejects the config" in message and "communication_data_type" in message


# --- warnings -------------------------------------------------------------------------------------------------------


def test_oversized_zero2_bucket_warns_but_loads(tmp_path):
    cfg = zero2(reduce_bucket_size=5e8)
    with pytest.warns(DsConfigWarning, match=r"reduce_bucket_size is 5e8 elements: a buffer of 2\.0 GB"):
        assert load_dsconfig(write(tmp_path, cfg)) == cfg


def test_unset_zero1_bucket_warns_about_deepspeeds_default(tmp_path):
    cfg = {"train_micro_batch_size_per_gpu": "auto", "zero_optimization": {"stage": 1}}
    with pytest.warns(DsConfigWarning, match="reduce_bucket_size is not set, so DeepSpeed uses its default of 5e8"):
        load_dsconfig(write(tmp_path, cfg))


def test_allgather_bucket_is_no_buffer_and_does_not_warn(tmp_path):
    cfg = {
        "train_micro_batch_size_per_gpu": "auto",
        "zero_optimization": {"stage": 1, "reduce_bucket_size": "auto", "allgather_bucket_size": 5e8},
    }
    with warnings.catch_warnings():
        warnings.simplefilter("error", DsConfigWarning)
        load_dsconfig(write(tmp_path, cfg))


def test_big_zero3_buckets_do_not_warn(tmp_path):
    cfg = json.loads(shipped_configs()["zero3_offload"].read_text())
    cfg["zero_optimization"]["reduce_bucket_size"] = 5e8
    with warnings.catch_warnings():
        warnings.simplefilter("error", DsConfigWarning)
        load_dsconfig(write(tmp_path, cfg))


# --- batch settings against the command line ------------------------------------------------------------------------


def batch_args(**overrides):
    args = dict(per_device_train_batch_size=32, gradient_accumulation_steps=1, world_size=3, max_grad_norm=1.0)
    return {**args, **overrides}


def test_batch_settings_all_auto_pass():
    check_batch_settings(load_dsconfig(shipped_configs()["zero1"]), **batch_args())


def test_batch_settings_that_agree_pass():
    cfg = {
        "train_micro_batch_size_per_gpu": 32,
        "gradient_accumulation_steps": 2,
        "train_batch_size": 192,
        "gradient_clipping": 1.0,
    }
    check_batch_settings(cfg, **batch_args(gradient_accumulation_steps=2))


def test_contradicting_micro_batch_size():
    with pytest.raises(TextsqlError) as info:
        check_batch_settings({"train_micro_batch_size_per_gpu": 16}, **batch_args(), source="ds.json")
    message = str(info.value)
    assert "train_micro_batch_size_per_gpu is 16 in the DeepSpeed config ds.json" in message
    assert "--per_device_train_batch_size is 32" in message and '"auto"' in message


def test_contradicting_clipping_and_total_batch():
    with pytest.raises(TextsqlError) as info:
        check_batch_settings({"gradient_clipping": 0.5, "train_batch_size": 32}, **batch_args())
    message = str(info.value)
    assert "gradient_clipping is 0.5" in message and "--max_grad_norm is 1.0" in message
    assert "train_batch_size is 32" in message and "(32 × 1 × 3)" in message and "96" in message


# --- CLI ------------------------------------------------------------------------------------------------------------


def test_cli_reports_shipped_configs_ok(capsys):
    paths = [str(shipped_configs()[name]) for name in SHIPPED]
    assert check_config_cli(paths) == 0
    out = capsys.readouterr().out
    expected = {
        "zero1": "zero1, offload: none",
        "zero2": "zero2, offload: none",
        "zero2_offload": "zero2, offload: optimizer cpu, param none",
        "zero3": "zero3, offload: none",
        "zero3_nvme": "zero3, offload: nvme, nvme_path from --nvme_path",
        "zero3_offload": "zero3, offload: cpu",
    }
    for name, path in zip(SHIPPED, paths):
        assert f"{path}: OK ({expected[name]})" in out


def test_cli_reports_a_bad_file_and_fails(tmp_path, capsys):
    bad = write(tmp_path, zero2(reduce_bucket_sise=1))
    assert check_config_cli([str(shipped_configs()["zero1"]), str(bad)]) == 2
    captured = capsys.readouterr()
    assert "OK (zero1" in captured.out
    assert "did you mean reduce_bucket_size?" in captured.err and str(bad) in captured.err


def test_cli_prints_warnings(tmp_path, capsys):
    big = write(tmp_path, zero2(reduce_bucket_size=500000000))
    assert check_config_cli([str(big)]) == 0
    assert "warning: zero_optimization.reduce_bucket_size is 5e8" in capsys.readouterr().out


def test_cli_without_files_fails_with_usage(capsys):
    with pytest.raises(SystemExit) as exit_:
        check_config_cli([])
    assert exit_.value.code == 2
    assert "usage: textsql check-config [-h] FILE [FILE ...]" in capsys.readouterr().err


def test_cli_takes_shipped_names(capsys):
    assert check_config_cli(["zero2"]) == 0
    assert "zero2: OK (zero2, offload: none)" in capsys.readouterr().out


def test_auto_under_a_misspelt_key_is_an_unknown_key(tmp_path):
    cfg = zero2()
    cfg["gradient_acumulation_steps"] = "auto"
    cfg["zero_optimization"]["reduce_bucket_sise"] = "auto"
    message = problems_of(tmp_path, cfg)
    assert "gradient_acumulation_steps: unknown key; did you mean gradient_accumulation_steps?" in message
    assert "zero_optimization.reduce_bucket_sise: unknown key; did you mean reduce_bucket_size?" in message
    assert "not allowed here" not in message


def test_resolve_dsconfig_path_takes_files_and_shipped_names(tmp_path):
    from textsql.strategy.dsconfig import resolve_dsconfig_path

    assert resolve_dsconfig_path("zero2") == shipped_configs()["zero2"]
    own = tmp_path / "mine.json"
    own.write_text("{}")
    assert resolve_dsconfig_path(str(own)) == own
    with pytest.raises(
        TextsqlError,
        match=r"--dsconfig 'zero9' is neither a JSON file nor a shipped strategy \(zero1, zero2, zero2_offload, zero3, "
        r"zero3_nvme, zero3_offload; FSDP strategies, with --fsdp_config: fsdp_full_shard, .*Did you mean zero3\?",
    ):
        resolve_dsconfig_path("zero9", flag="--dsconfig")
    with pytest.raises(TextsqlError, match="--deepspeed '.*missing.json' is neither"):
        resolve_dsconfig_path(str(tmp_path / "missing.json"))


# --- what accelerate fills and what the Trainer compares ------------------------------------------------------------


def test_accelerate_plugin_auto_list_matches_what_its_plugin_fills():
    from accelerate.utils import DeepSpeedPlugin

    cfg = {"zero_optimization": {"offload_optimizer": {}, "offload_param": {}}}
    for path in dsconfig_rules.ACCELERATE_PLUGIN_AUTO:
        *parents, key = path.split(".")
        node = cfg
        for parent in parents:
            node = node.setdefault(parent, {})
        node[key] = "auto"
    cfg["zero_optimization"]["sub_group_size"] = "auto"  # a place the plugin does not fill
    filled = DeepSpeedPlugin(hf_ds_config=cfg).deepspeed_config
    assert auto_paths(filled) == ["zero_optimization.sub_group_size"]


def test_trainer_compares_exactly_the_listed_values(tiny_t5, tmp_path):
    """Write a value unlike the training arguments wherever the Trainer takes "auto": it stops on exactly these."""
    odd = {"optimizer.params.betas": [0.5, 0.5], "fp16.enabled": True, "bf16.enabled": True}
    cfg = {}
    for path in dsconfig_rules.HF_AUTO_PLACEHOLDERS:
        *parents, key = path.split(".")
        node = cfg
        for parent in parents:
            node = node.setdefault(parent, {})
        node[key] = odd.get(path, 777)
    cfg["zero_optimization"]["stage"] = 3
    with pytest.raises(ValueError) as info:
        fill_like_trainer(cfg, tiny_t5, tmp_path)
    compared = {
        line.split("=")[0].removeprefix("- ds ") for line in str(info.value).splitlines() if line.startswith("- ds ")
    }
    assert compared == set(dsconfig_rules.TRAINER_COMPARES)


def test_values_the_trainer_compares_warn(tmp_path):
    cfg = zero2()
    cfg["gradient_accumulation_steps"] = 2
    cfg["optimizer"] = {"type": "AdamW", "params": {"lr": 3e-4, "weight_decay": "auto"}}
    found = warnings_of(tmp_path, cfg)
    assert "gradient_accumulation_steps = 2 (compared with --gradient_accumulation_steps)" in found
    assert "optimizer.params.lr = 0.0003 (compared with --learning_rate)" in found
    assert "The Trainer stops with a mismatch error unless the training arguments say the same" in found


def test_precision_written_as_a_value_warns_and_a_quoted_one_is_refused(tmp_path):
    cfg = zero2()
    cfg["bf16"]["enabled"] = True
    assert "bf16.enabled is true: the Trainer stops unless --bf16 is True too" in warnings_of(tmp_path, cfg)
    cfg["bf16"]["enabled"] = "true"
    message = problems_of(tmp_path, cfg)
    assert "bf16.enabled: must be true, false or \"auto\"; got 'true'. The Trainer compares it with --bf16" in message


def test_fp16_values_checked_only_when_fp16_is_on_warn_under_auto(tmp_path):
    cfg = zero2()
    cfg["fp16"].update(loss_scale=0, loss_scale_window=0)
    assert "fp16.loss_scale_window must be > 0 when dynamic loss scaling is enabled" in warnings_of(
        tmp_path, cfg
    ) and "a run in fp16 stops on it" in warnings_of(tmp_path, cfg)


def test_accelerate_fills_stage_and_offload_device(tmp_path, monkeypatch):
    monkeypatch.delenv("ACCELERATE_DEEPSPEED_ZERO_STAGE", raising=False)
    cfg = zero2(stage="auto", offload_optimizer={"device": "auto"})
    found = warnings_of(tmp_path, cfg)
    assert 'zero_optimization.stage: "auto" is filled by accelerate, not from the training arguments: with 2' in found
    assert 'zero_optimization.offload_optimizer.device: "auto" is filled by accelerate' in found and '"none"' in found
    assert describe_strategy(cfg)["label"] == "zero2"
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_ZERO_STAGE", "3")
    assert describe_strategy(cfg)["label"] == "zero3"


def test_auto_that_only_deepspeed_understands_is_refused(tmp_path):
    # DeepSpeed takes "auto" for keep_in_fp32_modules, but accelerate stops on every "auto" it does not fill.
    cfg = zero2()
    cfg["data_types"] = {"keep_in_fp32_modules": "auto"}
    assert "`data_types.keep_in_fp32_modules` not found in kwargs" in problems_of(tmp_path, cfg)


def test_steps_per_print_auto_is_overwritten_by_accelerate(tmp_path):
    cfg = zero2()
    cfg["steps_per_print"] = "auto"
    assert warnings_of(tmp_path, cfg) == ""


def test_deepspeeds_second_name_for_a_setting(tmp_path):
    cfg = json.loads(shipped_configs()["zero3_offload"].read_text())
    zero = cfg["zero_optimization"]
    zero["max_live_parameters"] = zero.pop("stage3_max_live_parameters")
    assert (
        "zero_optimization.max_live_parameters: DeepSpeed also accepts this name for stage3_max_live_parameters, "
        "but the Trainer, accelerate and textsql's planner read only stage3_max_live_parameters"
    ) in warnings_of(tmp_path, cfg)
    zero["stage3_max_live_parameters"] = 1e8
    assert "given twice, as max_live_parameters and as stage3_max_live_parameters" in problems_of(tmp_path, cfg)
    del zero["stage3_max_live_parameters"]
    zero["prefetch_bucket_size"] = zero.pop("stage3_prefetch_bucket_size")  # "auto" under the second name
    message = problems_of(tmp_path, cfg)
    assert 'zero_optimization.prefetch_bucket_size: "auto" is not allowed here' in message
    assert "only under DeepSpeed's other name for this setting, stage3_prefetch_bucket_size" in message


def test_ds_tools_are_added_as_deepspeed_reads_them_and_land_in_the_run_folder(tmp_path):
    from deepspeed.runtime.config import DeepSpeedConfig

    from textsql.strategy.dsconfig import add_ds_tools

    cfg = load_dsconfig(shipped_configs()["zero2"])
    tools = add_ds_tools(cfg, flops_profile_step=3, monitors=("csv", "tensorboard"), comms_logger=True)
    assert cfg == load_dsconfig(shipped_configs()["zero2"])  # the loaded config is left as it was
    resolved = resolve_for_run(tools, tmp_path / "run1")
    resolved["train_micro_batch_size_per_gpu"] = resolved["gradient_accumulation_steps"] = 1
    del resolved["train_batch_size"]
    resolved["gradient_clipping"], resolved["bf16"], resolved["fp16"] = 1.0, {"enabled": False}, {"enabled": False}
    resolved["zero_optimization"]["reduce_bucket_size"] = 1000
    ds = DeepSpeedConfig(resolved)
    profiler = ds.flops_profiler_config
    assert profiler.enabled and profiler.profile_step == 2  # DeepSpeed counts finished steps: the Trainer's step 3
    assert profiler.output_file == str(tmp_path / "run1" / "flops_profile.txt") and profiler.module_depth == -1
    monitors = ds.monitor_config
    assert monitors.csv_monitor.enabled and monitors.tensorboard.enabled and not monitors.wandb.enabled
    assert monitors.csv_monitor.output_path == monitors.tensorboard.output_path == str(tmp_path / "run1" / "ds_monitor")
    assert (monitors.csv_monitor.job_name, monitors.tensorboard.job_name) == ("csv", "tensorboard")
    assert ds.comms_config.comms_logger.enabled
    assert add_ds_tools(cfg) == cfg  # nothing asked, nothing added
