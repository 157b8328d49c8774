"""Loading any model folder textsql writes (plain, a LoRA or QLoRA adapter, quantized) in one pass down the layers,
QLoRA's bitsandbytes base among them, and the quantized folder's record (textsql_quantization.json), written and read
here alone."""

from __future__ import annotations

import json
import warnings
from dataclasses import dataclass
from pathlib import Path

from textsql.adapter_record import check_adapter_folder, quantized_base, read_adapter_record
from textsql.adapters import QUANTIZED_LAYER_TYPES, require_peft
from textsql.arguments.quantize import METHODS
from textsql.errors import TextsqlError
from textsql.extras import require_lifecycle_extra
from textsql.hub import load_model, load_tokenizer, model_family
from textsql.paths import ADAPTER_CONFIG_FILE, QUANTIZATION_FILE
from textsql.strategy.devices import NodeDevices, inference_dtype, quantized_compute_dtype
from textsql.vocabulary import fit_embeddings

RECORD_VERSION = 1


def pick_device(choice: str):
    """The torch device a command's --device names: cuda when asked for and visible (an error when asked for and not),
    the CPU for cpu or when no GPU is visible (auto)."""
    import torch

    if choice == "cuda" and not torch.cuda.is_available():
        raise TextsqlError("--device cuda was asked for, but no CUDA GPU is visible; use --device auto or cpu.")
    return torch.device("cuda" if choice != "cpu" and torch.cuda.is_available() else "cpu")


def check_method_device(method: str, device) -> None:
    kind = getattr(device, "type", str(device))
    if kind not in METHODS[method].devices:
        raise TextsqlError(
            f"--method {method} runs on the CPU only (torch's quantized Linear layers have no CUDA kernels), and "
            f"this would run on {kind}: pass --device cpu, or choose torchao-int8, bnb-int8 or bnb-nf4 for a GPU."
        )


def apply_dynamic_int8(model):
    """torch's dynamic int8 quantization of every nn.Linear, in place on a CPU model (returns it)."""
    import torch

    with warnings.catch_warnings():
        # torch.ao.quantization announces its move to torchao; its dynamic int8 Linear is still the fastest (measured).
        warnings.simplefilter("ignore", DeprecationWarning)
        warnings.filterwarnings("ignore", message=".*quantize_per_tensor.*")
        return torch.ao.quantization.quantize_dynamic(model, {torch.nn.Linear}, dtype=torch.qint8, inplace=True)


# ---------------------------------------------------------------------------------------------------------------------
# What a folder is, and its records
# ---------------------------------------------------------------------------------------------------------------------


def folder_kind(model_dir: str | Path) -> str:
    """'adapter' (a peft LoRA adapter, QLoRA's too), 'quantized' (by textsql quantize) or 'plain' (any other folder:
    a run's model, a merged adapter, a GGUF file `textsql import` dequantized, a hub name)."""
    folder = Path(model_dir)
    if (folder / ADAPTER_CONFIG_FILE).is_file():
        return "adapter"
    if (folder / QUANTIZATION_FILE).is_file():
        return "quantized"
    return "plain"


def write_record(model_dir: str | Path, record: dict) -> Path:
    """The quantized folder's record (the method, the source model, what the method ran, later its score), under this
    textsql's record version; returns its path."""
    path = Path(model_dir) / QUANTIZATION_FILE
    path.write_text(json.dumps({"version": RECORD_VERSION, **record}, indent=2) + "\n")
    return path


def read_record(model_dir: str | Path) -> dict:
    path = Path(model_dir) / QUANTIZATION_FILE
    try:
        record = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise TextsqlError(
            f"'{path}' cannot be read ({error}); quantize the model again with `textsql quantize`."
        ) from None
    if record.get("method") not in METHODS:
        raise TextsqlError(
            f"'{path}' names the method '{record.get('method')}', which this textsql does not know "
            f"({', '.join(METHODS)}); quantize the model again with `textsql quantize`."
        )
    return record


@dataclass(frozen=True)
class ModelFolder:
    """A model folder as read once: its kind (folder_kind), its record (an adapter's or a quantized model's; empty for
    a plain one), the model whose weights load (an adapter's base, else the folder) and the format of those weights
    (QLoRA's bitsandbytes base: nf4 or int8; else none)."""

    path: str
    kind: str
    record: dict
    weights: str
    quantize_base: str = "none"


