"""How the Trainer, accelerate and DeepSpeed read a DeepSpeed config, emulated rule by rule, so that a file is checked before
launch (textsql.strategy.dsconfig is the public side; it calls review_file, and reads configs with value_at,
accelerate_plugin and offload_device, as the rules do)."""

# A config is checked the way it travels under the Trainer: the Trainer fills its "auto" values
# (HfTrainerDeepSpeedConfig), accelerate fills a few more and adds its own (DeepSpeedPlugin, Accelerator
# ._prepare_deepspeed), and DeepSpeed parses the result. What one of them stops on is refused, with its reason; what
# runs but is probably not what the user meant (a misspelt key DeepSpeed ignores, a deprecated name, a value the
# Trainer will compare with its arguments) is a DsConfigWarning.

from __future__ import annotations

import copy
import difflib
import json
import logging
import typing
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

from textsql.errors import TextsqlError
from textsql.paths import DSCONFIG_DIR
from textsql.strategy.devices import prepare_deepspeed_import

# The places where the Hugging Face Trainer replaces "auto", copied from
# transformers/integrations/deepspeed.py (HfTrainerDeepSpeedConfig.trainer_config_process and
# trainer_config_finalize, transformers 5.23, unchanged in 5.24; tests/test_dsconfig.py checks this list against the
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
# Where the Trainer finds a value instead of "auto", it compares it with its own argument and stops on a difference
# (fill_match with must_match in the same two methods); the other places above it only fills.
TRAINER_COMPARES = {
    "train_micro_batch_size_per_gpu": "--per_device_train_batch_size",
    "gradient_accumulation_steps": "--gradient_accumulation_steps",
    "train_batch_size": "world size × --per_device_train_batch_size × --gradient_accumulation_steps",
    "gradient_clipping": "--max_grad_norm",
    "optimizer.params.lr": "--learning_rate",
    "optimizer.params.betas": "[--adam_beta1, --adam_beta2]",
    "optimizer.params.eps": "--adam_epsilon",
    "optimizer.params.weight_decay": "--weight_decay",
    "scheduler.params.warmup_max_lr": "--learning_rate",
    "scheduler.params.warmup_num_steps": "--warmup_steps (at least 1)",
    "scheduler.params.total_num_steps": "the number of training steps",
    "fp16.enabled": "--fp16",
    "bf16.enabled": "--bf16",
}
# "auto" that accelerate's DeepSpeedPlugin fills (accelerate/utils/dataclasses.py, plugin_to_config_mapping) from its
# ACCELERATE_* variables or its own defaults, not from the training arguments. The plugin itself runs on the config
# here, so the values are accelerate's.
ACCELERATE_PLUGIN_AUTO = (
    "zero_optimization.stage",
    "zero_optimization.offload_optimizer.device",
    "zero_optimization.offload_param.device",
    "zero_optimization.offload_optimizer.nvme_path",
    "zero_optimization.offload_param.nvme_path",
    "zero_optimization.stage3_gather_16bit_weights_on_model_save",
)
# What Accelerator._prepare_deepspeed (accelerate/accelerator.py, accelerate 1.15) hands to deepspeed_config_process,
# with placeholders for values known only at run time: it fills these where they are still "auto" and stops on any
# other "auto" ("... not found in kwargs"). It fills the two stage3_ bucket keys at every stage (the Trainer only at
# stage 3); tests/test_dsconfig.py trains with "auto" in each place.
ACCELERATE_PREPARE_AUTO = {
    "gradient_clipping": 1.0,
    "zero_optimization.stage3_gather_16bit_weights_on_model_save": False,
    "train_micro_batch_size_per_gpu": 1,
    "train_batch_size": 1,
    "zero_optimization.reduce_bucket_size": 1,
    "zero_optimization.stage3_prefetch_bucket_size": 1,
    "zero_optimization.stage3_param_persistence_threshold": 1,
    "optimizer.params.lr": 1e-4,
    "optimizer.params.weight_decay": 0.0,
    "scheduler.params.warmup_min_lr": 0,
    "scheduler.params.warmup_max_lr": 1e-4,
    "scheduler.params.warmup_num_steps": 1,
    "scheduler.params.total_num_steps": 10,
}
# DeepSpeed reads these two top-level keys in deepspeed.initialize / DeepSpeedConfig.__init__ (mesh set-up),
# outside the parsing that top_level_keys() traces.
MESH_KEYS = {"sequence_parallel_size", "data_parallel_size"}
# DeepSpeed asserts they are > 0 and that train_batch_size = micro × accumulation × world size; the Trainer compares them.
POSITIVE_INT_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
# accelerate's DeepSpeedPlugin overwrites it (with infinity, to keep DeepSpeed quiet): the file's value never runs.
ACCELERATE_OVERWRITES = {"steps_per_print"}
BUCKET_WARN_ELEMENTS = 2e8


