"""Fine-tune a seq2seq model on prepared WikiSQL with the Seq2SeqTrainer, with or without a DeepSpeed ZeRO config.

Run it as `textsql train ...` (one rank per visible GPU), `textsql train recipe.yaml`, `python -m textsql.train ...`,
or under a launcher: `deepspeed --num_gpus 2 --module textsql.train --model_id t5-small --deepspeed zero2`. From Python:
    train(ModelArguments(model_id="t5-small"), DataArguments(), TextsqlTrainingArguments(deepspeed="zero2"))
"""

from __future__ import annotations

import copy
import json
import logging
import os
import socket
import sys
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING

from transformers import Seq2SeqTrainingArguments
from transformers.trainer_utils import IntervalStrategy, SaveStrategy

from textsql.checkpoints import verify_checkpoint
from textsql.errors import TextsqlError
from textsql.sharedfiles import replace_file

if TYPE_CHECKING:
    from textsql.devices import NodeDevices, PrecisionChoice
    from textsql.run_summary import RunSummary

logger = logging.getLogger("textsql.train")

# The original walkthrough's flag names, kept so its commands still work.
# transformers 5 renamed gradient checkpointing; the old name still works there but warns and goes away in v6.
LEGACY_FLAGS = {"--outputdir": "--output_dir", "--epochs": "--num_train_epochs", "--gradient_checkpointing": "--activation_checkpointing"}


@dataclass
class ModelArguments:
    """Which model to fine-tune."""

    model_id: str = field(default="t5-small", metadata={"help": "Hub name (t5-small, t5-large, t5-3b) or a local model folder."})


