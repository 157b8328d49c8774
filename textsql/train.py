"""Fine-tune a seq2seq model on prepared WikiSQL with the Seq2SeqTrainer, with or without a DeepSpeed ZeRO config.

Run it as `textsql train ...`, `python -m textsql.train ...`, or under the DeepSpeed launcher:
    deepspeed --num_gpus 2 --module textsql.train --model_id t5-small --deepspeed dsconfig/zero2.json
or with the script path the launcher also accepts: `deepspeed textsql/train.py ...`.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from textsql.errors import TextsqlError

logger = logging.getLogger("textsql.train")

SUMMARY_FILE = "run_summary.json"
PRECISIONS = ("auto", "bf16", "fp32", "fp16")
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

    def __post_init__(self):
        if self.execution_accuracy_samples < 0:
            raise TextsqlError("--execution_accuracy_samples must be 0 (off) or a positive number of validation questions.")
        for name in ("max_train_samples", "max_eval_samples"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise TextsqlError(f"--{name} must be a positive number (or left out for all).")


@dataclass
class RunArguments:
    """How textsql sets up the run around the Trainer."""

    runs_root: str = field(default="runs", metadata={"help": "Root of all runs; a run's folder is named <model>-<strategy>-ws<world size>-bs<batch>."})
    precision: str = field(default="auto", metadata={"help": "auto (bf16 on GPUs that have it, else fp32), bf16, fp32 or fp16."})
    device: str = field(default="auto", metadata={"help": "auto (the GPU when there is one), cuda (stop if there is none) or cpu."})
    force_fp16: bool = field(default=False, metadata={"help": "Allow fp16 on T5 anyway (it overflows to NaN on t5-large)."})
    overwrite: bool = field(default=False, metadata={"help": "Train again in the folder of a finished run (nothing is deleted; files are replaced)."})

    def __post_init__(self):
        if self.precision not in PRECISIONS:
            raise TextsqlError(f"--precision must be one of {', '.join(PRECISIONS)}, not '{self.precision}'.")
        if self.device not in ("auto", "cuda", "cpu"):
            raise TextsqlError(f"--device must be one of auto, cuda, cpu, not '{self.device}'.")


# Defaults textsql chooses for Trainer arguments the user did not give on the command line.
TRAINER_DEFAULTS = {
    "num_train_epochs": "3",
    "per_device_train_batch_size": "32",
    "per_device_eval_batch_size": "32",
    "learning_rate": "3e-4",
    "eval_strategy": "epoch",
    "save_strategy": "epoch",
    "save_total_limit": "2",
    "logging_steps": "50",
    "logging_first_step": "True",
    "report_to": "tensorboard",
    # Batches of similar lengths waste little on padding (transformers 5 has no group_by_length flag).
    "train_sampling_strategy": "group_by_length",
    # T5's forward ignores the token count, so averaging across devices would scale the loss by the world size.
    "average_tokens_across_devices": "False",
    "ddp_find_unused_parameters": "False",
    "seed": "42",
}


def normalize_argv(argv: list[str]) -> list[str]:
    """Map the walkthrough's flag names to the Trainer's and expand `--deepspeed zero2` to the shipped file."""
    result = []
    for arg in argv:
        flag, eq, value = arg.partition("=")
        result.append(LEGACY_FLAGS.get(flag, flag) + eq + value if flag.startswith("--") else arg)
    return result


def given(argv: list[str], name: str) -> bool:
    return any(a == f"--{name}" or a.startswith(f"--{name}=") for a in argv)


def flag_value(argv: list[str], name: str) -> str | None:
    for i, arg in enumerate(argv):
        if arg.startswith(f"--{name}="):
            return arg.split("=", 1)[1]
        if arg == f"--{name}" and i + 1 < len(argv):
            return argv[i + 1]
    return None


def resolve_precision(run: RunArguments, model_id: str) -> str:
    """bf16 where the GPU has it, fp32 otherwise; fp16 on T5 only when forced."""
    import torch

    precision = run.precision
    if precision == "auto":
        precision = "bf16" if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else "fp32"
    if precision == "fp16" and "t5" in model_id.lower() and not run.force_fp16:
        raise TextsqlError(
            "fp16 is refused for T5: T5 checkpoints were pretrained in bf16 and their activations overflow fp16, "
            "giving NaN losses (t5-large and larger). Use --precision bf16 (Ampere or newer GPUs) or fp32, or pass "
            "--force_fp16 True to try anyway."
        )
    if precision == "bf16" and not _bf16_available():
        raise TextsqlError("--precision bf16 needs a GPU with bf16 (Ampere or newer); use --precision fp32 here.")
    return precision


def _bf16_available() -> bool:
    import torch

    return torch.cuda.is_available() and torch.cuda.is_bf16_supported()


def world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def rank() -> int:
    return int(os.environ.get("RANK", "0"))


def run_folder_name(model_id: str, strategy_label: str, per_device_batch: int) -> str:
    return f"{Path(model_id.rstrip('/')).name}-{strategy_label}-ws{world_size()}-bs{per_device_batch}"


def ensure_distributed_env() -> None:
    """DeepSpeed outside its launcher needs the rank variables (else it looks for mpi4py)."""
    if "RANK" in os.environ:
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(port))


def output_state(output_dir: Path) -> str:
    """'new', 'finished' (a run summary is there) or 'interrupted' (checkpoints but no summary)."""
    if (output_dir / SUMMARY_FILE).exists():
        return "finished"
    if output_dir.is_dir() and any(p.name.startswith("checkpoint-") for p in output_dir.iterdir()):
        return "interrupted"
    return "new"


@dataclass
class RunPlan:
    """Everything decided before the Trainer is built."""

    output_dir: Path
    precision: str
    strategy: dict
    dsconfig: dict | None
    resume_from: str | None
    trainer_argv: list[str]


def plan_run(argv: list[str], model: ModelArguments, run: RunArguments) -> RunPlan:
    """Validate the dsconfig, pick the output folder and precision, and decide whether to resume."""
    from textsql.dsconfig import check_batch_settings, describe_strategy, load_dsconfig, resolve_dsconfig_path, resolve_for_run

    import torch

    dsconfig_arg = flag_value(argv, "deepspeed")
    dsconfig = None
    if dsconfig_arg:
        dsconfig = load_dsconfig(resolve_dsconfig_path(dsconfig_arg))
    strategy = describe_strategy(dsconfig)
    batch = int(flag_value(argv, "per_device_train_batch_size") or TRAINER_DEFAULTS["per_device_train_batch_size"])
    if dsconfig is not None:
        check_batch_settings(
            dsconfig,
            per_device_train_batch_size=batch,
            gradient_accumulation_steps=int(flag_value(argv, "gradient_accumulation_steps") or 1),
            world_size=world_size(),
            max_grad_norm=float(flag_value(argv, "max_grad_norm") or 1.0),
        )
    output_dir = Path(flag_value(argv, "output_dir") or Path(run.runs_root) / run_folder_name(model.model_id, strategy["label"], batch))
    state = output_state(output_dir)
    if state == "finished" and not run.overwrite:
        raise TextsqlError(
            f"'{output_dir}' holds a finished run ({SUMMARY_FILE} is there). Pass --overwrite True to train again in it, "
            "or choose another --output_dir / --runs_root. textsql never deletes a run."
        )
    resume_from = None
    if state == "interrupted" and not run.overwrite:
        from transformers.trainer_utils import get_last_checkpoint

        resume_from = get_last_checkpoint(str(output_dir))
    precision = resolve_precision(run, model.model_id)
    trainer_argv = [a for a in argv]
    if dsconfig is not None:
        trainer_argv = replace_flag(trainer_argv, "deepspeed", str(_write_resolved_dsconfig(resolve_for_run(dsconfig, output_dir), output_dir)))
    extra = dict(TRAINER_DEFAULTS, output_dir=str(output_dir))
    extra["bf16"] = str(precision == "bf16")
    extra["fp16"] = str(precision == "fp16")
    if not torch.cuda.is_available():
        extra["use_cpu"] = "True"
    elif _bf16_available():
        extra["tf32"] = "True"
    for name, value in extra.items():
        if not given(trainer_argv, name):
            trainer_argv += [f"--{name}", value]
    return RunPlan(output_dir, precision, strategy, dsconfig, resume_from, trainer_argv)


def replace_flag(argv: list[str], name: str, value: str) -> list[str]:
    """argv with the value of `--name` (either `--name V` or `--name=V`) replaced."""
    result, skip = [], False
    for i, arg in enumerate(argv):
        if skip:
            skip = False
            continue
        if arg == f"--{name}":
            result += [arg, value]
            skip = True
        elif arg.startswith(f"--{name}="):
            result.append(f"--{name}={value}")
        else:
            result.append(arg)
    return result


def _write_resolved_dsconfig(config: dict, output_dir: Path) -> Path:
    """Each rank writes the same file atomically (nodes may not share a filesystem)."""
    output_dir.mkdir(parents=True, exist_ok=True)
    path = output_dir / "ds_config.json"
    tmp = output_dir / f".ds_config.{socket.gethostname()}.{os.getpid()}.tmp"
    tmp.write_text(json.dumps(config, indent=2) + "\n")
    os.replace(tmp, path)
    return path


def parse_arguments(argv: list[str]):
    """(model, data, run, training arguments, plan), parsed the Hugging Face way."""
    from transformers import HfArgumentParser, Seq2SeqTrainingArguments

    argv = normalize_argv(argv)
    if "-h" in argv or "--help" in argv:
        HfArgumentParser((ModelArguments, DataArguments, RunArguments, Seq2SeqTrainingArguments)).print_help()
        raise SystemExit(0)
    own = HfArgumentParser((ModelArguments, DataArguments, RunArguments))
    model, data, run, rest = own.parse_args_into_dataclasses(args=argv, return_remaining_strings=True)
    plan = plan_run(rest, model, run)
    if plan.dsconfig is not None or world_size() > 1:
        ensure_distributed_env()
    trainer_parser = HfArgumentParser(Seq2SeqTrainingArguments)
    try:
        (training,) = trainer_parser.parse_args_into_dataclasses(args=plan.trainer_argv)
    except ValueError as error:
        raise TextsqlError(f"Invalid training arguments: {error}") from None
    return model, data, run, training, plan


def load_training_data(data: DataArguments, tokenizer, has_eval: bool = True):
    """Train and validation splits with only the model's columns, checked against the tokenizer used in prep."""
    from textsql.data import load_prepared, tokenizer_fingerprint

    dataset, metadata = load_prepared(data.dataset_dir)
    expected = metadata.get("tokenizer_fingerprint")
    if expected and expected != tokenizer_fingerprint(tokenizer):
        raise TextsqlError(
            f"'{data.dataset_dir}' was tokenized with '{metadata['tokenizer']}', whose vocabulary differs from this model's "
            "tokenizer. Run `textsql prep` again with --model_id set to the model you train."
        )
    columns = ["input_ids", "attention_mask", "labels"]
    train = dataset["train"].select_columns(columns)
    if data.max_train_samples:
        train = train.select(range(min(data.max_train_samples, len(train))))
    evaluation = dataset["validation"].select_columns(columns) if "validation" in dataset else None
    if evaluation is not None and data.max_eval_samples:
        evaluation = evaluation.select(range(min(data.max_eval_samples, len(evaluation))))
    return train, evaluation, metadata


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

        def evaluate(self, *args, **kwargs):
            metrics = super().evaluate(*args, **kwargs)
            if self.execution_scoring is not None:
                accuracy = self.execution_accuracy()
                metrics["eval_execution_accuracy"] = accuracy
                self.log({"eval_execution_accuracy": accuracy})
            return metrics

        def execution_accuracy(self) -> float:
            """Every rank generates the same questions: under ZeRO-3 they must step through generate() together."""
            from transformers.integrations import is_deepspeed_zero3_enabled

            from textsql.infer import generate_sql, score_predictions

            model = self.accelerator.unwrap_model(self.model)
            predictions = generate_sql(
                model, self.processing_class, self.execution_scoring.sources, batch_size=self.args.per_device_eval_batch_size,
                synced_gpus=is_deepspeed_zero3_enabled() and self.args.world_size > 1, progress=self.is_world_process_zero(),
                device=self.args.device,
            )
            _, metrics = score_predictions(self.execution_scoring, predictions)
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


