"""One training run, top to bottom: decide the device, precision, run folder and resume point (set_up_run), build the
trainer of the objective --stage names (OBJECTIVES: textsql.train.sft, textsql.train.grpo), train, save the model and
write run_summary.json (train)."""

from __future__ import annotations

import copy
import json
import logging
import os
import time
from dataclasses import asdict, dataclass
from importlib import import_module
from pathlib import Path
from typing import TYPE_CHECKING

from textsql import __version__
from textsql.adapters import adapter_state, parameter_counts, save_adapter
from textsql.arguments.run_name import run_folder_name, run_name_settings
from textsql.arguments.training import DataArguments, ModelArguments, TextsqlTrainingArguments, arguments_dict
from textsql.checkpoints import newest_whole_checkpoint, verify_checkpoint
from textsql.errors import TextsqlError
from textsql.hub import load_config
from textsql.paths import LOG_FILE, RESOLVED_DSCONFIG_FILE, SUMMARY_FILE
from textsql.planner.check import compare_with_run
from textsql.prepared import check_prepared
from textsql.run_summary import RunSummary, run_state, write_summary
from textsql.sharedfiles import replace_file
from textsql.strategy.devices import (
    NodeDevices,
    resolve_run_devices,
    use_accelerator,
)
from textsql.strategy.dsconfig import (
    add_ds_tools,
    check_batch_settings,
    check_nvme_offload,
    describe_strategy,
    load_async_io,
    load_dsconfig,
    nvme_offload_blocks,
    resolve_dsconfig_path,
    resolve_for_run,
)
from textsql.strategy.fsdpconfig import (
    check_fsdp_devices,
    check_fsdpconfig,
    describe_fsdp_strategy,
    hybrid_sizes,
    load_fsdpconfig,
    normalized,
    resolve_fsdpconfig_path,
    trainer_fsdp_config,
)
from textsql.strategy.opbuilds import OP_BUILD_VARIABLES, clear_dead_build_locks, use_op_cache
from textsql.tracking import end_failed_run, for_training
from textsql.train import watch
from textsql.train.callbacks import PhaseCallback, TrainingProgress, attach
from textsql.train.collate import check_packing
from textsql.train.distributed import (
    ensure_distributed_env,
    gather_fields,
    nodes_in_launch,
    release_deepspeed_shm_buffer,
    world_size,
)
from textsql.train.dstools import (
    comms_logger_enabled,
    own_latencies_in_comms_logger,
    running_ds_config,
    write_comms_summary,
)
from textsql.train.estimate import TrainingTimer
from textsql.train.logs import _route_deepspeed_logs, configure_logging
from textsql.train.objective import Inputs
from textsql.train.trainer import peak_memory, pin_to_one_gpu, save_final_model, tf32_enabled

if TYPE_CHECKING:
    from textsql.strategy.devices import PrecisionChoice

logger = logging.getLogger("textsql.train")


class TrainingInterrupted(TextsqlError):
    """Training was interrupted (Ctrl-C, a notebook's stop button); the message says how to resume."""


def interrupted_message(model: ModelArguments, training: TextsqlTrainingArguments, ranks: int) -> str:
    """One line after an interrupt: the checkpoint the same command resumes from, or that nothing was saved yet."""
    try:
        folder = run_dir(model, training, ranks)
    except TextsqlError:
        return "interrupted."
    newest, _ = newest_whole_checkpoint(folder)
    if newest:
        return f"interrupted; run the same command again to resume from {newest.absolute()}."
    return (
        f"interrupted before any checkpoint was complete (save_strategy {getattr(training.save_strategy, 'value', training.save_strategy)}); "
        f"running the same command again starts over in {folder.absolute()}."
    )


def load_strategy(deepspeed, fsdp_config=None, nvme_path=None) -> tuple[dict | None, dict]:
    """(the DeepSpeed or FSDP config, validated, or None without one; its strategy: stage or sharding, offload, label).
    An NVMe config gets --nvme_path and is refused before launch without one, or without DeepSpeed's async I/O op."""

    if deepspeed and fsdp_config:
        raise TextsqlError(
            "--deepspeed and --fsdp_config were both given: a run shards either with DeepSpeed ZeRO or with "
            "PyTorch FSDP. Pass one of them."
        )
    if nvme_path and not deepspeed:
        raise TextsqlError(
            f"--nvme_path {nvme_path} was given without --deepspeed: only DeepSpeed's ZeRO-Infinity swaps to NVMe. "
            "Pass --deepspeed zero3_nvme, or leave --nvme_path out."
        )
    if fsdp_config:
        return (config := load_fsdp_strategy(fsdp_config)), describe_fsdp_strategy(config)
    if not deepspeed:
        return None, describe_strategy(None)
    config = load_dsconfig(resolve_dsconfig_path(deepspeed)) if not isinstance(deepspeed, dict) else deepspeed
    config = check_nvme_offload(config, nvme_path)
    return config, describe_strategy(config)