@dataclass
class _Review:
    """What the checks found: problems make the file refused, warnings are shown."""

    problems: list = field(default_factory=list)
    warnings: list = field(default_factory=list)


# ---------------------------------------------------------------------------------------------------------------------
# Reading
# ---------------------------------------------------------------------------------------------------------------------


def _read_json(path: Path, review: _Review) -> dict:
    """Parse the file; JSON syntax errors raise at once, duplicate keys are warned about (JSON keeps the last one)."""
    if not path.is_file():
        raise TextsqlError(
            f"DeepSpeed config {path} does not exist. Pass the path of a JSON file, for example one of the "
            f"shipped configs in {DSCONFIG_DIR}."
        )
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
        raise TextsqlError(f"DeepSpeed config {path} must hold one JSON object ({{...}}), not a {type(cfg).__name__}.")
    review.warnings += [
        f"{key}: duplicate key; JSON keeps only the last value (the one the Trainer and DeepSpeed "
        f"read), so delete the other one"
        for key in duplicates
    ]
    return cfg


def _json_error(path, exc: json.JSONDecodeError) -> str:
    lines = exc.doc.splitlines()
    shown = []
    for number in range(max(1, exc.lineno - 1), exc.lineno + 1):
        if number <= len(lines):
            shown.append(f"  {number:4d} | {lines[number - 1]}")
    shown.append("         " + " " * (exc.colno - 1) + "^")
    return (
        f"DeepSpeed config {path} is not valid JSON: {exc.msg} at line {exc.lineno}, column {exc.colno}:\n"
        + "\n".join(shown)
        + "\nThe Trainer reads the file with Python's json module (DeepSpeed's own reader is more lenient): JSON "
        "allows no comments and no trailing commas, needs a comma between entries and double quotes around "
        "keys and strings."
    )


def import_deepspeed():
    prepare_deepspeed_import()
    try:
        import deepspeed  # noqa: F401  (slow: imported only when a config is checked)
    except ImportError as exc:
        raise TextsqlError(
            f"Checking a DeepSpeed config needs the deepspeed package, which does not import "
            f"({exc}). Install it with `pip install deepspeed`."
        ) from None


def _problem_paragraph(path, problems) -> str:
    count = f"{len(problems)} problem" + ("s" if len(problems) > 1 else "")
    items = "\n".join(f"  {i}. {p}" for i, p in enumerate(problems, 1))
    return (
        f"DeepSpeed config {path} has {count} that would stop the training:\n{items}\n"
        f"Fix the file and check it again with `textsql check-config {path}`."
    )


def review_file(path: Path) -> tuple[dict, list[str]]:
    """(the parsed config, its warnings): every rule checked as the config travels; what would stop the training raised
    together as one TextsqlError (textsql.strategy.dsconfig.load_dsconfig warns the rest)."""
    review = _Review()
    cfg = _read_json(path, review)
    import_deepspeed()
    with quiet_deepspeed():
        _review_config(cfg, review)
    if review.problems:
        raise TextsqlError(_problem_paragraph(path, review.problems))
    return cfg, review.warnings


def _review_config(cfg, review: _Review) -> None:
    """Every check, in the order the config travels: the Trainer's "auto", accelerate, then DeepSpeed."""
    framed = _check_frame(cfg, review)
    prepared = _substitute_autos(cfg, review)
    handed = _through_accelerate(prepared, review) if framed else None
    _check_top_level(prepared, review)
    _check_sections(prepared, review, auto_precision=_auto_precision(cfg))
    _check_trainer_comparisons(cfg, review)
    if handed is None:
        return
    _warn_stage3_keys_below_stage3(cfg, handed, review)
    if not review.problems:
        _deepspeed_rejects(handed, review)
    if not review.problems:
        _offload_needs_deepspeed_optimizer(handed, review)
    _warn_big_buckets(cfg, handed, review)


