"""`textsql quantize`'s arguments: the model, the method (the table of methods), GPTQ's bits and calibration."""

from __future__ import annotations

from dataclasses import dataclass, field

from textsql.arguments import same_flag
from textsql.arguments.data import DataArguments
from textsql.arguments.infer import InferArguments
from textsql.errors import TextsqlError

BITS = (4, 8)  # --method gptq's --bits
DEFAULT_CALIBRATION_SAMPLES = 128


@dataclass(frozen=True)
class Method:
    """One quantization method: what it does, where it runs, and how its folder is saved."""

    name: str
    summary: str
    devices: tuple[str, ...]
    package: str  # the lifecycle extra's package it needs ("torch" for none)


METHODS = {
    "torchao-int8": Method(
        "torchao-int8",
        "int8 weight-only (torchao Int8WeightOnlyConfig through transformers' TorchAoConfig); "
        "saved quantized in safetensors",
        ("cpu", "cuda"),
        "torchao",
    ),
    "bnb-int8": Method(
        "bnb-int8",
        "bitsandbytes LLM.int8 (8-bit weights; activations cast to fp16 to be quantized, with fp16 "
        "outliers kept apart); saved quantized in safetensors",
        ("cpu", "cuda"),
        "bitsandbytes",
    ),
    "bnb-nf4": Method(
        "bnb-nf4",
        "bitsandbytes 4-bit NF4, computing in bf16 (GPUs with native bf16) or fp32 (older GPUs, the CPU); "
        "saved quantized in safetensors",
        ("cpu", "cuda"),
        "bitsandbytes",
    ),
    "dynamic-int8": Method(
        "dynamic-int8",
        "torch's dynamic int8 quantization of every Linear layer (int8 weights, activations "
        "quantized per batch): the fastest measured on a CPU; saved as the fp32 weights and quantized when "
        "loaded (about a second)",
        ("cpu",),
        "torch",
    ),
    "gptq": Method(
        "gptq",
        "GPTQ (llmcompressor, run in textsql's GPTQ environment), 4- or 8-bit weights in groups, calibrated on the "
        "dataset's own training examples; causal LMs only; saved compressed (compressed-tensors) in safetensors",
        ("cpu", "cuda"),
        "compressed_tensors",
    ),
}


DEFAULT_METHOD = "torchao-int8"


@dataclass
class QuantizeArguments:
    """Which model, which method, and the questions it is scored on against the unquantized model."""

    model_dir: str = same_flag(
        InferArguments,
        "model_dir",
        "A plain model folder (run folder, merged adapter) or hub name; merge an adapter first.",
    )
    method: str = field(
        default=DEFAULT_METHOD,
        metadata={
            "help": "torchao-int8 (default), bnb-int8, bnb-nf4, dynamic-int8 (CPU only), gptq (causal LMs): "
            "docs/lifecycle.md."
        },
    )
    output_dir: str | None = field(
        default=None,
        metadata={
            "help": "Where the quantized model goes (default: <model_dir>-<method>, gptq: <model_dir>-gptq-4bit)."
        },
    )
    dataset_dir: str = same_flag(
        DataArguments, "dataset_dir", "Prepared dataset (textsql prep) whose split scores both models."
    )
    split: str = same_flag(InferArguments, "split", "Split to score both models on: test, validation or train.")
    max_examples: int | None = field(default=200, metadata={"help": "Score the first N examples (0: the whole split)."})
    batch_size: int = same_flag(InferArguments, "batch_size", "Questions per generate() call.")
    max_new_tokens: int = same_flag(InferArguments, "max_new_tokens", "Longest SQL to generate, in tokens.")
    device: str = same_flag(
        InferArguments,
        "device",
        "auto (GPU when there is one), cuda, or cpu: where both models are quantized and scored.",
    )
    bits: int | None = field(default=None, metadata={"help": "--method gptq: 4 (default) or 8 bits per weight."})
    group_size: int = field(
        default=0,
        metadata={
            "help": "--method gptq: weights per group sharing one scale (0: 128 where it divides every layer's input "
            "width, else 64, else 32)."
        },
    )
    calibration_samples: int | None = field(
        default=None,
        metadata={
            "help": f"--method gptq: training examples of --dataset_dir (prompt and SQL, drawn at random) it calibrates "
            f"on (default {DEFAULT_CALIBRATION_SAMPLES})."
        },
    )
    gptq_env_dir: str | None = field(
        default=None,
        metadata={
            "help": "--method gptq: textsql's GPTQ environment (llmcompressor; created there once when missing; "
            "default: the user's cache, ~/.cache/textsql/gptq/<pinned versions>)."
        },
    )
    gptq_wheels: str | None = field(
        default=None,
        metadata={
            "help": "--method gptq, air-gapped: create the GPTQ environment from this folder of wheels only "
            "(pip --no-index --find-links; docs/lifecycle.md says how to fill it)."
        },
    )

    def __post_init__(self):
        if self.method not in METHODS:
            raise TextsqlError(f"--method must be one of {', '.join(METHODS)}, not '{self.method}'.")
        if self.batch_size < 1 or self.max_new_tokens < 1:
            raise TextsqlError("--batch_size and --max_new_tokens must be at least 1.")
        if self.max_examples is not None and self.max_examples < 0:
            raise TextsqlError("--max_examples must be 0 (the whole split) or a positive number.")
        if self.device not in ("auto", "cuda", "cpu"):
            raise TextsqlError(f"--device must be auto, cuda or cpu, not '{self.device}'.")
        gptq_flags = {
            "--bits": self.bits is not None,
            "--group_size": self.group_size != 0,
            "--calibration_samples": self.calibration_samples is not None,
            "--gptq_env_dir": self.gptq_env_dir is not None,
            "--gptq_wheels": self.gptq_wheels is not None,
        }
        if self.method != "gptq":
            given = [flag for flag, set_ in gptq_flags.items() if set_]
            if given:
                raise TextsqlError(
                    f"{', '.join(given)} only apply to --method gptq; --method {self.method} has its own width "
                    "(docs/lifecycle.md). Leave them out, or pass --method gptq."
                )
            return
        self.bits = 4 if self.bits is None else self.bits
        if self.bits not in BITS:
            raise TextsqlError(f"--bits must be 4 or 8 for GPTQ, not {self.bits}.")
        if self.group_size < 0:
            raise TextsqlError(f"--group_size must be 0 (chosen from the model) or positive, not {self.group_size}.")
        self.calibration_samples = (
            DEFAULT_CALIBRATION_SAMPLES if self.calibration_samples is None else self.calibration_samples
        )
        if self.calibration_samples < 1:
            raise TextsqlError("--calibration_samples must be at least 1.")

    @property
    def label(self) -> str:
        """The method as folders and tables name it: gptq with its width (gptq-4bit), the others by their name."""
        return f"gptq-{self.bits}bit" if self.method == "gptq" else self.method