@dataclass
class DataArguments:
    """Which prepared dataset to train on."""

    dataset_dir: str = field(default="data/wikisql", metadata={"help": "Folder written by `textsql prep`."})
    max_train_samples: int | None = field(default=None, metadata={"help": "Train on at most this many examples."})
    max_eval_samples: int | None = field(default=None, metadata={"help": "Evaluate on at most this many validation examples."})
    execution_accuracy_samples: int = field(
        default=0,
        metadata={"help": "At each evaluation, generate SQL for the first N validation questions and log their execution "
                  "accuracy (TensorBoard eval/execution_accuracy, run_summary.json). 0 turns it off."},
    )
    execution_accuracy_decoding: str = field(
        default="greedy",
        metadata={"help": "Decoding for that score: greedy, or execution_guided (the best of --execution_accuracy_num_beams "
                  "beams that executes; see textsql infer --decoding)."},
    )
    execution_accuracy_num_beams: int = field(default=1, metadata={"help": "Beams for that score (at least 2 with execution_guided)."})

    def __post_init__(self):
        from textsql.infer import check_decoding

        if self.execution_accuracy_samples < 0:
            raise TextsqlError("--execution_accuracy_samples must be 0 (off) or a positive number of validation questions.")
        check_decoding(self.execution_accuracy_decoding, self.execution_accuracy_num_beams, "--execution_accuracy_")
        for name in ("max_train_samples", "max_eval_samples"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise TextsqlError(f"--{name} must be a positive number (or left out for all).")


def _textsql_default(name: str, default, why: str = ""):
    """A Seq2SeqTrainingArguments field with textsql's default; the Trainer's help text says what it is."""
    parent = _TRAINER_FIELDS[name]
    note = f" textsql's default: {default!r}" + (f" ({why})" if why else "") + "."
    return field(default=default, metadata={**parent.metadata, "help": parent.metadata.get("help", "").rstrip() + note})


_TRAINER_FIELDS = {f.name: f for f in fields(Seq2SeqTrainingArguments)}


@dataclass
class TextsqlTrainingArguments(Seq2SeqTrainingArguments):
    """The Trainer's arguments with textsql's defaults, and how textsql sets a run up around the Trainer.

    Building one is cheap and touches no device, so a notebook kernel or the multi-pod session (perhaps without a GPU)
    can describe a run and hand it to the processes that train. The Trainer's own checks and device setup run once, in
    the training process, when `train()` finalizes the arguments with what textsql decided there: precision and
    TF32, CPU or GPU, the run folder and the DeepSpeed config written for the run.
    """

    output_dir: str | None = field(
        default=None, metadata={"help": "Where the run is written; default: <runs_root>/<model>-<strategy>-ws<world size>-bs<batch>."})
    num_train_epochs: float = _textsql_default("num_train_epochs", 3.0)
    per_device_train_batch_size: int = _textsql_default("per_device_train_batch_size", 32, "the walkthrough's")
    per_device_eval_batch_size: int = _textsql_default("per_device_eval_batch_size", 32)
    learning_rate: float = _textsql_default("learning_rate", 3e-4)
    eval_strategy: IntervalStrategy | str = _textsql_default("eval_strategy", "epoch")
    save_strategy: SaveStrategy | str = _textsql_default("save_strategy", "epoch")
    save_total_limit: int | None = _textsql_default("save_total_limit", 2)
    logging_steps: float = _textsql_default("logging_steps", 50)
    logging_first_step: bool = _textsql_default("logging_first_step", True)
    report_to: None | str | list[str] = _textsql_default("report_to", "tensorboard")
    train_sampling_strategy: str = _textsql_default(
        "train_sampling_strategy", "group_by_length", "batches of similar lengths waste little on padding")
    average_tokens_across_devices: bool = _textsql_default(
        "average_tokens_across_devices", False, "T5's forward ignores the token count, so averaging would scale the loss by the world size")
    ddp_find_unused_parameters: bool | None = _textsql_default("ddp_find_unused_parameters", False)
    # How textsql sets the run up.
    runs_root: str = field(default="runs", metadata={"help": "Root of all runs; a run's folder is named <model>-<strategy>-ws<world size>-bs<batch>."})
    precision: str = field(
        default="auto",
        metadata={"help": "auto (bf16 where every GPU has it natively: compute capability 8.0+, with TF32 for the rest; fp32 "
                  "on older GPUs and the CPU), bf16, fp32 (true fp32 matmuls, no TF32) or fp16. The Trainer's --bf16/--fp16 "
                  "flags mean the same."},
    )
    force_fp16: bool = field(default=False, metadata={"help": "Allow fp16 on T5 anyway (it overflows to NaN on t5-large)."})
    # Not `device`: that is the Trainer's property for the torch device it sets up.
    accelerator: str = field(
        default="auto",
        metadata={"help": "auto (the GPUs when there are any), cuda (stop with an error when this process sees no GPU, "
                  "instead of training on the CPU) or cpu."},
    )
    num_gpus: int | None = field(
        default=None,
        metadata={"help": "Ranks on this pod when `textsql train` is started directly: one per visible GPU by default "
                  "(started through the deepspeed launcher), 1 to train on one GPU. Ignored under a launcher."},
    )
    save_dtype: str = field(
        default="float32",
        metadata={"help": "dtype of the saved final model, whatever the strategy trained in: float32 (so every strategy's model "
                  "scores alike and can be fine-tuned again without DeepSpeed) or bfloat16 (half the size)."},
    )
    overwrite: bool = field(default=False, metadata={"help": "Train again in the folder of a finished run (nothing is deleted; files are replaced)."})

    def __post_init__(self):
        """textsql's own checks only; the Trainer's __post_init__ runs in finalize()."""
        from textsql.devices import DEVICE_CHOICES, PRECISIONS

        if self.precision not in PRECISIONS:
            raise TextsqlError(f"--precision must be one of {', '.join(PRECISIONS)}, not '{self.precision}'.")
        if self.accelerator not in DEVICE_CHOICES:
            raise TextsqlError(f"--accelerator must be one of {', '.join(DEVICE_CHOICES)}, not '{self.accelerator}'.")
        if self.save_dtype not in ("float32", "bfloat16"):
            raise TextsqlError(f"--save_dtype must be float32 or bfloat16, not '{self.save_dtype}'.")
        if self.num_gpus is not None and self.num_gpus < 1:
            raise TextsqlError(f"--num_gpus must be at least 1 (or left out for one rank per visible GPU), not {self.num_gpus}.")
        self.finalized = False

    def finalize(self, **decided) -> "TextsqlTrainingArguments":
        """Set what textsql decided, then run the Trainer's own checks and device setup (once, in the training process)."""
        if self.finalized:
            raise RuntimeError("These training arguments are finalized already; finalize a copy (copy.copy) for another run.")
        for name, value in decided.items():
            setattr(self, name, value)
        try:
            super().__post_init__()
        except ValueError as error:
            raise TextsqlError(f"Invalid training arguments: {error}") from None
        self.finalized = True
        return self


def world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def rank() -> int:
    return int(os.environ.get("RANK", "0"))


def run_folder_name(model_id: str, strategy_label: str, per_device_batch: int, ranks: int) -> str:
    return f"{Path(model_id.rstrip('/')).name}-{strategy_label}-ws{ranks}-bs{per_device_batch}"


def load_strategy(deepspeed) -> tuple[dict | None, dict]:
    """(the DeepSpeed config, validated, or None without one; its strategy: stage, offload, label)."""
    from textsql.dsconfig import describe_strategy, load_dsconfig, resolve_dsconfig_path

    if not deepspeed:
        return None, describe_strategy(None)
    config = load_dsconfig(resolve_dsconfig_path(deepspeed)) if not isinstance(deepspeed, dict) else deepspeed
    return config, describe_strategy(config)


def run_dir(model: ModelArguments, training: TextsqlTrainingArguments, ranks: int, strategy_label: str | None = None) -> Path:
    """The run's folder: --output_dir, or <runs_root>/<model>-<strategy>-ws<ranks>-bs<batch>."""
    if training.output_dir:
        return Path(training.output_dir)
    if strategy_label is None:
        strategy_label = load_strategy(training.deepspeed)[1]["label"]
    return Path(training.runs_root) / run_folder_name(model.model_id, strategy_label, training.per_device_train_batch_size, ranks)


def ensure_distributed_env() -> None:
    """DeepSpeed outside its launcher needs the rank variables (else it looks for mpi4py)."""
    from textsql.launch import free_port

    if "RANK" in os.environ:
        return
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))


