"""Load, validate, describe and prepare the DeepSpeed JSON configs that training hands to the Trainer."""

from __future__ import annotations

import copy
import warnings
from pathlib import Path

from textsql.errors import TextsqlError
from textsql.paths import DS_MONITOR_DIR, DSCONFIG_DIR, FLOPS_PROFILE_FILE
from textsql.strategy.dsconfig_rules import (
    ACCELERATE_PLUGIN_AUTO,
    _accelerate_plugin,
    _import_deepspeed,
    _offload_device,
    _problem_paragraph,
    _quiet_deepspeed,
    _read_json,
    _Review,
    _review_config,
    _value_at,
)


class DsConfigWarning(UserWarning):
    """A setting that runs but is probably not what was meant (a key DeepSpeed ignores, a multi-GB bucket, ...)."""


# ---------------------------------------------------------------------------------------------------------------------
# Public API
# ---------------------------------------------------------------------------------------------------------------------


def load_dsconfig(path) -> dict:
    """Read a DeepSpeed JSON file, check every key and value, and return the parsed dict unchanged.

    Everything that would stop the Trainer, accelerate or DeepSpeed is collected and raised together as one
    TextsqlError; settings that run but look like mistakes are warned about with DsConfigWarning.
    """
    path = Path(path)
    review = _Review()
    cfg = _read_json(path, review)
    _import_deepspeed()
    with _quiet_deepspeed():
        _review_config(cfg, review)
    if review.problems:
        raise TextsqlError(_problem_paragraph(path, review.problems))
    for message in review.warnings:
        warnings.warn(message, DsConfigWarning, stacklevel=2)
    return cfg


def check_batch_settings(
    cfg, *, per_device_train_batch_size, gradient_accumulation_steps, world_size, max_grad_norm, source=None
) -> None:
    """Raise TextsqlError when numbers in the DeepSpeed config contradict the training arguments.

    The Trainer does the same comparison, but only after the model is loaded and with a terse message.
    """
    expected = {
        "train_micro_batch_size_per_gpu": (per_device_train_batch_size, "--per_device_train_batch_size"),
        "gradient_accumulation_steps": (gradient_accumulation_steps, "--gradient_accumulation_steps"),
        "train_batch_size": (
            per_device_train_batch_size * gradient_accumulation_steps * world_size,
            f"per_device_train_batch_size × gradient_accumulation_steps × world size "
            f"({per_device_train_batch_size} × {gradient_accumulation_steps} × {world_size})",
        ),
        "gradient_clipping": (max_grad_norm, "--max_grad_norm"),
    }
    where = f"the DeepSpeed config {source}" if source else "the DeepSpeed config"
    clashes = []
    for key, (want, arg) in expected.items():
        have = cfg.get(key)
        if have is not None and have != "auto" and have != want:
            clashes.append(f"{key} is {have} in {where} but {arg} is {want}")
    if clashes:
        raise TextsqlError(
            f"The DeepSpeed config contradicts the training arguments: {'; '.join(clashes)}. "
            f'Set these keys to "auto" in the JSON file so that the Trainer fills them from the training '
            f"arguments, or make the numbers agree."
        )


def describe_strategy(cfg) -> dict:
    """Name the parallel strategy of a config (None means no DeepSpeed): stage, offload devices and a short label.

    A stage or offload device left "auto" is read as accelerate fills it (from ACCELERATE_* variables, else its default).
    """
    if cfg is None:
        return {
            "strategy": "none",
            "zero_stage": None,
            "offload_optimizer": "none",
            "offload_param": "none",
            "label": "none",
        }
    zero = cfg.get("zero_optimization") or {}
    if isinstance(zero, dict) and any(_value_at(cfg, path) == "auto" for path in ACCELERATE_PLUGIN_AUTO):
        zero = _accelerate_plugin(cfg).deepspeed_config["zero_optimization"]
    stage = int(zero.get("stage", 0)) if isinstance(zero, dict) else 0
    offload_optimizer = _offload_device(zero, "offload_optimizer", "cpu_offload") if stage >= 1 else "none"
    offload_param = _offload_device(zero, "offload_param", "cpu_offload_param") if stage == 3 else "none"
    label = f"zero{stage}"
    devices = {offload_optimizer, offload_param}
    if "nvme" in devices:
        label += "_nvme"
    elif "cpu" in devices:
        label += "_offload"
    return {
        "strategy": f"zero{stage}" if stage else "none",
        "zero_stage": stage,
        "offload_optimizer": offload_optimizer,
        "offload_param": offload_param,
        "label": label,
    }