def _check_frame(cfg, review: _Review) -> bool:
    """The two things the Trainer needs before anything else: a zero_optimization object and a batch size."""
    zero = cfg.get("zero_optimization")
    framed = isinstance(zero, dict)
    if zero is None:
        misspelt = [key for key in cfg if difflib.get_close_matches(str(key), ["zero_optimization"], n=1, cutoff=0.75)]
        fix = (
            f'the file has "{misspelt[0]}", which DeepSpeed does not know: did you mean zero_optimization? Rename it'
            if misspelt
            else 'add "zero_optimization": {"stage": N}, N from 0 (no ZeRO) to 3'
        )
        review.problems.append(
            'zero_optimization: missing. The Trainer stops without it (accelerate: "Please specify the ZeRO '
            f'optimization config in the DeepSpeed config."); {fix}'
        )
    elif not framed:
        old_form = (
            " DeepSpeed still reads its old boolean form (true meaning stage 1), but the Trainer does not: "
            "accelerate reads zero_optimization.stage from it and stops (\"'bool' object has no attribute "
            "'get'\")."
            if isinstance(zero, bool)
            else ""
        )
        review.problems.append(
            f"zero_optimization: must be an object {{...}}; got {json.dumps(zero)}.{old_form} "
            f'Write "zero_optimization": {{"stage": {1 if zero is True else 0}}}'
        )
    if "train_batch_size" not in cfg and "train_micro_batch_size_per_gpu" not in cfg:
        review.problems.append(
            'train_micro_batch_size_per_gpu: missing, and so is train_batch_size. DeepSpeed needs one of them ("Either '
            'train_batch_size or train_micro_batch_size_per_gpu needs to be provided"): add '
            '"train_micro_batch_size_per_gpu": "auto" so that the Trainer fills it from --per_device_train_batch_size'
        )
        framed = False
    return framed


# ---------------------------------------------------------------------------------------------------------------------
# "auto"
# ---------------------------------------------------------------------------------------------------------------------


def _substitute_autos(cfg, review: _Review):
    """Copy cfg with placeholders for the "auto" the Trainer and accelerate fill at run time; report and drop every
    other "auto" (accelerate stops on it). accelerate's DeepSpeedPlugin fills its own "auto" later, in
    _through_accelerate, so those stay.
    """
    prepared = copy.deepcopy(cfg)
    removed = removed_top_level_keys()
    for keys, parent, key in list(_auto_leaves(prepared)):
        path = _dotted(keys)
        if path in ACCELERATE_PLUGIN_AUTO or path in ACCELERATE_OVERWRITES:
            continue  # the DeepSpeedPlugin fills or overwrites it
        if path in HF_AUTO_PLACEHOLDERS or path in ACCELERATE_PREPARE_AUTO:
            parent[key] = copy.deepcopy(HF_AUTO_PLACEHOLDERS.get(path, ACCELERATE_PREPARE_AUTO.get(path)))
            continue
        if keys[0] not in removed:  # a removed block is reported as such
            review.problems.append(_unfilled_auto(keys))
        _drop(parent, key)
    return prepared


def _unfilled_auto(keys) -> str:
    path, key = _dotted(keys), keys[-1]
    stops = f'accelerate stops on it ("`{path}` not found in kwargs")'
    candidates = _candidates_at(keys[:-1])
    if candidates is not None and key not in candidates and key not in _deprecated_keys_at(keys[:-1]):
        return f'{_unknown_key(path, key, candidates, "DeepSpeed would ignore it")}, but as it holds "auto", {stops}'
    alias = _alias_of(keys)
    spelled = (
        f' The Trainer and accelerate fill "auto" only under DeepSpeed\'s other name for this setting, {alias}.'
        if alias
        else ""
    )
    return (
        f'{path}: "auto" is not allowed here: neither the Trainer nor accelerate fills it, and {stops}. Write a '
        f'value.{spelled} "auto" is filled only in {_compact_paths(_auto_paths())}'
    )


def _auto_paths() -> list:
    return list(
        dict.fromkeys([*HF_AUTO_PLACEHOLDERS, *ACCELERATE_PREPARE_AUTO, *ACCELERATE_PLUGIN_AUTO])
    )  # in order, once each


def _section_model(keys):
    """DeepSpeed's pydantic model of the block at this key path (its first key a pydantic section), or None."""
    if not keys or keys[0] not in _pydantic_sections():
        return None
    return _model_at(_pydantic_sections()[keys[0]], tuple(str(k) for k in keys[1:]))


def _alias_of(keys):
    """DeepSpeed's alias (e.g. stage3_prefetch_bucket_size) when keys end in a field's own name, else None."""
    model = _section_model(keys[:-1]) if len(keys) >= 2 else None
    info = model.model_fields.get(str(keys[-1])) if model is not None else None
    return info.alias if info is not None else None


