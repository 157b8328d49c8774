"""Load, check and describe the PyTorch FSDP2 configs (fsdpconfig/*.json) that training hands to the Trainer, and refuse
FSDP where it would not shard (the CPU)."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

from textsql.errors import TextsqlError
from textsql.paths import FSDPCONFIG_DIR
from textsql.strategy.devices import NodeDevices
from textsql.strategy.dsconfig import resolve_config_path, shipped_in
from textsql.strategy.table import FSDP_LAYOUT

FSDP_VERSION = 2
# The keys the Trainer reads from fsdp_config for FSDP2 (transformers' TrainingArguments._process_fsdp_args), each with
# the values it accepts; "hybrid_shard" is textsql's own (accelerate's ParallelismConfig, set by textsql at launch).
BOOLEAN_KEYS = (
    "reshard_after_forward",
    "cpu_offload",
    "cpu_ram_efficient_loading",
    "activation_checkpointing",
    "hybrid_shard",
)
CHOICE_KEYS = {
    "auto_wrap_policy": ("TRANSFORMER_BASED_WRAP", "SIZE_BASED_WRAP", "NO_WRAP"),  # accelerate's FSDP_AUTO_WRAP_POLICY
    "state_dict_type": ("FULL_STATE_DICT", "SHARDED_STATE_DICT"),  # accelerate's FSDP2_STATE_DICT_TYPE
}
KNOWN_KEYS = {"version", "transformer_layer_cls_to_wrap", "min_num_params", *BOOLEAN_KEYS, *CHOICE_KEYS}
TEXTSQL_KEYS = ("hybrid_shard",)
# FSDP1's knobs: FSDP2 (the only version textsql runs; transformers deprecates FSDP1) ignores or refuses them.
FSDP1_KEYS = (
    "sharding_strategy",
    "backward_prefetch",
    "forward_prefetch",
    "use_orig_params",
    "sync_module_states",
    "limit_all_gathers",
)


class FsdpConfigWarning(UserWarning):
    """A setting that runs but is probably not what was meant (a whole stack gathered at once, say)."""


def load_fsdpconfig(path) -> dict:
    """Read an FSDP JSON file, check every key and value, and return it with the Trainer's `fsdp_` prefixes removed.

    Everything the Trainer would ignore or stop on is collected and raised together as one TextsqlError; a setting that
    runs but looks like a mistake is warned about with FsdpConfigWarning."""
    path = Path(path)
    try:
        raw = json.loads(path.read_text())
    except OSError as error:
        raise TextsqlError(
            f"The FSDP config {path} cannot be read ({error.strerror}). Pass an existing JSON file, or "
            f"a shipped strategy name ({', '.join(shipped_fsdp_configs())})."
        ) from None
    except json.JSONDecodeError as error:
        raise TextsqlError(
            f"The FSDP config {path} is not valid JSON: {error.msg} at line {error.lineno}, column "
            f"{error.colno}. Fix the file (compare with {FSDPCONFIG_DIR / 'fsdp_full_shard.json'})."
        ) from None
    problems, cautions = check_fsdpconfig(raw)
    if problems:
        raise TextsqlError(
            f"The FSDP config {path} cannot be used: " + "; ".join(problems) + ". Fix these keys (the "
            f"shipped files in {FSDPCONFIG_DIR} show every key with a valid value), then run "
            f"`textsql check-config {path}` again."
        )
    for caution in cautions:
        warnings.warn(f"{path}: {caution}", FsdpConfigWarning, stacklevel=2)
    return normalized(raw)


def normalized(raw: dict) -> dict:
    """The config with the Trainer's optional `fsdp_` key prefixes removed (the Trainer strips them too)."""
    return {key.removeprefix("fsdp_"): value for key, value in raw.items()}