def read_folder(model_dir: str | Path, base_model: str | None = None) -> ModelFolder:
    """What the folder is and what its record says; `base_model` loads an adapter on a copy of its base elsewhere (it
    is checked to be the same model)."""
    kind = folder_kind(model_dir)
    if kind == "quantized":
        return ModelFolder(str(model_dir), kind, read_record(model_dir), str(model_dir))
    if kind == "adapter":
        record = read_adapter_record(model_dir)
        base = base_model or record["base_model"]
        return ModelFolder(str(model_dir), kind, record, base, quantized_base(record))
    return ModelFolder(str(model_dir), kind, {}, str(model_dir))


# ---------------------------------------------------------------------------------------------------------------------
# QLoRA's base: quantized by bitsandbytes
# ---------------------------------------------------------------------------------------------------------------------


def bnb_config(quantize_base: str, compute_dtype: str, sharded: bool = False):
    """transformers' BitsAndBytesConfig for --quantize_base: NF4 with double quantization (the constants quantized
    too, ~0.4 bit per weight less) computing in `compute_dtype` (textsql.strategy.devices.quantized_compute_dtype), or
    LLM.int8. Where ZeRO-3 or FSDP shards the model (`sharded`) the 4-bit weights are stored in the compute dtype:
    both flatten the parameters of a unit into one tensor of one dtype, and uint8 storage would not join them."""
    import torch
    from transformers import BitsAndBytesConfig

    if quantize_base == "int8":
        return BitsAndBytesConfig(load_in_8bit=True)
    dtype = getattr(torch, compute_dtype)
    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=dtype,
        bnb_4bit_quant_storage=dtype if sharded else torch.uint8,
    )


def quantized_base_settings(quantize_base: str, compute_dtype: str, sharded: bool = False) -> dict:
    """from_pretrained's arguments for a base quantized by bitsandbytes (bnb_config), the rest of it (embeddings,
    norms, the output layer) in `compute_dtype`; bitsandbytes checked to be installed."""
    import torch

    require_lifecycle_extra("bitsandbytes", f"--quantize_base {quantize_base}")
    return {
        "quantization_config": bnb_config(quantize_base, compute_dtype, sharded),
        "dtype": getattr(torch, compute_dtype),
    }


def load_quantized_base(model_id: str, quantize_base: str, compute_dtype: str, sharded: bool = False, **kwargs):
    """QLoRA's base model to train or round to (quantized_base_settings), a family bitsandbytes cannot quantize refused
    before loading (textsql.families: Family.quantize_refusal), its layers checked to be really swapped."""
    family = model_family(model_id)
    if family.quantize_refusal:
        raise TextsqlError(
            f"--quantize_base {quantize_base} cannot quantize '{model_id}': {family.quantize_refusal}. Train a LoRA "
            "adapter on the unquantized base (leave --quantize_base out), or choose a model of another family."
        )
    model = load_model(model_id, **quantized_base_settings(quantize_base, compute_dtype, sharded), **kwargs)
    check_quantized_layers(model, quantize_base)
    return model


def unquantized_linear_layers(model) -> list[str]:
    """Names of the linear layers of a bitsandbytes-loaded model that transformers meant to swap and did not: a
    family's own subclass of nn.Linear (falcon's FalconLinear) stays in full precision without a word. The layers it
    skips on purpose (the output layer, a family's _keep_in_fp32_modules such as T5's wo) are not counted."""
    import torch
    from transformers.pytorch_utils import Conv1D
    from transformers.quantizers.quantizers_utils import should_convert_module

    skipped = list(getattr(getattr(model, "hf_quantizer", None), "modules_to_not_convert", None) or [])
    return [
        name
        for name, module in model.named_modules()
        if isinstance(module, (torch.nn.Linear, Conv1D))
        and type(module).__name__ not in QUANTIZED_LAYER_TYPES.values()
        and should_convert_module(name, skipped)
    ]


def check_quantized_layers(model, quantize_base: str) -> None:
    """Refuse a model whose linear layers were not all swapped for bitsandbytes' (the base would train as QLoRA in
    full precision, its memory unchanged), naming the layers left."""
    left = unquantized_linear_layers(model)
    swapped = sum(type(module).__name__ == QUANTIZED_LAYER_TYPES[quantize_base] for module in model.modules())
    if left or not swapped:
        shown = ", ".join(left[:4]) + (f" and {len(left) - 4} more" if len(left) > 4 else "")
        raise TextsqlError(
            f"--quantize_base {quantize_base}: bitsandbytes left {len(left)} linear layers of "
            f"{type(model).__name__} unquantized ({shown or 'all of them'}; their type is "
            f"{type(model.get_submodule(left[0])).__name__ if left else 'not nn.Linear'}, and transformers swaps only "
            "layers of type nn.Linear). Train LoRA on the unquantized base (leave --quantize_base out), or add the "
            "family's quantize_refusal to textsql/families.py."
        )