def peak_memory() -> dict:
    """This rank's peak memory: CUDA max allocated/reserved on a GPU, resident set size on the CPU."""
    import resource

    import torch

    info = {"rank": rank(), "local_rank": int(os.environ.get("LOCAL_RANK", "0")), "host": socket.gethostname()}
    info["cpu_peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    if torch.cuda.is_available():
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


def configure_logging(is_main: bool) -> None:
    import transformers

    level = logging.INFO if is_main else logging.WARNING
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s", level=level)
    transformers.utils.logging.set_verbosity(level)


def train(argv: list[str]) -> dict | None:
    """Parse, plan, train, evaluate, save the model, and write run_summary.json (rank 0). Returns the summary on rank 0."""
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    model_args, data_args, run_args, training_args, plan = parse_arguments(argv)
    configure_logging(training_args.process_index == 0)
    os.environ["TENSORBOARD_LOGGING_DIR"] = str(plan.output_dir / "tensorboard")
    if plan.dsconfig is not None:
        import deepspeed

        # Before from_pretrained, or ZeRO-3's zero.Init assumes a world size of 1.
        deepspeed.init_distributed()

    from transformers import DataCollatorForSeq2Seq

    from textsql.hub import load_seq2seq_model, load_tokenizer

    tokenizer = load_tokenizer(model_args.model_id)
    train_set, eval_set, data_meta = load_training_data(data_args, tokenizer)
    if eval_set is None and training_args.eval_strategy != "no":
        raise TextsqlError(f"'{data_args.dataset_dir}' has no validation split; pass --eval_strategy no to train without evaluation.")
    model = load_seq2seq_model(model_args.model_id)
    if training_args.activation_checkpointing:
        model.config.use_cache = False
    collator = DataCollatorForSeq2Seq(
        tokenizer, model=model, label_pad_token_id=-100, pad_to_multiple_of=8 if torch.cuda.is_available() else None
    )
    trainer = make_trainer_class()(
        model=model,
        args=training_args,
        train_dataset=train_set,
        eval_dataset=eval_set,
        data_collator=collator,
        processing_class=tokenizer,
    )
    if data_args.execution_accuracy_samples and eval_set is not None:
        from textsql.infer import load_scoring_set

        trainer.execution_scoring = load_scoring_set(data_args.dataset_dir, "validation", data_args.execution_accuracy_samples)
    if plan.resume_from:
        logger.info("Resuming the interrupted run from %s", plan.resume_from)
    try:
        result = trainer.train(resume_from_checkpoint=plan.resume_from)
    except ValueError as error:
        if "mismatch" in str(error).lower():
            raise TextsqlError(f"The DeepSpeed config contradicts the command line: {error}") from None
        raise
    eval_metrics = trainer.evaluate() if eval_set is not None else {}
    trainer.save_model(str(plan.output_dir))  # every rank: ZeRO-3 gathers the weights collectively
    trainer.save_state()
    memory = gather_to_all(peak_memory())
    real_tokens = sum(gather_to_all(trainer.real_tokens))
    if not trainer.is_world_process_zero():
        return None
    summary = build_summary(model_args, data_args, run_args, training_args, plan, result, eval_metrics, memory, real_tokens, data_meta, trainer)
    from textsql.memory import compare_with_run

    summary["memory_check"] = compare_with_run(summary)  # every run checks the planner's prediction
    (plan.output_dir / SUMMARY_FILE).write_text(json.dumps(summary, indent=2, default=str) + "\n")
    return summary


def build_summary(model_args, data_args, run_args, training_args, plan, result, eval_metrics, memory, real_tokens, data_meta, trainer) -> dict:
    import deepspeed
    import torch
    import transformers

    from textsql import __version__

    metrics = result.metrics
    runtime = metrics.get("train_runtime", 0.0)
    ds_config = None
    if trainer.is_deepspeed_enabled:
        ds_config = trainer.accelerator.state.deepspeed_plugin.hf_ds_config.config
    return {
        "run": plan.output_dir.name,
        "output_dir": str(plan.output_dir),
        "model_id": model_args.model_id,
        "parameters": sum(p.numel() for p in trainer.model.parameters()) if not plan.strategy.get("zero_stage") == 3 else _zero3_parameters(trainer.model),
        "world_size": training_args.world_size,
        "strategy": plan.strategy,
        "precision": plan.precision,
        "resumed_from": plan.resume_from,
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
            "run": asdict(run_args),
            "training": json.loads(training_args.to_json_string()),
        },
        "deepspeed_config": ds_config,
        "versions": {"textsql": __version__, "torch": torch.__version__, "transformers": transformers.__version__, "deepspeed": deepspeed.__version__},
        "finished": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def _zero3_parameters(model) -> int:
    # Under ZeRO-3 each parameter is a placeholder; ds_numel holds its real size.
    return sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())


