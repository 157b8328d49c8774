"""What the planner knows of a model: its shape (widths, parameters, the largest layer, the module trace ZeRO-3's
replay needs), from a folder, the built-in tables or the Hugging Face cache, built on the meta device once and cached."""

from __future__ import annotations

import hashlib
import json
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, fields
from functools import lru_cache
from pathlib import Path

from textsql.errors import TextsqlError
from textsql.families import auto_model_class, family_of
from textsql.hub import download_command, hub_offline
from textsql.planner import causal as causal_lm
from textsql.planner.shape_cache import read_record, shape_key, write_record
from textsql.planner.zero3_trace import (
    NARROW_WIDTHS,
    ModuleTrace,
    record_module_trace,
)

GIB = (
    2**30
)  # "GB" everywhere in the planner means 2**30 bytes, as nvidia-smi (MiB / 1024) and DeepSpeed's estimators count


# The original T5 checkpoints' config.json (google-t5/t5-*), so that nothing needs downloading. All use ReLU
# feed-forward blocks, tied input/output embeddings and a 32128-token vocabulary.
T5_SHAPES = {
    "t5-small": {"d_model": 512, "d_ff": 2048, "num_layers": 6, "num_heads": 8, "d_kv": 64},
    "t5-base": {"d_model": 768, "d_ff": 3072, "num_layers": 12, "num_heads": 12, "d_kv": 64},
    "t5-large": {"d_model": 1024, "d_ff": 4096, "num_layers": 24, "num_heads": 16, "d_kv": 64},
    "t5-3b": {"d_model": 1024, "d_ff": 16384, "num_layers": 24, "num_heads": 32, "d_kv": 128},
    "t5-11b": {"d_model": 1024, "d_ff": 65536, "num_layers": 24, "num_heads": 128, "d_kv": 128},
}


T5_VOCAB_SIZE = 32128


@dataclass(frozen=True)
class ModelShape:
    """What the planner needs to know about a T5-family model; parameter counts come from the meta device."""

    name: str
    source: str
    d_model: int
    d_ff: int
    num_layers: int
    num_decoder_layers: int
    num_heads: int
    d_kv: int
    vocab_size: int
    gated: bool
    parameters: int
    largest_layer_parameters: int
    matmul_parameters: int = 0  # parameters of nn.Linear layers: the weights autocast copies to 16 bits
    parameter_sizes: tuple = field(repr=False, default=())
    module_trace: ModuleTrace | None = field(repr=False, default=None)
    # Causal LMs (None for T5): the widths as the family reads its config, the parameters of one decoder layer (FSDP's
    # unit), whether attention is eager (no sdpa: the scores are kept), and (elements, output rows) of every weight
    # bitsandbytes quantizes (each nn.Linear / Conv1D but the output layer).
    causal: causal_lm.CausalWidths | None = field(repr=False, default=None)
    family: str = "t5"
    block_parameters: int = 0
    eager_attention: bool = False
    quantizable: tuple = field(repr=False, default=())

    def persistent_parameters(self, threshold: int) -> int:
        """Elements of the parameters ZeRO-3 keeps gathered on every GPU (each at most `threshold` elements)."""
        return sum(n for n in self.parameter_sizes if n <= threshold)

    def as_dict(self) -> dict:
        found = {f.name: getattr(self, f.name) for f in fields(self) if f.repr}
        return found | ({"causal": asdict(self.causal)} if self.causal else {})

    @property
    def sequence_kind(self) -> str:
        return "causal" if self.causal else "seq2seq"


def resolve_model(name: str) -> ModelShape:
    """The shape of a local model folder, a built-in T5 shape, or a config in the Hugging Face cache (in that order).
    Built once per model (torch and transformers), then read from the user's cache (textsql.planner.shape_cache)."""
    name = str(name)
    folder = Path(name).expanduser()
    if folder.is_dir():
        config_file = folder / "config.json"
        identity = ["folder", hashlib.sha256(config_file.read_bytes()).hexdigest()] if config_file.is_file() else None
        return _cached_shape(identity, name, f"{config_file}", lambda: _config_from_folder(folder))
    short = name.split("/")[-1] if name.startswith(("google-t5/", "t5/")) else name
    if short in T5_SHAPES:

        def t5_config():
            from transformers import T5Config

            return T5Config(**T5_SHAPES[short], vocab_size=T5_VOCAB_SIZE)

        identity = ["t5", T5_SHAPES[short], T5_VOCAB_SIZE]
        return _cached_shape(identity, short, "built-in shape table", t5_config)
    builtin = causal_lm.builtin_config(name)
    if builtin is not None:

        def causal_config():
            from transformers import AutoConfig

            return AutoConfig.for_model(**builtin)

        return _cached_shape(["causal", builtin], name, "built-in causal LM table", causal_config)
    _refuse_a_near_miss(name, [*T5_SHAPES, *causal_lm.CAUSAL_CONFIGS, *causal_lm.CAUSAL_ALIASES])
    return _shape_from_config(_config_from_hub(name), name, "Hugging Face cache")


