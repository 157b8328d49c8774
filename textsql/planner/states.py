"""Model states and the buffers beside them, per GPU and per pod: parameters, gradients and optimizer states by ZeRO stage
(DeepSpeed's estimators), LoRA's and a quantized base's, DeepSpeed's buckets and what CPU offload keeps on the GPU
(bucket_bytes: its staging buffer, per-parameter fp32 transfer copies, gradients awaiting their copy), ZeRO-3's
gathered parameters, ZeRO-Infinity's NVMe buffers; and the DeepSpeed settings they follow."""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

from textsql.arguments.lora import lora_arguments
from textsql.arguments.plan import NVME_GB_PER_S, PRECISIONS
from textsql.arguments.speed import SpeedArguments
from textsql.families import t5_lora_module_names
from textsql.planner import causal as causal_lm
from textsql.planner.shape import (
    GIB,
    ModelShape,
)
from textsql.planner.zero3_trace import (
    simulate_parameter_coordinator,
    zero3_step_events,
)
from textsql.strategy.dsconfig import load_dsconfig, resolve_dsconfig_path

# DeepSpeed's defaults for zero_optimization keys a config file leaves out (deepspeed/runtime/zero/config.py).
# overlap_comm None means DeepSpeed's dynamic default: on for stage 3, off below.
DEEPSPEED_ZERO_DEFAULTS = {
    "reduce_bucket_size": 500_000_000,
    "overlap_comm": None,
    "contiguous_gradients": True,
    "sub_group_size": 1_000_000_000,
    "stage3_prefetch_bucket_size": 50_000_000,
    "stage3_max_live_parameters": 1_000_000_000,
    "stage3_max_reuse_distance": 1_000_000_000,
    "stage3_param_persistence_threshold": 100_000,
}


# What the shipped dsconfig/ files set: used when no --dsconfig is given. "auto" is filled by the Trainer from d_model.
SHIPPED_ZERO_SETTINGS = {
    "reduce_bucket_size": "auto",
    "overlap_comm": None,  # zero1.json: false; zero2.json and zero3_offload.json: true (= DeepSpeed's dynamic default
    "contiguous_gradients": True,  # for stage 3; zero2.json sets it for stage 2 too, see _overlap_comm)
    "sub_group_size": 1_000_000_000,
    "stage3_prefetch_bucket_size": "auto",
    "stage3_max_live_parameters": 1_000_000_000,
    "stage3_max_reuse_distance": 1_000_000_000,
    "stage3_param_persistence_threshold": "auto",
}


SHIPPED_OVERLAP_COMM = {1: False, 2: True, 3: True}


# ZeRO-Infinity's pinned host buffers through which NVMe swapping goes: DeepSpeed's defaults
# (deepspeed/runtime/zero/offload_config.py), which the shipped zero3_nvme.json sets too. Keys of zero_settings().
NVME_DEFAULTS = {
    "nvme_optimizer_buffer_count": 4,  # offload_optimizer.buffer_count: buffers of the largest sub-group partition
    "nvme_param_buffer_count": 5,  # offload_param.buffer_count
    "nvme_param_buffer_size": 100_000_000,  # offload_param.buffer_size, elements of the training dtype
}


# DeepSpeed's own estimators multiply host memory by this (additional_buffer_factor, their default).
ADDITIONAL_BUFFER_FACTOR = 1.5


def zero_settings(dsconfig: dict | None) -> dict:
    """Bucket, prefetch and persistence settings: from a DeepSpeed config dict, else the shipped configs' settings.

    Keys a config leaves out take DeepSpeed's defaults; "auto" stays (the Trainer fills it from d_model).
    """
    if dsconfig is None:
        settings = dict(SHIPPED_ZERO_SETTINGS) | NVME_DEFAULTS
        settings["shipped"] = True
        return settings
    zero = dsconfig.get("zero_optimization") or {}
    settings = {key: zero.get(key, default) for key, default in DEEPSPEED_ZERO_DEFAULTS.items()}
    optimizer, param = (
        zero.get(key) if isinstance(zero.get(key), dict) else {} for key in ("offload_optimizer", "offload_param")
    )
    settings["nvme_optimizer_buffer_count"] = optimizer.get(
        "buffer_count", NVME_DEFAULTS["nvme_optimizer_buffer_count"]
    )
    settings["nvme_param_buffer_count"] = param.get("buffer_count", NVME_DEFAULTS["nvme_param_buffer_count"])
    settings["nvme_param_buffer_size"] = param.get("buffer_size", NVME_DEFAULTS["nvme_param_buffer_size"])
    settings["shipped"] = False
    return settings


