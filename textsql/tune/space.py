"""`textsql tune`'s candidates: the strategies, micro-batches, adapters and levers that apply here and fit."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from pathlib import Path

from textsql.arguments.lora import QUANTIZED_BASES
from textsql.arguments.training import TextsqlTrainingArguments, arguments_from_dict
from textsql.arguments.tune import LEVERS, TuneArguments
from textsql.errors import TextsqlError
from textsql.paths import (
    METADATA_FILE,
)
from textsql.planner.phases import predict_strategy
from textsql.planner.shape import GIB, resolve_model
from textsql.planner.states import Setup, setup_from_arguments, zero_settings
from textsql.prep import longest_lengths
from textsql.strategy.fsdpconfig import is_fsdp_config_name
from textsql.strategy.table import NVME_STRATEGIES, STRATEGIES, STRATEGY_LAYOUT, is_fsdp
from textsql.tracking import candidate_values
from textsql.tune.store import CONFIRM_PREFIX

# textsql train's --per_device_train_batch_size, from the spec: the "default settings" candidate's micro-batch
TEXTSQL_DEFAULT_MICRO_BATCH = TextsqlTrainingArguments.per_device_train_batch_size


# The adapters a candidate can train with: each name's `textsql train` arguments (QLoRA: LoRA on a quantized base).
ADAPTERS = {
    "lora": {"lora": True},
    **{f"qlora-{base}": {"lora": True, "quantize_base": base} for base in QUANTIZED_BASES if base != "none"},
}


CAUSAL_ONLY_LEVERS = ("fused_loss", "liger", "packing", "flex_packing")


@dataclass
class Candidate:
    """One setting to measure: a strategy (a table row or a config file), a micro-batch and the accumulation that keeps
    the global batch; with the planner's prediction for it."""

    strategy: str
    micro_batch: int
    accumulation: int
    predicted_gpu_gb: float | None = None
    predicted_fits: bool | None = None  # None: no prediction applies (the CPU, a config file)
    adapter: str = ""  # "": every weight trains; else a name of ADAPTERS
    default: bool = False  # textsql train's own settings
    levers: tuple = ()  # names of LEVERS on top
    from_recipe: bool = False  # the confirmation: trained as `textsql train RECIPE` reads it, not as a candidate

    @property
    def key(self) -> str:
        name = Path(self.strategy).stem if self.strategy.endswith(".json") else self.strategy
        key = f"{name}-mb{self.micro_batch}-acc{self.accumulation}" + (f"-{self.adapter}" if self.adapter else "")
        key += f"-{'+'.join(self.levers)}" if self.levers else ""
        return f"{CONFIRM_PREFIX}{key}" if self.from_recipe else key


def micro_batch_choices(per_rank: int, requested: str = "") -> list[int]:
    """Micro-batches that divide the global batch per rank: the requested ones, or the powers of two up to it."""
    if requested:
        try:
            sizes = sorted({int(part) for part in requested.split(",") if part.strip()})
        except ValueError:
            raise TextsqlError(
                f"--micro_batches is a comma-separated list of whole numbers, like 4,8,16; not {requested!r}."
            ) from None
        bad = [size for size in sizes if size < 1 or per_rank % size]
        if bad:
            raise TextsqlError(
                f"Micro-batches {bad} do not divide the global batch per rank ({per_rank}): accumulation "
                "must keep the same global batch for every candidate. Choose divisors of it."
            )
        return sizes
    return [2**i for i in range(int(math.log2(per_rank)) + 1) if per_rank % 2**i == 0]