# This process's shapes by cache key: one ModuleTrace per model, as zero3_residency's cache compares traces by identity.
_SHAPES: dict[str, dict] = {}


def _cached_shape(identity, name: str, source: str, config) -> ModelShape:
    """The shape of the model `identity` names (None: not cached), built from `config()` when neither this process
    nor the user's cache has it."""
    if identity is None:
        return _shape_from_config(config(), name, source)
    key = shape_key(identity)
    if key not in _SHAPES:
        record = read_record(key)
        if record is None:
            built = _shape_from_config(config(), name, source)
            record = write_record(key, _shape_record(built))
        _SHAPES[key] = record | {
            "module_trace": record["module_trace"] and ModuleTrace(**record["module_trace"]),
            "causal": record["causal"] and causal_lm.CausalWidths(**record["causal"]),
        }
    return ModelShape(name=name, source=source, **_SHAPES[key])


def _shape_record(shape: ModelShape) -> dict:
    """A shape as JSON-able values, less the name and source its caller gives."""
    record = {f.name: getattr(shape, f.name) for f in fields(shape) if f.name not in ("name", "source")}
    return record | {
        "module_trace": shape.module_trace and asdict(shape.module_trace),
        "causal": shape.causal and asdict(shape.causal),
    }


def _refuse_a_near_miss(name: str, known) -> None:
    """A name one typo away from a built-in one (t5-3B, t5-smal) answered at once, before the hub's retries (28 s
    offline) and a download command that repeats the typo."""
    import difflib

    lowered = {k.lower(): k for k in known}
    close = difflib.get_close_matches(name.lower(), list(lowered), n=1, cutoff=0.85)
    if close and lowered[close[0]] != name:
        close = [lowered[close[0]]]
        raise TextsqlError(
            f"'{name}' is not a model textsql knows: did you mean {close[0]}? (Built-in shapes: {', '.join(known)}; "
            "any other name is read from a model folder's config.json or the Hugging Face cache.)"
        )


def _config_from_folder(folder: Path):
    from transformers import AutoConfig

    if not (folder / "config.json").is_file():
        raise TextsqlError(
            f"'{folder}' is a folder without config.json, so it is not a model folder. Pass the folder "
            f"written by save_pretrained (only its config.json is read), or a built-in name: "
            f"{', '.join(T5_SHAPES)}."
        )
    try:
        return AutoConfig.from_pretrained(str(folder))
    except (OSError, ValueError) as error:
        raise TextsqlError(
            f"'{folder / 'config.json'}' cannot be read as a model config ({_first_line(error)}). "
            f"Write it again with save_pretrained, or pass a built-in name: {', '.join(T5_SHAPES)}."
        ) from None


def _config_from_hub(name: str):
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(name, local_files_only=hub_offline())  # the env is read now, not at import
    except (OSError, ValueError) as error:
        where = (
            "HF_HUB_OFFLINE is set and it is not in the local Hugging Face cache"
            if hub_offline()
            else f"it could not be fetched from the hub ({_first_line(error)})"
        )
        local = f"models/{name.split('/')[-1]}"
        raise TextsqlError(
            f"Unknown model '{name}': it is not one of the built-in shapes ({', '.join([*T5_SHAPES, *causal_lm.CAUSAL_CONFIGS])}), not a local "
            f"folder, and {where}. Only its config.json is needed: on a machine with internet access run "
            f"`{download_command(name, 'config.json', local_dir=local)}`, copy '{local}' into the project "
            f"and pass --model {local}."
        ) from None


def _shape_from_config(config, name: str, source: str) -> ModelShape:
    family = family_of(config)  # refuses a model type textsql does not know, with the list of those it knows
    inspected = _inspect_model(config.to_json_string())
    if family.causal:
        widths = causal_lm.causal_widths(config, family)
        return ModelShape(
            name=name,
            source=source,
            d_model=widths.hidden,
            d_ff=widths.ffn,
            num_layers=widths.layers,
            num_decoder_layers=0,  # one stack of decoder layers, counted in num_layers
            num_heads=widths.heads,
            d_kv=widths.head_dim,
            vocab_size=widths.vocab,
            gated=widths.gated,
            parameters=sum(inspected["sizes"]),
            largest_layer_parameters=inspected["largest_layer"],
            matmul_parameters=inspected["matmul"],
            parameter_sizes=inspected["sizes"],
            module_trace=inspected["trace"],
            causal=widths,
            family=family.name,
            block_parameters=inspected["block"],
            eager_attention=inspected["eager"],
            quantizable=inspected["quantizable"],
        )
    return ModelShape(
        name=name,
        source=source,
        d_model=config.d_model,
        d_ff=config.d_ff,
        num_layers=config.num_layers,
        num_decoder_layers=config.num_decoder_layers or config.num_layers,
        num_heads=config.num_heads,
        d_kv=config.d_kv,
        vocab_size=config.vocab_size,
        gated=bool(getattr(config, "is_gated_act", False)),
        parameters=sum(inspected["sizes"]),
        largest_layer_parameters=inspected["largest_layer"],
        matmul_parameters=inspected["matmul"],
        parameter_sizes=inspected["sizes"],
        module_trace=inspected["trace"],
        family=family.name,
        quantizable=inspected["quantizable"],
    )