def read_dsconfig(name_or_path: str) -> dict:
    """Load and validate a DeepSpeed JSON file, or a shipped strategy name (zero1, zero2, zero3, ...)."""
    return load_dsconfig(resolve_dsconfig_path(name_or_path, flag="--dsconfig"))


def _filled(value, auto_value) -> int:
    """A setting's number, with the Trainer's fill for "auto"."""
    return int(auto_value) if value == "auto" else int(value)


def _overlap_comm(settings: dict, stage: int) -> bool:
    value = settings["overlap_comm"]
    if value is None:
        return SHIPPED_OVERLAP_COMM[stage] if settings.get("shipped") else stage == 3
    return bool(value)


def model_states(
    total_params: int,
    largest_layer_params: int,
    stage: int,
    offload_optimizer: bool,
    offload_param: bool,
    num_gpus_per_node: int,
    num_nodes: int,
    precision: str = "bf16",
) -> dict:
    """GPU bytes of parameters, gradients and optimizer states per GPU, and host bytes per node for model states.

    In bf16/fp16 the three GPU terms add up to exactly DeepSpeed's estimate_zero2_model_states_mem_needs (stage 2)
    and estimate_zero3_model_states_mem_needs (stage 3, zero_init=True), and the host term equals theirs, for the
    same inputs and additional_buffer_factor 1.5. Those estimators assume 2-byte parameters and gradients; in fp32
    each of those copies is 4 bytes. Stage 1 (no DeepSpeed estimator) keeps full gradients; stage 0 is plain
    PyTorch with an fp32 model and torch AdamW.
    """
    P, L = total_params, largest_layer_params
    gpus = num_gpus_per_node * num_nodes
    low = 4 if precision == "fp32" else 2  # bytes of DeepSpeed's "16-bit" parameter and gradient copies
    buffer = ADDITIONAL_BUFFER_FACTOR
    load_cpu = P * 4 * num_gpus_per_node * buffer  # every rank loads the fp32 checkpoint on the host first
    if stage == 0:
        return _states(4 * P, 4 * P, 8 * P, load_cpu)
    if stage == 1:
        # Full low-precision gradients on every GPU, plus the fp32 gradient, master weights and two Adam moments of
        # this GPU's partition (4 + 4 + 8 bytes per parameter / N).
        return _states(low * P, low * P + int(4 * P / gpus), int(12 * P / gpus), load_cpu)
    if stage == 2:
        if offload_optimizer:
            return _states(low * P, 0, 0, P * max(4 * gpus, 16) * buffer)
        # DeepSpeed: 2P + 18P/N, 18 = 2 (16-bit gradients) + 4 (fp32 gradients) + 4 (fp32 params) + 8 (Adam moments)
        gradients = int(low * P / gpus) + int(4 * P / gpus)
        optimizer = int((low + 16) * P / gpus) - gradients
        return _states(low * P, gradients, optimizer, load_cpu)
    if stage == 3:
        nodes_factor = 1 / num_nodes
        gathered = low * L  # the largest layer gathered (parameters) and its full gradient before reduce-scatter
        if offload_optimizer and offload_param:
            return _states(gathered, gathered, 0, P * 18 * nodes_factor * buffer)
        params = int(low * P / gpus) + gathered
        if offload_optimizer:
            return _states(params, gathered, 0, P * 16 * nodes_factor * buffer)
        # DeepSpeed: 4L + 18P/N. 18 = 2 (16-bit params) + 2 (16-bit gradients) + 12 (fp32 params + Adam moments)
        # + 2 for the fp32 gradient, which ZeRO-3 builds one sub-group at a time.
        optimizer = int(12 * P / gpus)
        gradients = int((2 * low + 14) * P / gpus) - int(low * P / gpus) - optimizer + gathered
        return _states(params, gradients, optimizer, L * 4 * num_gpus_per_node * buffer)
    raise ValueError(f"ZeRO stage {stage}")


