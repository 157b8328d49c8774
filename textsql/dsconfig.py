"""Load, validate, describe and prepare the DeepSpeed JSON configs that training hands to the Trainer."""

from __future__ import annotations

import copy
import difflib
import json
import logging
import sys
import typing
import warnings
from functools import lru_cache
from importlib import resources
from pathlib import Path

from textsql.errors import TextsqlError

# Package data (textsql/shipped_dsconfig, a link to the repository's dsconfig/ in a checkout): resolved, so messages
# name the folder users edit in an editable install, and the installed copy in a wheel.
DSCONFIG_DIR = Path(str(resources.files("textsql") / "shipped_dsconfig")).resolve()

# The places where the Hugging Face Trainer replaces "auto", copied from
# transformers/integrations/deepspeed.py (HfTrainerDeepSpeedConfig.trainer_config_process and
# trainer_config_finalize, transformers 5.23; tests/test_dsconfig.py checks this list against the
# keys the Trainer really touches), each with a placeholder used while validating.
HF_AUTO_PLACEHOLDERS = {
    "train_micro_batch_size_per_gpu": 1,
    "gradient_accumulation_steps": 1,
    "train_batch_size": 1,
    "gradient_clipping": 1.0,
    "optimizer.params.lr": 1e-4,
    "optimizer.params.betas": [0.9, 0.999],
    "optimizer.params.eps": 1e-8,
    "optimizer.params.weight_decay": 0.0,
    "scheduler.params.warmup_min_lr": 0,
    "scheduler.params.warmup_max_lr": 1e-4,
    "scheduler.params.total_num_steps": 10,
    "scheduler.params.warmup_num_steps": 1,
    "fp16.enabled": False,
    "bf16.enabled": False,
    "zero_optimization.reduce_bucket_size": 1,
    "zero_optimization.stage3_prefetch_bucket_size": 1,
    "zero_optimization.stage3_param_persistence_threshold": 1,
}
# trainer_config_finalize fills these two only when the stage is 3; otherwise "auto" stays in the config.
ZERO3_ONLY_AUTO = {
    "zero_optimization.stage3_prefetch_bucket_size", "zero_optimization.stage3_param_persistence_threshold"}
