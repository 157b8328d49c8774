"""The training arguments: three dataclasses with textsql's defaults (the mixins beside them in textsql/arguments/), parsed
once from a command line, a JSON/YAML recipe or a dict, and handed between processes as one JSON object."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from pathlib import Path

from transformers import Seq2SeqTrainingArguments
from transformers.trainer_utils import IntervalStrategy, SaveStrategy
from transformers.training_args import OptimizerNames

from textsql.arguments.data import DataArguments, ModelArguments
from textsql.arguments.devices import DeviceArguments
from textsql.arguments.dstools import DsToolsArguments
from textsql.arguments.grpo import GRPO_LR_SCHEDULER, GrpoArguments
from textsql.arguments.lora import LoraArguments
from textsql.arguments.speed import SpeedArguments, check_speed_here
from textsql.arguments.tracking import TrackingArguments
from textsql.errors import TextsqlError
from textsql.paths import in_project

# The original walkthrough's flag names, kept so its commands still work.
# transformers 5 renamed gradient checkpointing; the old name still works there but warns and goes away in v6.
LEGACY_FLAGS = {
    "--outputdir": "--output_dir",
    "--epochs": "--num_train_epochs",
    "--gradient_checkpointing": "--activation_checkpointing",
}


def _textsql_default(name: str, default, why: str = ""):
    """A Seq2SeqTrainingArguments field with textsql's default; the Trainer's help text says what it is."""
    parent = _TRAINER_FIELDS[name]
    note = f" textsql's default: {default!r}" + (f" ({why})" if why else "") + "."
    return field(default=default, metadata={**parent.metadata, "help": parent.metadata.get("help", "").rstrip() + note})


_TRAINER_FIELDS = {f.name: f for f in fields(Seq2SeqTrainingArguments)}


def default_lr_scheduler(stage: str) -> str:
    """What --lr_scheduler_type auto means for a stage: linear decay for supervised runs, constant after warm-up for
    GRPO (the run folder names a schedule only where it is not its stage's own)."""
    return GRPO_LR_SCHEDULER if stage == "grpo" else "linear"


@dataclass
class TextsqlTrainingArguments(
    Seq2SeqTrainingArguments,
    DeviceArguments,
    LoraArguments,
    DsToolsArguments,
    TrackingArguments,
    GrpoArguments,
    SpeedArguments,
):
    """The Trainer's arguments with textsql's defaults, and how textsql sets a run up around the Trainer.

    Building one is cheap and touches no device, so a notebook kernel or the multi-pod session (perhaps without a GPU)
    can describe a run and hand it to the processes that train. The Trainer's own checks and device setup run once, in
    the training process, when `train()` finalizes the arguments with what textsql decided there: precision and
    TF32, CPU or GPU, the run folder and the DeepSpeed config written for the run. The LoRA fields
    (textsql.arguments.lora.LoraArguments: --lora, --lora_rank, ...) and DeepSpeed's tools (textsql.arguments.dstools.
    DsToolsArguments: --flops_profiler, --ds_monitor, --comms_logger), MLflow's (textsql.arguments.tracking.TrackingArguments:
    --mlflow_log_model, ...) and the GRPO stage's (textsql.arguments.grpo.GrpoArguments: --stage, --num_generations, ...) are
    training arguments like the others, so they travel with them to every rank and node.
    """

    output_dir: str | None = field(
        default=None,
        metadata={
            "help": "Where the run is written; default: <runs_root>/<model>-<strategy>[-lora-r<rank>]-ws<world size>-bs<batch>."
        },
    )
    num_train_epochs: float = _textsql_default("num_train_epochs", 3.0)
    per_device_train_batch_size: int = _textsql_default("per_device_train_batch_size", 32, "the walkthrough's")
    per_device_eval_batch_size: int = _textsql_default("per_device_eval_batch_size", 32)
    learning_rate: float = _textsql_default("learning_rate", 3e-4)
    lr_scheduler_type: str = field(
        default="auto",
        metadata={
            "help": "The learning rate schedule (transformers' SchedulerType: linear, cosine, constant, "
            "constant_with_warmup, ...). textsql's default auto: linear decay for --stage sft, constant after "
            "--warmup_steps for --stage grpo."
        },
    )
    eval_strategy: IntervalStrategy | str = _textsql_default("eval_strategy", "epoch")
    save_strategy: SaveStrategy | str = _textsql_default("save_strategy", "epoch")
    save_total_limit: int | None = _textsql_default("save_total_limit", 2)
    logging_steps: float = _textsql_default(
        "logging_steps",
        0.02,
        "a fraction of the run: 50 points on every loss curve, a run of 20 steps as much as one of 5,000",
    )
    logging_first_step: bool = _textsql_default("logging_first_step", True)
    report_to: None | str | list[str] = _textsql_default("report_to", "tensorboard")
    train_sampling_strategy: str = _textsql_default(
        "train_sampling_strategy", "group_by_length", "batches of similar lengths waste little on padding"
    )
    average_tokens_across_devices: bool = _textsql_default(
        "average_tokens_across_devices",
        True,
        "a step's loss is the mean over the label tokens of every rank's micro-batches, as one batch on one process "
        "would give; False: each rank's own tokens, the ranks' losses then averaged (docs/training.md)",
    )
    ddp_find_unused_parameters: bool | None = _textsql_default("ddp_find_unused_parameters", False)
    optim: OptimizerNames | str = _textsql_default(
        "optim",
        "adamw_torch_fused",
        "one kernel updates every parameter, on GPUs and the CPU; the foreach AdamW was no faster in "
        "bench/speed_levers.py",
    )
    logging_nan_inf_filter: bool = _textsql_default(
        "logging_nan_inf_filter",
        False,
        "a NaN or inf loss is logged as it is, not hidden; the check cost a GPU sync at every micro-batch "
        "(bench/step_profile.py)",
    )
    fsdp_config: str | None = field(
        default=None,
        metadata={
            "help": "Shard with PyTorch FSDP2 instead of DeepSpeed: a shipped strategy (fsdp_full_shard, "
            "fsdp_shard_grad_op, fsdp_full_shard_offload, fsdp_hybrid_shard; the files are in fsdpconfig/) or your "
            "own FSDP JSON file (`textsql check-config FILE` checks it). GPUs only; textsql turns --fsdp on."
        },
    )
    nvme_path: str | None = field(
        default=None,
        metadata={
            "help": "Folder on a local NVMe drive that ZeRO-Infinity (--deepspeed zero3_nvme) swaps parameters and "
            "optimizer states to: it fills the config's nvme_path \"auto\". Needs DeepSpeed's async I/O op (libaio: "
            "`apt-get install libaio-dev`); `textsql plan` says how much disk it takes."
        },
    )
    # How textsql sets the run up.
    runs_root: str = field(
        default="runs",
        metadata={
            "help": "Root of all runs; a run's folder is named <model>-<strategy>[-lora-r<rank>]-ws<world size>-bs<batch>."
        },
    )
    save_dtype: str = field(
        default="float32",
        metadata={
            "help": "dtype of the saved final model, whatever the strategy trained in: float32 (so every strategy's model "
            "scores alike and can be fine-tuned again without DeepSpeed) or bfloat16 (half the size)."
        },
    )
    overwrite: bool = field(
        default=False,
        metadata={"help": "Train again in the folder of a finished run (nothing is deleted; files are replaced)."},
    )
    packing: bool = field(
        default=False,
        metadata={
            "help": "Causal LMs: put each batch's examples end to end in one row, without padding, the position ids "
            "restarting at each example so that no example attends to another (transformers' "
            "DataCollatorWithFlattening); the loss is the padded batch's. Refused for T5 and for the families whose "
            "attention cannot keep packed examples apart (opt, bloom); see docs/causal-lm.md."
        },
    )

    def __post_init__(self):
        """textsql's own checks only; the Trainer's __post_init__ runs in finalize()."""
        self.runs_root, self.output_dir = in_project(self.runs_root), in_project(self.output_dir)
        self.check_devices()
        if self.save_dtype not in ("float32", "bfloat16"):
            raise TextsqlError(f"--save_dtype must be float32 or bfloat16, not '{self.save_dtype}'.")
        if self.lr_scheduler_type == "auto":
            self.lr_scheduler_type = default_lr_scheduler(self.stage)
        self._check_numbers()
        self.check_lora()
        self.check_ds_tools(self.deepspeed)
        self.check_tracking(self.report_to)
        self.check_grpo()
        self.check_speed()  # the speed levers (textsql.arguments.speed.SpeedArguments); what the device refuses, at start
        if self.stage == "grpo" and self.packing:
            raise TextsqlError(
                "--packing packs gold examples for supervised fine-tuning; --stage grpo trains on its own sampled "
                "completions. Leave --packing out."
            )
        self.finalized = False

    def _check_numbers(self) -> None:
        """Numbers the Trainer or DeepSpeed would only refuse once the ranks have started, refused here, before anything
        starts or any folder is made."""
        for name in ("per_device_train_batch_size", "per_device_eval_batch_size", "gradient_accumulation_steps"):
            if getattr(self, name) < 1:
                raise TextsqlError(f"--{name} must be at least 1, not {getattr(self, name)}.")
        if self.max_steps == 0 or self.max_steps < -1:
            raise TextsqlError(
                f"--max_steps must be a positive number of steps (or -1: --num_train_epochs decides), not {self.max_steps}."
            )
        if self.max_steps == -1 and not self.num_train_epochs > 0:
            raise TextsqlError(
                f"--num_train_epochs must be above 0 (or give --max_steps), not {self.num_train_epochs}."
            )
        if not self.learning_rate > 0:
            raise TextsqlError(f"--learning_rate must be above 0, not {self.learning_rate}.")
        if not self.logging_steps > 0:
            raise TextsqlError(
                f"--logging_steps must be above 0 (a number of steps, or a fraction of the run below 1), not {self.logging_steps}."
            )

    def finalize(self, **decided) -> TextsqlTrainingArguments:
        """Set what textsql decided, then run the Trainer's own checks and device setup (once, in the training process)."""
        if self.finalized:
            raise RuntimeError(
                "These training arguments are finalized already; finalize a copy (copy.copy) for another run."
            )
        for name, value in decided.items():
            setattr(self, name, value)
        try:
            super().__post_init__()
        except ValueError as error:
            raise TextsqlError(f"Invalid training arguments: {error}") from None
        check_speed_here(self)  # the device, strategy and precision now known; before any run folder is made
        self.finalized = True
        return self


ARGUMENT_CLASSES = (ModelArguments, DataArguments, TextsqlTrainingArguments)


RECIPE_SUFFIXES = (".json", ".yaml", ".yml")


def normalize_argv(argv: list[str]) -> list[str]:
    """Map the walkthrough's flag names to the Trainer's."""
    result = []
    for arg in argv:
        flag, eq, value = arg.partition("=")
        result.append(LEGACY_FLAGS.get(flag, flag) + eq + value if flag.startswith("--") else arg)
    return result


def argument_parser():
    from transformers import HfArgumentParser

    return HfArgumentParser(
        ARGUMENT_CLASSES,
        prog="textsql train",
        description="Fine-tune a T5 or causal LM on prepared WikiSQL. Arguments, or one JSON/YAML recipe file.",
    )


def parse_arguments(argv: list[str]) -> tuple[ModelArguments, DataArguments, TextsqlTrainingArguments]:
    """The three argument dataclasses from a command line, or from a JSON or YAML recipe (`textsql train recipe.yaml`),
    or a recipe and flags after it that override its keys (`textsql train recipe.yaml --max_steps 40`)."""
    parser = argument_parser()
    # `deepspeed --module textsql.train recipe.yaml` gives each rank `--local_rank=N recipe.yaml`; LOCAL_RANK says the same
    without_local_rank = [a for a in argv if not a.startswith("--local_rank=")]
    try:
        if without_local_rank and without_local_rank[0].endswith(RECIPE_SUFFIXES):
            recipe = Path(without_local_rank[0])
            if not recipe.is_file():
                raise TextsqlError(f"The recipe file {recipe} does not exist.")
            if len(without_local_rank) == 1:
                if recipe.suffix == ".json":
                    return tuple(parser.parse_json_file(recipe, allow_extra_keys=False))
                return tuple(parser.parse_yaml_file(recipe, allow_extra_keys=False))
            recipe_as_defaults(parser, recipe)
            return tuple(parser.parse_args_into_dataclasses(args=normalize_argv(without_local_rank[1:])))
        return tuple(parser.parse_args_into_dataclasses(args=normalize_argv(argv)))
    except ValueError as error:  # unknown keys or flags, bad values
        raise TextsqlError(f"Invalid training arguments: {error}") from None


def recipe_as_defaults(parser, recipe: Path) -> None:
    """The recipe's keys as the parser's defaults (what a flag after the recipe overrides); an unknown key refused
    with the keys' source named."""
    import json

    import yaml

    text = recipe.read_text(encoding="utf-8")
    values = json.loads(text) if recipe.suffix == ".json" else yaml.safe_load(text)
    if not isinstance(values, dict):
        raise TextsqlError(f"The recipe {recipe} is not a mapping of `textsql train` arguments to values.")
    known = {action.dest: action for action in parser._actions}
    unknown = sorted(set(values) - set(known))
    if unknown:
        raise TextsqlError(
            f"The recipe {recipe} has keys `textsql train` does not know: {', '.join(unknown)} (`textsql train --help` "
            "lists them)."
        )
    for name in values:
        known[name].required = False  # given by the recipe; a flag after it may still override it
    parser.set_defaults(**values)


def as_arguments(arguments) -> tuple[ModelArguments, DataArguments, TextsqlTrainingArguments]:
    """The three argument dataclasses, given as they are or as a command line (parsed here, once)."""
    arguments = tuple(arguments)
    if len(arguments) == 3 and all(isinstance(a, kind) for a, kind in zip(arguments, ARGUMENT_CLASSES)):
        return arguments
    if all(isinstance(a, str) for a in arguments):
        return parse_arguments(list(arguments))
    raise TextsqlError(
        "Pass the training arguments as (ModelArguments, DataArguments, TextsqlTrainingArguments) or as a "
        "command line (a list of strings, as `textsql train` takes)."
    )


def arguments_dict(model: ModelArguments, data: DataArguments, training: TextsqlTrainingArguments) -> dict:
    """The arguments as one JSON-able object (what each dataclass was given: nothing the Trainer derives later), with
    every token left out: the object travels to other processes and nodes, and lands in files."""
    from enum import Enum

    values = {}
    for instance in (model, data, training):
        for f in fields(instance):
            if f.init:
                value = getattr(instance, f.name)
                values[f.name] = value.value if isinstance(value, Enum) else value
    for name in [name for name in values if name.endswith("_token")]:
        values[name] = None
    return values


def arguments_from_dict(values: dict) -> tuple[ModelArguments, DataArguments, TextsqlTrainingArguments]:
    try:
        return tuple(argument_parser().parse_dict(values, allow_extra_keys=False))
    except ValueError as error:
        raise TextsqlError(f"Invalid training arguments: {error}") from None