def strategy_choices(requested: str, accelerator: str, nodes: int) -> list[str]:
    """The strategies to try: the requested ones, or every table row that applies (FSDP on GPUs; hybrid sharding only
    across pods, where it differs from full sharding; not NVMe offload, which needs a folder and is the slowest)."""
    if requested:
        names = [part.strip() for part in requested.split(",") if part.strip()]
        unknown = [n for n in names if n not in STRATEGIES and not n.endswith(".json")]
        if unknown:
            raise TextsqlError(
                f"Unknown strategies {unknown}: use names of the strategy table ({', '.join(STRATEGIES)}) "
                "or paths of DeepSpeed/FSDP JSON files."
            )
        return names
    return [
        name
        for name in STRATEGIES
        if not (is_fsdp(name) and accelerator == "cpu")
        and not (name == "fsdp_hybrid_shard" and nodes == 1)
        and name not in NVME_STRATEGIES
    ]


def dataset_lengths(dataset_dir: str) -> tuple[int, int]:
    """The longest source and target of the prepared training split (what a batch is padded to at worst)."""
    path = Path(dataset_dir) / METADATA_FILE
    try:
        return longest_lengths(json.loads(path.read_text())["lengths"]["train"])
    except (OSError, KeyError, TypeError, ValueError):
        raise TextsqlError(
            f"'{path}' cannot be read: --dataset_dir must be a folder written by `textsql prep`."
        ) from None


def candidate_setup(args: TuneArguments, world: int, precision: str, base: dict, adapter: str = "") -> Setup:
    """The planner's Setup of a candidate: the `textsql train` arguments after -- (`base`, arguments_dict's) with the
    adapter's (ADAPTERS), as every run's memory check and `textsql plan` build theirs (setup_from_arguments), on the
    prepared dataset's longest lengths and the shipped DeepSpeed settings."""
    source, target = dataset_lengths(args.dataset_dir)
    return setup_from_arguments(
        base | ADAPTERS.get(adapter, {}),
        nodes=args.nodes,
        gpus_per_node=world // args.nodes,
        source_length=source,
        target_length=target,
        precision=precision,
        settings=zero_settings(None),
    )


