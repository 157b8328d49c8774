"""The run folder's name: <model>-<strategy>[-lora-r<rank>]-ws<ranks>-bs<batch>, then the settings that make another
experiment (RUN_NAME_PARTS), beside the flags they name."""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path

from textsql.arguments.training import TextsqlTrainingArguments, default_lr_scheduler
from textsql.paths import MODEL_NAME_LIMIT, short_name

# Settings that make another experiment, as short name parts when they differ from textsql's defaults: two runs that
# differ in one of them never share a folder, and the same command finds its own folder again (and resumes there).
# Not the precision: a multi-pod launch decides it for every rank (auto -> bf16/fp32), and the name must not change.
RUN_NAME_PARTS = {
    "learning_rate": "lr{:g}",
    "num_train_epochs": "ep{:g}",
    "max_steps": "steps{}",
    "gradient_accumulation_steps": "ga{}",
    "seed": "seed{}",
    "weight_decay": "wd{:g}",
    "warmup_steps": "warmup{:g}",
    "lr_scheduler_type": "{}",
    "max_grad_norm": "clip{:g}",
    "label_smoothing_factor": "ls{:g}",
    "optim": "{}",
    "activation_checkpointing": "ckpt",
    "packing": "packed",
    "stage": "{}",
}


def run_name_settings(training: TextsqlTrainingArguments) -> list[str]:
    """The name parts of the settings in RUN_NAME_PARTS that differ from their defaults, in that order."""
    defaults = {f.name: f.default for f in fields(TextsqlTrainingArguments) if f.name in RUN_NAME_PARTS}
    defaults["lr_scheduler_type"] = default_lr_scheduler(training.stage)  # "auto", as the run resolved it
    parts = []
    for name, form in RUN_NAME_PARTS.items():
        value = getattr(training, name)
        value = getattr(value, "value", value)  # an enum (lr_scheduler_type, optim) by its value
        default = getattr(defaults[name], "value", defaults[name])
        if value != default and value is not None and value is not False:
            parts.append(form.format(value))
    return parts


def run_folder_name(
    model_id: str,
    strategy_label: str,
    per_device_batch: int,
    ranks: int,
    settings: list[str] = (),
    lora_label: str = "",
) -> str:
    """<model>-<strategy>[-lora-r<rank>]-ws<ranks>-bs<batch>, then the settings that differ from the defaults
    (run_name_settings): LoRA is an option on top of any strategy, named beside it. Short (textsql.paths.short_name):
    a long model name (a run folder as the base) and a long tail of settings are cut and end in a hash; every setting
    is in the run's run_summary.json."""
    model = short_name(Path(model_id.rstrip("/")).name, limit=MODEL_NAME_LIMIT)
    return short_name("-".join([f"{model}-{strategy_label}{lora_label}-ws{ranks}-bs{per_device_batch}", *settings]))