@dataclass
class RunPlan:
    """Everything decided before the Trainer is built, and the Trainer settings it fixes."""

    output_dir: Path
    precision: PrecisionChoice
    accelerator: str
    devices: NodeDevices
    strategy: dict
    dsconfig: dict | None
    resume_from: str | None
    trainer_settings: dict


def plan_run(model: ModelArguments, training: TextsqlTrainingArguments, devices=None) -> RunPlan:
    """Decide the device, precision and run folder, validate the DeepSpeed config against the arguments, and decide
    whether to resume. `devices` (textsql.devices.NodeDevices) is what this process sees; read from torch when not given.
    """
    from textsql.devices import NodeDevices, choose_accelerator, precision_from_trainer_flags, resolve_precision, use_accelerator
    from textsql.dsconfig import check_batch_settings, resolve_for_run
    from textsql.run_summary import SUMMARY_FILE, run_state

    devices = devices if devices is not None else NodeDevices.local()
    accelerator = choose_accelerator(training.accelerator, devices)
    use_accelerator(accelerator)  # before anything imports deepspeed
    requested = precision_from_trainer_flags(training.precision, training.bf16, training.fp16)
    precision = resolve_precision(requested, model.model_id, devices.gpus if accelerator == "cuda" else (), force_fp16=training.force_fp16)
    dsconfig, strategy = load_strategy(training.deepspeed)
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
            f"'{output_dir}' holds a finished run ({SUMMARY_FILE} is there). Pass --overwrite True to train again in it, "
            "or choose another --output_dir / --runs_root. textsql never deletes a run."
        )
    resume_from = None
    if state == "interrupted" and not training.overwrite:
        from transformers.trainer_utils import get_last_checkpoint

        resume_from = get_last_checkpoint(str(output_dir))
        if resume_from:
            verify_checkpoint(resume_from)  # before DeepSpeed unpickles it: the run folder may be writable by others
    settings = dict(precision.trainer_flags(), use_cpu=accelerator == "cpu", output_dir=str(output_dir))
    if dsconfig is not None:
        settings["deepspeed"] = str(_write_resolved_dsconfig(resolve_for_run(dsconfig, output_dir), output_dir))
    return RunPlan(output_dir, precision, accelerator, devices, strategy, dsconfig, resume_from, settings)


def _write_resolved_dsconfig(config: dict, output_dir: Path) -> Path:
    """Each rank writes the same file atomically (nodes may not share a filesystem)."""
    output_dir.mkdir(parents=True, exist_ok=True)
    return replace_file(output_dir / "ds_config.json", json.dumps(config, indent=2) + "\n")  # never through a planted link


