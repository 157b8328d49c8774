"""Load, validate, describe and prepare the DeepSpeed JSON configs that training hands to the Trainer."""

from __future__ import annotations

import copy
import difflib
import sys
import warnings
from contextlib import contextmanager
from functools import lru_cache
from pathlib import Path

from textsql.errors import TextsqlError
from textsql.paths import DS_MONITOR_DIR, DSCONFIG_DIR, FLOPS_PROFILE_FILE, FSDPCONFIG_DIR
from textsql.strategy.dsconfig_rules import (
    ACCELERATE_PLUGIN_AUTO,
    accelerate_plugin,
    import_deepspeed,
    offload_device,
    quiet_deepspeed,
    review_file,
    value_at,
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
    cfg, found = review_file(Path(path))
    for message in found:
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
    if isinstance(zero, dict) and any(value_at(cfg, path) == "auto" for path in ACCELERATE_PLUGIN_AUTO):
        zero = accelerate_plugin(cfg).deepspeed_config["zero_optimization"]
    stage = int(zero.get("stage", 0)) if isinstance(zero, dict) else 0
    offload_optimizer = offload_device(zero, "offload_optimizer", "cpu_offload") if stage >= 1 else "none"
    offload_param = offload_device(zero, "offload_param", "cpu_offload_param") if stage == 3 else "none"
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


# The other kind of shipped config, named where a name of one kind is asked for: `--deepspeed fsdp_full_shard` means
# `--fsdp_config fsdp_full_shard`, and a typo's closest name may be of either kind.
OTHER_KIND = {
    "DeepSpeed": ("FSDP", "--fsdp_config", FSDPCONFIG_DIR),
    "FSDP": ("DeepSpeed", "--deepspeed", DSCONFIG_DIR),
}


def resolve_config_path(name_or_path, shipped: dict[str, Path], kind: str, flag: str) -> Path:
    """An existing JSON file as given, or a shipped strategy's name as its file in `shipped` (shipped_in). An unknown
    name is refused with the closest shipped name of either kind (difflib) and the other kind's names."""
    path = Path(name_or_path)
    if path.is_file():
        return path
    name = str(name_or_path)
    if name in shipped:
        return shipped[name]
    other_kind, other_flag, other_dir = OTHER_KIND[kind]
    others = sorted(p.stem for p in other_dir.glob("*.json"))
    what = "shipped strategy" if kind == "DeepSpeed" else f"shipped {kind} strategy"
    if name in others:
        raise TextsqlError(
            f"{flag} '{name}' is a shipped {other_kind} strategy, not a {kind} one: pass it as `{other_flag} {name}` "
            f"(the {kind} strategies: {', '.join(shipped)})."
        )
    close = difflib.get_close_matches(name, [*shipped, *others], n=1, cutoff=0.6)
    hint = ""
    if close:
        hint = f" Did you mean {close[0]}?" if close[0] in shipped else f" Did you mean `{other_flag} {close[0]}`?"
    raise TextsqlError(
        f"{flag} '{name}' is neither a JSON file nor a {what} ({', '.join(shipped)}; {other_kind} strategies, with "
        f"{other_flag}: {', '.join(others)}): there is no such file.{hint} Pass the path of your {kind} JSON file, "
        "or a shipped name."
    )


def nvme_offload_blocks(cfg) -> list[dict]:
    """The offload blocks of a DeepSpeed config that swap to NVMe (offload_optimizer, offload_param)."""
    zero = cfg.get("zero_optimization") if isinstance(cfg, dict) else None
    if not isinstance(zero, dict):
        return []
    blocks = [zero.get(key) for key in ("offload_optimizer", "offload_param")]
    return [block for block in blocks if isinstance(block, dict) and block.get("device") == "nvme"]


def with_nvme_path(cfg, nvme_path) -> dict:
    """A copy of the config whose NVMe offload blocks swap to `nvme_path` (--nvme_path) where they leave nvme_path
    "auto" or unset; refused before launch when an NVMe block has no path, when --nvme_path contradicts the file's,
    or when nothing is offloaded to NVMe and --nvme_path was given."""
    blocks = nvme_offload_blocks(cfg)
    if not blocks:
        if nvme_path:
            raise TextsqlError(
                f"--nvme_path {nvme_path} was given, but this DeepSpeed config offloads nothing to NVMe, so it would "
                'not be used. Pass --deepspeed zero3_nvme (or your own config with an offload device "nvme"), or '
                "leave --nvme_path out."
            )
        return cfg
    resolved = copy.deepcopy(cfg)
    for block in nvme_offload_blocks(resolved):
        given = block.get("nvme_path")
        if given in (None, "auto", "none"):
            if not nvme_path:
                raise TextsqlError(
                    "This DeepSpeed config offloads to NVMe (ZeRO-Infinity: zero3_nvme) but names no folder to swap "
                    'to (nvme_path is "auto" or unset). Pass --nvme_path DIR, a folder on a local NVMe drive with '
                    "room for the model's parameters and optimizer states (`textsql plan` says how much), or choose "
                    "zero3_offload to offload to host memory instead."
                )
            block["nvme_path"] = str(Path(nvme_path).absolute())
        elif nvme_path and Path(given).absolute() != Path(nvme_path).absolute():
            raise TextsqlError(
                f'nvme_path is "{given}" in the DeepSpeed config but --nvme_path is {nvme_path}: write "auto" in the '
                "JSON file so that --nvme_path fills it, or make them agree."
            )
    for folder in {Path(block["nvme_path"]) for block in nvme_offload_blocks(resolved)}:
        if folder.exists() and not folder.is_dir():
            raise TextsqlError(
                f"The NVMe folder {folder} is a file, not a folder. Pass --nvme_path DIR, a folder on a local NVMe "
                "drive (DeepSpeed creates its swap files in it)."
            )
    return resolved


@contextmanager
def _stderr_with_a_descriptor():
    """sys.stderr as a stream with a file descriptor while DeepSpeed's has_function runs: it redirects sys.stderr's
    descriptor to silence the compiler, and on a stream without one (a notebook's, a captured one) it answers "no
    libaio" whatever is installed."""
    try:
        sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):  # io.UnsupportedOperation is both of the last two
        saved, sys.stderr = sys.stderr, sys.__stderr__
        try:
            yield
        finally:
            sys.stderr = saved
    else:
        yield