def _states(parameters, gradients, optimizer_states, cpu) -> dict:
    return {
        "parameters": int(parameters),
        "gradients": int(gradients),
        "optimizer_states": int(optimizer_states),
        "cpu_model_states": int(cpu),
    }


def bucket_bytes(
    shape: ModelShape,
    settings: dict,
    stage: int,
    offload_optimizer: bool,
    precision: str,
    gpus: int,
    trainable: int | None = None,
) -> dict:
    """GPU bytes of gradient and communication buffers: DDP's buckets without DeepSpeed; DeepSpeed's reduce buffers,
    and (ZeRO-3) the reduce-scatter copy and the fp32 gradient of the optimizer's sub-group; with CPU offload, what
    offload keeps on the GPU (offload_bytes). `trainable`: the parameters with gradients when fewer than all (LoRA);
    buffers for gradients shrink to them."""
    low = 4 if precision == "fp32" else 2
    with_gradients = shape.parameters if trainable is None else trainable
    if stage == 0:
        # DDP (more than one GPU) copies gradients into fp32 buckets covering every parameter that has one.
        return {"ddp": 4 * with_gradients if gpus > 1 else 0}
    auto_bucket = shape.d_model * shape.d_model  # the Trainer's fill for "auto"
    bucket = _filled(settings["reduce_bucket_size"], auto_bucket)
    if trainable is not None:
        bucket = min(bucket, trainable)  # LoRA: a bucket never holds more than the gradients there are
    reduce = bucket * low if settings["contiguous_gradients"] else 0
    largest_parameter = max(shape.parameter_sizes) if trainable is None else 0  # LoRA's matrices are small
    oversized = sum(n for n in shape.parameter_sizes if n > bucket) if trainable is None else 0
    offload = {}
    if offload_optimizer:
        offload = offload_bytes(settings, stage, low, with_gradients, largest_parameter, oversized, gpus)
    if stage in (1, 2):
        # stage_1_and_2.py: one reduce buffer, two with overlap_comm.
        return {"reduce": reduce * (2 if _overlap_comm(settings, stage) else 1), **offload}
    # stage3.py: the reduce bucket (ipg_buckets) and reduce_scatter_coalesced's torch.cat of the bucket's gradients
    # (runtime/comm/coalesced_collectives.py), in the gradient type.
    detail = {"reduce": reduce, "reduce_scatter": bucket * low, **offload}
    if not offload_optimizer:
        # initialize_optimizer_states: an fp32 gradient buffer the size of the largest optimizer sub-group's
        # partition, on the GPU. DeepSpeed's estimator (18P/N) leaves 2P/N for it; the rest is added here.
        partition = math.ceil(with_gradients / gpus)
        sub_group = min(_filled(settings["sub_group_size"], 0), partition)
        detail["fp32_gradient_sub_group"] = max(0, 4 * sub_group - 2 * partition)
    return detail


# What the planner's CPU-offload rows were calibrated on: the GPU check's measured peak (torch's reserved bytes) over the
# prediction for the same run (bench/gpu/results/2026-11-26-h200.json: t5-small's shape, bf16, batch 32, one H200),
# without offload_bytes' transfer copies and gradients awaiting their copy, and with them; the residual is what
# `textsql plan --assumptions` states (tests/unit/test_memory.py recomputes both figures from that JSON).
OFFLOAD_CALIBRATION = {"zero2_offload": (1.35, 1.10), "zero3_offload": (1.31, 1.04)}