# ---------------------------------------------------------------------------------------------------------------------
# Arguments: parsed once (command line, or a JSON/YAML recipe), handed between processes as one JSON object
# ---------------------------------------------------------------------------------------------------------------------

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

    return HfArgumentParser(ARGUMENT_CLASSES, prog="textsql train",
                            description="Fine-tune a seq2seq model on prepared WikiSQL. Arguments, or one JSON/YAML recipe file.")


def parse_arguments(argv: list[str]) -> tuple[ModelArguments, DataArguments, TextsqlTrainingArguments]:
    """The three argument dataclasses from a command line, or from a JSON or YAML recipe (`textsql train recipe.yaml`)."""
    parser = argument_parser()
    # `deepspeed --module textsql.train recipe.yaml` gives each rank `--local_rank=N recipe.yaml`; LOCAL_RANK says the same
    without_local_rank = [a for a in argv if not a.startswith("--local_rank=")]
    try:
        if len(without_local_rank) == 1 and without_local_rank[0].endswith(RECIPE_SUFFIXES):
            recipe = Path(without_local_rank[0])
            if not recipe.is_file():
                raise TextsqlError(f"The recipe file {recipe} does not exist.")
            if recipe.suffix == ".json":
                return tuple(parser.parse_json_file(recipe, allow_extra_keys=False))
            return tuple(parser.parse_yaml_file(recipe, allow_extra_keys=False))
        return tuple(parser.parse_args_into_dataclasses(args=normalize_argv(argv)))
    except ValueError as error:  # unknown keys or flags, bad values
        raise TextsqlError(f"Invalid training arguments: {error}") from None


def as_arguments(arguments) -> tuple[ModelArguments, DataArguments, TextsqlTrainingArguments]:
    """The three argument dataclasses, given as they are or as a command line (parsed here, once)."""
    arguments = tuple(arguments)
    if len(arguments) == 3 and all(isinstance(a, kind) for a, kind in zip(arguments, ARGUMENT_CLASSES)):
        return arguments
    if all(isinstance(a, str) for a in arguments):
        return parse_arguments(list(arguments))
    raise TextsqlError("Pass the training arguments as (ModelArguments, DataArguments, TextsqlTrainingArguments) or as a "
                       "command line (a list of strings, as `textsql train` takes).")


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


def load_training_data(data: DataArguments, model_tokenizer):
    """(train split, validation split or None, metadata, tokenizer): only the model's columns, and the tokenizer to train
    with (the model's own, or prep's copy with the characters it lacked; see textsql.data.tokenizer_for_training)."""
    from textsql.data import load_prepared, tokenizer_for_training

    dataset, metadata = load_prepared(data.dataset_dir)
    tokenizer = tokenizer_for_training(model_tokenizer, data.dataset_dir, metadata)
    columns = ["input_ids", "attention_mask", "labels"]
    train = dataset["train"].select_columns(columns)
    if data.max_train_samples:
        train = train.select(range(min(data.max_train_samples, len(train))))
    evaluation = dataset["validation"].select_columns(columns) if "validation" in dataset else None
    if evaluation is not None and data.max_eval_samples:
        evaluation = evaluation.select(range(min(data.max_eval_samples, len(evaluation))))
    return train, evaluation, metadata, tokenizer


