"""Predict peak GPU and CPU memory per pod for every training strategy before launch, and recommend the fastest that fits."""

from __future__ import annotations

import hashlib
import json
import math
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, fields
from functools import lru_cache
from pathlib import Path

from textsql.adapters import LoraArguments
from textsql.errors import TextsqlError
from textsql.families import auto_model_class, family_of, t5_lora_module_names
from textsql.hub import download_command, hub_offline
from textsql.planner import causal as causal_lm
from textsql.planner.shape_cache import read_record, shape_key, write_record
from textsql.planner.zero3_trace import (
    NARROW_WIDTHS,
    ModuleTrace,
    record_module_trace,
    simulate_parameter_coordinator,
    zero3_step_events,
)
from textsql.strategy.dsconfig import describe_strategy, load_dsconfig, resolve_dsconfig_path
from textsql.strategy.table import DEEPSPEED_STRATEGIES, FSDP_LAYOUT, NVME_STRATEGIES, STRATEGIES, STRATEGY_LAYOUT

GIB = (
    2**30
)  # "GB" everywhere in the planner means 2**30 bytes, as nvidia-smi (MiB / 1024) and DeepSpeed's estimators count
PRECISIONS = ("fp32", "bf16", "fp16")

# parameters + gradients + optimizer_states are the model states (DeepSpeed's estimators); weight_copies are the parameter
# copies held beyond them (ZeRO-3's gathered parameters, autocast's 16-bit weights); buckets are communication and
# gradient buffers.
COMPONENTS = ("parameters", "gradients", "optimizer_states", "weight_copies", "activations", "buckets", "overhead")

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
# Sustained bandwidth of the NVMe folder zero3_nvme swaps to, read and write alike, GB/s per pod: a conservative figure
# for one PCIe NVMe drive (data-center drives sustain about 2-7 GB/s sequential; several striped, more). Not measured
# by textsql: DeepSpeed's NVMe profiling guide (microsoft/DeepSpeed issue #998, `ds_nvme_tune`) measures yours; pass
# it as --nvme_gb_per_s.
NVME_GB_PER_S = 2.0

# DeepSpeed's own estimators multiply host memory by this (additional_buffer_factor, their default).
ADDITIONAL_BUFFER_FACTOR = 1.5
# What torch does not see. CUDA context with torch's kernels loaded lazily (CUDA >= 11.7, torch's default since 1.13):
# measured by the GPU check (bench/gpu, 2026-11-26: NVIDIA H200, CUDA 13.0, torch 2.11, driver 580.159) as the device
# memory in use beyond torch's reservation after the first allocation: 648,871,936 bytes (0.60 GiB; the estimate it
# replaces was 0.5 GiB, from pytorch/pytorch#86509's 287 MB bare context plus the kernels a step loads).
CUDA_CONTEXT_BYTES = 648_871_936
# NCCL's communicator buffers with more than one GPU: measured by the same check after a one-rank NCCL all-reduce on
# that H200 (NCCL 2.28.9): 585,105,408 bytes beyond the context (0.54 GiB; the estimate it replaces was 0.25 GiB from
# NCCL_BUFFSIZE's 4 MiB per channel and peer). A lower bound: more peers (several GPUs, several pods) add channels.
NCCL_BUFFER_BYTES = 585_105_408
# The caching allocator reserves more than it hands out (block rounding, fragmentation): pytorch/pytorch#40989 shows
# peak reserved / peak allocated of 1.11 for a training step (16726 / 15006 MB); 10% of everything allocated. The GPU
# check (bench/gpu, H200, 2026-11-26; 11 runs of t5-small's shape in bf16, batch 32, 48/40 tokens, every strategy and
# LoRA) measured 1.11-1.54 (median 1.32), but the planner's allocated bytes came out 12-18% high on the same runs, so
# its reserved prediction landed within -11% / +2% of the measurement except ZeRO-2/3 with CPU offload (+31% / +35%:
# under-predicted, the next thing to model). Kept at 10% until the allocated terms are calibrated too.
ALLOCATOR_OVERHEAD_FRACTION = 0.10
# Host memory of one training process besides model states: Python, torch + CUDA libraries, transformers,
# DeepSpeed, the tokenized dataset.
CPU_RUNTIME_BYTES_PER_RANK = 3 * GIB
MAX_BATCH_SEARCHED = 4096