@lru_cache(maxsize=1)
def async_io_problem() -> str | None:
    """Why DeepSpeed's async I/O op (the NVMe swapper's) cannot run here, with the fix; None when it can: built
    already, or buildable (libaio found by AsyncIOBuilder().is_compatible(), which compiles a call to io_submit)."""
    import_deepspeed()
    with quiet_deepspeed(), _stderr_with_a_descriptor():
        from deepspeed.ops.op_builder import AsyncIOBuilder

        builder = AsyncIOBuilder()
        if builder.is_compatible(verbose=False):
            return None
    return (
        "zero3_nvme swaps parameters and optimizer states to NVMe through DeepSpeed's async I/O op (async_io), and "
        "that op cannot be built here: DeepSpeed's AsyncIOBuilder().is_compatible() found no libaio (its check "
        "compiles and links a call to io_submit). Install libaio's development files (`apt-get install libaio-dev`; "
        "`yum install libaio-devel` on RHEL), or point CFLAGS/LDFLAGS at a libaio built from source; DeepSpeed then "
        "builds the op on the first run. Or offload to host memory instead: --deepspeed zero3_offload."
    )


def load_async_io() -> None:
    """Load DeepSpeed's async I/O op (built once, into TORCH_EXTENSIONS_DIR) before its NVMe swapper asks for it: loaded
    here, where sys.stderr gets a file descriptor for the op's compatibility check, it is the one DeepSpeed reuses."""
    with _stderr_with_a_descriptor():
        from deepspeed.ops.op_builder import AsyncIOBuilder

        AsyncIOBuilder().load(verbose=False)


def check_nvme_offload(cfg, nvme_path) -> dict:
    """with_nvme_path, then refuse an NVMe config that DeepSpeed's async I/O op cannot serve here (async_io_problem)."""
    resolved = with_nvme_path(cfg, nvme_path)
    if nvme_offload_blocks(resolved):
        problem = async_io_problem()
        if problem:
            raise TextsqlError(problem)
    return resolved


def shipped_configs() -> dict[str, Path]:
    """The shipped DeepSpeed JSON files (dsconfig/), by name without .json."""
    return shipped_in(DSCONFIG_DIR, "DeepSpeed")


def resolve_dsconfig_path(name_or_path, flag: str = "--deepspeed") -> Path:
    """An existing JSON file as given, or a shipped strategy name (zero1, zero2, zero3, ...) as dsconfig/NAME.json."""
    return resolve_config_path(name_or_path, shipped_configs(), "DeepSpeed", flag)


def describe_config(cfg) -> str:
    info = describe_strategy(cfg)
    optimizer, param = info["offload_optimizer"], info["offload_param"]
    offload = optimizer if optimizer == param else f"optimizer {optimizer}, param {param}"
    unset = any(block.get("nvme_path") in (None, "auto") for block in nvme_offload_blocks(cfg))
    return f"zero{info['zero_stage']}, offload: {offload}" + (", nvme_path from --nvme_path" if unset else "")
