"""Loading any model folder textsql writes for inference (plain, LoRA adapter, quantized) on the device it runs on, and
the quantized folder's record (textsql_quantization.json), written and read here alone."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

from textsql.adapters import load_adapter_model, quantized_base, read_adapter_record
from textsql.arguments.quantize import METHODS
from textsql.errors import TextsqlError
from textsql.extras import require_lifecycle_extra
from textsql.hub import load_model, load_tokenizer
from textsql.paths import ADAPTER_CONFIG_FILE, QUANTIZATION_FILE
from textsql.strategy.devices import NodeDevices, inference_dtype, quantized_compute_dtype

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


def folder_kind(model_dir: str | Path) -> str:
    """'adapter' (a peft LoRA adapter), 'quantized' (by textsql quantize) or 'plain' (any other folder, a hub name)."""
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


def quantized_base_loading(device) -> dict:
    """How a QLoRA adapter's base is loaded, quantized as it trained: computing in bf16 on GPUs that have it (fp32 before
    Ampere and on the CPU), bitsandbytes placing the quantized weights on `device` itself."""
    gpus = NodeDevices.local().gpus if device.type == "cuda" else ()
    placement = {"device_map": {"": str(device)}} if device.type == "cuda" else {}
    return {"compute_dtype": quantized_compute_dtype(gpus), **placement}


def load_for_inference(model_dir: str, device_choice: str = "auto", dtype: str = "float32"):
    """(model, tokenizer) in eval mode for any folder textsql writes: a plain model (run folder, merged adapter, hub
    name) in `dtype` (float32, bfloat16 or auto), a LoRA adapter on its base (a QLoRA adapter on its base quantized as it trained: the adapter
    learned against the rounded weights), or a quantized folder as it was quantized. The one loader of infer, compare,
    quantize and merge; every folder's own pickles are checked before anything loads (hub.load_model and
    adapters.load_base_for_adapter, with textsql.checkpoints' check), which GRPO's load goes through too."""
    import torch

    device = pick_device(device_choice)
    dtype = inference_dtype(dtype, device.type)  # auto: bfloat16 where the device computes it natively
    kind = folder_kind(model_dir)
    if kind == "adapter" and quantized_base(read_adapter_record(model_dir)) != "none":
        model, tokenizer = load_adapter_model(model_dir, quantized=quantized_base_loading(device))
        return model.eval(), tokenizer  # bitsandbytes placed it; quantized weights cannot be moved or cast
    if kind == "adapter":  # its base checked to be the one it trained on (textsql.adapters)
        model, tokenizer = load_adapter_model(model_dir)
        return model.to(getattr(torch, dtype)).to(device).eval(), tokenizer
    tokenizer = load_tokenizer(model_dir)
    if kind == "quantized":
        model = load_quantized(model_dir, device)
    else:
        model = load_model(model_dir, dtype=getattr(torch, dtype)).to(device)
    return model.eval(), tokenizer


def load_quantized(model_dir: str, device):
    """A folder written by `textsql quantize`: safetensors only (never a pickle), on `device`."""
    record = read_record(model_dir)
    method = record["method"]
    check_method_device(method, device)
    if METHODS[method].package != "torch":
        require_lifecycle_extra(METHODS[method].package, f"Loading a {method} model")
    if method == "dynamic-int8":
        import torch

        return apply_dynamic_int8(load_model(model_dir, dtype=torch.float32, use_safetensors=True))
    # The config's quantization_config rebuilds the quantized layers; quantized weights cannot be moved by .to().
    return load_model(model_dir, device_map=str(device), use_safetensors=True)
