"""`textsql plan`'s arguments: the model, the pods, the batch and the settings to predict memory for."""

from __future__ import annotations

from dataclasses import dataclass, field

from textsql.arguments import same_flag
from textsql.arguments.data import DataArguments, ModelArguments
from textsql.arguments.devices import DeviceArguments
from textsql.arguments.lora import LoraArguments, lora_arguments
from textsql.arguments.speed import SpeedArguments, speed_refusals
from textsql.errors import TextsqlError
from textsql.strategy.devices import DEFAULT_POD_MEMORY_GB

# textsql plan's older spellings: each still works, and says its new name, textsql train's
LEGACY_FLAGS = {
    "--model": "--model_id",
    "--dsconfig": "--deepspeed",
    "--gradient_checkpointing": "--activation_checkpointing",
    "--eval_num_beams": "--execution_accuracy_num_beams",
}
# The precisions the planner models (textsql train's --precision but auto, which a plan of GPUs reads as bf16)
PRECISIONS = ("fp32", "bf16", "fp16")

# Sustained bandwidth of the NVMe folder zero3_nvme swaps to, read and write alike, GB/s per pod: a conservative figure
# for one PCIe NVMe drive (data-center drives sustain about 2-7 GB/s sequential; several striped, more). Not measured
# by textsql: DeepSpeed's NVMe profiling guide (microsoft/DeepSpeed issue #998, `ds_nvme_tune`) measures yours; pass
# it as --nvme_gb_per_s.
NVME_GB_PER_S = 2.0


@dataclass
class PlanArguments:
    """The model, the pods and the batch to plan for."""

    model_id: str = same_flag(
        ModelArguments,
        "model_id",
        "t5-small, t5-base, t5-large, t5-3b or t5-11b, or a causal LM of the built-in table (Qwen/Qwen2.5-"
        "0.5B/1.5B/7B, meta-llama/Llama-3.2-1B, meta-llama/Llama-3.1-8B, mistralai/Mistral-7B-v0.1, bigscience/bloom-"
        "1b1, bigscience/bloom-7b1, tiiuae/falcon-7b, Salesforce/codegen2-1B, bigcode/starcoderbase-1b, gpt2, "
        "facebook/opt-1.3b: nothing is downloaded), a local model folder with config.json, or a hub name already in "
        "the local Hugging Face cache.",
    )
    dataset_dir: str = same_flag(
        DataArguments,
        "dataset_dir",
        "The prepared dataset (textsql prep's --output_dir) the recommended command trains on.",
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
    execution_accuracy_num_beams: int = same_flag(
        DataArguments,
        "execution_accuracy_num_beams",
        "Beams of the SQL generated at each evaluation, as textsql train's (1: greedy); 0 when evaluation generates "
        "nothing (textsql train --execution_accuracy_samples 0).",
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
    precision: str = same_flag(
        DeviceArguments,
        "precision",
        "auto (bf16: what textsql train picks on Ampere and newer GPUs), bf16, fp32 or fp16, as textsql train's.",
    )
    activation_checkpointing: bool = field(
        default=False,
        metadata={"help": "Recompute activations in the backward pass (less memory, about 30 percent slower)."},
    )
    deepspeed: str | None = field(
        default=None,
        metadata={
            "help": "A DeepSpeed JSON file or shipped name (zero1, zero2, zero3, ...): bucket and sub-group "
            "sizes and the stage3_* settings (max live parameters, max reuse distance, prefetch bucket, "
            "persistence threshold) come from it. Without it, the shipped dsconfig/ settings are assumed."
        },
    )
    cpu_memory_gb: float | None = field(
        default=None,
        metadata={
            "help": "Host memory of one pod in GB, which every strategy's host peak (offload, checkpoint saves) must "
            f"fit. Default: {DEFAULT_POD_MEMORY_GB:g}, what textsql's cluster gives a worker pod unless told "
            "(Cluster(memory=...)); the plan says when it assumed it."
        },
    )
    safety_margin: float = field(
        default=0.1,
        metadata={
            "help": "Fraction of GPU (and CPU) memory kept free when recommending (0.1 = use at most 90 percent)."
        },
    )
    lora: bool = same_flag(
        LoraArguments,
        "lora",
        "Also plan LoRA (textsql train --lora True) under every strategy, and recommend it where full fine-tuning does "
        "not fit or needs more pods.",
    )
    lora_rank: int = same_flag(LoraArguments, "lora_rank")
    lora_targets: str = same_flag(LoraArguments, "lora_targets")
    quantize_base: str = same_flag(
        LoraArguments,
        "quantize_base",
        "With --lora True, also plan QLoRA: the frozen base quantized by bitsandbytes, nf4 or int8 (as textsql train "
        "--quantize_base), for causal LMs and T5; recommended where neither full fine-tuning nor LoRA on a bf16/fp32 "
        "base fits.",
    )
    # The speed levers that change memory, as textsql train takes them (textsql.arguments.speed)
    fused_loss: str = same_flag(SpeedArguments, "fused_loss")
    lora_base_dtype: str = same_flag(SpeedArguments, "lora_base_dtype")
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
        if not str(self.model_id).strip():
            raise TextsqlError(
                "--model_id is empty. Pass t5-small, t5-base, t5-large, t5-3b, t5-11b or a model folder."
            )
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
        beams = self.execution_accuracy_num_beams
        if isinstance(beams, bool) or not isinstance(beams, int) or beams < 0:
            raise TextsqlError(
                f"--execution_accuracy_num_beams must be 0 (evaluation generates nothing), 1 (greedy) or more beams, "
                f"not {beams!r}."
            )
        if not self.gpu_memory_gb > 0:
            raise TextsqlError(f"--gpu_memory_gb must be positive (40 for an A100-40GB), not {self.gpu_memory_gb!r}.")
        if self.cpu_memory_gb is not None and not self.cpu_memory_gb > 0:
            raise TextsqlError(f"--cpu_memory_gb must be positive (or left out), not {self.cpu_memory_gb!r}.")
        if self.precision == "auto":
            self.precision = "bf16"  # a plan is of GPUs: textsql train's auto on Ampere and newer
        if self.precision not in PRECISIONS:
            raise TextsqlError(f"--precision must be one of {', '.join(PRECISIONS)}, not '{self.precision}'.")
        lora_arguments(self)  # the same checks as training's
        speed = SpeedArguments(fused_loss=self.fused_loss, lora_base_dtype=self.lora_base_dtype)
        speed.lora = self.lora  # what check_speed reads of the run's other flags
        speed.check_speed()
        refused = speed_refusals(
            speed,
            device="cuda",  # the plan is of GPUs
            family=None,
            zero_stage=None,
            fsdp=False,
            precision=self.precision,
            lora=self.lora,
            quantized=self.quantize_base != "none",
            liger_installed=True,  # the plan is of the GPUs' pods, not of this machine
        )
        if refused:
            raise TextsqlError("textsql train would refuse these settings: " + "; ".join(refused) + ".")
        if not self.nvme_gb_per_s > 0:
            raise TextsqlError(
                f"--nvme_gb_per_s must be positive (2 for one PCIe NVMe drive), not {self.nvme_gb_per_s!r}."
            )
        if not 0 <= self.safety_margin < 1:
            raise TextsqlError(
                f"--safety_margin is a fraction of memory kept free, from 0 to below 1 (e.g. 0.1), "
                f"not {self.safety_margin!r}."
            )