def check_fsdpconfig(raw) -> tuple[list[str], list[str]]:
    """(problems, cautions) of an FSDP config as parsed JSON: what would stop the Trainer or silently not apply, and
    what runs but is probably a mistake."""
    if not isinstance(raw, dict):
        return [f"it must be a JSON object of fsdp_config keys, not {type(raw).__name__}"], []
    cfg, problems, cautions = normalized(raw), [], []
    version = cfg.get("version", FSDP_VERSION)
    if version != FSDP_VERSION:
        problems.append(
            f"version is {version!r}: textsql runs FSDP2 only (version 2; transformers deprecates FSDP1 and removes it)"
        )
    for key in cfg:
        if key in FSDP1_KEYS:
            problems.append(
                f"{key} is an FSDP1 setting that FSDP2 does not read (sharding is reshard_after_forward true "
                "for full shard, false for shard-grad-op; hybrid_shard true shards inside a pod)"
            )
        elif key.startswith("xla"):
            problems.append(f"{key} is for TPUs (torch_xla), which textsql does not train on")
        elif key not in KNOWN_KEYS:
            problems.append(
                f"{key} is not an FSDP2 setting the Trainer reads (it would be ignored silently); known keys: "
                f"{', '.join(sorted(KNOWN_KEYS))}"
            )
    for key in BOOLEAN_KEYS:
        if key in cfg and not isinstance(cfg[key], bool):
            problems.append(f"{key} must be true or false, not {cfg[key]!r}")
    for key, choices in CHOICE_KEYS.items():
        if key in cfg and cfg[key] not in choices:
            problems.append(f"{key} must be one of {', '.join(choices)}, not {cfg[key]!r}")
    if "min_num_params" in cfg and (
        isinstance(cfg["min_num_params"], bool)
        or not isinstance(cfg["min_num_params"], int)
        or cfg["min_num_params"] < 0
    ):
        problems.append(f"min_num_params must be a whole number of at least 0, not {cfg['min_num_params']!r}")
    layers = cfg.get("transformer_layer_cls_to_wrap")
    if layers is not None and not (
        isinstance(layers, list) and layers and all(isinstance(n, str) and n for n in layers)
    ):
        problems.append(
            'transformer_layer_cls_to_wrap must be a list of module class names, like ["LlamaDecoderLayer"], or left '
            f"out (each model's own decoder layers: its _no_split_modules), not {layers!r}"
        )
    elif layers and cfg.get("auto_wrap_policy", "TRANSFORMER_BASED_WRAP") != "TRANSFORMER_BASED_WRAP":
        cautions.append(
            f"transformer_layer_cls_to_wrap is read only with auto_wrap_policy TRANSFORMER_BASED_WRAP, not "
            f"{cfg['auto_wrap_policy']}"
        )
    if cfg.get("hybrid_shard") and cfg.get("cpu_offload"):
        cautions.append("hybrid_shard with cpu_offload keeps a whole replica of the model states on every pod's host")
    if cfg.get("activation_checkpointing"):
        cautions.append(
            "activation_checkpointing here is FSDP's own; do not also pass --activation_checkpointing True "
            "(the Trainer refuses both)"
        )
    return problems, cautions


def describe_fsdp_strategy(cfg: dict) -> dict:
    """The strategy of a loaded FSDP config, shaped as dsconfig.describe_strategy's (zero_stage None: no DeepSpeed)."""
    layout = (
        bool(cfg.get("reshard_after_forward", True)),
        bool(cfg.get("cpu_offload", False)),
        bool(cfg.get("hybrid_shard", False)),
    )
    label = next((name for name, row in FSDP_LAYOUT.items() if row == layout), None)
    if label is None:  # a combination without its own row (hybrid with offload, shard-grad-op with offload)
        reshard, offload, hybrid = layout
        label = (
            "fsdp_"
            + ("hybrid_shard" if hybrid else "full_shard" if reshard else "shard_grad_op")
            + ("_offload" if offload else "")
        )
    offload = "cpu" if layout[1] else "none"
    return {
        "strategy": "fsdp",
        "zero_stage": None,
        "offload_optimizer": offload,
        "offload_param": offload,
        "label": label,
        "fsdp_version": int(cfg.get("version", FSDP_VERSION)),
        "reshard_after_forward": layout[0],
        "hybrid_shard": layout[2],
    }