def load_fsdp_strategy(fsdp_config) -> dict:
    """An FSDP config from a shipped name, a JSON file, or a dict (a notebook's), checked."""
    if not isinstance(fsdp_config, dict):
        return load_fsdpconfig(resolve_fsdpconfig_path(fsdp_config))
    problems, _ = check_fsdpconfig(fsdp_config)
    if problems:
        raise TextsqlError("The FSDP config given as a dict cannot be used: " + "; ".join(problems) + ".")
    return normalized(fsdp_config)


def run_dir(
    model: ModelArguments, training: TextsqlTrainingArguments, ranks: int, strategy_label: str | None = None
) -> Path:
    """The run's folder: --output_dir, or <runs_root>/<model>-<strategy>[-lora-r<rank>]-ws<ranks>-bs<batch>[-<settings>]."""
    if training.output_dir:
        return Path(training.output_dir)
    if strategy_label is None:
        strategy_label = load_strategy(training.deepspeed, training.fsdp_config, training.nvme_path)[1]["label"]
    return Path(training.runs_root) / run_folder_name(
        model.model_id,
        strategy_label,
        training.per_device_train_batch_size,
        ranks,
        run_name_settings(training),
        training.lora_label(),
    )


@dataclass
class RunSetup:
    """Everything decided before the Trainer is built, and the Trainer settings it fixes."""

    output_dir: Path
    precision: PrecisionChoice
    accelerator: str
    devices: NodeDevices
    strategy: dict
    dsconfig: dict | None
    resume_from: str | None
    trainer_settings: dict
    fsdpconfig: dict | None = None


def set_up_run(model: ModelArguments, training: TextsqlTrainingArguments, devices=None) -> RunSetup:
    """Decide the device, precision and run folder, validate the DeepSpeed config against the arguments, and decide
    whether to resume. `devices` (textsql.strategy.devices.NodeDevices) is what this process sees; read from torch when not given.
    """

    devices = devices if devices is not None else NodeDevices.local()
    resolved = resolve_run_devices(training, model.model_id, devices)
    accelerator, precision = resolved.accelerator, resolved.precision
    use_accelerator(accelerator)  # before anything imports deepspeed
    if training.fsdp and not training.fsdp_config:
        raise TextsqlError(
            "--fsdp was given without --fsdp_config: name the FSDP strategy with --fsdp_config "
            "fsdp_full_shard (or fsdp_shard_grad_op, fsdp_full_shard_offload, fsdp_hybrid_shard, or your "
            "own JSON file); textsql turns FSDP on from it."
        )
    config, strategy = load_strategy(training.deepspeed, training.fsdp_config, training.nvme_path)
    fsdpconfig = config if strategy["strategy"] == "fsdp" else None
    dsconfig = None if fsdpconfig is not None else config
    check_fsdp_devices(strategy, accelerator, devices)
    # LoRA and packing ride on any strategy: recorded beside it
    strategy = dict(strategy, lora=training.lora_settings(), packing=training.packing)
    if dsconfig is not None:
        check_batch_settings(
            dsconfig,
            per_device_train_batch_size=training.per_device_train_batch_size,
            gradient_accumulation_steps=training.gradient_accumulation_steps,
            world_size=world_size(),
            max_grad_norm=training.max_grad_norm,
        )
    output_dir = run_dir(model, training, world_size(), strategy["label"])
    state = run_state(output_dir)
    if state == "finished" and not training.overwrite:
        raise TextsqlError(
            f"{output_dir.absolute()} holds a finished run with these settings ({SUMMARY_FILE} is there). To train it "
            "again in the same folder, ask for overwrite (`--overwrite True`; overwrite=True in a notebook); or change "
            "a setting, or the output folder (output_dir / runs_root). textsql never deletes a run."
        )
    resume_from = None
    if state == "interrupted" and not training.overwrite:
        newest, set_aside = newest_whole_checkpoint(output_dir)
        for name, problems in set_aside.items():
            logger.warning("Not resuming from %s: %s.", output_dir / name, "; ".join(problems[:3]))
        if newest:
            verify_checkpoint(newest)  # before DeepSpeed unpickles it: the run folder may be writable by others
            resume_from = str(newest)
    settings = dict(precision.trainer_flags(), use_cpu=accelerator == "cpu", output_dir=str(output_dir))
    if dsconfig is not None and resume_from and (Path(resume_from) / "latest_universal").is_file():
        # converted for another world size (textsql.cluster.runs.to_universal): DeepSpeed loads it into any ranks
        dsconfig = dict(dsconfig, checkpoint={**dsconfig.get("checkpoint", {}), "load_universal": True})
    if dsconfig is not None:
        tools = add_ds_tools(
            dsconfig,
            flops_profile_step=training.flops_profiler,
            monitors=training.ds_monitors,
            comms_logger=training.comms_logger,
        )
        settings["deepspeed"] = str(_write_resolved_dsconfig(resolve_for_run(tools, output_dir), output_dir))
    if fsdpconfig is not None:
        settings.update(fsdp_trainer_settings(fsdpconfig, world_size(), nodes_in_launch()))
    return RunSetup(output_dir, precision, accelerator, devices, strategy, dsconfig, resume_from, settings, fsdpconfig)