def offload_bytes(
    settings: dict, stage: int, low: int, with_gradients: int, largest_parameter: int, oversized: int, gpus: int
) -> dict:
    """What ZeRO's CPU offload of the optimizer keeps on the GPU besides the model states, read from DeepSpeed 0.19.8's
    code (runtime/zero/stage_1_and_2.py and stage3.py) and checked against the GPU check's measured ZeRO-2/3 offload
    rows (OFFLOAD_CALIBRATION). The host side
    (the fp32 master weights, Adam's moments and gradients, pinned) is in the model states. `oversized`: the elements
    of the parameters larger than reduce_bucket_size.

    - offload_staging: ZeRO-1/2's temp_grad_buffer_for_gpu_offload, a GPU buffer of the largest parameter in the
      gradient type; ZeRO-3's partition_grads brings each gradient partition back to the GPU before its copy to the
      host (the largest parameter's partition).
    - fp32_transfer_copies: each parameter's gradient is converted to fp32 on the GPU twice before it leaves, for the
      host's fp32 buffer (async_inplace_copy_grad_to_fp32_buffer_from_gpu; ZeRO-3: the master dtype's copy) and for
      its norm (set_norm_for_param_grad_in_gpu; ZeRO-3: _constant_buffered_norm2): 2 x 4 bytes of the largest
      parameter (ZeRO-3: of its partition). They are made on the reduction stream, whose blocks the caching allocator
      keeps in a pool of their own that the default stream's activations never reuse.
    - gradients_awaiting_copy: gradients recorded on the reduction stream (record_stream) stay reserved until their
      copies to the host finish. ZeRO-1/2: the gradients larger than the bucket, which bypass it and are cloned under
      offload's gradient protections (with "auto", d_model^2 elements: T5's feed-forward weights and embedding);
      ZeRO-3 (reduce_scatter): every parameter's gradient, whole. At most a step's worth: measured on t5-small only
      (one H200); larger models whose copies keep pace with the backward pass hold less."""
    if stage in (1, 2):
        return {
            "offload_staging": largest_parameter * low,
            "fp32_transfer_copies": 2 * 4 * largest_parameter,
            "gradients_awaiting_copy": low * oversized,
        }
    largest_partition = math.ceil(largest_parameter / gpus)
    return {
        "offload_staging": largest_partition * low,
        "fp32_transfer_copies": 2 * 4 * largest_partition,
        "gradients_awaiting_copy": low * with_gradients if _overlap_comm(settings, stage) else 0,
    }


def lora_layers(shape: ModelShape, rank: int, targets: str) -> dict:
    """The nn.Linear layers LoRA adapts under a preset (textsql.families: T5's module names): for each, how many there are,
    their input and output widths and which tokens pass through them; and the trainable parameters, r (in + out) each.
    A causal LM's: the decoder layer's matmuls the preset adapts (textsql.planner.causal.lora_block_layers)."""
    if shape.causal:
        chosen = [
            (f"decoder {role}", shape.num_layers, n_in, n_out, "sequence")
            for role, n_in, n_out in causal_lm.lora_block_layers(shape.causal, targets)
        ]
        return {
            "rank": rank,
            "targets": targets,
            "layers": chosen,
            "trainable": sum(count * rank * (n_in + n_out) for _, count, n_in, n_out, _ in chosen),
        }
    d, f, inner = shape.d_model, shape.d_ff, shape.num_heads * shape.d_kv
    enc, dec = shape.num_layers, shape.num_decoder_layers
    wi = ("wi_0", "wi_1") if shape.gated else ("wi",)
    layers = []  # (name, count, in, out, tokens: "source" or "target")
    for stack, count, tokens in (("encoder", enc, "source"), ("decoder", dec, "target")):
        layers += [(f"{stack} self-attention {n}", count, d, inner, tokens) for n in ("q", "k", "v")]
        layers.append((f"{stack} self-attention o", count, inner, d, tokens))
        layers += [(f"{stack} feed-forward {n}", count, d, f, tokens) for n in wi]
        layers.append((f"{stack} feed-forward wo", count, f, d, tokens))
    # cross-attention: queries from the decoder, keys and values from the encoder's output
    layers += [
        ("decoder cross-attention q", dec, d, inner, "target"),
        ("decoder cross-attention k", dec, d, inner, "source"),
        ("decoder cross-attention v", dec, d, inner, "source"),
        ("decoder cross-attention o", dec, inner, d, "target"),
    ]
    chosen = [layer for layer in layers if layer[0].rsplit(" ", 1)[1] in t5_lora_module_names(targets)]
    return {
        "rank": rank,
        "targets": targets,
        "layers": chosen,
        "trainable": sum(count * rank * (n_in + n_out) for _, count, n_in, n_out, _ in chosen),
    }