def make_trainer_class():
    """Seq2SeqTrainer that counts real (non-pad) tokens and logs throughput to TensorBoard."""
    import torch
    from transformers import Seq2SeqTrainer

    class TextsqlTrainer(Seq2SeqTrainer):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.real_tokens = 0
            self._pending_tokens = torch.zeros((), dtype=torch.long)
            self._last_log = (time.perf_counter(), 0, 0)

        execution_scoring = None  # a textsql.infer.ScoringSet when execution accuracy is scored at each evaluation
        execution_decoding = {"decoding": "greedy", "num_beams": 1}
        last_evaluation = None  # (global step, metrics) of the latest evaluate()

        def evaluate(self, *args, **kwargs):
            metrics = super().evaluate(*args, **kwargs)
            if self.execution_scoring is not None:
                accuracy = self.execution_accuracy()
                metrics["eval_execution_accuracy"] = accuracy
                self.log({"eval_execution_accuracy": accuracy})
            self.last_evaluation = (self.state.global_step, dict(metrics))
            return metrics

        def final_evaluation(self) -> dict:
            """The final weights' metrics: those of the evaluation training ended with when it fell on the last step (the same
            weights; scoring them again costs a whole generation pass on a large model), else a new evaluation."""
            step, metrics = self.last_evaluation or (None, None)
            if step == self.state.global_step and not self.args.load_best_model_at_end:
                return metrics
            return self.evaluate()

        def execution_accuracy(self) -> float:
            """Every rank generates the same questions: under ZeRO-3 they must step through generate() together."""
            from transformers.integrations import is_deepspeed_zero3_enabled

            from textsql.infer import decode_and_score

            decoding = self.execution_decoding
            _, metrics = decode_and_score(
                self.accelerator.unwrap_model(self.model), self.processing_class, self.execution_scoring,
                decoding=decoding["decoding"], num_beams=decoding["num_beams"], batch_size=self.args.per_device_eval_batch_size,
                synced_gpus=is_deepspeed_zero3_enabled() and self.args.world_size > 1, progress=False,
                device=self.args.device,
            )
            return metrics["execution_accuracy"]

        def training_step(self, model, inputs, num_items_in_batch=None):
            # Accumulated on the batch's device and read only at log time, so no sync per step.
            tokens = inputs["attention_mask"].sum() + (inputs["labels"] != -100).sum()
            self._pending_tokens = self._pending_tokens.to(tokens.device) + tokens
            return super().training_step(model, inputs, num_items_in_batch)

        def log(self, logs, start_time=None):
            self.real_tokens += int(self._pending_tokens.item())
            self._pending_tokens.zero_()
            now, last_step, last_tokens = time.perf_counter(), *self._last_log[1:]
            last_time = self._last_log[0]
            if "loss" in logs and self.state.global_step > last_step and now > last_time:
                steps = self.state.global_step - last_step
                samples = steps * self.args.train_batch_size * self.args.gradient_accumulation_steps * self.args.world_size
                logs["samples_per_second"] = round(samples / (now - last_time), 3)
                # Rank 0's real tokens times the world size: the others see batches of the same distribution.
                logs["real_tokens_per_second"] = round((self.real_tokens - last_tokens) * self.args.world_size / (now - last_time), 1)
                self._last_log = (now, self.state.global_step, self.real_tokens)
            super().log(logs, start_time)

    return TextsqlTrainer