@contextmanager
def _zero3_init_off():
    """Build without ZeRO-3's zero.Init even right after a ZeRO-3 run in this process (rank 0 alone calls the planner,
    and zero.Init would broadcast to ranks that are not there)."""
    from transformers.integrations import deepspeed as hf_deepspeed

    saved = hf_deepspeed._hf_deepspeed_config_weak_ref
    hf_deepspeed._hf_deepspeed_config_weak_ref = None
    try:
        yield
    finally:
        hf_deepspeed._hf_deepspeed_config_weak_ref = saved


@lru_cache(maxsize=32)
def _inspect_model(config_json: str) -> dict:
    """The model built on the meta device: every parameter's size, the largest layer, the nn.Linear parameters, and
    the module trace of a training step as ZeRO-3 sees it (from a narrow copy on the CPU).

    Counted as DeepSpeed's model_to_params does (tied weights once; a layer = one module's own parameters), except
    that ties are found by identity: on the meta device every data_ptr() is 0.
    """
    import torch
    from transformers import AutoConfig
    from transformers.pytorch_utils import Conv1D

    config_dict = json.loads(config_json)
    model_type = config_dict.pop("model_type")
    config = AutoConfig.for_model(model_type, **config_dict)
    model_class = auto_model_class(family_of(config))
    with _zero3_init_off(), torch.device("meta"):
        model = model_class.from_config(config)
    parameters = list(model.parameters())  # yields a tied weight once, in DeepSpeed's ds_id order
    index = {id(p): i for i, p in enumerate(parameters)}
    linear = {  # the matmuls autocast copies to 16 bits: GPT-2-style Conv1D layers are matmuls too
        index[id(p)]
        for m in model.modules()
        if isinstance(m, (torch.nn.Linear, Conv1D))
        for p in m.parameters(recurse=False)
    }
    # What bitsandbytes quantizes: every nn.Linear and GPT-2-style Conv1D but the output layer (transformers'
    # get_keys_to_not_convert); Conv1D stores its weight transposed (in, out).
    output = model.get_output_embeddings()
    quantizable = tuple(
        (m.weight.numel(), m.weight.shape[1] if isinstance(m, Conv1D) else m.weight.shape[0])
        for m in model.modules()
        if isinstance(m, (torch.nn.Linear, Conv1D)) and m is not output
    )
    blocks = [m for m in model.modules() if type(m).__name__ in (getattr(model, "_no_split_modules", None) or ())]
    # The hooks' order depends on the modules, not on their widths: record it on a narrow copy on the CPU, where a
    # step takes a fraction of a second (meta tensors run Python reference kernels).
    narrow = AutoConfig.for_model(model_type, **{**config_dict, **narrow_widths(config_dict)})
    with _zero3_init_off(), torch.random.fork_rng(devices=[]):  # seeded nothing: leave the caller's random state alone
        small = model_class.from_config(narrow)
        same_parameters = [n for n, _ in small.named_parameters()] == [n for n, _ in model.named_parameters()]
        trace = record_module_trace(small) if same_parameters else None
    return {
        "sizes": tuple(p.numel() for p in parameters),
        "largest_layer": max(sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules()),
        "matmul": sum(parameters[i].numel() for i in linear),
        "trace": trace,
        "block": sum(p.numel() for p in blocks[0].parameters()) if blocks else 0,
        "eager": getattr(model.config, "_attn_implementation", "eager") == "eager",
        "quantizable": quantizable,
    }


# A causal LM's narrow copy for the module trace: the same modules with tiny widths, whichever names its config uses.
CAUSAL_NARROW = {
    ("hidden_size", "n_embd"): 32,
    ("num_attention_heads", "n_head"): 4,  # codegen splits its heads in 4 groups
    ("intermediate_size", "ffn_dim", "n_inner", "ffn_hidden_size"): 32,
    ("head_dim",): 8,
    ("rotary_dim",): 4,
    ("word_embed_proj_dim",): 32,
    ("vocab_size",): 64,
}


def narrow_widths(config_dict: dict) -> dict:
    """The widths of the narrow copy whose training step gives the module trace: T5's NARROW_WIDTHS, or for a causal
    LM the keys its config sets (4 heads, at most 2 key-value heads, special ids inside the narrow vocabulary)."""
    if config_dict.get("is_encoder_decoder"):
        return NARROW_WIDTHS
    narrow = {key: value for keys, value in CAUSAL_NARROW.items() for key in keys if config_dict.get(key)}
    for key in ("num_key_value_heads", "num_kv_heads"):
        if config_dict.get(key):
            narrow[key] = min(config_dict[key], 2)
    for key in ("pad_token_id", "bos_token_id", "eos_token_id"):
        if isinstance(config_dict.get(key), int) and config_dict[key] >= CAUSAL_NARROW[("vocab_size",)]:
            narrow[key] = 0
    return narrow


def _first_line(error) -> str:
    return (str(error).strip().splitlines() or [type(error).__name__])[0]
