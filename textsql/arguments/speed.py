"""The speed levers' flags (--attention, --compile, --fused_loss, --lora_base_dtype): their defaults, their checks,
and why each cannot run with given facts (device, strategy, precision, family)."""

from __future__ import annotations

from dataclasses import dataclass, field

from textsql.errors import TextsqlError
from textsql.families import Family

ATTENTIONS = ("auto", "sdpa", "eager", "flex_attention")
COMPILES = ("none", "layers")
FUSED_LOSSES = ("none", "chunked", "liger")
LORA_BASE_DTYPES = ("float32", "bfloat16")


@dataclass
class SpeedArguments:
    """How fast a step runs, never what it computes: each lever leaves the loss the same (to rounding) and `textsql
    tune --levers` measures it on and off (docs/training.md, "Speed levers")."""

    attention: str = field(
        default="auto",
        metadata={
            "help": "Causal LMs' attention: auto (the model's own, sdpa), sdpa, eager, or flex_attention (torch's "
            "FlexAttention: with --packing True it skips the blocks between packed examples, where sdpa computes a "
            "dense block-diagonal mask over the whole row; GPUs only, as torch has no FlexAttention backward on the "
            "CPU)."
        },
    )
    compile: str = field(
        default="none",
        metadata={
            "help": "none, or layers: torch.compile each decoder layer (regional compilation: one graph every layer "
            "reuses, compiled in the first steps; generation, peft and DeepSpeed ZeRO-1/2 wrap the compiled layers "
            "unchanged). Refused under ZeRO-3 and FSDP, whose parameter hooks run inside the layers."
        },
    )
    fused_loss: str = field(
        default="none",
        metadata={
            "help": "Causal LMs: none (transformers' loss: the output layer over every position, the prompt's too), "
            "chunked (textsql's: the output layer at the label positions only, in chunks recomputed in the backward "
            "pass: the same loss without most of the logits, the largest tensor of a short step with Qwen's "
            "152k-word vocabulary) or liger (Liger Kernel's fused linear cross-entropy at those positions: the "
            "logits never exist; GPUs only, pip install liger-kernel)."
        },
    )
    lora_base_dtype: str = field(
        default="float32",
        metadata={
            "help": "LoRA without DeepSpeed: the frozen base's dtype. float32 (as loaded; autocast copies each weight "
            "to bf16 at every step) or bfloat16 (half the memory, no copies, no fp32 master weights of what never "
            "updates; only with --precision bf16). The adapter always trains in fp32. DeepSpeed holds the base in "
            "the training dtype already."
        },
    )

    def check_speed(self) -> None:
        for name, choices in (
            ("attention", ATTENTIONS),
            ("compile", COMPILES),
            ("fused_loss", FUSED_LOSSES),
            ("lora_base_dtype", LORA_BASE_DTYPES),
        ):
            if getattr(self, name) not in choices:
                raise TextsqlError(f"--{name} must be one of {', '.join(choices)}, not '{getattr(self, name)}'.")
        if self.compile != "none" and getattr(self, "torch_compile", False):
            raise TextsqlError(
                "--compile layers and the Trainer's --torch_compile True both compile the model: pass one of them "
                "(textsql's compiles each decoder layer, which generation and DeepSpeed keep working with)."
            )
        if self.lora_base_dtype == "bfloat16" and not getattr(self, "lora", True):
            raise TextsqlError("--lora_base_dtype bfloat16 is the frozen base of a LoRA run: pass --lora True too.")


def speed_refusals(
    speed: SpeedArguments,
    *,
    device: str,
    family: Family | None,
    zero_stage: int | None,
    fsdp: bool,
    precision: str,
    lora: bool,
    quantized: bool,
    liger_installed: bool,
    flex_attention_in_torch: bool = True,
    stage: str = "sft",
) -> list[str]:
    """Why each lever asked for cannot run with these facts (`device` "cuda" or "cpu"; the ZeRO stage or None; the
    precision's name; the family None before the model loads); empty where all can. Pure: the caller reads the facts."""
    problems = []
    if stage != "sft":
        asked = [
            f"--{name} {getattr(speed, name)}"
            for name, default in (("attention", "auto"), ("compile", "none"), ("fused_loss", "none"),
                                  ("lora_base_dtype", "float32"))
            if getattr(speed, name) != default
        ]  # fmt: skip
        if asked:
            problems.append(
                f"{', '.join(asked)}: the speed levers are for the supervised stage; --stage {stage} trains with TRL's "
                "GRPOTrainer, which computes its loss from the policy's logits itself (leave them at their defaults)"
            )
    if family is not None and not family.causal:
        for name, default in (("attention", "auto"), ("fused_loss", "none")):
            if getattr(speed, name) != default:
                problems.append(
                    f"--{name} {getattr(speed, name)} is for causal LMs: T5 runs its own attention (with its position "
                    "bias) and its decoder computes the output layer for the target alone, every position a label"
                )
    if speed.attention == "flex_attention":
        if device != "cuda":
            problems.append(
                "--attention flex_attention trains on GPUs only: torch has no FlexAttention backward on the CPU "
                "(use sdpa there)"
            )
        elif not flex_attention_in_torch:
            problems.append("--attention flex_attention needs torch 2.5 or newer (torch.nn.attention.flex_attention)")
    if speed.fused_loss == "liger":
        if device != "cuda":
            problems.append(
                "--fused_loss liger runs Liger Kernel's Triton kernels, GPUs only: use --fused_loss chunked on the CPU"
            )
        elif not liger_installed:
            problems.append("--fused_loss liger needs Liger Kernel: pip install liger-kernel (or --fused_loss chunked)")
    if speed.compile == "layers" and (zero_stage == 3 or fsdp):
        problems.append(
            "--compile layers cannot run under ZeRO-3 or FSDP: their parameter hooks gather each layer's weights "
            "inside the layer, which a compiled graph does not call (use ZeRO-2, or --compile none)"
        )
    if speed.lora_base_dtype == "bfloat16":
        if precision != "bf16":
            problems.append(
                f"--lora_base_dtype bfloat16 needs --precision bf16 (this run computes in {precision}): the base "
                "would compute in bf16 while the run asked for another precision"
            )
        elif quantized:
            problems.append("--lora_base_dtype bfloat16 does not apply to a quantized base (--quantize_base)")
    return problems


def check_speed_here(args, family: Family | None = None, deepspeed_config: dict | None = None) -> None:
    """Refuse the levers of finalized training arguments (textsql.arguments.training.TextsqlTrainingArguments) that
    cannot run on this process's device, strategy and precision (and the model's family, once it is loaded)."""
    zero_stage = None
    if args.deepspeed:
        config = deepspeed_config if deepspeed_config is not None else args.hf_deepspeed_config.config
        zero_stage = (config.get("zero_optimization") or {}).get("stage", 0)
    problems = speed_refusals(
        args,
        device=args.device.type,
        family=family,
        zero_stage=zero_stage,
        fsdp=bool(args.fsdp),
        precision="bf16" if args.bf16 else "fp16" if args.fp16 else "fp32",
        lora=bool(getattr(args, "lora", False)),
        quantized=getattr(args, "quantize_base", "none") != "none",
        liger_installed=args.fused_loss != "liger" or liger_installed(),
        stage=getattr(args, "stage", "sft"),
    )
    if problems:
        raise TextsqlError("These speed settings cannot run here: " + "; ".join(problems) + ".")


def liger_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("liger_kernel") is not None