# DeepSpeed itself understands "auto" here (runtime/constants.py KEEP_IN_FP32_MODULES_DEFAULT,
# runtime/config.py get_pipeline_config), so the Trainer need not fill it.
DEEPSPEED_AUTO = {"data_types.keep_in_fp32_modules", "pipeline.stages"}
# DeepSpeed reads these two top-level keys in deepspeed.initialize / DeepSpeedConfig.__init__ (mesh set-up),
# outside the parsing that top_level_keys() traces.
MESH_KEYS = {"sequence_parallel_size", "data_parallel_size"}
POSITIVE_INT_KEYS = (
    "train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "steps_per_print")
BUCKET_WARN_ELEMENTS = 2e8


class DsConfigWarning(UserWarning):
    """A setting DeepSpeed accepts but that is likely a mistake (e.g. a multi-GB communication bucket)."""


# ---------------------------------------------------------------------------------------------------------------------
# Public API
# ---------------------------------------------------------------------------------------------------------------------


def load_dsconfig(path) -> dict:
    """Read a DeepSpeed JSON file, check every key and value, and return the parsed dict unchanged.

    All problems of a file are collected and raised together as one TextsqlError; settings that are
    legal but costly (ZeRO-1/2 buckets above 2e8 elements) only warn with DsConfigWarning.
    """
    path = Path(path)
    cfg, problems = _read_json(path)
    _import_deepspeed()
    prepared, auto_problems = _substitute_autos(cfg)
    problems += auto_problems
    problems += _check_top_level(prepared)
    problems += _check_sections(prepared)
    if not problems:
        problems += _deepspeed_rejects(prepared)
    if problems:
        raise TextsqlError(_problem_paragraph(path, problems))
    _warn_big_buckets(cfg)
    return cfg


def check_batch_settings(cfg, *, per_device_train_batch_size, gradient_accumulation_steps, world_size, max_grad_norm,
                         source=None) -> None:
    """Raise TextsqlError when numbers in the DeepSpeed config contradict the training arguments.

    The Trainer does the same comparison, but only after the model is loaded and with a terse message.
    """
    expected = {
        "train_micro_batch_size_per_gpu": (per_device_train_batch_size, "--per_device_train_batch_size"),
        "gradient_accumulation_steps": (gradient_accumulation_steps, "--gradient_accumulation_steps"),
        "train_batch_size": (per_device_train_batch_size * gradient_accumulation_steps * world_size,
                             f"per_device_train_batch_size × gradient_accumulation_steps × world size "
                             f"({per_device_train_batch_size} × {gradient_accumulation_steps} × {world_size})"),
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
            f"arguments, or make the numbers agree.")


def describe_strategy(cfg) -> dict:
    """Name the parallel strategy of a config (None means no DeepSpeed): stage, offload devices and a short label."""
    if cfg is None:
        return {"strategy": "none", "zero_stage": None, "offload_optimizer": "none", "offload_param": "none",
                "label": "none"}
    zero = cfg.get("zero_optimization") or {}
    stage = int(zero.get("stage", 0)) if isinstance(zero, dict) else 0
    offload_optimizer = _offload_device(zero, "offload_optimizer", "cpu_offload") if stage >= 1 else "none"
    offload_param = _offload_device(zero, "offload_param", "cpu_offload_param") if stage == 3 else "none"
    label = f"zero{stage}"
    devices = {offload_optimizer, offload_param}
    if "nvme" in devices:
        label += "_nvme"
    elif "cpu" in devices:
        label += "_offload"
    return {"strategy": f"zero{stage}" if stage else "none", "zero_stage": stage,
            "offload_optimizer": offload_optimizer, "offload_param": offload_param, "label": label}


def resolve_for_run(cfg, run_dir) -> dict:
    """Return a deep copy whose unset profiler/monitor output locations point into run_dir.

    DeepSpeed would otherwise write them relative to the working directory of each rank.
    """
    run_dir = Path(run_dir).absolute()
    resolved = copy.deepcopy(cfg)
    profiler = resolved.get("flops_profiler")
    if isinstance(profiler, dict) and profiler.get("output_file") is None:
        profiler["output_file"] = str(run_dir / "flops_profile.txt")
    for monitor in ("tensorboard", "csv_monitor"):
        block = resolved.get(monitor)
        if isinstance(block, dict) and not block.get("output_path"):
            block["output_path"] = str(run_dir / "ds_monitor")
    return resolved


def shipped_configs() -> dict[str, Path]:
    """The shipped JSON files (the repository's dsconfig/ folder, package data when installed), by name without .json."""
    if not DSCONFIG_DIR.is_dir():
        raise TextsqlError(
            f"The folder of shipped DeepSpeed configs, {DSCONFIG_DIR}, does not exist: in a checkout, "
            f"textsql/shipped_dsconfig must be the symbolic link to dsconfig/ that git stores (check out with "
            f"`git config core.symlinks true`), then reinstall with `pip install .`; or pass the path of your own "
            f"DeepSpeed JSON file instead.")
    return {p.stem: p for p in sorted(DSCONFIG_DIR.glob("*.json"))}


def resolve_dsconfig_path(name_or_path, flag: str = "--deepspeed") -> Path:
    """An existing JSON file as given, or a shipped strategy name (zero1, zero2, zero3_offload) as dsconfig/NAME.json."""
    path = Path(name_or_path)
    if path.is_file():
        return path
    shipped = shipped_configs()
    if str(name_or_path) in shipped:
        return shipped[str(name_or_path)]
    raise TextsqlError(f"{flag} '{name_or_path}' is neither a JSON file nor a shipped strategy ({', '.join(shipped)}): "
                       "there is no such file. Pass the path of your DeepSpeed JSON file, or a shipped name.")


def check_config_cli(argv) -> int:
    """Body of `textsql check-config FILE [FILE ...]`: report each file as OK or its problems; 0 if all are OK."""
    files = list(argv)
    if not files or files[0] in ("-h", "--help"):
        print("usage: textsql check-config FILE [FILE ...]\n\nValidate DeepSpeed JSON config files, or shipped "
              f"strategies by name (the *.json files in {DSCONFIG_DIR}).",
              file=sys.stdout if files else sys.stderr)
        return 0 if files else 1
    status = 0
    for name in files:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", DsConfigWarning)
            try:
                cfg = load_dsconfig(resolve_dsconfig_path(name, flag="check-config"))
            except TextsqlError as exc:
                print(exc, file=sys.stderr)
                status = 1
                continue
        print(f"{name}: OK ({_summary(cfg)})")
        for warning in caught:
            if issubclass(warning.category, DsConfigWarning):
                print(f"{name}: warning: {warning.message}")
    return status


# ---------------------------------------------------------------------------------------------------------------------
# Reading
# ---------------------------------------------------------------------------------------------------------------------


def _read_json(path: Path):
    """Parse the file; JSON syntax errors raise at once, duplicate keys become problems."""
    if not path.is_file():
        raise TextsqlError(
            f"DeepSpeed config {path} does not exist. Pass the path of a JSON file, for example one of the "
            f"shipped configs in {DSCONFIG_DIR}.")
    text = path.read_text(encoding="utf-8")
    duplicates = []

    def no_duplicates(pairs):
        keys = [k for k, _ in pairs]
        duplicates.extend(sorted({k for k in keys if keys.count(k) > 1}))
        return dict(pairs)

    try:
        cfg = json.loads(text, object_pairs_hook=no_duplicates)
    except json.JSONDecodeError as exc:
        raise TextsqlError(_json_error(path, exc)) from None
    if not isinstance(cfg, dict):
        raise TextsqlError(f"DeepSpeed config {path} must hold one JSON object ({{...}}), "
                           f"not a {type(cfg).__name__}.")
    problems = [f'{key}: duplicate key; JSON keeps only the last value, so delete the other one'
                for key in duplicates]
    return cfg, problems


def _json_error(path, exc: json.JSONDecodeError) -> str:
    lines = exc.doc.splitlines()
    shown = []
    for number in range(max(1, exc.lineno - 1), exc.lineno + 1):
        if number <= len(lines):
            shown.append(f"  {number:4d} | {lines[number - 1]}")
    shown.append("         " + " " * (exc.colno - 1) + "^")
    return (f"DeepSpeed config {path} is not valid JSON: {exc.msg} at line {exc.lineno}, column {exc.colno}:\n"
            + "\n".join(shown)
            + "\nJSON allows no comments and no trailing commas, and needs double quotes around keys and strings.")


def _import_deepspeed():
    try:
        import deepspeed  # noqa: F401  (slow: imported only when a config is checked)
    except ImportError as exc:
        raise TextsqlError(f"Checking a DeepSpeed config needs the deepspeed package, which does not import "
                           f"({exc}). Install it with `pip install deepspeed`.") from None


def _problem_paragraph(path, problems) -> str:
    count = f"{len(problems)} problem" + ("s" if len(problems) > 1 else "")
    items = "\n".join(f"  {i}. {p}" for i, p in enumerate(problems, 1))
    return (f"DeepSpeed config {path} has {count}:\n{items}\n"
            f"Fix the file and check it again with `textsql check-config {path}`.")


# ---------------------------------------------------------------------------------------------------------------------
# "auto"
# ---------------------------------------------------------------------------------------------------------------------


def _substitute_autos(cfg):
    """Copy cfg with placeholders for the "auto" values the Trainer fills; report and drop every other "auto".

    An "auto" under a misspelt key is reported as an unknown key: DeepSpeed's models drop "auto" values before
    validating, so DeepSpeed itself would silently ignore such a key.
    """
    prepared = copy.deepcopy(cfg)
    zero = cfg.get("zero_optimization")
    stage = zero.get("stage") if isinstance(zero, dict) else None
    problems = []
    for keys, parent, key in list(_auto_leaves(prepared)):
        path = _dotted(keys)
        candidates = _candidates_at(keys[:-1])
        if path in HF_AUTO_PLACEHOLDERS and not (path in ZERO3_ONLY_AUTO and stage != 3):
            parent[key] = copy.deepcopy(HF_AUTO_PLACEHOLDERS[path])
            continue
        if path in DEEPSPEED_AUTO:
            continue
        if candidates is not None and key not in candidates:
            problems.append(_unknown_key(path, key, candidates, "DeepSpeed would silently ignore it"))
        elif path in ZERO3_ONLY_AUTO:
            problems.append(f'{path}: the Trainer fills "auto" here only with ZeRO stage 3 (this file has stage '
                            f'{stage}); delete the key, it is unused below stage 3')
        else:
            problems.append(f'{path}: "auto" is not allowed here because nothing fills it; write a value. '
                            f'The Trainer fills "auto" only in {_compact_paths(HF_AUTO_PLACEHOLDERS)}')
        _drop(parent, key)
    return prepared, problems


def _candidates_at(keys):
    """The keys DeepSpeed allows inside the block at this key path, or None where that is not known."""
    if not keys:
        return top_level_keys() | set(removed_top_level_keys())
    section, inner = keys[0], keys[1:]
    if section in _pydantic_sections():
        model = _model_at(_pydantic_sections()[section], tuple(str(k) for k in inner))
        return _allowed_fields(model) if model is not None else None
    if section in _plain_sections() and not inner:
        return set(_plain_sections()[section])
    return None


def _dotted(keys) -> str:
    path = ""
    for key in keys:
        path += f"[{key}]" if isinstance(key, int) else (f".{key}" if path else str(key))
    return path


def _compact_paths(paths) -> str:
    """['a', 'b.c', 'b.d'] -> 'a, b.{c, d}'."""
    groups = {}
    for path in paths:
        parent, _, leaf = path.rpartition(".")
        groups.setdefault(parent, []).append(leaf)
    parts = []
    for parent, leaves in groups.items():
        parts += leaves if not parent else [f"{parent}.{leaves[0]}" if len(leaves) == 1
                                            else f"{parent}.{{{', '.join(leaves)}}}"]
    return ", ".join(parts)


def _drop(container, key):
    """Remove a reported value so that later checks do not report it again (lists keep their length)."""
    if isinstance(container, list):
        container[key] = None
    else:
        del container[key]


def _auto_leaves(node, keys=()):
    """Yield (key path, container, key) of every "auto" string in a nested dict/list."""
    items = list(node.items()) if isinstance(node, dict) else list(enumerate(node))
    for key, value in items:
        if value == "auto":
            yield keys + (key,), node, key
        elif isinstance(value, (dict, list)):
            yield from _auto_leaves(value, keys + (key,))


# ---------------------------------------------------------------------------------------------------------------------
# Top level
# ---------------------------------------------------------------------------------------------------------------------


@lru_cache(maxsize=None)
def top_level_keys() -> frozenset:
    """The top-level keys DeepSpeed reads, found by tracing which keys its own parser looks up.

    DeepSpeed silently ignores unknown top-level keys, and its constants module mixes top-level and nested
    names, so a hand-written list would drift: instead run deepspeed.runtime.config.DeepSpeedConfig on a dict
    that records every key asked for, minus the keys DeepSpeed only asks for to reject (removed features).
    """
    from deepspeed.runtime import config as ds_config

    recorder = _KeyRecorder({"train_micro_batch_size_per_gpu": 1})
    with _quiet_deepspeed():
        try:
            ds_config.DeepSpeedConfig(recorder)
        except Exception:  # keys read before a failure still count
            pass
    return frozenset((recorder.seen | MESH_KEYS) - set(removed_top_level_keys()))


def removed_top_level_keys() -> dict:
    """DeepSpeed's own messages for top-level blocks of removed features (it rejects them)."""
    from deepspeed.runtime import config as ds_config

    return dict(getattr(ds_config, "_REMOVED_TOP_LEVEL_CONFIG_KEYS", {}))


class _KeyRecorder(dict):
    """A dict that remembers every key looked up in it (get, [], in, keys())."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.seen = set()

    def get(self, key, default=None):
        self.seen.add(key)
        return super().get(key, default)

    def __getitem__(self, key):
        self.seen.add(key)
        return super().__getitem__(key)

    def __contains__(self, key):
        self.seen.add(key)
        return super().__contains__(key)

    def keys(self):
        from collections.abc import KeysView

        return KeysView(self)


class _quiet_deepspeed:
    """Silence DeepSpeed's INFO log lines while its config parser runs."""

    def __enter__(self):
        from deepspeed.utils import logger

        self.logger, self.level = logger, logger.level
        logger.setLevel(logging.WARNING)

    def __exit__(self, *exc):
        self.logger.setLevel(self.level)


@lru_cache(maxsize=None)
def _top_level_defaults() -> dict:
    """Default value of each top-level scalar key, from the NAME / NAME_DEFAULT pairs of DeepSpeed's constants."""
    from deepspeed.runtime import constants

    keys = top_level_keys()
    defaults = {}
    for name in dir(constants):
        value = getattr(constants, name)
        if isinstance(value, str) and value in keys and hasattr(constants, name + "_DEFAULT"):
            defaults[value] = getattr(constants, name + "_DEFAULT")
    return defaults


def _check_top_level(cfg) -> list:
    problems = []
    valid, removed = top_level_keys(), removed_top_level_keys()
    for key, value in cfg.items():
        if key in removed:
            problems.append(f"{key}: DeepSpeed rejects this block: {removed[key].strip()}")
        elif key not in valid:
            problems.append(_unknown_key(key, key, valid, "DeepSpeed would silently ignore it"))
        elif key in POSITIVE_INT_KEYS:
            problems += _positive_int(key, value)
        elif key == "gradient_clipping" and not (_is_number(value) and value >= 0):
            problems.append(f"gradient_clipping: must be a number >= 0 (0 turns clipping off) or \"auto\"; "
                            f"got {value!r}")
        elif key in _top_level_defaults():
            problems += _type_problem(key, value, _top_level_defaults()[key])
    return problems


def _positive_int(path, value) -> list:
    if _is_number(value) and value >= 1 and float(value).is_integer():
        return []
    return [f'{path}: must be a whole number >= 1 or "auto"; got {value!r}']


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _type_problem(path, value, default) -> list:
    """Check value against the type of DeepSpeed's default for it (None: any value)."""
    if isinstance(default, bool):
        ok, want = isinstance(value, bool), "true or false (a JSON boolean, no quotes)"
    elif isinstance(default, int):
        ok, want = _is_number(value) and float(value).is_integer(), "a whole number"
    elif isinstance(default, float):
        ok, want = _is_number(value), "a number"
    elif isinstance(default, str):
        ok, want = isinstance(value, str), "a string"
    else:
        return []
    return [] if ok else [f"{path}: must be {want}; got {value!r}"]


def _unknown_key(path, key, candidates, consequence) -> str:
    close = difflib.get_close_matches(str(key), sorted(candidates), n=1, cutoff=0.6)
    if close:
        return f"{path}: unknown key; did you mean {close[0]}?"
    return f"{path}: unknown key ({consequence}); the keys allowed here are {', '.join(sorted(candidates))}"


# ---------------------------------------------------------------------------------------------------------------------
# Sections
# ---------------------------------------------------------------------------------------------------------------------


@lru_cache(maxsize=None)
def _pydantic_sections() -> dict:
    """Top-level blocks that DeepSpeed parses with its own pydantic models (extra keys forbidden)."""
    from deepspeed.comm.config import CommsLoggerConfig
    from deepspeed.compile.config import CompileConfig
    from deepspeed.monitor.config import DeepSpeedMonitorConfig
    from deepspeed.runtime.config import HybridEngineConfig
    from deepspeed.runtime.precision_config import DeepSpeedBF16Config, DeepSpeedFP16Config
    from deepspeed.runtime.tensor_parallel.config import TPTrainingConfig
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    sections = {"zero_optimization": DeepSpeedZeroConfig, "bf16": DeepSpeedBF16Config,
                "bfloat16": DeepSpeedBF16Config, "fp16": DeepSpeedFP16Config, "comms_logger": CommsLoggerConfig,
                "hybrid_engine": HybridEngineConfig, "compile": CompileConfig, "tensor_parallel": TPTrainingConfig}
    for name, field in DeepSpeedMonitorConfig.model_fields.items():  # tensorboard, wandb, csv_monitor, comet
        sections[name] = field.annotation
    return sections


@lru_cache(maxsize=None)
def _plain_sections() -> dict:
    """Blocks DeepSpeed reads key by key (no pydantic model): allowed keys with their defaults, from its constants."""
    from deepspeed.profiling import constants as profiling
    from deepspeed.runtime import constants
    from deepspeed.runtime.activation_checkpointing import config as act

    flops = {getattr(profiling, n): getattr(profiling, n + "_DEFAULT") for n in dir(profiling)
             if n.startswith("FLOPS_PROFILER_") and hasattr(profiling, n + "_DEFAULT")}
    no_default = object()
    return {
        profiling.FLOPS_PROFILER: flops,
        act.ACT_CHKPT: dict(act.ACT_CHKPT_DEFAULT),
        constants.OPTIMIZER: {constants.TYPE: "", constants.OPTIMIZER_PARAMS: no_default,
                              constants.LEGACY_FUSION: constants.LEGACY_FUSION_DEFAULT},
        constants.SCHEDULER: {constants.TYPE: "", constants.SCHEDULER_PARAMS: no_default},
    }


def _check_sections(cfg) -> list:
    problems = []
    pydantic_sections, plain_sections = _pydantic_sections(), _plain_sections()
    for name, value in cfg.items():
        if name in pydantic_sections or name in plain_sections:
            if not isinstance(value, dict):
                problems.append(f"{name}: must be an object {{...}}; got {value!r}")
            elif name in pydantic_sections:
                problems += _check_model(name, value, pydantic_sections[name])
            else:
                problems += _check_plain(name, value, plain_sections[name])
    problems += _check_precision(cfg)
    return problems


def _check_plain(name, section, defaults) -> list:
    problems = []
    for key, value in section.items():
        path = f"{name}.{key}"
        if key not in defaults:
            problems.append(_unknown_key(path, key, defaults, "DeepSpeed would silently ignore it"))
        elif isinstance(defaults[key], (bool, int, float, str)):
            problems += _type_problem(path, value, defaults[key])
        elif defaults[key] is not None and not isinstance(value, dict):
            problems.append(f"{path}: must be an object {{...}}; got {value!r}")
    return problems


def _check_model(name, section, model) -> list:
    """Validate one block with DeepSpeed's pydantic model and turn its errors into textsql problems."""
    import pydantic

    from deepspeed.runtime import config as ds_config

    data = copy.deepcopy(section)
    problems = _strict_bools(name, data, model)
    removed_zero = getattr(ds_config, "_REMOVED_ZERO_CONFIG_KEYS", {}) if name == "zero_optimization" else {}
    for key in [k for k in data if k in removed_zero]:
        problems.append(f"{name}.{key}: DeepSpeed rejects this key: {removed_zero[key].strip()}")
        del data[key]
    try:
        with _quiet_deepspeed():
            model(**data)
    except pydantic.ValidationError as exc:
        problems += [_pydantic_problem(name, model, error) for error in exc.errors()]
    except Exception as exc:  # assertions in DeepSpeed's deprecated-field handling
        problems.append(f"{name}: {_one_line(exc)}")
    return problems


def _strict_bools(prefix, data, model) -> list:
    """Flag quoted booleans ("false"), which pydantic would coerce but the Trainer reads as truthy strings."""
    problems = []
    fields = _fields_by_key(model)
    for key in list(data):
        field = fields.get(key)
        if field is None:
            continue
        value, path = data[key], f"{prefix}.{key}"
        if _annotation_is_bool(field.annotation) and value is not None and not isinstance(value, bool):
            problems.append(f"{path}: must be true or false (a JSON boolean, no quotes); got {value!r}")
            del data[key]
        elif isinstance(value, dict) and _model_in(field.annotation) is not None:
            problems += _strict_bools(path, value, _model_in(field.annotation))
    return problems


def _annotation_is_bool(annotation) -> bool:
    args = typing.get_args(annotation)
    return annotation is bool or (bool in args and all(a in (bool, type(None)) for a in args))


def _fields_by_key(model) -> dict:
    fields = {}
    for name, field in model.model_fields.items():
        fields[name] = field
        if field.alias:
            fields[field.alias] = field
    return fields


def _model_in(annotation):
    """The pydantic model class inside an annotation such as Optional[Model], or None."""
    from pydantic import BaseModel

    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in typing.get_args(annotation):
        found = _model_in(arg)
        if found is not None:
            return found
    return None


def _model_at(model, loc):
    for part in loc:
        field = _fields_by_key(model).get(part) if model is not None else None
        model = _model_in(field.annotation) if field is not None else None
    return model


def _pydantic_problem(name, model, error) -> str:
    loc = tuple(str(part) for part in error["loc"])
    path = ".".join((name,) + loc)
    kind, value = error["type"], error.get("input")
    if kind == "extra_forbidden":
        inner = _model_at(model, loc[:-1])
        candidates = _allowed_fields(inner) if inner is not None else set()
        return _unknown_key(path, loc[-1], candidates, "DeepSpeed rejects it")
    if kind == "enum":
        options = []
        for option in error.get("ctx", {}).get("expected", "").replace(" or ", ", ").split(", "):
            if option not in options:
                options.append(option)
        return f"{path}: must be one of {', '.join(options)}; got {value!r}"
    message = error["msg"]
    for prefix in ("Value error, ", "Assertion failed, "):
        message = message.removeprefix(prefix)
    message = message[:1].lower() + message[1:]
    if loc:
        return f"{path}: {message}; got {value!r}"
    return f"{path}: {message}"


def _allowed_fields(model) -> set:
    """Field names and aliases of a DeepSpeed model, without deprecated ones."""
    return {key for key, field in _fields_by_key(model).items() if not _is_deprecated(field)}


def _is_deprecated(field) -> bool:
    return bool(field.json_schema_extra and field.json_schema_extra.get("deprecated"))


def _check_precision(cfg) -> list:
    enabled = [name for name in ("fp16", "bf16", "bfloat16")
               if isinstance(cfg.get(name), dict) and cfg[name].get("enabled") is True]
    if "fp16" in enabled and len(enabled) > 1:
        return ['fp16.enabled and bf16.enabled are both true; enable at most one (or set both to "auto" '
                'and choose with --bf16 / --fp16)']
    return []


def _deepspeed_rejects(prepared) -> list:
    """Run DeepSpeed's own config parser on the prepared copy; batch sizes are left to check_batch_settings."""
    from deepspeed.runtime.config import DeepSpeedConfig

    trial = copy.deepcopy(prepared)
    trial.pop("train_batch_size", None)  # its consistency depends on the world size, unknown here
    trial.setdefault("train_micro_batch_size_per_gpu", 1)
    try:
        with _quiet_deepspeed():
            DeepSpeedConfig(trial)
    except Exception as exc:
        return [f"DeepSpeed rejects the config: {_one_line(exc)}"]
    return []


def _one_line(exc) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__


# ---------------------------------------------------------------------------------------------------------------------
# Warnings and descriptions
# ---------------------------------------------------------------------------------------------------------------------


def _warn_big_buckets(cfg) -> None:
    """Warn about ZeRO-1/2 reduce buckets above 2e8 elements (the unset default is 5e8: 2 GB in fp32).

    Only the reduce bucket is a buffer of its own; DeepSpeed 0.19 all-gathers the partitions in place.
    """
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    zero = cfg.get("zero_optimization") or {}
    if zero.get("stage") not in (1, 2):
        return
    for key in ("reduce_bucket_size",):
        value = zero.get(key, DeepSpeedZeroConfig.model_fields[key].default)
        if _is_number(value) and value > BUCKET_WARN_ELEMENTS:
            how = "is" if key in zero else "is not set, so DeepSpeed uses its default of"
            warnings.warn(
                f"zero_optimization.{key} {how} {_sci(value)} elements: a buffer of {value * 4 / 1e9:.1f} GB per GPU "
                f"in fp32. Values around 5e7 (0.2 GB) cost little speed; \"auto\" lets the Trainer size the "
                f"reduce bucket from the model.", DsConfigWarning, stacklevel=3)


def _sci(number) -> str:
    """500000000 -> '5e8', 250000000 -> '2.5e8'."""
    mantissa, exponent = f"{number:.2e}".split("e")
    return f"{mantissa.rstrip('0').rstrip('.')}e{int(exponent)}"


def _offload_device(zero, key, deprecated_flag) -> str:
    block = zero.get(key)
    if isinstance(block, dict):
        return str(block.get("device", "none"))
    return "cpu" if zero.get(deprecated_flag) is True else "none"


def _summary(cfg) -> str:
    info = describe_strategy(cfg)
    optimizer, param = info["offload_optimizer"], info["offload_param"]
    offload = optimizer if optimizer == param else f"optimizer {optimizer}, param {param}"
    return f"zero{info['zero_stage']}, offload: {offload}"