def lora_model_states(
    total_params: int,
    trainable: int,
    largest_layer_params: int,
    stage: int,
    offload_optimizer: bool,
    offload_param: bool,
    num_gpus_per_node: int,
    num_nodes: int,
    precision: str = "bf16",
    base_bytes: int | None = None,
) -> dict:
    """model_states for LoRA: the frozen base (P) held in the training dtype under DeepSpeed (fp32 without: textsql
    loads it so), partitioned under ZeRO-3; gradients, fp32 master weights and Adam moments for the T trainable
    parameters only, with DeepSpeed's per-parameter bytes of each stage. `base_bytes`: a quantized base's bytes
    (quantized_base), in place of the base's P parameters in the training dtype."""
    P, T, L = total_params, trainable, largest_layer_params
    gpus = num_gpus_per_node * num_nodes
    low = 4 if precision == "fp32" else 2
    base = (4 if stage == 0 else low) * P if base_bytes is None else base_bytes
    buffer = ADDITIONAL_BUFFER_FACTOR
    load_cpu = P * 4 * num_gpus_per_node * buffer  # every rank still loads the fp32 checkpoint on the host first
    if base_bytes is not None:  # bitsandbytes quantizes each weight as it loads it onto the GPU: no host copy
        load_cpu = 0
    if stage == 0:
        return _states(base + 4 * T, 4 * T, 8 * T, load_cpu)
    if stage == 1:
        return _states(base + low * T, low * T + int(4 * T / gpus), int(12 * T / gpus), load_cpu)
    if stage == 2:
        if offload_optimizer:  # the trainable parameters' fp32 gradients, master weights and moments on the host
            return _states(base + low * T, 0, 0, load_cpu + T * max(4 * gpus, 16) * buffer)
        gradients = int(low * T / gpus) + int(4 * T / gpus)
        return _states(base + low * T, gradients, int((low + 16) * T / gpus) - gradients, load_cpu)
    if stage == 3:
        nodes_factor = 1 / num_nodes
        gathered = low * L  # the largest (frozen) layer is still gathered for the forward and backward passes
        if offload_optimizer and offload_param:  # host: the base's 16-bit partitions, everything of the trainable ones
            return _states(gathered, 0, 0, (base + (low + 16) * T) * nodes_factor * buffer)
        params = int((base + low * T) / gpus) + gathered
        if offload_optimizer:
            return _states(params, 0, 0, (low + 16) * T * nodes_factor * buffer + L * 4 * num_gpus_per_node * buffer)
        optimizer = int(12 * T / gpus)
        return _states(params, int((low + 2) * T / gpus), optimizer, L * 4 * num_gpus_per_node * buffer)
    raise ValueError(f"ZeRO stage {stage}")


def nvme_bytes(shape: ModelShape, setup: Setup, trainable: int) -> dict:
    """ZeRO-Infinity (zero3_nvme) per pod: host bytes (pinned swap buffers, fp32 gradient partitions), disk bytes at
    --nvme_path (16-bit parameters; fp32 master weights and Adam moments of the trainable ones), the bytes read and
    written per step, and the seconds that takes at the assumed bandwidth."""
    settings = dict(setup.settings)
    P, T, N, ranks = shape.parameters, trainable, setup.gpus, setup.gpus_per_node
    low = 4 if setup.precision == "fp32" else 2
    sub_group = min(_filled(settings["sub_group_size"], 0), math.ceil(T / N))
    host = {
        "optimizer_swap_buffers": ranks * int(settings["nvme_optimizer_buffer_count"]) * sub_group * 4,
        "param_swap_buffers": ranks
        * int(settings["nvme_param_buffer_count"])
        * int(settings["nvme_param_buffer_size"])
        * low,
        "fp32_gradient_partitions": ranks * math.ceil(T / N) * 4,
    }
    disk = {"parameters": ranks * math.ceil(low * P / N), "optimizer_states": ranks * math.ceil(12 * T / N)}
    traffic = ranks * math.ceil((3 * low * P + 24 * T) / N)
    return {
        "host_bytes": sum(host.values()),
        "host_detail": host,
        "disk_bytes": sum(disk.values()),
        "disk_detail": disk,
        "traffic_per_step_bytes": traffic,
        "gb_per_s": setup.nvme_gb_per_s,
        "seconds_per_step_at_least": round(traffic / (setup.nvme_gb_per_s * GIB), 3),
    }


