"""`textsql tune`'s arguments: the model, the candidates (strategies, micro-batches, adapters, levers), how long each is measured."""

from __future__ import annotations

from dataclasses import dataclass, field

from textsql.arguments import same_flag
from textsql.arguments.devices import DeviceArguments
from textsql.arguments.lora import QUANTIZED_BASES, LoraArguments
from textsql.arguments.plan import PlanArguments
from textsql.arguments.training import DataArguments, ModelArguments
from textsql.errors import TextsqlError

# The speed levers a tune can try (textsql.train.speed and the Trainer's own flags): each name's `textsql train`
# arguments. fused AdamW is textsql's default (the Trainer's adamw_torch_fused): its alternative is what is measured.
LEVERS = {
    "fused_loss": {"fused_loss": "chunked"},
    "liger": {"fused_loss": "liger"},
    "compile": {"compile": "layers"},
    "packing": {"packing": True},
    "flex_packing": {"packing": True, "attention": "flex_attention"},
    "bf16_lora_base": {"lora_base_dtype": "bfloat16"},
    "foreach_adamw": {"optim": "adamw_torch"},
    "workers": {"dataloader_num_workers": 2, "dataloader_persistent_workers": True},
}


@dataclass
class TuneArguments:
    """What to tune, and how long to measure each candidate."""

    model_id: str = same_flag(ModelArguments, "model_id")
    dataset_dir: str = same_flag(DataArguments, "dataset_dir")
    tune_dir: str = field(
        default="tune",
        metadata={
            "help": "Where results, logs, the table, the plot and the recipe go. "
            "Measured candidates are kept there: running again resumes."
        },
    )
    global_batch_size: int = field(
        default=32,
        metadata={
            "help": "Samples per optimizer step over all ranks, the same for "
            "every candidate (micro-batch x accumulation x ranks)."
        },
    )
    strategies: str = field(
        default="",
        metadata={
            "help": "Comma-separated strategies (or DeepSpeed/FSDP JSON files) to "
            "try; default: every row of the strategy table that applies here."
        },
    )
    micro_batches: str = field(
        default="",
        metadata={
            "help": "Comma-separated micro-batches per rank; default: the powers "
            "of two up to the global batch per rank."
        },
    )
    warmup_steps: int = field(
        default=3,
        metadata={
            "help": "Optimizer steps run before timing, at least 1: the start-up (imports, DeepSpeed's op builds, "
            "loading, the first step's allocations and caches) ends inside them, never in the timed steps."
        },
    )
    timed_steps: int = field(default=20, metadata={"help": "Optimizer steps timed per measurement."})
    repeat_top: int = field(
        default=3,
        metadata={
            "help": "The fastest few candidates, and textsql train's default settings, are measured --repeats times "
            "in all (0: none)."
        },
    )
    repeats: int = field(
        default=3,
        metadata={
            "help": "Measurements of each repeated candidate, in rounds of alternating order (the first round in "
            "the table's order, the next reversed, ...), so that when a candidate runs does not decide the ranking; "
            "the table gives the median and the min-max."
        },
    )
    candidate_timeout_s: float = field(
        default=0,
        metadata={
            "help": "Seconds one measurement may take, start-up included, before it is stopped (every process it "
            "started is killed) and recorded as timed out; the next candidate then runs. 0: 900 s plus 30 s per "
            "warm-up and timed step."
        },
    )
    tolerance: float = field(
        default=0.05, metadata={"help": "A simpler setting within this fraction of the fastest wins."}
    )
    num_gpus: int | None = same_flag(
        DeviceArguments, "num_gpus", "Ranks per pod (one per visible GPU by default; 1 on the CPU)."
    )
    nodes: int = same_flag(
        PlanArguments, "nodes", "Pods: 1 here; more through a started cluster (textsql.tune.run_tune(cluster=...))."
    )
    gpu_memory_gb: float | None = field(
        default=None, metadata={"help": "Memory of one GPU in GB for the planner; default: this pod's first GPU."}
    )
    safety_margin: float = same_flag(
        PlanArguments, "safety_margin", "Fraction of GPU memory the planner keeps free when choosing candidates."
    )
    retry_failed: bool = field(
        default=False,
        metadata={
            "help": "Measure again the candidates that failed before (a busy port, a crash); kept results are "
            "otherwise never re-run."
        },
    )
    lora: bool = same_flag(
        LoraArguments,
        "lora",
        "Also measure every strategy x micro-batch with a LoRA adapter (textsql train --lora True; "
        "--lora_rank and --lora_targets after -- apply), beside the planner's LoRA prediction.",
    )
    quantize_base: str = same_flag(
        LoraArguments,
        "quantize_base",
        "Also measure every strategy x micro-batch with a QLoRA adapter on a base quantized to nf4 or int8 "
        "(textsql train --lora True --quantize_base ...), beside the planner's QLoRA prediction; none: no QLoRA "
        "candidates.",
    )
    confirm: bool = field(
        default=True,
        metadata={
            "help": "After choosing, train the written recipe as `textsql train RECIPE` reads it (its own logging, "
            "evaluation and reporting; the warm-up and timed steps only), and textsql train's default settings the "
            "same way, --repeats times in alternating order: the winner's speed-up re-measured from its recipe, "
            "beside the candidates' figure."
        },
    )
    accelerator: str = same_flag(DeviceArguments, "accelerator")
    levers: str = field(
        default="",
        metadata={
            "help": "Speed levers to measure on the fastest setting of the first round: each alone, then those that "
            "made it faster together; comma-separated from fused_loss, liger, compile, packing, flex_packing, "
            "bf16_lora_base, foreach_adamw, workers (textsql train's --fused_loss, --compile, --packing, --attention, "
            "--lora_base_dtype, --optim, --dataloader_num_workers), or all. A lever that cannot run here (FlexAttention "
            "and Liger on the CPU) is recorded with textsql's reason."
        },
    )

    def __post_init__(self):
        if self.quantize_base not in QUANTIZED_BASES:
            raise TextsqlError(
                f"--quantize_base must be one of {', '.join(QUANTIZED_BASES)}, not '{self.quantize_base}'."
            )
        for name in ("global_batch_size", "timed_steps", "nodes"):
            if getattr(self, name) < 1:
                raise TextsqlError(f"--{name} must be at least 1, not {getattr(self, name)}.")
        if self.warmup_steps < 1:
            raise TextsqlError(
                f"--warmup_steps must be at least 1, not {self.warmup_steps}: the first step's time includes the "
                "start-up (DeepSpeed's op builds, loading), which must not count as training speed."
            )
        if self.repeat_top < 0 or self.repeats < 1:
            raise TextsqlError("--repeat_top must be 0 or more and --repeats at least 1.")
        if not self.candidate_timeout_s >= 0:
            raise TextsqlError(
                f"--candidate_timeout_s is a number of seconds (0: chosen from the steps), not {self.candidate_timeout_s!r}."
            )
        if not 0 <= self.tolerance < 1:
            raise TextsqlError(f"--tolerance is a fraction (0.05 = 5 percent), not {self.tolerance!r}.")
        unknown = [name for name in self.lever_names if name not in LEVERS]
        if unknown:
            raise TextsqlError(f"Unknown levers {unknown}: choose from {', '.join(LEVERS)}, or all.")

    @property
    def lever_names(self) -> list[str]:
        names = [part.strip() for part in self.levers.split(",") if part.strip()]
        return list(LEVERS) if names == ["all"] else names

    @property
    def timeout_s(self) -> float:
        """The limit on one measurement: --candidate_timeout_s, or 900 s plus 30 s per step."""
        return self.candidate_timeout_s or 900 + 30 * (self.warmup_steps + self.timed_steps)