def _candidates_at(keys):
    """The keys DeepSpeed allows inside the block at this key path, or None where that is not known."""
    if not keys:
        return top_level_keys() | set(removed_top_level_keys())
    section, inner = keys[0], keys[1:]
    if section in _pydantic_sections():
        model = _section_model(keys)
        return _allowed_fields(model) if model is not None else None
    if section in _plain_sections() and not inner:
        return set(_plain_sections()[section])
    return None


def _deprecated_keys_at(keys) -> set:
    model = _section_model(keys)
    return (
        {name for name, field_ in model.model_fields.items() if _is_deprecated(field_)} if model is not None else set()
    )


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
        parts += (
            leaves
            if not parent
            else [f"{parent}.{leaves[0]}" if len(leaves) == 1 else f"{parent}.{{{', '.join(leaves)}}}"]
        )
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


def value_at(cfg, path, missing=None):
    """The value at a dotted path of nested dicts, or `missing`."""
    node = cfg
    for key in path.split("."):
        if not isinstance(node, dict) or key not in node:
            return missing
        node = node[key]
    return node


# ---------------------------------------------------------------------------------------------------------------------
# accelerate
# ---------------------------------------------------------------------------------------------------------------------


def accelerate_plugin(cfg):
    """accelerate's DeepSpeedPlugin on a copy of cfg, as the Trainer builds it: it fills its own "auto" (from ACCELERATE_*
    variables, else its defaults) and sets keys of its own; .deepspeed_config is the result."""
    from accelerate.utils import DeepSpeedPlugin

    return DeepSpeedPlugin(hf_ds_config=copy.deepcopy(cfg))


def _through_accelerate(prepared, review: _Review):
    """The config as accelerate hands it to deepspeed.initialize under the Trainer, or None where accelerate stops.

    accelerate's own code runs on the copy: DeepSpeedPlugin (fills its "auto", sets steps_per_print to infinity),
    set_mixed_precision (adds the fp16/bf16 blocks; the Trainer's choice is applied by then, "no" here) and
    deepspeed_config_process with what _prepare_deepspeed passes. Its "auto" fills are warned about: they come from
    ACCELERATE_* variables or accelerate's defaults, not from the training arguments.
    """
    try:
        plugin = accelerate_plugin(prepared)
        plugin.set_mixed_precision("no")
        plugin.deepspeed_config_process(must_match=False, **ACCELERATE_PREPARE_AUTO)
    except Exception as exc:  # accelerate raises ValueError, or stumbles on a malformed block
        review.problems.append(
            f"the Trainer cannot use this config: accelerate stops with {type(exc).__name__}: {_one_line(exc)}"
        )
        return None
    handed = plugin.deepspeed_config
    stage = value_at(handed, "zero_optimization.stage")
    for path in ACCELERATE_PLUGIN_AUTO:
        if value_at(prepared, path) != "auto":
            continue
        filled = value_at(handed, path)
        if path.endswith("stage3_gather_16bit_weights_on_model_save") and (stage != 3 or filled):
            continue
        if path.endswith("nvme_path"):  # textsql fills it from --nvme_path before accelerate sees it (with_nvme_path)
            continue
        note = (
            " ZeRO-3 checkpoints then hold no model weights file, only DeepSpeed's shards (textsql saves the final "
            "model itself); the shipped zero3_offload.json sets true."
            if path.endswith("on_model_save")
            else ""
        )
        review.warnings.append(
            f'{path}: "auto" is filled by accelerate, not from the training arguments: with '
            f"{json.dumps(filled)} (from its ACCELERATE_* settings, else its default).{note} Write "
            f"the value you want"
        )
    return handed


# ---------------------------------------------------------------------------------------------------------------------
# Top level
# ---------------------------------------------------------------------------------------------------------------------


@cache
def top_level_keys() -> frozenset:
    """The top-level keys DeepSpeed reads, found by tracing which keys its own parser looks up.

    DeepSpeed silently ignores unknown top-level keys, and its constants module mixes top-level and nested
    names, so a hand-written list would drift: instead run deepspeed.runtime.config.DeepSpeedConfig on a dict
    that records every key asked for, minus the keys DeepSpeed only asks for to reject (removed features).
    """
    from deepspeed.runtime import config as ds_config

    recorder = _KeyRecorder({"train_micro_batch_size_per_gpu": 1})
    with quiet_deepspeed():
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


class quiet_deepspeed:
    """Silence DeepSpeed's log lines (INFO, and the deprecation warnings textsql reports itself) while it parses."""

    def __enter__(self):
        from deepspeed.utils import logger

        self.logger, self.level = logger, logger.level
        logger.setLevel(logging.ERROR)

    def __exit__(self, *exc):
        self.logger.setLevel(self.level)


@cache
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