ASSUMPTIONS = [
    "GB = 2**30 bytes. The GPU figure is what nvidia-smi shows at the peak: torch's reserved memory plus the CUDA "
    "context and NCCL buffers.",
    "Model states (parameters + gradients + optimizer states) equal DeepSpeed's estimate_zero2/zero3_model_states_mem_"
    "needs for ZeRO-2/3 in bf16/fp16 (2-byte parameters and gradients, fp32 master weights and Adam moments). In fp32 "
    "every 2-byte copy is 4 bytes (ZeRO-2: 4P + 20P/N instead of 2P + 18P/N). ZeRO-1 keeps full gradients "
    "(its own formula: 2P + 2P + 16P/N). No DeepSpeed: fp32 weights, fp32 gradients and two fp32 Adam moments (16P) "
    "whatever the precision (autocast), plus DDP's gradient buckets (4P) on more than one GPU.",
    "Weight copies beyond the model states. ZeRO-3: the parameters gathered on the GPU at the peak, in the training "
    "dtype (4 bytes in fp32), less the largest layer the estimator already counts, plus the persistent parameters "
    "(each at most stage3_param_persistence_threshold elements, kept on every GPU). The gathered figure replays "
    "DeepSpeed 0.19.8's PartitionedParameterCoordinator on the model's module trace (recorded on a narrow copy of the model) with "
    "the dsconfig's stage3_prefetch_bucket_size, stage3_max_live_parameters and stage3_max_reuse_distance: with "
    "prefetching on, it keeps up to about stage3_max_live_parameters gathered (1e9 in common configs: all of t5-large). "
    "No DeepSpeed in bf16/fp16: autocast's 16-bit copy of every matmul weight (2 bytes per parameter), kept for the "
    "backward pass.",
    "Gradients are counted as coexisting with the activations and the gathered parameters (conservative); the "
    "optimizer step's temporaries are not counted: the Trainer's default fused AdamW has none (the older foreach AdamW "
    "allocated 4 bytes per parameter once the activations were freed).",
    "Activations: every tensor T5 saves for the backward pass (attention scores, softmax in fp32, dropout masks, "
    "feed-forward hidden states, layer norms), for the longest batch (batch x max lengths), plus the loss over the "
    "vocabulary (log-softmax output, its gradient and the logits' gradient). With gradient checkpointing only each "
    "block's input is kept, plus one block recomputed at a time.",
    "Buckets: ZeRO-1/2 reduce buffers (reduce_bucket_size elements of the gradient type; two with overlap_comm) and, "
    "with optimizer offload, a staging buffer the size of the largest parameter. ZeRO-3: the reduce buffer and "
    "reduce-scatter's copy of it; without optimizer offload the fp32 gradient buffer of the largest optimizer "
    "sub-group (sub_group_size) beyond the 2P/N the estimator counts; with it, a staging copy of a gradient partition.",
    f"Overhead: {CUDA_CONTEXT_BYTES / GIB:.2f} GB CUDA context and {NCCL_BUFFER_BYTES / GIB:.2f} GB NCCL buffers with "
    f"more than one GPU (both measured on an H200; NCCL's grow with the peers), and {ALLOCATOR_OVERHEAD_FRACTION:.0%} of "
    "the allocated memory for the caching allocator (sources in textsql/planner/memory.py).",
    "CPU per node: DeepSpeed's host estimate for the model states (zero.Init with ZeRO-3, as textsql trains) plus "
    "3 GB per training process for Python, libraries and data.",
    "ZeRO-Infinity (zero3_nvme): the GPU holds what it holds under zero3_offload. The host holds the pinned swap "
    "buffers (offload_optimizer.buffer_count x the largest optimizer sub-group partition in fp32; offload_param."
    "buffer_count x buffer_size in the training dtype) and the fp32 gradient partitions (4 bytes per trainable "
    "parameter / N), plus 3 GB per process. The disk (--nvme_path) holds each rank's 16-bit parameter partition and "
    "fp32 master weights and Adam moments (2 or 4 + 12 bytes per parameter / N). Per step the parameters are read in "
    "the forward and the backward pass and written after the update, and the optimizer states are read and written: "
    "(3 x 2 or 4 + 24) bytes per parameter / N; the time that takes at --nvme_gb_per_s (default 2 GB/s per pod, one "
    "PCIe NVMe drive: an assumption, measure yours with DeepSpeed's ds_nvme_tune) is a lower bound on a step.",
    "FSDP2 (fully_shard): parameters, gradients and Adam moments sharded in fp32 (4 + 4 + 8 bytes per parameter / N, "
    "N the GPUs a parameter is sharded over: all of them, or one pod's with hybrid sharding), on the host with "
    "offload. Weight copies: the gathered units in the compute dtype: T5's tied embeddings (one unit, kept gathered "
    "through the step), two T5 blocks at a time (the one computing and the one prefetched) with full sharding, every "
    "block after the forward pass with shard-grad-op. Buckets: the largest unit's unsharded gradient and its fp32 "
    "copy for the reduce-scatter. Activations as DeepSpeed's (the module itself computes in bf16). Not yet calibrated "
    "on a GPU.",
]
ASSUMPTIONS.append(
    "Phases: a pod's peak is the largest of the training step, evaluation, checkpoint save and final save. Between "
    "steps the activations are freed, and PyTorch's and FSDP's gradients (DeepSpeed keeps its gradient partitions; "
    "ZeRO-3's gathered parameters are counted whole). Evaluation adds the eval loss's forward pass over the "
    "vocabulary or, when it generates SQL, generate()'s caches: eval batch x beams rows of encoder output, "
    "cross-attention and self-attention keys and values of every decoder layer, and fp32 scores. Checkpoint save "
    "adds host memory: rank 0's whole model (ZeRO-3 gathers it in the training dtype; else safetensors copies the "
    "GPU tensors) and torch.save's copy of a GPU optimizer partition. The final fp32 save adds the full fp32 copy "
    "of the largest parameter on the GPU (DeepSpeed, FSDP) and every rank's fp32 state dict on the host (rank 0's "
    "alone under FSDP; the adapter alone with LoRA).",
)
LORA_ASSUMPTIONS = [
    "LoRA rows (--lora True): the base model is frozen and held in the training dtype under DeepSpeed (DeepSpeed casts "
    "the whole module; fp32 without DeepSpeed, as textsql loads it), partitioned under ZeRO-3 like any parameter. "
    "Gradients, fp32 master weights and Adam moments exist for the trainable parameters only: r x (in + out) for each "
    "adapted nn.Linear (plus 2 x d_model per character prep added, not counted here: a few thousand parameters). "
    "Activations: the full fine-tuning ones (the frozen layers still pass gradients back), plus, per adapted layer and "
    "token, the adapter's input after dropout with its mask and its r-wide hidden state. With CPU offload the optimizer "
    "states live in host memory, so there LoRA saves host memory, not GPU memory.",
]

CAUSAL_ASSUMPTIONS = [
    "Causal LM: prompt and SQL are one sequence of max_source_length + max_target_length tokens through one stack of "
    "decoder layers; the widths are the config's as its family reads them (textsql.families), the parameter count "
    "the model's own built on the meta device. Activations per layer and token: two norms (fp32 input, output), the "
    "attention's query, keys, values, output and its copy for the output projection (sdpa; transformers repeats "
    "grouped-query keys and values to every query head when the batch is padded, so GQA/MQA shrink the KV cache of "
    "generation, not the training step's saved keys and values), with eager attention (bloom, codegen) the fp32 "
    "softmax and probabilities over the sequence, and the feed-forward hidden states (4 x the feed-forward width "
    "where gated). The logits term: every position's logits upcast to fp32 by transformers' loss, 12 bytes (+2 in "
    "bf16) per position and vocabulary entry at the backward pass's start. Dropout masks are not counted (0 in most "
    "causal configs; gpt2 and opt use 0.1).",
]
QLORA_ASSUMPTIONS = [
    "QLoRA rows (--quantize_base): bitsandbytes quantizes every nn.Linear (and Conv1D) but the output layer. NF4 "
    "with double quantization: 4 bits per weight, a uint8 absmax per block of 64 and an fp32 absmax per 256 blocks "
    "(4.13 bits per weight), plus an fp32 offset and the 16- and 256-entry codes per tensor; int8: 1 byte per weight "
    "plus an fp32 scale per output row. Everything else (embeddings, norms, biases, the output layer) in fp32, as "
    "peft's prepare_model_for_kbit_training casts it. Weight copies: one weight dequantized in the compute dtype "
    "while its layer runs. The adapter, its gradients and Adam states as for LoRA. Host memory: no copy of the model "
    "(bitsandbytes quantizes each weight as it loads it onto the GPU), the 3 GB per process. Falcon's FalconLinear layers are "
    "not swapped by transformers' bitsandbytes integration; the plan assumes they are (textsql train checks it).",
]

# ---------------------------------------------------------------------------------------------------------------------
# Arguments
# ---------------------------------------------------------------------------------------------------------------------