def weight_copy_bytes(
    shape: ModelShape,
    stage: int,
    precision: str,
    residency: dict | None,
    quantized: dict | None = None,
    base_in_16_bits: bool = False,
) -> dict:
    """GPU bytes of parameter copies beyond the model states: ZeRO-3's gathered and persistent parameters (in the
    training dtype; `residency` is zero3_residency_for's), or, without DeepSpeed in 16-bit mixed precision, autocast's
    16-bit copy of every matmul weight. With a quantized base (`quantized`: quantized_base's), autocast copies only
    the matmuls left unquantized (the output layer), ZeRO-3 gathers the quantized bytes, and bitsandbytes'
    dequantized copy of one weight in the compute dtype exists while its layer runs forward or backward.
    `base_in_16_bits`: LoRA's frozen base held in bf16 (--lora_base_dtype bfloat16): autocast has nothing to copy."""
    low = 4 if precision == "fp32" else 2
    copies = {}
    if quantized is not None:
        copies["dequantized"] = low * max((n for n, _ in shape.quantizable), default=0)
    matmul = shape.matmul_parameters - (quantized["weights"] if quantized else 0)
    if stage == 0:
        return copies | {"autocast": 2 * matmul if precision != "fp32" and not base_in_16_bits else 0}
    if stage != 3:
        return copies
    in_model_states = low * shape.largest_layer_parameters  # DeepSpeed's estimator already counts the largest layer
    scale = quantized["total"] / (low * shape.parameters) if quantized else 1  # bytes per gathered element
    return copies | {
        "gathered": max(0, int(residency["gathered"] * low * scale) - in_model_states),
        "persistent": residency["persistent"] * low,
    }


# peft's prepare_model_for_kbit_training, which QLoRA runs before adding the adapter, casts every parameter that
# bitsandbytes did not quantize (embeddings, norms, biases, the output layer) from 16 bits to fp32.
KBIT_UNQUANTIZED_BYTES = 4


def quantized_base(shape: ModelShape, quantize: str) -> dict:
    """A quantized base's bytes on one GPU (before ZeRO-3 partitions it): the weights bitsandbytes quantizes (NF4 or
    int8, textsql.planner.causal.quantized_bytes) and the rest in fp32 (KBIT_UNQUANTIZED_BYTES)."""
    weights = sum(n for n, _ in shape.quantizable)
    found = causal_lm.quantized_base_bytes(
        quantize, shape.quantizable, shape.parameters - weights, KBIT_UNQUANTIZED_BYTES
    )
    return found | {"format": quantize, "weights": weights, "other_parameters": shape.parameters - weights}


@lru_cache(maxsize=256)
def zero3_residency(
    shape: ModelShape,
    persistence_threshold: int,
    prefetch_bucket_size: int,
    max_live_parameters: int,
    max_reuse_distance: int,
    gradient_checkpointing: bool,
) -> dict:
    """Elements ZeRO-3 holds gathered on each GPU at its peak: the coordinator's gathered parameters, plus the
    persistent ones (always gathered, on every GPU)."""
    persistent = frozenset(i for i, n in enumerate(shape.parameter_sizes) if n <= persistence_threshold)
    persistent_elements = shape.persistent_parameters(persistence_threshold)
    if shape.module_trace is None:  # no module trace: every parameter, an upper bound
        return {
            "gathered": shape.parameters - persistent_elements,
            "persistent": persistent_elements,
            "source": "upper bound (no module trace)",
        }
    events, module_parameters = zero3_step_events(shape.module_trace, persistent, gradient_checkpointing)
    replay = simulate_parameter_coordinator(
        shape.parameter_sizes,
        events,
        module_parameters,
        persistent,
        prefetch_bucket_size,
        max_live_parameters,
        max_reuse_distance,
    )
    return {
        "gathered": replay["peak_gathered"],
        "persistent": persistent_elements,
        "source": "replay of DeepSpeed's PartitionedParameterCoordinator on the model's module trace",
    }