def _check_top_level(cfg, review: _Review) -> None:
    valid, removed = top_level_keys(), removed_top_level_keys()
    for key, value in cfg.items():
        if key in removed:
            review.problems.append(f"{key}: DeepSpeed rejects this block: {removed[key].strip()}")
        elif key not in valid:
            review.warnings.append(_unknown_key(key, key, valid, "DeepSpeed ignores it"))
        elif key in POSITIVE_INT_KEYS:
            if not _is_whole(value, minimum=1):
                review.problems.append(f'{key}: must be a whole number >= 1 or "auto"; got {value!r}')
        elif key == "gradient_clipping":
            if not _is_number(value):
                review.problems.append(
                    f'gradient_clipping: must be a number >= 0 (0 turns clipping off) or "auto"; got {value!r}'
                )
            elif value < 0:
                review.warnings.append(
                    f"gradient_clipping: {value} is negative, which DeepSpeed treats as 0 (no "
                    f'clipping); write 0, or "auto" to follow --max_grad_norm'
                )
        elif key in ACCELERATE_OVERWRITES:
            if value != "auto" and not _is_whole(value, minimum=1):
                review.warnings.append(
                    f"{key}: must be a whole number >= 1; got {value!r}. It has no effect under "
                    f"the Trainer: accelerate replaces {key} with infinity"
                )
        elif key in _top_level_defaults():
            for problem in _type_problem(key, value, _top_level_defaults()[key]):
                reason = _deepspeed_alone_rejects(key, value)
                if reason:
                    review.problems.append(f"{problem}; DeepSpeed stops on it ({reason})")
                else:
                    review.warnings.append(
                        f"{problem}; DeepSpeed takes it as it is, which is probably not what was meant"
                    )


def _deepspeed_alone_rejects(key, value):
    """DeepSpeed's error for a config holding just this top-level value, or None when it parses."""
    from deepspeed.runtime.config import DeepSpeedConfig

    try:
        DeepSpeedConfig({"train_micro_batch_size_per_gpu": 1, key: value})
    except Exception as exc:
        return _one_line(exc)
    return None


def _is_whole(value, minimum) -> bool:
    return _is_number(value) and float(value).is_integer() and value >= minimum


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
        return f"{path}: unknown key; did you mean {close[0]}? {consequence[:1].upper()}{consequence[1:]}"
    return f"{path}: unknown key ({consequence}); the keys allowed here are {', '.join(sorted(candidates))}"


# ---------------------------------------------------------------------------------------------------------------------
# Sections
# ---------------------------------------------------------------------------------------------------------------------


@cache
def _pydantic_sections() -> dict:
    """Top-level blocks that DeepSpeed parses with its own pydantic models (extra keys forbidden)."""
    from deepspeed.comm.config import CommsLoggerConfig
    from deepspeed.compile.config import CompileConfig
    from deepspeed.monitor.config import DeepSpeedMonitorConfig
    from deepspeed.runtime.config import HybridEngineConfig
    from deepspeed.runtime.precision_config import DeepSpeedBF16Config, DeepSpeedFP16Config
    from deepspeed.runtime.tensor_parallel.config import TPTrainingConfig
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    sections = {
        "zero_optimization": DeepSpeedZeroConfig,
        "bf16": DeepSpeedBF16Config,
        "bfloat16": DeepSpeedBF16Config,
        "fp16": DeepSpeedFP16Config,
        "comms_logger": CommsLoggerConfig,
        "hybrid_engine": HybridEngineConfig,
        "compile": CompileConfig,
        "tensor_parallel": TPTrainingConfig,
    }
    for name, field_ in DeepSpeedMonitorConfig.model_fields.items():  # tensorboard, wandb, csv_monitor, comet
        sections[name] = field_.annotation
    return sections


@cache
def _plain_sections() -> dict:
    """Blocks DeepSpeed reads key by key (no pydantic model): allowed keys with their defaults, from its constants."""
    from deepspeed.profiling import constants as profiling
    from deepspeed.runtime import constants
    from deepspeed.runtime.activation_checkpointing import config as act

    flops = {
        getattr(profiling, n): getattr(profiling, n + "_DEFAULT")
        for n in dir(profiling)
        if n.startswith("FLOPS_PROFILER_") and hasattr(profiling, n + "_DEFAULT")
    }
    no_default = object()
    return {
        profiling.FLOPS_PROFILER: flops,
        act.ACT_CHKPT: dict(act.ACT_CHKPT_DEFAULT),
        constants.OPTIMIZER: {
            constants.TYPE: "",
            constants.OPTIMIZER_PARAMS: no_default,
            constants.LEGACY_FUSION: constants.LEGACY_FUSION_DEFAULT,
        },
        constants.SCHEDULER: {constants.TYPE: "", constants.SCHEDULER_PARAMS: no_default},
    }