def peak_memory(accelerator: str | None = None) -> dict:
    """This rank's peak memory: CUDA max allocated/reserved on a GPU, resident set size on the CPU."""
    import resource

    import torch

    info = {"rank": rank(), "local_rank": int(os.environ.get("LOCAL_RANK", "0")), "host": socket.gethostname()}
    info["cpu_peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    if (accelerator or ("cuda" if torch.cuda.is_available() else "cpu")) == "cuda":
        info["device"] = torch.cuda.get_device_name()
        info["cuda_max_allocated_bytes"] = torch.cuda.max_memory_allocated()
        info["cuda_max_reserved_bytes"] = torch.cuda.max_memory_reserved()
    else:
        info["device"] = "cpu"
    return info


def gather_to_all(value) -> list:
    """Every rank's value (rank order) when running distributed, else just this one."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [value]
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, value)
    return gathered


LOG_FILE = "train.log"
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class _TerminalFilter(logging.Filter):
    """Warnings from everyone, and textsql's own messages (resuming, grown embeddings, ...) on rank 0."""

    def __init__(self, is_main: bool):
        super().__init__()
        self.is_main = is_main

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.WARNING or (self.is_main and record.name.startswith("textsql"))


def configure_logging(is_main: bool, log_file: Path | None = None) -> None:
    """The terminal shows one training progress bar (the Trainer's), the logged losses and evaluation results, warnings,
    textsql's own messages and the summary; rank 0's `log_file` keeps everything at INFO (transformers' per-checkpoint
    "Configuration saved in ..." lines, DeepSpeed's engine and config dumps). Safe to call again in one process."""
    import datasets
    import transformers

    root = logging.getLogger()
    for handler in [h for h in root.handlers if getattr(h, "textsql", False)]:
        root.removeHandler(handler)
        handler.close()
    terminal = logging.StreamHandler()
    terminal.addFilter(_TerminalFilter(is_main))
    handlers = [terminal]
    if log_file is not None and is_main:
        Path(log_file).parent.mkdir(parents=True, exist_ok=True)
        handlers.append(logging.FileHandler(log_file, encoding="utf-8"))
    for handler in handlers:
        handler.textsql = True
        handler.setFormatter(logging.Formatter(LOG_FORMAT))
        root.addHandler(handler)
    root.setLevel(logging.INFO)
    transformers.utils.logging.set_verbosity(logging.INFO if is_main else logging.WARNING)
    transformers.utils.logging.disable_default_handler()  # its records reach the two handlers above instead
    transformers.utils.logging.enable_propagation()
    transformers.utils.logging.disable_progress_bar()  # "Loading weights", "Writing model shards"
    datasets.disable_progress_bars()
    if "deepspeed" in sys.modules:
        _route_deepspeed_logs()


def _route_deepspeed_logs() -> None:
    """DeepSpeed logs through its own stdout handler: keep its INFO lines for the file only."""
    from deepspeed.utils import logger as deepspeed_logger

    for handler in deepspeed_logger.handlers:
        if not getattr(handler, "textsql", False):
            handler.setLevel(logging.WARNING)
    deepspeed_logger.propagate = True


def training_progress_only():
    """The Trainer's progress callback without its nested evaluation bar (which fills a log or notebook with escape codes)."""
    from transformers.trainer_callback import ProgressCallback

    class TrainingProgress(ProgressCallback):
        def on_prediction_step(self, args, state, control, eval_dataloader=None, **kwargs):
            pass

    return TrainingProgress


def pin_to_one_gpu(training_args, plan: RunPlan) -> None:
    """One process that sees several GPUs trains on the first only: the Trainer would wrap the model in nn.DataParallel
    (slow, and every figure of the run would describe one process driving several GPUs). Use all of them with one rank
    per GPU: `textsql.launch.run_training(argv)` (the notebooks' way) or `deepspeed --num_gpus N --module textsql.train`."""
    if training_args.world_size == 1 and training_args.n_gpu > 1:
        logger.warning("%d GPUs are visible to this one process; training on %s only. To train on all of them, start one "
                       "rank per GPU (textsql.launch.run_training, or `deepspeed --num_gpus %d --module textsql.train ...`).",
                       training_args.n_gpu, training_args.device, training_args.n_gpu)
        training_args._n_gpu = 1


def tf32_enabled() -> bool:
    """Whether fp32 matmuls on the GPU may use TF32 in this process (what really runs, not what was asked)."""
    import torch

    if not torch.cuda.is_available():
        return False
    return torch.backends.cuda.matmul.fp32_precision == "tf32" or bool(torch.backends.cuda.matmul.allow_tf32)


def save_final_model(trainer, output_dir: Path, dtype: str) -> None:
    """Save the trained weights in one dtype whatever the strategy ran (fp32 by default), with the tokenizer; every rank
    calls it. DeepSpeed holds the fp32 master weights in its optimizer (the module itself is bf16 under bf16 ZeRO-1/2,
    and placeholders under ZeRO-3): they are read with safe_get_full_fp32_param, collectively under ZeRO-3. The result
    loads without DeepSpeed, so scores compare across strategies and the model can be fine-tuned again on any strategy.
    """
    import torch

    target = getattr(torch, dtype)
    model = trainer.model
    if trainer.is_deepspeed_enabled:
        from deepspeed.utils import safe_get_full_fp32_param

        state = {}
        for name, param in model.named_parameters():  # the same order on every rank: each call is a collective
            full = safe_get_full_fp32_param(param)
            state[name] = (param if full is None else full).detach().to("cpu", target)  # None: a frozen ZeRO-1/2 parameter, whole
    else:
        state = {name: param.detach().to("cpu", target) for name, param in model.named_parameters()}
    if trainer.is_world_process_zero() or (trainer.args.save_on_each_node and trainer.is_local_process_zero()):
        model.save_pretrained(str(output_dir), state_dict=state, safe_serialization=True)
        # save_pretrained records the module's dtype (bf16 under DeepSpeed bf16); from_pretrained(dtype="auto") reads it.
        model.config.dtype = dtype
        model.config.save_pretrained(str(output_dir))
        trainer.processing_class.save_pretrained(str(output_dir))
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.barrier()


def train(model_args: ModelArguments, data_args: DataArguments, training_args: TextsqlTrainingArguments) -> RunSummary | None:
    """Plan, train, evaluate, save the model, and write run_summary.json (rank 0). Returns the summary on rank 0.

    The arguments are left as given: the Trainer gets a finalized copy.
    """
    plan = plan_run(model_args, training_args)
    if plan.dsconfig is not None or world_size() > 1:
        ensure_distributed_env()
    training_args = copy.copy(training_args).finalize(**plan.trainer_settings)
    configure_logging(training_args.process_index == 0, plan.output_dir / LOG_FILE)
    pin_to_one_gpu(training_args, plan)
    os.environ["TENSORBOARD_LOGGING_DIR"] = str(plan.output_dir / "tensorboard")
    if plan.dsconfig is not None:
        import deepspeed

        _route_deepspeed_logs()
        # Before from_pretrained, or ZeRO-3's zero.Init assumes a world size of 1.
        deepspeed.init_distributed()

    from transformers import DataCollatorForSeq2Seq

    from textsql.data import check_source_settings, record_source_settings
    from textsql.hub import load_seq2seq_model, load_tokenizer
    from textsql.vocabulary import fit_embeddings

    train_set, eval_set, data_meta, tokenizer = load_training_data(data_args, load_tokenizer(model_args.model_id))
    if eval_set is None and training_args.eval_strategy != "no":
        raise TextsqlError(f"'{data_args.dataset_dir}' has no validation split; pass --eval_strategy no to train without evaluation.")
    model = load_seq2seq_model(model_args.model_id)
    check_source_settings(model.config, data_meta, data_args.dataset_dir)
    record_source_settings(model.config, data_meta)  # every saved copy of the model says what it reads
    if fit_embeddings(model, tokenizer):
        logger.info("Grew the embeddings to %d ids for the characters prep added to the tokenizer", len(tokenizer))
    if training_args.activation_checkpointing:
        model.config.use_cache = False
    collator = DataCollatorForSeq2Seq(
        tokenizer, model=model, label_pad_token_id=-100, pad_to_multiple_of=8 if plan.accelerator == "cuda" else None
    )
    trainer = make_trainer_class()(
        model=model,
        args=training_args,
        train_dataset=train_set,
        eval_dataset=eval_set,
        data_collator=collator,
        processing_class=tokenizer,
    )
    if not training_args.disable_tqdm:
        from transformers.trainer_callback import ProgressCallback

        trainer.remove_callback(ProgressCallback)
        trainer.add_callback(training_progress_only())
    if data_args.execution_accuracy_samples and eval_set is not None:
        from textsql.infer import load_scoring_set

        trainer.execution_scoring = load_scoring_set(data_args.dataset_dir, "validation", data_args.execution_accuracy_samples)
        trainer.execution_decoding = {"decoding": data_args.execution_accuracy_decoding, "num_beams": data_args.execution_accuracy_num_beams}
    if plan.resume_from:
        logger.info("Resuming the interrupted run from %s", plan.resume_from)
    logger.info("Training starts: %s, world size %d, %s%s on %s; the full log is %s", plan.output_dir, training_args.world_size,
                plan.precision.name, " + TF32" if plan.precision.tf32 else "", plan.accelerator, plan.output_dir / LOG_FILE)
    try:
        result = trainer.train(resume_from_checkpoint=plan.resume_from)
    except ValueError as error:
        if "mismatch" in str(error).lower():
            raise TextsqlError(f"The DeepSpeed config contradicts the command line: {error}") from None
        raise
    eval_metrics = trainer.final_evaluation() if eval_set is not None else {}
    save_final_model(trainer, plan.output_dir, training_args.save_dtype)  # every rank: ZeRO-3 gathers collectively
    trainer.save_state()
    memory = gather_to_all(peak_memory(plan.accelerator))
    real_tokens = sum(gather_to_all(trainer.real_tokens))
    if not trainer.is_world_process_zero():
        return None
    summary = build_summary(model_args, data_args, training_args, plan, result, eval_metrics, memory, real_tokens, data_meta, trainer)
    from textsql.plan import compare_with_run
    from textsql.run_summary import write_summary

    summary.memory_check = compare_with_run(summary)  # every run checks the planner's prediction
    write_summary(summary, plan.output_dir)
    return summary


def build_summary(model_args, data_args, training_args, plan, result, eval_metrics, memory, real_tokens, data_meta, trainer) -> RunSummary:
    import deepspeed
    import torch
    import transformers

    from textsql import __version__
    from textsql.run_summary import RunSummary

    metrics = result.metrics
    runtime = metrics.get("train_runtime", 0.0)
    ds_config = None
    if trainer.is_deepspeed_enabled:
        ds_config = trainer.accelerator.state.deepspeed_plugin.hf_ds_config.config
    return RunSummary.from_dict({
        "run": plan.output_dir.name,
        "output_dir": str(plan.output_dir),
        "model_id": model_args.model_id,
        "parameters": sum(p.numel() for p in trainer.model.parameters()) if not plan.strategy.get("zero_stage") == 3 else _zero3_parameters(trainer.model),
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
        "execution_accuracy_history": [
            {"step": h["step"], "execution_accuracy": h["eval_execution_accuracy"]} for h in trainer.state.log_history if "eval_execution_accuracy" in h
        ],
        "first_logged_loss": next((h["loss"] for h in trainer.state.log_history if "loss" in h), None),
        "last_logged_loss": next((h["loss"] for h in reversed(trainer.state.log_history) if "loss" in h), None),
        "peak_memory_per_rank": memory,
        "tensorboard_dir": os.environ.get("TENSORBOARD_LOGGING_DIR"),
        "dataset": {"dir": data_args.dataset_dir, "source": data_meta.get("source"), "train_examples": len(trainer.train_dataset)},
        "arguments": {
            "model": asdict(model_args),
            "data": asdict(data_args),
            "training": json.loads(training_args.to_json_string()),
        },
        "deepspeed_config": ds_config,
        "versions": {"textsql": __version__, "torch": torch.__version__, "transformers": transformers.__version__, "deepspeed": deepspeed.__version__},
        "finished": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    })


def _zero3_parameters(model) -> int:
    # Under ZeRO-3 each parameter is a placeholder; ds_numel holds its real size.
    return sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())