# ---------------------------------------------------------------------------------------------------------------------
# The pass
# ---------------------------------------------------------------------------------------------------------------------


def weight_settings(folder: ModelFolder, device, dtype: str) -> dict:
    """from_pretrained's arguments for the folder's weights: a quantized folder as it was quantized (safetensors only,
    never a pickle; its method's package checked), a QLoRA adapter's base quantized as it trained (computing in bf16 on
    GPUs that have it, fp32 before Ampere and on the CPU; bitsandbytes placing it on a GPU itself), an adapter's base
    in fp32 (the adapter's own dtype), a plain model in `dtype`. `device` None: a model to train, left on the CPU."""
    import torch

    if folder.kind == "quantized":
        method = folder.record["method"]
        check_method_device(method, device)
        if METHODS[method].package != "torch":
            require_lifecycle_extra(METHODS[method].package, f"Loading a {method} model")
        if method == "dynamic-int8":  # quantized again as it loads (apply_dynamic_int8): fp32 weights are saved
            return {"dtype": torch.float32, "use_safetensors": True}
        # The config's quantization_config rebuilds the quantized layers; quantized weights cannot be moved by .to().
        return {"device_map": str(device), "use_safetensors": True}
    if folder.quantize_base != "none":
        on_gpu = device is None or device.type == "cuda"
        compute = quantized_compute_dtype(NodeDevices.local().gpus if on_gpu else ())
        placement = {"device_map": {"": str(device)}} if device is not None and device.type == "cuda" else {}
        return {**quantized_base_settings(folder.quantize_base, compute), **placement}
    return {"dtype": getattr(torch, "float32" if folder.kind == "adapter" else dtype)}


def load_folder(folder: ModelFolder, device=None, dtype: str = "float32", trainable: bool = False):
    """(model, tokenizer) of a folder read by read_folder, in one pass: its tokenizer, an adapter checked against its
    record (its tokenizer, its base's tokenizer and weights, its pickles), the weights loaded as weight_settings says
    (every folder's pickles checked first: hub.load_model), then made ready: a quantized base's layers checked, a
    dynamic-int8 model quantized again, an adapter put on its base (`trainable`: to train on, as --stage grpo does),
    the model in `dtype` on `device` where its weights can move (None: left on the CPU) and, but to train, in eval
    mode."""
    import torch

    tokenizer = load_tokenizer(folder.path)
    if folder.kind == "adapter":
        base_tokenizer = load_tokenizer(folder.weights)
        check_adapter_folder(folder.path, folder.record, tokenizer, folder.weights, base_tokenizer)
    settings = weight_settings(folder, device, dtype)
    model = load_model(folder.weights, **settings)
    if folder.quantize_base != "none":
        check_quantized_layers(model, folder.quantize_base)
    if folder.kind == "quantized" and folder.record["method"] == "dynamic-int8":
        model = apply_dynamic_int8(model)
    if folder.kind == "adapter":
        fit_embeddings(model, tokenizer)  # the characters prep added: their rows are the adapter's trained tokens
        model = require_peft().PeftModel.from_pretrained(model, folder.path, is_trainable=trainable)
    if device is not None and folder.kind != "quantized" and folder.quantize_base == "none":  # quantized: placed
        model = model.to(getattr(torch, dtype)).to(device)
    return (model if trainable else model.eval()), tokenizer


def load_for_inference(model_dir: str, device_choice: str = "auto", dtype: str = "float32", base_model=None):
    """(model, tokenizer) in eval mode for any folder textsql writes, on the device --device picks: a plain model (run
    folder, merged adapter, imported GGUF, hub name) in `dtype` (float32, bfloat16 or auto: bfloat16 where the device
    computes it natively), a LoRA adapter on its base (a QLoRA adapter on its base quantized as it trained: the adapter
    learned against the rounded weights; `base_model`: a copy of the base elsewhere), or a quantized folder as it was
    quantized. The one loader of infer, compare, quantize, merge and the benchmarks."""
    device = pick_device(device_choice)
    folder = read_folder(model_dir, base_model)
    return load_folder(folder, device, inference_dtype(dtype, device.type))