def _auto_precision(cfg) -> set:
    """The precision blocks whose "enabled" is "auto": textsql's choice may turn them on."""
    return {name for name in ("fp16", "bf16") if value_at(cfg, f"{name}.enabled") == "auto"}


def _check_sections(cfg, review: _Review, auto_precision=frozenset()) -> None:
    pydantic_sections, plain_sections = _pydantic_sections(), _plain_sections()
    for name, value in cfg.items():
        if name == "zero_optimization" and not isinstance(value, dict):
            continue  # _check_frame reports it
        if name in pydantic_sections or name in plain_sections:
            if not isinstance(value, dict):
                review.problems.append(f"{name}: must be an object {{...}}; got {json.dumps(value)}")
            elif name in pydantic_sections:
                _check_model(name, value, pydantic_sections[name], review, name in auto_precision)
            else:
                _check_plain(name, value, plain_sections[name], review)
    if "bfloat16" in cfg:
        review.warnings.append(
            "bfloat16: DeepSpeed's old name for the bf16 block. Under the Trainer accelerate always writes a bf16 "
            "block (from --bf16), which DeepSpeed reads instead, so this one has no effect: rename it bf16 (and set "
            '"enabled": "auto")'
        )
    enabled = [
        name for name in ("fp16", "bf16") if isinstance(cfg.get(name), dict) and cfg[name].get("enabled") is True
    ]
    if len(enabled) > 1:
        review.problems.append(
            'fp16.enabled and bf16.enabled are both true; DeepSpeed stops on that ("bfloat16 and '
            'fp16 modes cannot be simultaneously enabled"): enable at most one, or set both to '
            '"auto" and let textsql choose the precision'
        )


def _check_plain(name, section, defaults, review: _Review) -> None:
    """Blocks DeepSpeed reads key by key: unknown keys and odd types run (DeepSpeed ignores or takes them as they are)."""
    for key, value in section.items():
        path = f"{name}.{key}"
        if key not in defaults:
            review.warnings.append(_unknown_key(path, key, defaults, "DeepSpeed ignores it"))
        elif isinstance(defaults[key], (bool, int, float, str)):
            review.warnings += [
                f"{problem}; DeepSpeed takes it as it is, which is probably not what was meant"
                for problem in _type_problem(path, value, defaults[key])
            ]
        elif defaults[key] is not None and not isinstance(value, dict):
            review.problems.append(f"{path}: must be an object {{...}}; got {json.dumps(value)}")


def _check_model(name, section, model, review: _Review, may_be_enabled=False) -> None:
    """Validate one block with DeepSpeed's pydantic model and turn its errors into textsql problems."""
    import pydantic
    from deepspeed.runtime import config as ds_config

    data = copy.deepcopy(section)
    _strict_bools(name, data, model, review)
    removed_zero = getattr(ds_config, "_REMOVED_ZERO_CONFIG_KEYS", {}) if name == "zero_optimization" else {}
    for key in [k for k in data if k in removed_zero]:
        review.problems.append(f"{name}.{key}: DeepSpeed rejects this key: {removed_zero[key].strip()}")
        del data[key]
    _check_spellings(name, data, model, review)
    try:
        model(**data)
    except pydantic.ValidationError as exc:
        review.problems += [_pydantic_problem(name, model, error) for error in exc.errors()]
        return
    except Exception as exc:  # assertions in DeepSpeed's deprecated-field handling
        review.problems.append(f"{name}: DeepSpeed stops on this block: {_one_line(exc)}")
        return
    if may_be_enabled:
        try:  # "auto" becomes true when textsql chooses this precision; some values are checked only then
            model(**{**data, "enabled": True})
        except pydantic.ValidationError as exc:
            review.warnings += [
                f"{_pydantic_problem(name, model, error)} (DeepSpeed checks it only when {name} is "
                f"on: a run in {name} stops on it)"
                for error in exc.errors()
            ]