def plan_candidates(
    args: TuneArguments,
    strategies: list[str],
    micro_batches: list[int],
    world: int,
    accelerator: str,
    precision: str,
    gpu_memory_gb: float | None,
    base: dict | None = None,
) -> tuple[list[Candidate], list[dict]]:
    """(the candidates to measure, the settings left out with the reason): every strategy x micro-batch (and with
    --lora, each also with a LoRA adapter of the rank and targets in `base`, the `textsql train` arguments) the planner
    predicts to fit in the GPU's memory (less the margin); on the CPU there is no GPU prediction, so all are tried.
    The planner has no LoRA model under FSDP: such candidates are tried without a prediction."""
    per_rank = args.global_batch_size // world
    base = base or {}
    qlora = [f"qlora-{args.quantize_base}"] if args.quantize_base != "none" else []
    adapters = [""] + (["lora"] if args.lora else []) + qlora
    shape, setups = None, {}
    if accelerator == "cuda" and gpu_memory_gb:
        shape = resolve_model(args.model_id)
        setups = {adapter: candidate_setup(args, world, precision, base, adapter) for adapter in adapters}
    candidates, left_out = [], []
    for strategy, micro, adapter in [(s, m, a) for s in strategies for m in micro_batches for a in adapters]:
        candidate = Candidate(strategy, micro, per_rank // micro, adapter=adapter)
        predictable = strategy in STRATEGIES and (not adapter or strategy in STRATEGY_LAYOUT)
        if shape is not None and predictable:
            row = predict_strategy(shape, setups[adapter], strategy, micro)
            candidate.predicted_gpu_gb = round(row["gpu_total_bytes"] / GIB, 3)
            candidate.predicted_fits = row["gpu_total_bytes"] <= gpu_memory_gb * GIB * (1 - args.safety_margin)
            if not candidate.predicted_fits:
                left_out.append(
                    result_row(
                        candidate,
                        "predicted not to fit",
                        error=f"predicted {candidate.predicted_gpu_gb:.1f} GB of {gpu_memory_gb:g} GB",
                    )
                )
                continue
        candidates.append(candidate)
    default = Candidate("none", min(TEXTSQL_DEFAULT_MICRO_BATCH, per_rank), 0, default=True)
    default.accumulation = per_rank // default.micro_batch
    match = next((c for c in candidates if c.key == default.key), None)
    if match is not None:
        match.default = True
    else:  # always measured: the winner is compared with it
        candidates.insert(0, default)
    return candidates, left_out


def candidate_arguments(base: dict, candidate: Candidate, args: TuneArguments, output_dir: Path):
    """The three argument dataclasses of one measurement: the user's settings, the candidate's strategy and batch, a
    fixed number of steps logged one by one, no evaluation, no checkpoints."""
    values = dict(
        base,
        per_device_train_batch_size=candidate.micro_batch,
        gradient_accumulation_steps=candidate.accumulation,
        max_steps=args.warmup_steps + args.timed_steps,
        logging_steps=1,
        logging_first_step=True,
        eval_strategy="no",
        save_strategy="no",
        report_to="none",
        execution_accuracy_samples=0,
        output_dir=str(output_dir),
        overwrite=True,
        disable_tqdm=True,
        accelerator=args.accelerator,
        num_gpus=args.num_gpus,
        lora=False,
    )
    values.update(strategy_values(candidate.strategy))
    values.update(ADAPTERS.get(candidate.adapter, {}))
    for lever in candidate.levers:
        values.update(LEVERS[lever])
    values.update(candidate_values(base.get("mlflow_parent_run_id")))  # a tracked tune: nested MLflow runs
    return arguments_from_dict(values)


def strategy_values(strategy: str) -> dict:
    """The `textsql train` arguments that select a strategy: --deepspeed or --fsdp_config (none for "none")."""
    if strategy == "none":
        return {"deepspeed": None, "fsdp_config": None}
    if is_fsdp(strategy) or (strategy.endswith(".json") and is_fsdp_config_name(strategy)):
        return {"deepspeed": None, "fsdp_config": strategy}
    return {"deepspeed": strategy, "fsdp_config": None}


def lever_candidates(first: list[dict], by_key: dict, levers: list[str], causal: bool, stage: str) -> list[Candidate]:
    """The lever round's candidates. "alone": each lever on the fastest candidate without levers of the first round
    (those that do not apply to it left out: the causal LMs' levers on T5, LoRA's base without an adapter). "together":
    the levers that made it faster (above the candidate's own speed), all at once, when there are two or more."""
    plain = [e for e in first if e["status"] == "ok" and not e.get("levers")]
    if not plain:
        return []
    base = by_key[plain[0]["key"]]  # fastest first
    if stage == "alone":
        applicable = [
            name
            for name in levers
            if (causal or name not in CAUSAL_ONLY_LEVERS) and (name != "bf16_lora_base" or base.adapter == "lora")
        ]
        return [replace(base, levers=(name,), default=False) for name in applicable]
    faster = [
        e["levers"][0]
        for e in first
        if e["status"] == "ok"
        and len(e.get("levers") or ()) == 1
        and e["samples_per_second"] > plain[0]["samples_per_second"]
    ]
    # one value per flag: flex_packing over packing, liger over fused_loss when both helped
    for loser, winner in (("packing", "flex_packing"), ("fused_loss", "liger")):
        if loser in faster and winner in faster:
            faster.remove(loser)
    return [replace(base, levers=tuple(faster), default=False)] if len(faster) > 1 else []


def result_row(candidate: Candidate, status: str, *, repeat: int = 0, error: str | None = None, **measured) -> dict:
    return {
        "key": candidate.key,
        "repeat": repeat,
        "status": status,
        "strategy": candidate.strategy,
        "micro_batch": candidate.micro_batch,
        "accumulation": candidate.accumulation,
        "adapter": candidate.adapter,
        "levers": list(candidate.levers),
        "default": candidate.default,
        "predicted_gpu_gb": candidate.predicted_gpu_gb,
        "predicted_fits": candidate.predicted_fits,
        "error": error,
        **measured,
    }