def fsdp_trainer_settings(fsdpconfig: dict, world: int, nodes: int) -> dict:
    """The Trainer's FSDP2 settings: fsdp on, the config less textsql's keys, and for hybrid sharding accelerate's
    ParallelismConfig (replicated across the pods, sharded over each pod's ranks)."""
    settings = {"fsdp": True, "fsdp_config": trainer_fsdp_config(fsdpconfig)}
    if fsdpconfig.get("hybrid_shard"):
        from accelerate import ParallelismConfig

        replicate, shard = hybrid_sizes(world, nodes)
        settings["parallelism_config"] = ParallelismConfig(dp_replicate_size=replicate, dp_shard_size=shard)
    return settings


def _write_resolved_dsconfig(config: dict, output_dir: Path) -> Path:
    """Each rank writes the same file atomically (nodes may not share a filesystem)."""
    output_dir.mkdir(parents=True, exist_ok=True)
    return replace_file(
        output_dir / RESOLVED_DSCONFIG_FILE, json.dumps(config, indent=2) + "\n"
    )  # never through a planted link


# ---------------------------------------------------------------------------------------------------------------------
# One run: set up -> the objective by --stage -> train -> save -> summary
# ---------------------------------------------------------------------------------------------------------------------

# The training objectives by --stage: each a module whose build(Inputs) returns its trainer (textsql.train.objective),
# imported when its stage runs (GRPO's imports TRL, the grpo extra, which a supervised run does without).
OBJECTIVES = {"sft": "textsql.train.sft", "grpo": "textsql.train.grpo"}