def _check_spellings(name, data, model, review: _Review) -> None:
    """Deprecated fields, and DeepSpeed's second names for a field (prefetch_bucket_size for
    stage3_prefetch_bucket_size): both run, but only the documented name is filled and read by the Trainer,
    accelerate and textsql's planner."""
    for field_name, info in model.model_fields.items():
        if field_name not in data:
            continue
        path = f"{name}.{field_name}"
        if _is_deprecated(info):
            new = info.json_schema_extra.get("new_param", "")
            new_info = model.model_fields.get(new)
            written = new_info.alias if new_info is not None and new_info.alias else new
            review.warnings.append(
                f'{path}: deprecated (DeepSpeed: "Config parameter {field_name} is deprecated'
                + (f" use {written} instead" if new else "")
                + '"); DeepSpeed still reads it'
            )
        elif info.alias and info.alias in data:
            review.problems.append(
                f"{path}: given twice, as {field_name} and as {info.alias} (DeepSpeed's two names "
                f"for one setting), which DeepSpeed refuses; keep {info.alias}"
            )
            del data[field_name]
        elif info.alias:
            review.warnings.append(
                f"{path}: DeepSpeed also accepts this name for {info.alias}, but the Trainer, "
                f"accelerate and textsql's planner read only {info.alias}: write {info.alias}"
            )


def _strict_bools(prefix, data, model, review: _Review) -> None:
    """Quoted booleans ("false"): pydantic reads the usual spellings, other readers of the file take any
    non-empty string as true. fp16/bf16.enabled are left to _check_trainer_comparisons (the Trainer stops on them)."""
    import pydantic

    fields = _fields_by_key(model)
    for key in list(data):
        field_ = fields.get(key)
        if field_ is None:
            continue
        value, path = data[key], f"{prefix}.{key}"
        if _annotation_is_bool(field_.annotation) and value not in (None, "auto") and not isinstance(value, bool):
            del data[key]
            if path in TRAINER_COMPARES:
                continue
            try:
                read = pydantic.TypeAdapter(bool).validate_python(value)
            except pydantic.ValidationError:
                review.problems.append(f"{path}: must be true or false (a JSON boolean, no quotes); got {value!r}")
            else:
                review.warnings.append(
                    f"{path}: {value!r} is not a JSON boolean; DeepSpeed reads it as "
                    f"{json.dumps(read)}, other readers as a non-empty string (true): write "
                    f"{json.dumps(read)}"
                )
        elif isinstance(value, dict) and _model_in(field_.annotation) is not None:
            _strict_bools(path, value, _model_in(field_.annotation), review)


def _annotation_is_bool(annotation) -> bool:
    args = typing.get_args(annotation)
    return annotation is bool or (bool in args and all(a in (bool, type(None)) for a in args))


def _fields_by_key(model) -> dict:
    fields = {}
    for name, field_ in model.model_fields.items():
        fields[name] = field_
        if field_.alias:
            fields[field_.alias] = field_
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
        field_ = _fields_by_key(model).get(part) if model is not None else None
        model = _model_in(field_.annotation) if field_ is not None else None
    return model


def _pydantic_problem(name, model, error) -> str:
    loc = tuple(str(part) for part in error["loc"])
    path = ".".join((name,) + loc)
    kind, value = error["type"], error.get("input")
    if kind == "extra_forbidden":
        if loc[-1] in top_level_keys():
            parent = ".".join((name,) + loc[:-1])
            return f"{path}: unknown key here (DeepSpeed rejects it); {loc[-1]} is a top-level block: move it out of {parent}"
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
    return {key for key, field_ in _fields_by_key(model).items() if not _is_deprecated(field_)}


def _is_deprecated(field_) -> bool:
    return bool(field_.json_schema_extra and field_.json_schema_extra.get("deprecated"))


# ---------------------------------------------------------------------------------------------------------------------
# The Trainer's comparisons, and what DeepSpeed does with the result
# ---------------------------------------------------------------------------------------------------------------------


def _check_trainer_comparisons(cfg, review: _Review) -> None:
    """Values where the Trainer fills "auto": it compares a written value with its argument and stops on a difference.

    fp16/bf16.enabled must be JSON booleans for that comparison to ever pass. textsql chooses the precision itself.
    """
    written = {}
    for path, argument in TRAINER_COMPARES.items():
        value = value_at(cfg, path, missing="auto")
        if value == "auto":
            continue
        if path.endswith(".enabled") and not isinstance(value, bool):
            review.problems.append(
                f'{path}: must be true, false or "auto"; got {value!r}. The Trainer compares it '
                f'with {argument} and stops on anything but a JSON boolean ("... mismatch '
                f'TrainingArguments values: - ds {path}={value} ...")'
            )
        elif path.endswith(".enabled"):
            review.warnings.append(
                f"{path} is {json.dumps(value)}: the Trainer stops unless {argument} is {value} too, and textsql sets "
                f"--bf16/--fp16 from its own --precision (default auto: bf16 on GPUs that have it natively, else fp32; "
                f'fp16 only with --force_fp16, T5 overflows in it). Write "auto" to follow that choice'
            )
        else:
            written[path] = value
    if written:
        items = "; ".join(
            f"{path} = {json.dumps(value)} (compared with {TRAINER_COMPARES[path]})" for path, value in written.items()
        )
        review.warnings.append(
            f'values where the Trainer takes "auto": {items}. The Trainer stops with a mismatch '
            f'error unless the training arguments say the same; "auto" takes them from there'
        )