def resolve_for_run(cfg, run_dir) -> dict:
    """Return a deep copy whose unset profiler/monitor output locations point into run_dir.

    DeepSpeed would otherwise write them relative to the working directory of each rank.
    """
    run_dir = Path(run_dir).absolute()
    resolved = copy.deepcopy(cfg)
    profiler = resolved.get("flops_profiler")
    if isinstance(profiler, dict) and profiler.get("output_file") is None:
        profiler["output_file"] = str(run_dir / FLOPS_PROFILE_FILE)
    for monitor in ("tensorboard", "csv_monitor"):
        block = resolved.get(monitor)
        if isinstance(block, dict) and not block.get("output_path"):
            block["output_path"] = str(run_dir / DS_MONITOR_DIR)
    return resolved


# --ds_monitor's names -> DeepSpeed's config block and the subfolder of ds_monitor/ it writes (its job_name).
DS_MONITORS = {"csv": ("csv_monitor", "csv"), "tensorboard": ("tensorboard", "tensorboard"), "wandb": ("wandb", None)}


def add_ds_tools(cfg, *, flops_profile_step: int = 0, monitors=(), comms_logger: bool = False) -> dict:
    """A deep copy with DeepSpeed's tools turned on, keeping what the config sets itself: the flops profiler at optimizer
    step `flops_profile_step` (counted from 1, as the Trainer logs; DeepSpeed counts finished steps, from 0), the
    monitors named (DS_MONITORS) and the comms logger. resolve_for_run then points their files into the run folder."""
    added = copy.deepcopy(cfg)
    if flops_profile_step:
        block = added.setdefault("flops_profiler", {})
        block.update(enabled=True, profile_step=flops_profile_step - 1)
        for key, value in {"module_depth": -1, "top_modules": 1, "detailed": True}.items():
            block.setdefault(key, value)
    for name in monitors:
        key, job_name = DS_MONITORS[name]
        block = added.setdefault(key, {})
        block["enabled"] = True
        if job_name:
            block["job_name"] = job_name  # ds_monitor/csv/, ds_monitor/tensorboard/: where the docs say
        if name == "wandb":
            block.setdefault("project", "textsql")
    if comms_logger:
        added.setdefault("comms_logger", {})["enabled"] = True
    return added


def shipped_in(folder: Path, kind: str) -> dict[str, Path]:
    """The shipped JSON files in `folder` (a folder of the repository: dsconfig/, fsdpconfig/; package data when
    installed), by name without .json. `kind` names them in the message: DeepSpeed, FSDP."""
    if not folder.is_dir():
        raise TextsqlError(
            f"The folder of shipped {kind} configs, {folder}, does not exist: in a checkout, "
            f"textsql/shipped_{folder.name} must be the symbolic link to {folder.name}/ that git stores (check out with "
            f"`git config core.symlinks true`), then reinstall with `pip install .`; or pass the path of your own "
            f"{kind} JSON file instead."
        )
    return {p.stem: p for p in sorted(folder.glob("*.json"))}


def resolve_config_path(name_or_path, shipped: dict[str, Path], kind: str, flag: str) -> Path:
    """An existing JSON file as given, or a shipped strategy's name as its file in `shipped` (shipped_in)."""
    path = Path(name_or_path)
    if path.is_file():
        return path
    if str(name_or_path) in shipped:
        return shipped[str(name_or_path)]
    what = "shipped strategy" if kind == "DeepSpeed" else f"shipped {kind} strategy"
    raise TextsqlError(
        f"{flag} '{name_or_path}' is neither a JSON file nor a {what} ({', '.join(shipped)}): "
        f"there is no such file. Pass the path of your {kind} JSON file, or a shipped name."
    )


def shipped_configs() -> dict[str, Path]:
    """The shipped DeepSpeed JSON files (dsconfig/), by name without .json."""
    return shipped_in(DSCONFIG_DIR, "DeepSpeed")


def resolve_dsconfig_path(name_or_path, flag: str = "--deepspeed") -> Path:
    """An existing JSON file as given, or a shipped strategy name (zero1, zero2, zero3_offload) as dsconfig/NAME.json."""
    return resolve_config_path(name_or_path, shipped_configs(), "DeepSpeed", flag)


def describe_config(cfg) -> str:
    info = describe_strategy(cfg)
    optimizer, param = info["offload_optimizer"], info["offload_param"]
    offload = optimizer if optimizer == param else f"optimizer {optimizer}, param {param}"
    return f"zero{info['zero_stage']}, offload: {offload}"
