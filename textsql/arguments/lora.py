"""LoRA's flags (--lora, --lora_rank, --lora_targets, --quantize_base, ...): their defaults and checks, the run
folder's part for them, and what the run summary records."""

from __future__ import annotations

from dataclasses import dataclass, field

from textsql.errors import TextsqlError
from textsql.families import LORA_PRESETS

QUANTIZED_BASES = ("none", "nf4", "int8")  # --quantize_base: the base's bitsandbytes format under a LoRA adapter


@dataclass
class LoraArguments:
    """LoRA on top of any strategy: the base model stays frozen (in the training dtype), only the adapter trains."""

    lora: bool = field(
        default=False,
        metadata={
            "help": "Train a LoRA adapter (peft) on the frozen model instead of every weight, with or without "
            "DeepSpeed. The run saves the adapter (fp32) and the tokenizer; `textsql merge RUN` makes a plain model "
            "of it. Needs the peft extra (pip install 'textsql[peft]')."
        },
    )
    lora_rank: int = field(
        default=8, metadata={"help": "LoRA rank r: each adapted weight W (out x in) learns B (out x r) A (r x in)."}
    )
    lora_alpha: float = field(default=16.0, metadata={"help": "LoRA scaling alpha: the update is (alpha / r) B A."})
    lora_dropout: float = field(default=0.05, metadata={"help": "Dropout on the adapter's input, from 0 to below 1."})
    lora_targets: str = field(
        default="qv",
        metadata={
            "help": "Which layers get adapters: qv (the query and value projections of every attention; the fused "
            "query-key-value layer of bloom, falcon, gpt2, gpt_bigcode and codegen) or all (every linear layer of "
            "every attention and feed-forward block; never the lm head). The characters prep added to the tokenizer "
            "always train their embedding rows."
        },
    )

    quantize_base: str = field(
        default="none",
        metadata={
            "help": "QLoRA: load the frozen base quantized with bitsandbytes, nf4 (4-bit NormalFloat with double "
            "quantization) or int8, so a 7B causal LM fits on one A100-40GB; none keeps it in the training dtype. "
            "Needs --lora True (a quantized base cannot be fully fine-tuned) and the lifecycle extra."
        },
    )

    def __post_init__(self):
        self.check_lora()

    def check_lora(self) -> None:
        if isinstance(self.lora_rank, bool) or not isinstance(self.lora_rank, int) or self.lora_rank < 1:
            raise TextsqlError(
                f"--lora_rank must be a whole number of at least 1 (8 or 16 are common), not {self.lora_rank!r}."
            )
        if not self.lora_alpha > 0:
            raise TextsqlError(f"--lora_alpha must be positive (commonly twice --lora_rank), not {self.lora_alpha!r}.")
        if not 0 <= self.lora_dropout < 1:
            raise TextsqlError(
                f"--lora_dropout is a probability from 0 to below 1 (e.g. 0.05), not {self.lora_dropout!r}."
            )
        if self.lora_targets not in LORA_PRESETS:
            raise TextsqlError(f"--lora_targets must be one of {', '.join(LORA_PRESETS)}, not '{self.lora_targets}'.")
        if self.quantize_base not in QUANTIZED_BASES:
            raise TextsqlError(
                f"--quantize_base must be one of {', '.join(QUANTIZED_BASES)}, not '{self.quantize_base}'."
            )
        if self.quantize_base != "none" and not self.lora:
            raise TextsqlError(
                f"--quantize_base {self.quantize_base} needs --lora True: a quantized base's weights cannot be "
                "trained, only an adapter beside them (QLoRA). Add --lora True, or drop --quantize_base to fine-tune "
                "every weight."
            )

    def lora_settings(self) -> dict | None:
        """What the run summary's strategy records: None without --lora."""
        if not self.lora:
            return None
        settings = {
            "rank": self.lora_rank,
            "alpha": self.lora_alpha,
            "dropout": self.lora_dropout,
            "targets": self.lora_targets,
        }
        return settings | ({"quantize_base": self.quantize_base} if self.quantize_base != "none" else {})

    def lora_label(self) -> str:
        """The run folder's part for LoRA ('-lora-r8'; on a quantized base '-qlora-nf4-r8'), empty without it."""
        if not self.lora:
            return ""
        kind = f"-qlora-{self.quantize_base}" if self.quantize_base != "none" else "-lora"
        return f"{kind}-r{self.lora_rank}"


def lora_arguments(values) -> LoraArguments:
    """The LoRA arguments of anything that has their fields (the training arguments, a run summary's arguments dict)."""
    get = values.get if isinstance(values, dict) else lambda name, default: getattr(values, name, default)
    defaults = LoraArguments()
    return LoraArguments(**{name: get(name, getattr(defaults, name)) for name in defaults.__dataclass_fields__})