def _warn_stage3_keys_below_stage3(cfg, handed, review: _Review) -> None:
    stage = value_at(handed, "zero_optimization.stage", missing=0)
    if stage == 3 or not isinstance(stage, int):
        return
    for key in cfg["zero_optimization"]:
        if key.startswith("stage3_") or key in ("offload_param", "cpu_offload_param"):
            review.warnings.append(
                f"zero_optimization.{key}: used only by ZeRO stage 3 (this file has stage {stage}): "
                f"DeepSpeed ignores it"
            )


def _deepspeed_rejects(handed, review: _Review) -> None:
    """Run DeepSpeed's own config parser on what accelerate would hand it (run-time values as placeholders)."""
    from deepspeed.runtime.config import DeepSpeedConfig

    trial = copy.deepcopy(handed)
    trial.pop("train_batch_size", None)  # its consistency depends on the world size, checked at train time
    trial.setdefault("train_micro_batch_size_per_gpu", 1)
    try:
        DeepSpeedConfig(trial)
    except Exception as exc:
        review.problems.append(f"DeepSpeed rejects the config: {_one_line(exc)}")


def _offload_needs_deepspeed_optimizer(handed, review: _Review) -> None:
    """With the optimizer offloaded and no optimizer block, accelerate swaps the Trainer's torch AdamW for DeepSpeed's
    CPU Adam only when it sees zero_optimization.offload_optimizer.device; DeepSpeed otherwise stops in
    deepspeed.initialize (runtime/engine.py, zero_force_ds_cpu_optimizer)."""
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    zero = DeepSpeedZeroConfig(**handed["zero_optimization"])
    offloaded = zero.offload_optimizer is not None and zero.offload_optimizer.device in ("cpu", "nvme")
    seen = value_at(handed, "zero_optimization.offload_optimizer.device", missing="none") != "none"
    if offloaded and not seen and "optimizer" not in handed and handed.get("zero_force_ds_cpu_optimizer", True):
        review.problems.append(
            "zero_optimization.cpu_offload: the optimizer is offloaded through the deprecated cpu_offload, which "
            "accelerate does not read, so it hands DeepSpeed the Trainer's torch AdamW and DeepSpeed stops (\"You are "
            'using ZeRO-Offload with a client provided optimizer ..."). Write "offload_optimizer": {"device": "cpu"} '
            "instead"
        )


def _one_line(exc) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__


# ---------------------------------------------------------------------------------------------------------------------
# Warnings and descriptions
# ---------------------------------------------------------------------------------------------------------------------


def _warn_big_buckets(cfg, handed, review: _Review) -> None:
    """Warn about ZeRO-1/2 reduce buckets above 2e8 elements (the unset default is 5e8: 2 GB in fp32).

    Only the reduce bucket is a buffer of its own; DeepSpeed 0.19 all-gathers the partitions in place.
    """
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    zero = cfg["zero_optimization"]
    if value_at(handed, "zero_optimization.stage") not in (1, 2):
        return
    for key in ("reduce_bucket_size",):
        value = zero.get(key, DeepSpeedZeroConfig.model_fields[key].default)
        if _is_number(value) and value > BUCKET_WARN_ELEMENTS:
            how = "is" if key in zero else "is not set, so DeepSpeed uses its default of"
            review.warnings.append(
                f"zero_optimization.{key} {how} {_sci(value)} elements: a buffer of {value * 4 / 1e9:.1f} GB per GPU "
                f'in fp32. Values around 5e7 (0.2 GB) cost little speed; "auto" lets the Trainer size the '
                f"reduce bucket from the model."
            )


def _sci(number) -> str:
    """500000000 -> '5e8', 250000000 -> '2.5e8'."""
    mantissa, exponent = f"{number:.2e}".split("e")
    return f"{mantissa.rstrip('0').rstrip('.')}e{int(exponent)}"


def offload_device(zero, key, deprecated_flag) -> str:
    block = zero.get(key)
    if isinstance(block, dict):
        return str(block.get("device", "none"))
    return "cpu" if zero.get(deprecated_flag) is True else "none"