def describe_fsdp_config(cfg: dict) -> str:
    info = describe_fsdp_strategy(cfg)
    sharding = (
        "hybrid (sharded in a pod, replicated across pods)"
        if info["hybrid_shard"]
        else ("full shard" if info["reshard_after_forward"] else "shard-grad-op")
    )
    return f"FSDP2 {sharding}, offload: {info['offload_param']}"


def trainer_fsdp_config(cfg: dict) -> dict:
    """What the Trainer's fsdp_config gets: the file's keys less textsql's own."""
    return {key: value for key, value in cfg.items() if key not in TEXTSQL_KEYS}


def hybrid_sizes(world_size: int, nodes: int) -> tuple[int, int]:
    """(dp_replicate_size, dp_shard_size) of hybrid sharding: shard over a pod's ranks, replicate across the pods."""
    if nodes < 1 or world_size % nodes:
        raise TextsqlError(
            f"Hybrid sharding needs the same number of ranks on every pod, but {world_size} ranks do not "
            f"divide over {nodes} pods. Give every pod the same number of GPUs."
        )
    if nodes > 1 and world_size == nodes:
        raise TextsqlError(
            "Hybrid sharding with one GPU per pod shards nothing (every pod holds a whole replica): use no "
            "strategy (plain data parallel) or fsdp_full_shard to shard across the pods."
        )
    return nodes, world_size // nodes


def check_fsdp_devices(strategy: dict, accelerator: str, devices: NodeDevices) -> None:
    """Refuse FSDP on the CPU: accelerate turns FSDP on for GPU backends only, so the Trainer would silently train plain
    DDP with every rank holding the whole model (FSDP1 stops with "no available devices")."""
    if strategy.get("strategy") != "fsdp" or accelerator == "cuda":
        return
    where = "this node has no GPU" if not devices.gpus else "--accelerator cpu was given"
    raise TextsqlError(
        f"{strategy['label']} needs GPUs: on the CPU the Trainer silently falls back to plain data parallel, every "
        f"rank holding the whole model, so nothing would be sharded; and this run would train on the CPU ({where}; "
        f"{devices.describe()}). Train on GPUs, or on the CPU choose a DeepSpeed strategy (--deepspeed zero2 or "
        "zero3_offload shard on the CPU too) or none."
    )


def shipped_fsdp_configs() -> dict[str, Path]:
    """The shipped FSDP JSON files (fsdpconfig/), by name without .json."""
    return shipped_in(FSDPCONFIG_DIR, "FSDP")


def resolve_fsdpconfig_path(name_or_path, flag: str = "--fsdp_config") -> Path:
    """An existing JSON file as given, or a shipped strategy name (fsdp_full_shard, ...) as fsdpconfig/NAME.json."""
    return resolve_config_path(name_or_path, shipped_fsdp_configs(), "FSDP", flag)


def is_fsdp_config_name(name_or_path) -> bool:
    """Whether `textsql check-config NAME` means an FSDP config: a shipped FSDP name, or a JSON file with FSDP's keys
    (a DeepSpeed config has zero_optimization, batch sizes or precision blocks instead)."""
    if str(name_or_path) in shipped_fsdp_configs():
        return True
    path = Path(name_or_path)
    if not path.is_file():
        return False
    try:
        raw = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return False
    if not isinstance(raw, dict) or "zero_optimization" in raw:
        return False
    # DeepSpeed has an activation_checkpointing block of its own
    return bool(normalized(raw).keys() & (KNOWN_KEYS | set(FSDP1_KEYS)) - {"activation_checkpointing"})
