"""DeepSpeed's tools as flags: what each needs is refused before anything starts, with the fix; the flags travel with
the training arguments and reach the DeepSpeed config the run writes (the trainings themselves: test_report.py)."""

import importlib.util
import json

import pytest

from textsql.errors import TextsqlError


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--flops_profiler", "-1"], "--flops_profiler is the optimizer step to profile"),
        (["--deepspeed", "zero2", "--ds_monitor", "csv,tensorbord"], "'tensorbord' is not one of them"),
        (["--ds_monitor", "csv"], "this run has no DeepSpeed. Without DeepSpeed the Trainer's own TensorBoard"),
        (["--fsdp_config", "fsdp_full_shard", "--ds_monitor", "tensorboard"], "Add --deepspeed"),
        (["--comms_logger", "True"], "DDP and FSDP call torch.distributed directly"),
    ],
)
def test_what_a_tool_cannot_do_is_refused_before_anything_starts(argv, message):
    from textsql.arguments.training import parse_arguments

    with pytest.raises(TextsqlError, match=message):
        parse_arguments(argv)


@pytest.mark.skipif(importlib.util.find_spec("wandb") is not None, reason="wandb is installed here")
def test_wandb_is_refused_when_not_installed_naming_the_fix():
    from textsql.arguments.training import parse_arguments

    with pytest.raises(TextsqlError, match=r"pip install wandb.*wandb login"):
        parse_arguments(["--deepspeed", "zero2", "--ds_monitor", "csv,wandb"])


def test_the_flags_travel_and_reach_the_runs_deepspeed_config(assets, tmp_path):
    from textsql.arguments.training import arguments_dict, arguments_from_dict, parse_arguments
    from textsql.cli.flags import train_flags
    from textsql.train.run import set_up_run

    assert {"flops_profiler", "ds_monitor", "comms_logger"} <= train_flags()  # known before torch loads
    data_dir, model_dir = assets
    argv = ["--model_id", str(model_dir), "--dataset_dir", str(data_dir), "--runs_root", str(tmp_path)]
    argv += [
        "--deepspeed",
        "zero1",
        "--flops_profiler",
        "4",
        "--ds_monitor",
        "csv, tensorboard",
        "--comms_logger",
        "True",
    ]
    model, data, training = parse_arguments(argv)
    values = json.loads(json.dumps(arguments_dict(model, data, training)))  # what every rank and node gets
    training = arguments_from_dict(values)[2]
    assert (training.flops_profiler, training.ds_monitors, training.comms_logger) == (4, ("csv", "tensorboard"), True)
    plan = set_up_run(model, training)
    written = json.loads(open(plan.trainer_settings["deepspeed"]).read())
    assert written["flops_profiler"]["enabled"] is True and written["flops_profiler"]["profile_step"] == 3
    assert written["flops_profiler"]["output_file"] == str((plan.output_dir / "flops_profile.txt").absolute())
    assert written["csv_monitor"] == {
        "enabled": True,
        "job_name": "csv",
        "output_path": str((plan.output_dir / "ds_monitor").absolute()),
    }
    assert written["tensorboard"]["enabled"] is True and written["comms_logger"] == {"enabled": True}
    assert "flops" not in plan.output_dir.name  # a tool does not make another experiment: the same run folder


def test_zero3s_linear_layers_counted_twice_are_noted_where_the_config_has_them():
    from textsql.train.dstools import ZERO3_LINEAR_COUNTED_TWICE, counting_note, profiled_step

    assert counting_note({"zero_optimization": {"stage": 3}}) == ZERO3_LINEAR_COUNTED_TWICE
    assert counting_note({"zero_optimization": {"stage": 3, "memory_efficient_linear": False}}) is None
    assert counting_note({"zero_optimization": {"stage": 2}}) is None and counting_note(None) is None
    # The step profiled: DeepSpeed's own block (it counts finished steps), else the flag.
    assert profiled_step({"flops_profiler": {"enabled": True, "profile_step": 9}}, 0) == 10
    assert profiled_step({"flops_profiler": {"enabled": False, "profile_step": 9}}, 3) == 0
    assert profiled_step(None, 3) == 3 and profiled_step(None, 0) == 0