def format_summary(summary: dict) -> str:
    """A few lines for people: what ran, how fast, how well, how much memory per rank."""
    gib = 1024**3
    lines = [
        f"run            {summary['run']}  ({summary['output_dir']})",
        f"model          {summary['model_id']}  {summary['parameters'] / 1e6:.2f}M parameters, {summary['precision']}",
        f"strategy       {summary['strategy']['label']}  world size {summary['world_size']}",
        f"steps          {summary['global_step']}  epochs {summary['epochs']:.2f}  runtime {summary['train_runtime']:.1f} s",
        f"throughput     {summary['train_samples_per_second']:.1f} samples/s, {summary['real_tokens_per_second']:.0f} real tokens/s",
        f"loss           first {summary['first_logged_loss']:.3f} -> last {summary['last_logged_loss']:.3f}; "
        f"train {summary['train_loss']:.3f}, eval {summary['eval_loss'] if summary['eval_loss'] is None else round(summary['eval_loss'], 3)}",
    ]
    if summary.get("execution_accuracy") is not None:
        lines.append(f"exec accuracy  {summary['execution_accuracy']:.1%} on the first {summary['arguments']['data']['execution_accuracy_samples']} validation questions")
    for m in summary["peak_memory_per_rank"]:
        gpu = f", CUDA max allocated {m['cuda_max_allocated_bytes'] / gib:.2f} GiB reserved {m['cuda_max_reserved_bytes'] / gib:.2f} GiB" if "cuda_max_allocated_bytes" in m else ""
        lines.append(f"rank {m['rank']:<9} {m['host']} {m['device']}: peak RSS {m['cpu_peak_rss_bytes'] / gib:.2f} GiB{gpu}")
    if summary.get("memory_check"):
        from textsql.memory import format_comparison

        lines.append(format_comparison(summary["memory_check"]))
    lines.append(f"tensorboard    tensorboard --logdir {Path(summary['output_dir']).parent}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        summary = train(argv)
    except TextsqlError as error:
        print(f"textsql train: {error}", file=sys.stderr)
        return 2
    if summary is not None:
        from textsql.launch import SUMMARY_MARKER

        print(format_summary(summary))
        print(f"{SUMMARY_MARKER}{Path(summary['output_dir']).resolve() / SUMMARY_FILE}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