def train(
    model_args: ModelArguments, data_args: DataArguments, training_args: TextsqlTrainingArguments, callbacks=()
) -> RunSummary | None:
    """Plan, train, evaluate, save the model, and write run_summary.json (rank 0). Returns the summary on rank 0.

    The arguments are left as given: the Trainer gets a finalized copy. `callbacks`: transformers TrainerCallbacks
    added to the run's Trainer (the demo's timer).
    """
    import torch.nn.functional as F
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    linear, op_builds = F.linear, {name: os.environ.get(name) for name in OP_BUILD_VARIABLES}
    try:
        return _train(model_args, data_args, training_args, callbacks)
    except BaseException:
        end_failed_run()  # a tracked run's MLflow run ends as FAILED
        raise
    finally:
        # What a DeepSpeed run changes for the rest of the process, given back, so that a notebook or test that trains
        # in-process and then loads or runs another model gets plain torch and transformers: ZeRO-3 replaces torch's
        # F.linear (DeepSpeed: "This will persist unless manually reset"; a torchao-quantized model fails on it), and
        # transformers keeps the run's DeepSpeed config as the process's, so every later from_pretrained would
        # partition the model under zero.Init. The op cache this run chose (use_op_cache) is not the session's: a
        # multi-pod launch from it gives each pod its own.
        F.linear = linear
        unset_hf_deepspeed_config()
        for name, value in op_builds.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _train(
    model_args: ModelArguments, data_args: DataArguments, training_args: TextsqlTrainingArguments, callbacks=()
) -> RunSummary | None:
    """Set up -> the objective --stage names builds its trainer -> train -> save -> the run summary (rank 0)."""
    check_prepared(data_args.dataset_dir)  # before the run folder is made: a run that cannot start leaves nothing
    if training_args.packing:
        check_packing(load_config(model_args.model_id))  # the family now; the attention once the model is loaded
    plan = set_up_run(model_args, training_args)
    finalized = start_run(plan, training_args)
    objective = import_module(OBJECTIVES[training_args.stage])
    built = objective.build(Inputs(model_args, data_args, finalized, training_args, plan))
    trainer = built.trainer
    add_callbacks(trainer, finalized, callbacks)
    arguments = arguments_dict(model_args, data_args, finalized)
    tracking = for_training(
        finalized, arguments, model_args.model_id, built.family.name, plan.strategy, nodes_in_launch(), plan.output_dir
    )
    attach(trainer, tracking)  # MLflow (textsql.tracking): the curves on rank 0, the run's figures after its summary
    result = fit(trainer, plan)
    with watch.phase("final evaluation"):  # each phase judged by its own progress by a watching pod
        eval_metrics = trainer.final_evaluation()
    with watch.phase("final save"):
        save_trained(trainer, built.adapter, plan.output_dir, finalized.save_dtype)
    comms = None
    if comms_logger_enabled(running_ds_config(trainer)):  # on every rank: the summary synchronizes them
        comms = write_comms_summary(plan.output_dir, trainer.is_world_process_zero())
    memory = gather_fields(peak_memory(plan.accelerator))  # numbers and names, never a peer's pickle
    real_tokens = trainer.tokens_read()  # every rank: it may gather
    if not trainer.is_world_process_zero():
        return None
    summary = build_summary(
        model_args, data_args, finalized, plan, result, eval_metrics, memory, real_tokens, built.data_meta, trainer
    )
    trainer.summary_figures(summary)  # the objective's own: MFU for supervised runs, the stage's record for GRPO
    summary.memory_check = compare_with_run(summary)  # every run checks the planner's prediction
    summary.comms_summary = comms
    if trainer.flops_profiler is not None:
        summary.flops_profile = trainer.flops_profiler.figures(
            accumulation=finalized.gradient_accumulation_steps,
            micro_batch=finalized.per_device_train_batch_size,
            precision=plan.precision.name,
            tf32=summary.tf32,
            gpu=memory[0].get("device") if plan.accelerator == "cuda" else None,
            last_step=trainer.state.global_step,
        )
    write_summary(summary, plan.output_dir)
    if tracking is not None:
        tracking.finish(summary, plan.output_dir, plan.fsdpconfig, finalized.mlflow_log_model)
    return summary


def start_run(plan: RunSetup, training_args: TextsqlTrainingArguments) -> TextsqlTrainingArguments:
    """This process made ready for the run `plan` decided: the process group, the Trainer's arguments finalized (a
    copy; the given ones are left as they are), the log, TensorBoard's folder, and DeepSpeed's start (its logs, op
    cache, process group, async I/O) before any model loads."""
    if plan.dsconfig is not None or plan.fsdpconfig is not None or world_size() > 1:
        ensure_distributed_env()  # the Trainer runs FSDP only in a process group, one rank included
    finalized = copy.copy(training_args).finalize(**plan.trainer_settings)
    configure_logging(finalized.process_index == 0, plan.output_dir / LOG_FILE)
    pin_to_one_gpu(finalized)
    os.environ["TENSORBOARD_LOGGING_DIR"] = str(plan.output_dir / "tensorboard")
    if "wandb" in finalized.ds_monitors:
        os.environ.setdefault("WANDB_DIR", str(plan.output_dir))  # W&B's local files in the run folder too
    if plan.dsconfig is not None:
        import deepspeed

        _route_deepspeed_logs()
        if finalized.comms_logger or comms_logger_enabled(plan.dsconfig):
            own_latencies_in_comms_logger()
        # One op cache whoever started this rank; DeepSpeed's first op load would wait forever on a killed build's lock.
        clear_dead_build_locks(use_op_cache())
        # Before from_pretrained, or ZeRO-3's zero.Init assumes a world size of 1.
        deepspeed.init_distributed()
        release_deepspeed_shm_buffer()
        if nvme_offload_blocks(plan.dsconfig):
            load_async_io()  # ZeRO-Infinity's op, before zero.Init's swapper asks for it
    return finalized


def add_callbacks(trainer, training_args: TextsqlTrainingArguments, callbacks=()) -> None:
    """The caller's callbacks added to the trainer; the training loop's phases (textsql.train.watch); a TrainingTimer
    that says once how long the run takes, from its first steps (unless the caller brought its own: the demo's prints
    among its lines); the progress bar for training steps only (not evaluation's)."""
    for callback in callbacks:
        trainer.add_callback(callback)
    trainer.add_callback(PhaseCallback())  # the loop's phases, for a pod that watches this rank (textsql.cluster)
    if not any(isinstance(callback, TrainingTimer) for callback in callbacks):
        trainer.add_callback(TrainingTimer(eval_examples=len(trainer.eval_dataset or ())))
    if not training_args.disable_tqdm:
        from transformers.trainer_callback import ProgressCallback

        trainer.remove_callback(ProgressCallback)
        trainer.add_callback(TrainingProgress)