def zero3_residency_for(shape: ModelShape, settings: dict, gradient_checkpointing: bool) -> dict:
    """zero3_residency with the dsconfig's stage-3 settings ("auto" as the Trainer fills it), and the settings used."""
    auto_bucket = shape.d_model * shape.d_model
    used = {
        "stage3_param_persistence_threshold": _filled(
            settings["stage3_param_persistence_threshold"], 10 * shape.d_model
        ),
        "stage3_prefetch_bucket_size": _filled(settings["stage3_prefetch_bucket_size"], 0.9 * auto_bucket),
        "stage3_max_live_parameters": _filled(settings["stage3_max_live_parameters"], 0),
        "stage3_max_reuse_distance": _filled(settings["stage3_max_reuse_distance"], 0),
    }
    return zero3_residency(shape, *used.values(), gradient_checkpointing) | {"settings": used}


@dataclass(frozen=True)
class Setup:
    """Everything but the strategy and the batch: the cluster, the lengths, the precision, the DeepSpeed settings."""

    nodes: int
    gpus_per_node: int
    source_length: int
    target_length: int
    precision: str
    gradient_checkpointing: bool
    settings: tuple  # zero_settings() items, hashable
    lora_rank: int = 0  # 0: full fine-tuning; else LoRA of this rank on lora_targets
    lora_targets: str = "qv"
    quantize_base: str = "none"  # with LoRA: the frozen base quantized by bitsandbytes (nf4, int8)
    eval_batch: int = 32  # per_device_eval_batch_size
    eval_num_beams: int = 1  # beams of the SQL generated during evaluation; 0: evaluation computes the loss only
    nvme_gb_per_s: float = NVME_GB_PER_S
    # The speed levers that change memory (textsql train's --fused_loss and --lora_base_dtype; textsql.arguments.speed)
    fused_loss: str = "none"  # chunked or liger: a causal LM's logits at the label positions only, in chunks
    lora_base_dtype: str = "float32"  # bfloat16: LoRA's frozen base in bf16 without DeepSpeed (no autocast copies)

    @property
    def gpus(self) -> int:
        return self.nodes * self.gpus_per_node


def setup_from_arguments(
    arguments,
    *,
    nodes: int,
    gpus_per_node: int,
    source_length: int,
    target_length: int,
    precision: str,
    settings: dict,
    nvme_gb_per_s: float = NVME_GB_PER_S,
) -> Setup:
    """The planner's Setup of a run from its `textsql train` arguments (textsql.arguments): the dataclasses themselves,
    anything with their fields (`textsql plan`'s PlanArguments takes the same flags for what the planner models), or
    their dict (arguments_dict; a run summary's training and data arguments together). The one place a training flag
    becomes a prediction's input, so that `textsql plan`, tune's candidates and every run's memory check predict the
    same run alike. A flag left out takes the spec's default. What a run decides when it starts comes as keywords: the
    pods, the longest lengths it pads to, the precision (bf16/fp16/fp32) and the DeepSpeed settings (zero_settings)."""
    get = arguments.get if isinstance(arguments, dict) else lambda name, default=None: getattr(arguments, name, default)
    lora = lora_arguments(arguments)
    speed = SpeedArguments()  # the spec's defaults for what the planner models of the levers
    beams = get("execution_accuracy_num_beams")  # textsql plan's 0: evaluation generates nothing
    eval_num_beams = (1 if beams is None else int(beams)) if get("execution_accuracy_samples", 1) else 0
    return Setup(
        nodes,
        gpus_per_node,
        source_length,
        target_length,
        precision if precision in PRECISIONS else "fp32",
        bool(get("activation_checkpointing") or get("gradient_checkpointing")),
        tuple(sorted(settings.items())),
        lora_rank=lora.lora_rank if lora.lora else 0,
        lora_targets=lora.lora_targets if lora.lora else "qv",
        quantize_base=lora.quantize_base if lora.lora else "none",
        eval_batch=int(get("per_device_eval_batch_size") or get("per_device_train_batch_size") or Setup.eval_batch),
        eval_num_beams=int(eval_num_beams),
        nvme_gb_per_s=nvme_gb_per_s,
        fused_loss=get("fused_loss") or speed.fused_loss,
        lora_base_dtype=get("lora_base_dtype") or speed.lora_base_dtype,
    )