@dataclass
class PlanArguments:
    """The model, the pods and the batch to plan for."""

    model: str = field(
        default="t5-small",
        metadata={
            "help": "t5-small, t5-base, t5-large, t5-3b or t5-11b, or a causal LM of the built-in table (Qwen/Qwen2.5-"
            "0.5B/1.5B/7B, meta-llama/Llama-3.2-1B, meta-llama/Llama-3.1-8B, mistralai/Mistral-7B-v0.1, bigscience/bloom-"
            "1b1, bigscience/bloom-7b1, tiiuae/falcon-7b, Salesforce/codegen2-1B, bigcode/starcoderbase-1b, gpt2, "
            "facebook/opt-1.3b: nothing is downloaded), a local model folder with config.json, or a hub name already in "
            "the local Hugging Face cache."
        },
    )
    nodes: int = field(default=1, metadata={"help": "Pods (nodes) training together."})
    gpus_per_node: int = field(default=1, metadata={"help": "GPUs in each pod."})
    gpu_memory_gb: float = field(
        default=40.0, metadata={"help": "Memory of one GPU in GB (2**30 bytes; an A100-40GB has 40)."}
    )
    per_device_train_batch_size: int = field(default=32, metadata={"help": "Training batch per GPU."})
    per_device_eval_batch_size: int = field(
        default=32, metadata={"help": "Evaluation batch per GPU (as textsql train's), for the evaluation phase."}
    )
    eval_num_beams: int = field(
        default=1,
        metadata={
            "help": "Beams of the SQL generated at each evaluation (textsql train --execution_accuracy_num_beams; 1: "
            "greedy); 0 when evaluation generates nothing (--execution_accuracy_samples 0)."
        },
    )
    max_source_length: int = field(
        default=96,
        metadata={
            "help": "Longest question in a batch, in tokens (batches are padded to their longest); a causal LM's prompt."
        },
    )
    max_target_length: int = field(
        default=96,
        metadata={
            "help": "Longest SQL target in a batch, in tokens. A causal LM reads prompt and SQL as one sequence of "
            "max_source_length + max_target_length tokens."
        },
    )
    precision: str = field(default="bf16", metadata={"help": "fp32, bf16 or fp16 (bf16 on Ampere and newer GPUs)."})
    gradient_checkpointing: bool = field(
        default=False,
        metadata={"help": "Recompute activations in the backward pass (less memory, about 30 percent slower)."},
    )
    dsconfig: str | None = field(
        default=None,
        metadata={
            "help": "A DeepSpeed JSON file or shipped name (zero1, zero2, zero3, ...): bucket and sub-group "
            "sizes and the stage3_* settings (max live parameters, max reuse distance, prefetch bucket, "
            "persistence threshold) come from it. Without it, the shipped dsconfig/ settings are assumed."
        },
    )
    cpu_memory_gb: float | None = field(
        default=None, metadata={"help": "Host memory of one pod in GB; checked for the offload strategies when given."}
    )
    safety_margin: float = field(
        default=0.1,
        metadata={
            "help": "Fraction of GPU (and CPU) memory kept free when recommending (0.1 = use at most 90 percent)."
        },
    )
    lora: bool = field(
        default=False,
        metadata={
            "help": "Also plan LoRA (textsql train --lora True) under every strategy, and "
            "recommend it where full fine-tuning does not fit or needs more pods."
        },
    )
    lora_rank: int = field(default=8, metadata={"help": "LoRA rank r (as textsql train --lora_rank)."})
    lora_targets: str = field(default="qv", metadata={"help": "qv or all (as textsql train --lora_targets)."})
    quantize_base: str = field(
        default="none",
        metadata={
            "help": "With --lora True, also plan QLoRA: the frozen base quantized by bitsandbytes, nf4 or int8 (as "
            "textsql train --quantize_base), for causal LMs and T5; recommended where neither full fine-tuning nor LoRA on "
            "a bf16/fp32 base fits."
        },
    )
    nvme_gb_per_s: float = field(
        default=NVME_GB_PER_S,
        metadata={
            "help": "Sustained read and write bandwidth of the NVMe folder zero3_nvme swaps to, GB/s per pod: the "
            "zero3_nvme row's seconds per step of disk traffic. Default 2: one PCIe NVMe drive (an assumption; "
            "measure yours with DeepSpeed's ds_nvme_tune)."
        },
    )
    json: bool = field(default=False, metadata={"help": "Print the plan as JSON instead of a table."})
    assumptions: bool = field(
        default=False, metadata={"help": "Print the assumptions behind the numbers under the table."}
    )

    def __post_init__(self):
        if not str(self.model).strip():
            raise TextsqlError("--model is empty. Pass t5-small, t5-base, t5-large, t5-3b, t5-11b or a model folder.")
        for name in (
            "nodes",
            "gpus_per_node",
            "per_device_train_batch_size",
            "per_device_eval_batch_size",
            "max_source_length",
            "max_target_length",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise TextsqlError(f"--{name} must be a whole number of at least 1, not {value!r}.")
        if isinstance(self.eval_num_beams, bool) or not isinstance(self.eval_num_beams, int) or self.eval_num_beams < 0:
            raise TextsqlError(
                f"--eval_num_beams must be 0 (evaluation generates nothing), 1 (greedy) or more beams, "
                f"not {self.eval_num_beams!r}."
            )
        if not self.gpu_memory_gb > 0:
            raise TextsqlError(f"--gpu_memory_gb must be positive (40 for an A100-40GB), not {self.gpu_memory_gb!r}.")
        if self.cpu_memory_gb is not None and not self.cpu_memory_gb > 0:
            raise TextsqlError(f"--cpu_memory_gb must be positive (or left out), not {self.cpu_memory_gb!r}.")
        if self.precision not in PRECISIONS:
            raise TextsqlError(f"--precision must be one of {', '.join(PRECISIONS)}, not '{self.precision}'.")
        LoraArguments(
            lora=self.lora, lora_rank=self.lora_rank, lora_targets=self.lora_targets, quantize_base=self.quantize_base
        )  # the same checks as training
        if not self.nvme_gb_per_s > 0:
            raise TextsqlError(
                f"--nvme_gb_per_s must be positive (2 for one PCIe NVMe drive), not {self.nvme_gb_per_s!r}."
            )
        if not 0 <= self.safety_margin < 1:
            raise TextsqlError(
                f"--safety_margin is a fraction of memory kept free, from 0 to below 1 (e.g. 0.1), "
                f"not {self.safety_margin!r}."
            )


# ---------------------------------------------------------------------------------------------------------------------
# Model shape
# ---------------------------------------------------------------------------------------------------------------------


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


# ---------------------------------------------------------------------------------------------------------------------
# DeepSpeed settings
# ---------------------------------------------------------------------------------------------------------------------


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


# ---------------------------------------------------------------------------------------------------------------------
# The pieces of the prediction
# ---------------------------------------------------------------------------------------------------------------------


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


def activation_bytes(
    shape: ModelShape,
    batch: int,
    source_length: int,
    target_length: int,
    precision: str,
    gradient_checkpointing: bool,
    autocast: bool,
    frozen: bool = False,
) -> dict:
    """Peak bytes of activations (everything saved for the backward pass) of one training step of a T5 model (a causal
    LM's: textsql.planner.causal.activation_bytes, where `frozen` says the base does not train: LoRA).

    Counted per token from the tensors HF's T5 saves: q/k/v and the attention output; the attention scores' fp32
    softmax output, dropout mask (1 byte) and dropout output; RMS layer norm inputs and outputs (fp32 when computed
    in fp32); the feed-forward hidden state (activation output, dropout mask and output); residual dropout masks.
    The loss over the vocabulary peaks at the start of the backward pass with three batch x target x vocab tensors
    (log-softmax output, its gradient, the logits' gradient). `autocast` is plain PyTorch mixed precision: 16-bit
    matmul outputs, fp32 layer norms and loss.
    """
    if shape.causal:  # one sequence of prompt + SQL through one stack of decoder layers
        return causal_lm.activation_bytes(
            shape.causal,
            batch,
            source_length + target_length,
            precision,
            gradient_checkpointing,
            shape.eager_attention,
            autocast=autocast,
            frozen=frozen,
        )
    s = shape
    b, src, tgt = batch, source_length, target_length
    e = 4 if precision == "fp32" else 2
    wide = 4 if (precision == "fp32" or autocast) else 2  # layer norms and the loss
    d, f, inner = s.d_model, s.d_ff, s.num_heads * s.d_kv
    norm = 12 * d if wide == 4 else 8 * d  # fp32 input (copy), normed, output: 4+4+4 bytes, or 4+2+2 in 16-bit
    score = 4 + 1 + e  # per attention score: fp32 softmax output, dropout mask, dropout output
    hidden = (4 * e + 1) * f if s.gated else (2 * e + 1) * f
    feed_forward = norm + hidden + d
    self_attention = norm + 4 * inner * e + d
    cross_attention = norm + 2 * inner * e + d  # its keys and values are counted per source token below
    encoder_layer = b * src * (self_attention + feed_forward + s.num_heads * src * score)
    decoder_layer = (
        b * tgt * (self_attention + cross_attention + feed_forward + s.num_heads * (tgt + src) * score)
        + b * src * 2 * inner * e
    )
    # Embedding dropout, final layer norm and dropout of each stack; the decoder's scaled output feeds the lm head.
    stack_ends = b * src * (2 * d * (1 + e) + norm) + b * tgt * (2 * d * (1 + e) + norm + d * e)
    position_bias = b * s.num_heads * (src * src + tgt * tgt + tgt * src) * e  # bias + mask, one per attention kind
    gradient_flow = 3 * b * max(src, tgt) * d * e  # gradients of the hidden states and of the encoder output
    loss = 3 * b * tgt * s.vocab_size * wide
    if gradient_checkpointing:
        layers = (s.num_layers * b * src + s.num_decoder_layers * b * tgt) * d * e  # each block's input
        transient = max(loss, encoder_layer, decoder_layer)  # the loss first, then one block recomputed at a time
    else:
        layers = s.num_layers * encoder_layer + s.num_decoder_layers * decoder_layer
        transient = loss
    total = layers + transient + stack_ends + position_bias + gradient_flow
    return {
        "layers": int(layers),
        "transient": int(transient),
        "other": int(stack_ends + position_bias + gradient_flow),
        "loss_peak": int(loss),
        "total": int(total),
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
    offload staging buffers and (ZeRO-3) the reduce-scatter copy and the fp32 gradient of the optimizer's sub-group.
    `trainable`: the parameters with gradients when fewer than all (LoRA); buffers for gradients shrink to them."""
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
    if stage in (1, 2):
        # stage_1_and_2.py: one reduce buffer, two with overlap_comm; with optimizer offload a GPU buffer of the
        # largest parameter (temp_grad_buffer_for_gpu_offload) through which gradients go to the host.
        staging = largest_parameter * low if offload_optimizer else 0
        return {"reduce": reduce * (2 if _overlap_comm(settings, stage) else 1), "offload_staging": staging}
    # stage3.py: the reduce bucket (ipg_buckets) and reduce_scatter_coalesced's torch.cat of the bucket's gradients
    # (runtime/comm/coalesced_collectives.py), in the gradient type.
    detail = {"reduce": reduce, "reduce_scatter": bucket * low}
    partition = math.ceil(with_gradients / gpus)
    if offload_optimizer:
        # partition_grads copies each reduced gradient partition back to the GPU before offloading it
        detail["offload_staging"] = math.ceil(largest_parameter / gpus) * low
    else:
        # initialize_optimizer_states: an fp32 gradient buffer the size of the largest optimizer sub-group's
        # partition, on the GPU. DeepSpeed's estimator (18P/N) leaves 2P/N for it; the rest is added here.
        sub_group = min(_filled(settings["sub_group_size"], 0), partition)
        detail["fp32_gradient_sub_group"] = max(0, 4 * sub_group - 2 * partition)
    return detail


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


def lora_activation_bytes(
    lora: dict,
    batch: int,
    source_length: int,
    target_length: int,
    precision: str,
    gradient_checkpointing: bool,
    shape: ModelShape,
) -> int:
    """LoRA's activations beyond the model's: per adapted layer and token, its input after dropout (and the 1-byte
    mask) and the r-wide output of A. With gradient checkpointing, those of one encoder and one decoder block."""
    if shape.causal:
        return causal_lm.lora_activation_bytes(
            shape.causal,
            lora["rank"],
            lora["targets"],
            batch,
            source_length + target_length,
            precision,
            gradient_checkpointing,
        )
    e = 4 if precision == "fp32" else 2
    tokens = {"source": batch * source_length, "target": batch * target_length}
    per_block = {"encoder": 0, "decoder": 0}
    for name, _count, n_in, _n_out, kind in lora["layers"]:
        per_block[name.split(" ", 1)[0]] += tokens[kind] * (n_in * (e + 1) + lora["rank"] * e)
    if gradient_checkpointing:
        return per_block["encoder"] + per_block["decoder"]
    return per_block["encoder"] * shape.num_layers + per_block["decoder"] * shape.num_decoder_layers


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
    shape: ModelShape, stage: int, precision: str, residency: dict | None, quantized: dict | None = None
) -> dict:
    """GPU bytes of parameter copies beyond the model states: ZeRO-3's gathered and persistent parameters (in the
    training dtype; `residency` is zero3_residency_for's), or, without DeepSpeed in 16-bit mixed precision, autocast's
    16-bit copy of every matmul weight. With a quantized base (`quantized`: quantized_base's), autocast copies only
    the matmuls left unquantized (the output layer), ZeRO-3 gathers the quantized bytes, and bitsandbytes'
    dequantized copy of one weight in the compute dtype exists while its layer runs forward or backward."""
    low = 4 if precision == "fp32" else 2
    copies = {}
    if quantized is not None:
        copies["dequantized"] = low * max((n for n, _ in shape.quantizable), default=0)
    matmul = shape.matmul_parameters - (quantized["weights"] if quantized else 0)
    if stage == 0:
        return copies | {"autocast": 2 * matmul if precision != "fp32" else 0}
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

    @property
    def gpus(self) -> int:
        return self.nodes * self.gpus_per_node


def predict(
    shape: ModelShape,
    setup: Setup,
    stage: int,
    offload_optimizer: bool,
    offload_param: bool,
    batch: int,
    nvme: bool = False,
) -> dict:
    """Bytes per GPU by component (and their total), host bytes per node, for one strategy and batch (LoRA when
    setup.lora_rank is set). `nvme`: what is offloaded goes to NVMe (nvme_bytes) instead of host memory."""
    settings = dict(setup.settings)
    lora = lora_layers(shape, setup.lora_rank, setup.lora_targets) if setup.lora_rank else None
    quantized = quantized_base(shape, setup.quantize_base) if lora and setup.quantize_base != "none" else None
    if lora is None:
        states = model_states(
            shape.parameters,
            shape.largest_layer_parameters,
            stage,
            offload_optimizer,
            offload_param,
            setup.gpus_per_node,
            setup.nodes,
            setup.precision,
        )
    else:
        states = lora_model_states(
            shape.parameters,
            lora["trainable"],
            shape.largest_layer_parameters,
            stage,
            offload_optimizer,
            offload_param,
            setup.gpus_per_node,
            setup.nodes,
            setup.precision,
            base_bytes=quantized["total"] if quantized else None,
        )
    activations = activation_bytes(
        shape,
        batch,
        setup.source_length,
        setup.target_length,
        setup.precision,
        setup.gradient_checkpointing,
        autocast=stage == 0 and setup.precision != "fp32",
        frozen=lora is not None and quantized is None,  # bitsandbytes' matmuls keep their inputs, frozen or not
    )
    if lora is not None:
        activations["lora"] = lora_activation_bytes(
            lora, batch, setup.source_length, setup.target_length, setup.precision, setup.gradient_checkpointing, shape
        )
        activations["total"] += activations["lora"]
    if quantized is not None and setup.quantize_base == "int8" and shape.causal:
        tokens = batch * (setup.source_length + setup.target_length)
        layers = 1 if setup.gradient_checkpointing else shape.causal.layers
        activations["int8_inputs"] = layers * causal_lm.int8_matmul_input_bytes(shape.causal, tokens)
        activations["total"] += activations["int8_inputs"]
    buckets = bucket_bytes(
        shape,
        settings,
        stage,
        offload_optimizer,
        setup.precision,
        setup.gpus,
        trainable=None if lora is None else lora["trainable"],
    )
    residency = zero3_residency_for(shape, settings, setup.gradient_checkpointing) if stage == 3 else None
    copies = weight_copy_bytes(shape, stage, setup.precision, residency, quantized)
    gpu = {
        "parameters": states["parameters"],
        "gradients": states["gradients"],
        "optimizer_states": states["optimizer_states"],
        "weight_copies": sum(copies.values()),
        "activations": activations["total"],
        "buckets": sum(buckets.values()),
    }
    allocated = sum(gpu.values())
    unseen_by_torch = CUDA_CONTEXT_BYTES + (NCCL_BUFFER_BYTES if setup.gpus > 1 else 0)
    gpu["overhead"] = int(ALLOCATOR_OVERHEAD_FRACTION * allocated) + unseen_by_torch
    total = sum(gpu.values())
    disk = nvme_bytes(shape, setup, shape.parameters if lora is None else lora["trainable"]) if nvme else None
    if disk is not None:
        states["cpu_model_states"] = disk["host_bytes"]
    cpu = int(states["cpu_model_states"] + CPU_RUNTIME_BYTES_PER_RANK * setup.gpus_per_node)
    return {
        "nvme": disk,
        "gpu_bytes": gpu,
        "gpu_total_bytes": total,
        "torch_allocated_bytes": allocated,
        "torch_reserved_bytes": total - unseen_by_torch,
        "model_states_bytes": states["parameters"] + states["gradients"] + states["optimizer_states"],
        "activations_detail": activations,
        "buckets_detail": buckets,
        "weight_copies_detail": copies,
        "zero3_residency": residency,
        "overhead_detail": {
            "allocator": gpu["overhead"] - unseen_by_torch,
            "cuda_context": CUDA_CONTEXT_BYTES,
            "nccl": unseen_by_torch - CUDA_CONTEXT_BYTES,
        },
        "cpu_per_node_bytes": cpu,
        "cpu_model_states_bytes": states["cpu_model_states"],
        "trainable_parameters": shape.parameters if lora is None else lora["trainable"],
        "quantized_base": quantized,
    }


def fsdp_units(shape: ModelShape) -> dict:
    """Parameters of the FSDP units textsql wraps: one T5 block of each stack, and the rest (the tied embeddings, with
    the final layer norms) as the embedding unit. A causal LM's: its decoder layer (the model's _no_split_modules), and
    the rest (embeddings, output layer, final norm) as the embedding unit."""
    if shape.causal:
        blocks = shape.num_layers * shape.block_parameters
        return {
            "encoder_block": 0,
            "decoder_block": shape.block_parameters,
            "blocks": blocks,
            "embeddings": max(0, shape.parameters - blocks),
        }
    d, inner, f = shape.d_model, shape.num_heads * shape.d_kv, shape.d_ff
    feed_forward = (3 if shape.gated else 2) * d * f + d
    encoder_block = 4 * d * inner + d + feed_forward
    decoder_block = 8 * d * inner + 2 * d + feed_forward
    blocks = shape.num_layers * encoder_block + shape.num_decoder_layers * decoder_block
    return {
        "encoder_block": encoder_block,
        "decoder_block": decoder_block,
        "blocks": blocks,
        "embeddings": max(0, shape.parameters - blocks),
    }


def predict_fsdp(
    shape: ModelShape, setup: Setup, reshard_after_forward: bool, offload: bool, hybrid: bool, batch: int
) -> dict:
    """Bytes per GPU by component (and their total), host bytes per node, under FSDP2: the model states sharded in fp32
    over the GPUs (one pod's with hybrid sharding), and the gathered units in the compute dtype."""
    P = shape.parameters
    shards = setup.gpus_per_node if hybrid else setup.gpus
    low = 4 if setup.precision == "fp32" else 2
    units = fsdp_units(shape)
    block = max(units["encoder_block"], units["decoder_block"])
    largest_unit = max(block, units["embeddings"])
    sharded = {
        "parameters": math.ceil(4 * P / shards),
        "gradients": math.ceil(4 * P / shards),
        "optimizer_states": math.ceil(8 * P / shards),
    }
    gathered_blocks = 2 * block if reshard_after_forward else units["blocks"]
    copies = {"embeddings": low * units["embeddings"], "blocks": low * gathered_blocks}
    buckets = {"unsharded_gradient": low * largest_unit, "reduce_scatter_fp32": 4 * largest_unit}
    activations = activation_bytes(
        shape,
        batch,
        setup.source_length,
        setup.target_length,
        setup.precision,
        setup.gradient_checkpointing,
        autocast=False,
    )
    load_cpu = P * 4 * setup.gpus_per_node * ADDITIONAL_BUFFER_FACTOR  # every rank loads the fp32 checkpoint first
    cpu_states = load_cpu + (16 * P * setup.gpus_per_node / shards if offload else 0)
    gpu = {
        "parameters": 0 if offload else sharded["parameters"],
        "gradients": 0 if offload else sharded["gradients"],
        "optimizer_states": 0 if offload else sharded["optimizer_states"],
        "weight_copies": sum(copies.values()),
        "activations": activations["total"],
        "buckets": sum(buckets.values()),
    }
    allocated = sum(gpu.values())
    unseen_by_torch = CUDA_CONTEXT_BYTES + (NCCL_BUFFER_BYTES if setup.gpus > 1 else 0)
    gpu["overhead"] = int(ALLOCATOR_OVERHEAD_FRACTION * allocated) + unseen_by_torch
    total = sum(gpu.values())
    cpu = int(cpu_states + CPU_RUNTIME_BYTES_PER_RANK * setup.gpus_per_node)
    return {
        "gpu_bytes": gpu,
        "gpu_total_bytes": total,
        "torch_allocated_bytes": allocated,
        "torch_reserved_bytes": total - unseen_by_torch,
        "model_states_bytes": gpu["parameters"] + gpu["gradients"] + gpu["optimizer_states"],
        "activations_detail": activations,
        "buckets_detail": buckets,
        "weight_copies_detail": copies,
        "zero3_residency": None,
        "fsdp_units": units | {"sharded_over": shards},
        "overhead_detail": {
            "allocator": gpu["overhead"] - unseen_by_torch,
            "cuda_context": CUDA_CONTEXT_BYTES,
            "nccl": unseen_by_torch - CUDA_CONTEXT_BYTES,
        },
        "cpu_per_node_bytes": cpu,
        "cpu_model_states_bytes": int(cpu_states),
    }


# ---------------------------------------------------------------------------------------------------------------------
# The phases of a run: its peak is the largest of them
# ---------------------------------------------------------------------------------------------------------------------

# In the order a run meets them; where two phases predict the same peak, the earlier one is named.
PHASES = ("training", "evaluation", "checkpoint_save", "final_save")


def generation_bytes(shape: ModelShape, setup: Setup, fp32_module: bool = False) -> dict:
    """GPU bytes an evaluation adds to what stays between training steps: the evaluation loss's forward pass (no
    gradients: the logits, their fp32 copy in 16-bit training, and the fp32 log-softmax, eval batch x target x
    vocabulary) or, when evaluation generates
    SQL (setup.eval_num_beams > 0: textsql's execution accuracy), generate()'s working set, whichever is larger.

    generate() holds, for eval batch x beams rows: the encoder output (source x d_model), the cross-attention keys and
    values of every decoder layer (2 x source x heads x d_kv), the self-attention cache grown to the target length
    (2 x target x heads x d_kv per layer), and each step's scores over the vocabulary in fp32 (the logits' copy, the
    log-softmax, the beam scores added: three rows x vocabulary tensors). generate() runs the module in its own dtype
    (no autocast): `fp32_module` for plain PyTorch, whose module is fp32 whatever the precision.
    """
    if shape.causal:
        return causal_lm.generation_bytes(
            shape.causal,
            setup.eval_batch,
            setup.eval_num_beams,
            setup.source_length + setup.target_length,
            setup.precision,
            fp32_module,
        )
    s = shape
    e = 4 if setup.precision == "fp32" else 2
    inner, src, tgt = s.num_heads * s.d_kv, setup.source_length, setup.target_length
    loss_forward = setup.eval_batch * tgt * s.vocab_size * (e + 4 + (4 if e == 2 else 0))
    detail = {"loss_forward": int(loss_forward)}
    if setup.eval_num_beams:
        e = 4 if fp32_module else e
        rows = setup.eval_batch * setup.eval_num_beams
        detail |= {
            "encoder_output": rows * src * s.d_model * e,
            "cross_attention_cache": s.num_decoder_layers * 2 * rows * src * inner * e,
            "self_attention_cache": s.num_decoder_layers * 2 * rows * tgt * inner * e,
            "step_scores": 3 * rows * s.vocab_size * 4,
        }
    generate = sum(v for k, v in detail.items() if k != "loss_forward")
    detail["total"] = int(max(loss_forward, generate))
    return detail


def predict_phases(
    shape: ModelShape, setup: Setup, row: dict, stage: int, offload_optimizer: bool, fsdp: bool = False
) -> dict:
    """Each phase's predicted GPU bytes per GPU and host bytes per pod, from the training step's prediction `row`
    (predict or predict_fsdp for the same strategy). Between training steps the activations are freed; what stays
    (held) is the parameters, optimizer states and buffers, DeepSpeed's gradient partitions (the Trainer frees
    PyTorch's and FSDP's gradients), and ZeRO-3's / FSDP's gathered parameters (counted whole: generate() runs every
    module again and again, so the coordinator's trace never settles).

    - training: the row itself.
    - evaluation: held + generation_bytes (the eval loss's forward pass, or generate()'s caches and scores).
    - checkpoint_save: held on the GPU (ZeRO-3 gathers one module at a time, already counted; safetensors copies one
      tensor at a time to the host). On the host: rank 0's whole model in the module's dtype (ZeRO-3 with
      stage3_gather_16bit_weights_on_model_save: the gathered 16-bit state dict; else safetensors' host copies of the
      GPU tensors, kept until the file is written; fp32 without DeepSpeed and under FSDP), and on each rank torch.save's host copy of the largest optimizer tensor on the GPU (the flat fp32
      partition, 4P/N bytes; none when the optimizer is offloaded, its states already on the host).
    - final_save: textsql's save_final_model writes fp32: on the GPU, the full fp32 copy of one parameter at a time
      (DeepSpeed's safe_get_full_fp32_param, FSDP's full_tensor: the largest parameter, plus its fp32 partition
      brought from the host under ZeRO-3 offload); plain PyTorch copies to the host directly. On the host, every rank
      builds the whole fp32 state dict on the host (4P each; under FSDP rank 0 alone), which safetensors writes
      without a copy. With LoRA, textsql saves the adapter alone: its trainable parameters in fp32 on each rank.
    The pod's peak is the largest phase (peak_phase names it; cpu_peak_phase the host's).
    """
    P, N = shape.parameters, setup.gpus
    low = 4 if setup.precision == "fp32" else 2
    largest = max(shape.parameter_sizes, default=shape.largest_layer_parameters)
    gpu = row["gpu_bytes"]
    held_parts = {
        "parameters": gpu["parameters"],
        "gradients": gpu["gradients"] if stage > 0 and not fsdp else 0,
        "optimizer_states": gpu["optimizer_states"],
        "weight_copies": gpu["weight_copies"] if stage == 3 or fsdp else 0,
        "buckets": gpu["buckets"],
    }
    held = sum(held_parts.values())  # what stays between training steps
    train_cpu = row["cpu_per_node_bytes"]
    lora = setup.lora_rank > 0
    trainable = row.get("trainable_parameters", P)
    # ZeRO-3: the gathered 16-bit state dict on the host (safetensors writes host tensors without a copy; with LoRA
    # too: the Trainer gathers the whole model, then PEFT keeps the adapter); else safetensors' host copies of the
    # module's weights on the GPU (with LoRA, the adapter's), all kept until the file is written.
    if stage == 3 and not fsdp:
        model_on_rank0 = low * P
    else:
        model_on_rank0 = (4 if stage == 0 or fsdp else low) * (trainable if lora else P)
    largest_state = 4 * (trainable if lora else largest) if stage == 0 else math.ceil(4 * trainable / N)
    optimizer_copy = 0 if offload_optimizer else largest_state
    if lora:  # textsql saves the adapter alone (adapter_state on every rank): its parameters, gathered whole
        final_gpu, state_dicts = 0, 4 * trainable * setup.gpus_per_node
    elif stage == 0 and not fsdp:
        final_gpu, state_dicts = 0, 4 * P * setup.gpus_per_node
    else:
        final_gpu = 4 * largest + (math.ceil(4 * largest / N) if stage == 3 and offload_optimizer else 0)
        state_dicts = 4 * P * (1 if fsdp else setup.gpus_per_node)
    generation = generation_bytes(shape, setup, fp32_module=stage == 0 and not fsdp)
    extra = {
        "evaluation": (generation["total"], 0),
        "checkpoint_save": (0, model_on_rank0 + optimizer_copy * setup.gpus_per_node),
        "final_save": (final_gpu, state_dicts),
    }
    unseen = row["gpu_total_bytes"] - row["torch_reserved_bytes"]
    phases = {
        "training": {
            "gpu_total_bytes": row["gpu_total_bytes"],
            "gpu_added_bytes": row["torch_allocated_bytes"] - held,
            "allocated_bytes": row["torch_allocated_bytes"],
            "cpu_per_node_bytes": train_cpu,
            "cpu_added_bytes": 0,
        }
    }
    for name, (added_gpu, added_cpu) in extra.items():
        allocated = held + added_gpu
        phases[name] = {
            "gpu_total_bytes": allocated + int(ALLOCATOR_OVERHEAD_FRACTION * allocated) + unseen,
            "gpu_added_bytes": int(added_gpu),
            "allocated_bytes": int(allocated),
            "cpu_per_node_bytes": int(train_cpu + added_cpu),
            "cpu_added_bytes": int(added_cpu),
        }
    phases["evaluation"]["generation_detail"] = generation
    for phase in phases.values():
        phase["gpu_total_gb"] = round(phase["gpu_total_bytes"] / GIB, 3)
        phase["cpu_per_node_gb"] = round(phase["cpu_per_node_bytes"] / GIB, 3)
    return {
        "phases": phases,
        "held_between_steps_bytes": held,
        "held_between_steps_detail": held_parts,
        "peak_phase": max(PHASES, key=lambda n: phases[n]["gpu_total_bytes"]),
        "cpu_peak_phase": max(PHASES, key=lambda n: phases[n]["cpu_per_node_bytes"]),
    }


def with_phases(shape: ModelShape, setup: Setup, row: dict, stage: int, offload_optimizer: bool, fsdp: bool) -> dict:
    """The training step's row with its phases added, and its totals the pod's peak: the largest phase (the
    training step's own figures stay in training_gpu_total_bytes, training_cpu_per_node_bytes and gpu_bytes)."""
    found = predict_phases(shape, setup, row, stage, offload_optimizer, fsdp)
    phases = found["phases"]
    return dict(
        row,
        **found,
        training_gpu_total_bytes=row["gpu_total_bytes"],
        training_cpu_per_node_bytes=row["cpu_per_node_bytes"],
        gpu_total_bytes=phases[found["peak_phase"]]["gpu_total_bytes"],
        cpu_per_node_bytes=phases[found["cpu_peak_phase"]]["cpu_per_node_bytes"],
    )


def predict_strategy(shape: ModelShape, setup: Setup, strategy: str, batch: int) -> dict:
    """The pod's peak over a run's phases (with_phases) for a strategy of the table, by name."""
    if strategy in FSDP_LAYOUT:
        reshard, offload, hybrid = FSDP_LAYOUT[strategy]
        row = predict_fsdp(shape, setup, reshard, offload, hybrid, batch)
        return with_phases(shape, setup, row, 3, offload, fsdp=True)
    stage, offload_optimizer, offload_param = STRATEGY_LAYOUT[strategy]
    row = predict(shape, setup, stage, offload_optimizer, offload_param, batch, nvme=strategy in NVME_STRATEGIES)
    return with_phases(shape, setup, row, stage, offload_optimizer, fsdp=False)


# ---------------------------------------------------------------------------------------------------------------------
# The plan
# ---------------------------------------------------------------------------------------------------------------------


def plan_memory(args: PlanArguments) -> dict:
    """Predict every strategy's peak memory per pod and recommend the fastest that fits, with its largest batch (JSON-able)."""
    shape = resolve_model(args.model)
    dsconfig = read_dsconfig(args.dsconfig) if args.dsconfig else None
    settings = zero_settings(dsconfig)
    setup = Setup(
        args.nodes,
        args.gpus_per_node,
        args.max_source_length,
        args.max_target_length,
        args.precision,
        args.gradient_checkpointing,
        tuple(sorted(settings.items())),
        eval_batch=args.per_device_eval_batch_size,
        eval_num_beams=args.eval_num_beams,
        nvme_gb_per_s=args.nvme_gb_per_s,
    )
    limits = _limits(args)
    strategies = {}
    for name in STRATEGIES:
        row = predict_strategy(shape, setup, name, args.per_device_train_batch_size)
        strategies[name] = _with_verdict(row, limits, args.gpu_memory_gb, args.cpu_memory_gb)
    plan = {
        "model": shape.as_dict(),
        "inputs": {k: v for k, v in asdict(args).items() if k != "json"} | {"world_size": setup.gpus},
        "dsconfig_strategy": _dsconfig_label(dsconfig),
        "zero_settings": {k: v for k, v in settings.items() if k != "shipped"},
        "zero_settings_source": args.dsconfig or "shipped dsconfig/ files",
        "strategies": strategies,
        "assumptions": ASSUMPTIONS,
    }
    plan["recommendation"], plan["problem"] = _recommend(shape, setup, args, strategies, limits)
    if args.lora:
        _add_lora(plan, shape, setup, args, limits)
    if args.lora and args.quantize_base != "none":
        _add_lora(plan, shape, setup, args, limits, quantize=args.quantize_base)
    if shape.causal:
        plan["assumptions"] = plan["assumptions"] + CAUSAL_ASSUMPTIONS
    return plan


def _add_lora(
    plan: dict, shape: ModelShape, setup: Setup, args: PlanArguments, limits: dict, quantize: str = "none"
) -> None:
    """LoRA rows for every strategy, and the recommendation: LoRA's fastest fitting strategy where full fine-tuning
    fits under none on these pods or needs more of them; with the offload strategies, the host memory LoRA saves.
    With `quantize` (nf4, int8) the same for QLoRA (plan["qlora"]), recommended where neither full fine-tuning nor
    LoRA on the unquantized base fits."""
    from dataclasses import replace

    key = "lora" if quantize == "none" else "qlora"
    lora_setup = replace(setup, lora_rank=args.lora_rank, lora_targets=args.lora_targets, quantize_base=quantize)
    layers = lora_layers(shape, args.lora_rank, args.lora_targets)
    rows = {}
    for name in DEEPSPEED_STRATEGIES:  # LoRA is modelled on the ZeRO strategies (and plain DDP); not yet under FSDP
        row = predict_strategy(shape, lora_setup, name, args.per_device_train_batch_size)
        rows[name] = _with_verdict(row, limits, args.gpu_memory_gb, args.cpu_memory_gb)
    plan[key] = {
        "rank": args.lora_rank,
        "targets": args.lora_targets,
        "quantize_base": quantize,
        "trainable_parameters": layers["trainable"],
        "adapted_layers": sum(count for _, count, *_ in layers["layers"]),
        "strategies": rows,
    }
    if quantize != "none":
        plan[key]["quantized_base"] = quantized_base(shape, quantize)
        plan["assumptions"] = plan["assumptions"] + QLORA_ASSUMPTIONS
        _recommend_lora(plan, key, shape, lora_setup, args, limits, rows)
        return
    plan["assumptions"] = plan["assumptions"] + LORA_ASSUMPTIONS
    offload = [n for n in DEEPSPEED_STRATEGIES if STRATEGY_LAYOUT[n][1] and n not in NVME_STRATEGIES]
    plan["lora"]["offload_note"] = (
        "; ".join(
            f"{n}: GPU {plan['strategies'][n]['gpu_total_gb']:.1f} -> {rows[n]['gpu_total_gb']:.1f} GB, host "
            f"{plan['strategies'][n]['cpu_per_node_gb']:.1f} -> {rows[n]['cpu_per_node_gb']:.1f} GB per pod"
            for n in offload
        )
        + ": with CPU offload the optimizer states live in host memory, so LoRA's saving is there."
    )
    _recommend_lora(plan, key, shape, lora_setup, args, limits, rows)


def _recommend_lora(plan, key, shape, lora_setup, args, limits, rows) -> None:
    """plan[key]["recommendation"] (LoRA or QLoRA's fastest fitting strategy), and the plan's recommendation where
    nothing before it fits (full fine-tuning, then LoRA on the unquantized base)."""
    full = plan["recommendation"]
    fitting = [n for n in DEEPSPEED_STRATEGIES if rows[n]["fits_with_margin"]]
    if not fitting:
        plan[key]["recommendation"] = None
        return
    name = fitting[0]
    quantize = lora_setup.quantize_base
    lora_recommendation = {
        "strategy": name,
        "lora": True,
        "lora_rank": args.lora_rank,
        "lora_targets": args.lora_targets,
        "quantize_base": quantize,
        "per_device_train_batch_size": args.per_device_train_batch_size,
        "largest_per_device_train_batch_size": largest_batch(shape, lora_setup, name, limits),
        "predicted_gpu_gb": rows[name]["gpu_total_gb"],
        "peak_phase": rows[name]["peak_phase"],
    }
    plan[key]["recommendation"] = lora_recommendation
    if quantize != "none":
        faster = full is not None and STRATEGIES.index(name) < STRATEGIES.index(full["strategy"])
        # LoRA on the unquantized base wins unless it fits only by offloading to host memory or NVMe, which moves
        # the model states over PCIe at every step: slower than dequantizing each weight on the GPU
        offloaded = (
            full is not None and full["strategy"] in STRATEGY_LAYOUT and any(STRATEGY_LAYOUT[full["strategy"]][1:])
        )
        if full is None or (full.get("lora") and faster and offloaded):
            why = (
                f"neither full fine-tuning nor LoRA on a {args.precision} base fits under any strategy"
                if full is None
                else f"full fine-tuning fits under no strategy, and LoRA on a {args.precision} base only under "
                f"{full['strategy']}, which offloads to the host or NVMe"
            )
            plan["recommendation"] = dict(
                lora_recommendation,
                reason=(
                    f"{why} on {args.nodes} pod(s) of {args.gpus_per_node} GPU(s). QLoRA (LoRA r={args.lora_rank} on "
                    f"{args.lora_targets}, the base in {quantize}) under {name} fits in {1 - args.safety_margin:.0%} "
                    f"of {args.gpu_memory_gb:g} GB: textsql train --lora True --lora_rank {args.lora_rank} "
                    f"--lora_targets {args.lora_targets} --quantize_base {quantize}"
                    + ("" if name == "none" else f" --deepspeed {name}")
                ),
            )
            plan["problem"] = None
        elif faster:
            full["alternative"] = (
                f"QLoRA ({quantize} base) fits under {name}, a faster strategy ({rows[name]['gpu_total_gb']:.1f} GB)"
            )
        return
    if full is None:
        from dataclasses import replace

        full_setup = replace(lora_setup, lora_rank=0, lora_targets="qv", quantize_base="none")
        pods = pods_for_full_fine_tuning(shape, full_setup, args, limits)
        needs = f"; full fine-tuning would need {pods} pods of {args.gpus_per_node} GPU(s)" if pods else ""
        plan["recommendation"] = dict(
            lora_recommendation,
            reason=(
                f"full fine-tuning fits under no strategy on {args.nodes} pod(s){needs}. LoRA (r={args.lora_rank}, "
                f"{args.lora_targets}) under {name} fits in {1 - args.safety_margin:.0%} of {args.gpu_memory_gb:g} GB: "
                f"textsql train --lora True --lora_rank {args.lora_rank} --lora_targets {args.lora_targets}"
                + ("" if name == "none" else f" --deepspeed {name}")
            ),
        )
        plan["problem"] = None
    elif STRATEGIES.index(name) < STRATEGIES.index(full["strategy"]):
        # full fine-tuning fits only under a slower strategy (the model spread over the GPUs, or offloaded to the host)
        full["alternative"] = (
            f"LoRA (r={args.lora_rank}, {args.lora_targets}) fits under {name}, a faster strategy, "
            f"on each GPU alone ({rows[name]['gpu_total_gb']:.1f} GB)"
        )


def pods_for_full_fine_tuning(
    shape: ModelShape, setup: Setup, args: PlanArguments, limits: dict, most: int = 64
) -> int | None:
    """The fewest pods (up to `most`) on which some strategy fits full fine-tuning at this batch; None if none."""
    from dataclasses import replace

    for nodes in range(args.nodes + 1, most + 1):
        more = replace(setup, nodes=nodes)
        if any(_fits(predict_strategy(shape, more, n, args.per_device_train_batch_size), limits) for n in STRATEGIES):
            return nodes
    return None


def _limits(args: PlanArguments) -> dict:
    keep = 1 - args.safety_margin
    return {
        "gpu": args.gpu_memory_gb * GIB * keep,
        "cpu": None if args.cpu_memory_gb is None else args.cpu_memory_gb * GIB * keep,
    }


def _fits(row: dict, limits: dict) -> bool:
    cpu_ok = limits["cpu"] is None or row["cpu_per_node_bytes"] <= limits["cpu"]
    return row["gpu_total_bytes"] <= limits["gpu"] and cpu_ok


def _with_verdict(row: dict, limits: dict, gpu_memory_gb: float, cpu_memory_gb: float | None) -> dict:
    row = dict(row)
    row["gpu_gb"] = {k: round(v / GIB, 3) for k, v in row["gpu_bytes"].items()}
    row["gpu_total_gb"] = round(row["gpu_total_bytes"] / GIB, 3)
    row["cpu_per_node_gb"] = round(row["cpu_per_node_bytes"] / GIB, 3)
    row["fits_gpu"] = row["gpu_total_bytes"] <= gpu_memory_gb * GIB
    row["fits_cpu"] = None if cpu_memory_gb is None else row["cpu_per_node_bytes"] <= cpu_memory_gb * GIB
    row["fits_with_margin"] = _fits(row, limits)
    return row


def _recommend(shape, setup, args, strategies, limits):
    """(recommendation, problem): the first strategy in speed order that fits with the margin, and its largest batch."""
    for name in STRATEGIES:
        if strategies[name]["fits_with_margin"]:
            largest = largest_batch(shape, setup, name, limits)
            return {
                "strategy": name,
                "per_device_train_batch_size": args.per_device_train_batch_size,
                "largest_per_device_train_batch_size": largest,
                "predicted_gpu_gb": strategies[name]["gpu_total_gb"],
                "peak_phase": strategies[name]["peak_phase"],
                "reason": f"{name} is the fastest strategy whose peak over the run's phases fits in {1 - args.safety_margin:.0%} of "
                f"{args.gpu_memory_gb:g} GB"
                + (f" (and of {args.cpu_memory_gb:g} GB host memory)" if args.cpu_memory_gb else ""),
            }, None
    return None, _no_fit_message(shape, setup, args, strategies, limits)


def largest_batch(shape: ModelShape, setup: Setup, strategy: str, limits: dict) -> int:
    """The largest per-device batch (up to 4096) whose prediction fits the limits under `strategy`; 0 if none."""

    def fits(batch):
        return _fits(predict_strategy(shape, setup, strategy, batch), limits)

    if not fits(1):
        return 0
    low, high = 1, 2
    while high <= MAX_BATCH_SEARCHED and fits(high):
        low, high = high, high * 2
    high = min(high, MAX_BATCH_SEARCHED + 1)
    while high - low > 1:  # fits(low) and not fits(high)
        middle = (low + high) // 2
        low, high = (middle, high) if fits(middle) else (low, middle)
    return low


def _no_fit_message(shape, setup, args, strategies, limits) -> str:
    smallest = min(STRATEGIES, key=lambda n: strategies[n]["gpu_total_bytes"])
    allowed = f"{args.gpu_memory_gb:g} GB less the {args.safety_margin:.0%} safety margin"
    fixes = []
    if args.nodes * args.gpus_per_node < 64:
        fixes.append("more pods (--nodes) or GPUs per pod, which divide the ZeRO-3 model states")
    if not args.gradient_checkpointing:
        fixes.append("--gradient_checkpointing True")
    if args.precision == "fp32":
        fixes.append("--precision bf16 (Ampere or newer)")
    if strategies[smallest]["peak_phase"] == "evaluation":
        fixes.insert(
            0,
            f"a smaller --per_device_eval_batch_size or fewer --eval_num_beams (evaluation sets {smallest}'s peak: "
            f"textsql train's --per_device_eval_batch_size and --execution_accuracy_num_beams)",
        )
    if shape.causal and not args.lora:
        fixes.append("LoRA (--lora True) or QLoRA (--lora True --quantize_base nf4), which the plan then shows")
    elif shape.causal and args.quantize_base == "none":
        fixes.append("QLoRA (--quantize_base nf4)")
    fixes.append("shorter --max_source_length/--max_target_length or a smaller model")
    for name in STRATEGIES:
        batch = largest_batch(shape, setup, name, limits)
        if batch:
            return (
                f"A per-device batch of {args.per_device_train_batch_size} fits under no strategy for {shape.name} on "
                f"{args.nodes} x {args.gpus_per_node} GPU(s): the smallest prediction is "
                f"{strategies[smallest]['gpu_total_gb']:.1f} GB ({smallest}), over the {limits['gpu'] / GIB:.1f} GB "
                f"allowed ({allowed}). The fastest strategy that fits at all is {name} with a batch of at most "
                f"{batch}: pass --per_device_train_batch_size {batch} and raise --gradient_accumulation_steps to keep "
                f"the effective batch, or use {', or '.join(fixes)}."
            )
    cpu_note = ""
    if args.cpu_memory_gb is not None and not strategies[smallest]["fits_cpu"]:
        cpu_note = (
            f" The host memory also falls short ({strategies[smallest]['cpu_per_node_gb']:.1f} GB per node needed)."
        )
    return (
        f"{shape.name} fits under no strategy on {args.nodes} x {args.gpus_per_node} GPU(s) of {args.gpu_memory_gb:g} GB, "
        f"not even with a batch of 1: the smallest prediction at batch {args.per_device_train_batch_size} is "
        f"{strategies[smallest]['gpu_total_gb']:.1f} GB ({smallest}), over the {limits['gpu'] / GIB:.1f} GB allowed "
        f"({allowed}).{cpu_note} Use {', or '.join(fixes)}."
    )


def _dsconfig_label(dsconfig) -> str | None:
    if dsconfig is None:
        return None

    return describe_strategy(dsconfig)["label"]


def _first_line(error) -> str:
    return (str(error).strip().splitlines() or [type(error).__name__])[0]