def fit(trainer, plan: RunSetup):
    """trainer.train(), from the checkpoint an interrupted run left where there is one; the Trainer's result."""
    if plan.resume_from:
        logger.info("Resuming the interrupted run from %s", plan.resume_from)
    logger.info(
        "Training starts: %s, world size %d, %s%s on %s; the full log is %s",
        plan.output_dir,
        trainer.args.world_size,
        plan.precision.name,
        " + TF32" if plan.precision.tf32 else "",
        plan.accelerator,
        plan.output_dir / LOG_FILE,
    )
    try:
        return trainer.train(resume_from_checkpoint=plan.resume_from)
    except ValueError as error:
        if "mismatch" in str(error).lower():
            raise TextsqlError(f"The DeepSpeed config contradicts the command line: {error}") from None
        raise


def save_trained(trainer, adapter: dict | None, output_dir: Path, save_dtype: str) -> None:
    """What the run trained, saved in its folder by every rank (ZeRO-3 gathers collectively): the LoRA adapter only
    where there is one (under ZeRO-3 the frozen base is (0,) placeholders and merge_and_unload does nothing), else the
    whole model in one dtype; and the Trainer's state."""
    if adapter is not None:
        state = adapter_state(trainer.model, trainer.is_deepspeed_enabled)
        if trainer.is_world_process_zero():
            save_adapter(trainer.model, state, output_dir, trainer.processing_class, adapter)
    else:
        save_final_model(trainer, output_dir, save_dtype)
    trainer.save_state()


def build_summary(
    model_args, data_args, training_args, plan, result, eval_metrics, memory, real_tokens, data_meta, trainer
) -> RunSummary:
    """The run's summary from its arguments, set-up, Trainer result and figures, as every objective records it (each
    adds its own: summary_figures)."""
    import deepspeed
    import torch
    import transformers

    metrics = result.metrics
    trainable, parameters = parameter_counts(trainer.model)
    runtime = metrics.get("train_runtime", 0.0)
    ds_config = running_ds_config(trainer)
    return RunSummary.from_dict(
        {
            "run": plan.output_dir.name,
            "output_dir": str(plan.output_dir),
            "model_id": model_args.model_id,
            "parameters": parameters,
            "trainable_parameters": trainable,
            "world_size": training_args.world_size,
            "strategy": plan.strategy,
            "precision": plan.precision.name,
            "tf32": tf32_enabled() if plan.accelerator == "cuda" else False,
            "precision_reason": plan.precision.reason,
            "device": plan.accelerator,
            "node_devices": plan.devices.describe(),
            "resumed_from": plan.resume_from,
            "saved_dtype": training_args.save_dtype,
            "train_runtime": runtime,
            "train_samples_per_second": metrics.get("train_samples_per_second"),
            "real_tokens": real_tokens,
            "real_tokens_per_second": real_tokens / runtime if runtime else None,
            "global_step": trainer.state.global_step,
            "epochs": trainer.state.epoch,
            "train_loss": metrics.get("train_loss"),
            "eval_loss": eval_metrics.get("eval_loss"),
            "execution_accuracy": eval_metrics.get("eval_execution_accuracy"),
            "execution_accuracy_questions": trainer.sql_scoring.questions if trainer.sql_scoring else None,
            "execution_accuracy_history": [
                {"step": h["step"], "execution_accuracy": h["eval_execution_accuracy"]}
                for h in trainer.state.log_history
                if "eval_execution_accuracy" in h
            ],
            "first_logged_loss": next((h["loss"] for h in trainer.state.log_history if "loss" in h), None),
            "last_logged_loss": next((h["loss"] for h in reversed(trainer.state.log_history) if "loss" in h), None),
            "peak_memory_per_rank": memory,
            "tensorboard_dir": os.environ.get("TENSORBOARD_LOGGING_DIR"),
            "dataset": {
                "dir": data_args.dataset_dir,
                "source": data_meta.get("source"),
                "train_examples": len(trainer.train_dataset),
            },
            "arguments": {
                "model": asdict(model_args),
                "data": asdict(data_args),
                "training": json.loads(training_args.to_json_string()),
            },
            "deepspeed_config": ds_config,
            "versions": {
                "textsql": __version__,
                "torch": torch.__version__,
                "transformers": transformers.__version__,
                "deepspeed": deepspeed.__version__,
            },
            "finished": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }
    )