def launches_ranks(training: TextsqlTrainingArguments, devices=None) -> int:
    """How many ranks `textsql train` itself must start on this pod: 0 under a launcher or for one rank (it trains in
    this process), else one per visible GPU (or --num_gpus)."""
    from textsql.devices import ranks_per_node
    from textsql.launch import STARTED_BY_TEXTSQL, node_devices

    if "LOCAL_RANK" in os.environ or STARTED_BY_TEXTSQL in os.environ:
        return 0
    ranks = ranks_per_node(training.num_gpus, devices if devices is not None else node_devices(training.accelerator))
    return ranks if ranks > 1 else 0


def train_and_report(model_args: ModelArguments, data_args: DataArguments, training_args: TextsqlTrainingArguments) -> int:
    """Train, then (rank 0) print the summary and the line that tells a launcher where run_summary.json is; 2 with one
    paragraph for a problem the user can fix."""
    try:
        summary = train(model_args, data_args, training_args)
    except TextsqlError as error:
        print(f"textsql train: {error}", file=sys.stderr)
        return 2
    if summary is not None:
        from textsql.launch import SUMMARY_MARKER
        from textsql.run_summary import SUMMARY_FILE, format_summary

        print(format_summary(summary))
        print(f"{SUMMARY_MARKER}{Path(summary.output_dir).resolve() / SUMMARY_FILE}", flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    """`textsql train ARGS` or `textsql train recipe.yaml`: parse once, then train here or start one rank per GPU."""
    argv = sys.argv[1:] if argv is None else argv
    try:
        model_args, data_args, training_args = parse_arguments(argv)
        ranks = launches_ranks(training_args)
        if ranks:
            from textsql.launch import run_training

            run_training(model_args, data_args, training_args, num_gpus=ranks)  # rank 0 prints the summary
            return 0
    except TextsqlError as error:
        print(f"textsql train: {error}", file=sys.stderr)
        return 2
    return train_and_report(model_args, data_args, training_args)


def end_distributed(succeeded: bool) -> None:
    """Leave the process group before the interpreter exits, as torch asks of every program: otherwise gloo's or NCCL's
    threads are torn down at exit, which can abort a rank that has finished ("terminate called without an active
    exception"). After a failure the other ranks may never arrive, so there is no barrier then."""
    if "torch" not in sys.modules:  # --help, a bad argument: nothing was started
        return
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return
    if succeeded:
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    status = main()
    end_distributed(status == 0)
    sys.exit(status)
