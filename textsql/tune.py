"""`textsql tune`: the fastest strategy and micro-batch that fit, measured with textsql's own training at a fixed global
batch: candidates from the planner, failures recorded beside their prediction, the best few repeated, a simpler setting
preferred when it is nearly as fast, a table, a plot and a `textsql train` recipe of the winner; resumable."""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import statistics
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from textsql.arguments.lora import QUANTIZED_BASES
from textsql.arguments.training import TextsqlTrainingArguments, arguments_dict, arguments_from_dict, parse_arguments
from textsql.errors import TextsqlError
from textsql.extras import require_notebooks_extra
from textsql.families import family_of
from textsql.hub import load_config
from textsql.paths import (
    METADATA_FILE,
    TUNE_LOGS_DIR,
    TUNE_PLOT_FILE,
    TUNE_RECIPE_FILE,
    TUNE_RESULTS_FILE,
    TUNE_RUNS_DIR,
    TUNE_TABLE_FILE,
)
from textsql.planner.phases import predict_strategy
from textsql.planner.shape import GIB, resolve_model
from textsql.planner.states import Setup, setup_from_arguments, zero_settings
from textsql.prep import longest_lengths
from textsql.strategy.devices import NodeDevices, choose_accelerator, resolve_precision
from textsql.strategy.fsdpconfig import check_fsdp_devices, is_fsdp_config_name
from textsql.strategy.table import NVME_STRATEGIES, STRATEGIES, STRATEGY_LAYOUT, is_fsdp, strategy_rank
from textsql.tracking import candidate_values, end_tune_run, start_tune_run
from textsql.train.local_launch import TrainingTimedOut, node_devices, ranks_per_node, run_training

RESULTS_VERSION = 2
# textsql train's --per_device_train_batch_size, from the spec: the "default settings" candidate's micro-batch
TEXTSQL_DEFAULT_MICRO_BATCH = TextsqlTrainingArguments.per_device_train_batch_size
# The adapters a candidate can train with: each name's `textsql train` arguments (QLoRA: LoRA on a quantized base).
ADAPTERS = {
    "lora": {"lora": True},
    **{f"qlora-{base}": {"lora": True, "quantize_base": base} for base in QUANTIZED_BASES if base != "none"},
}
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
CAUSAL_ONLY_LEVERS = ("fused_loss", "liger", "packing", "flex_packing")
CONFIRM_PREFIX = "recipe:"  # a confirmation's key in the results: the setting trained from its recipe
RETRIED = ("failed", "out of memory", "timed out")  # what --retry_failed measures again
RANK_QUOTE = re.compile(r"^(rank \d+ )?\| ")  # how textsql.cluster.launch.failure_message quotes a rank's output
OUT_OF_MEMORY_MARKERS = ("out of memory", "outofmemoryerror", "cuda error: out of memory", "cannot allocate memory")


@dataclass
class TuneArguments:
    """What to tune, and how long to measure each candidate."""

    model_id: str = field(
        default="t5-small", metadata={"help": "The model to train (hub name or folder), as textsql train's --model_id."}
    )
    dataset_dir: str = field(default="data/wikisql", metadata={"help": "Folder written by `textsql prep`."})
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
    num_gpus: int | None = field(
        default=None, metadata={"help": "Ranks per pod (one per visible GPU by default; 1 on the CPU)."}
    )
    nodes: int = field(
        default=1,
        metadata={"help": "Pods: 1 here; more through a started cluster (textsql.tune.run_tune(cluster=...))."},
    )
    gpu_memory_gb: float | None = field(
        default=None, metadata={"help": "Memory of one GPU in GB for the planner; default: this pod's first GPU."}
    )
    safety_margin: float = field(
        default=0.1, metadata={"help": "Fraction of GPU memory the planner keeps free when choosing candidates."}
    )
    retry_failed: bool = field(
        default=False,
        metadata={
            "help": "Measure again the candidates that failed before (a busy port, a crash); kept results are "
            "otherwise never re-run."
        },
    )
    lora: bool = field(
        default=False,
        metadata={
            "help": "Also measure every strategy x micro-batch with a LoRA adapter (textsql train --lora True; "
            "--lora_rank and --lora_targets after -- apply), beside the planner's LoRA prediction."
        },
    )
    quantize_base: str = field(
        default="none",
        metadata={
            "help": "Also measure every strategy x micro-batch with a QLoRA adapter on a base quantized to nf4 or int8 "
            "(textsql train --lora True --quantize_base ...), beside the planner's QLoRA prediction; none: no QLoRA "
            "candidates."
        },
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
    accelerator: str = field(default="auto", metadata={"help": "auto, cuda or cpu, as textsql train's --accelerator."})
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


# ---------------------------------------------------------------------------------------------------------------------
# Candidates
# ---------------------------------------------------------------------------------------------------------------------


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


# ---------------------------------------------------------------------------------------------------------------------
# Measuring one candidate
# ---------------------------------------------------------------------------------------------------------------------


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


def timed_throughput(log_history: list[dict], warmup_steps: int, samples_per_step: int) -> tuple[float, float] | None:
    """(samples/s, seconds per step) over the steps after the warm-up, from the per-step samples_per_second textsql's
    trainer logs (the time between two log lines, so the warm-up's start-up is outside it)."""
    rates = [
        h["samples_per_second"]
        for h in log_history
        if "samples_per_second" in h and h.get("step", 0) > warmup_steps and h["samples_per_second"] > 0
    ]
    if not rates:
        return None
    seconds = sum(samples_per_step / rate for rate in rates)
    return len(rates) * samples_per_step / seconds, seconds / len(rates)


def peak_memory(summary) -> tuple[int | None, str]:
    """The busiest rank's peak: torch's reserved GPU memory, or the process's resident memory on the CPU."""
    ranks = summary.peak_memory_per_rank or []
    gpu = [r["cuda_max_reserved_bytes"] for r in ranks if "cuda_max_reserved_bytes" in r]
    if gpu:
        return max(gpu), "GPU reserved"
    cpu = [r.get("cpu_peak_rss_bytes", 0) for r in ranks]
    return (max(cpu) if cpu else None), "CPU RSS"


def failure_status(message: str) -> str:
    lowered = message.lower()
    return "out of memory" if any(marker in lowered for marker in OUT_OF_MEMORY_MARKERS) else "failed"


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


def run_name(candidate: Candidate, repeat: int) -> str:
    """A measurement's run folder and log name (a confirmation's "recipe:" as "recipe-": a file name)."""
    return f"{candidate.key.replace(CONFIRM_PREFIX, 'recipe-')}-r{repeat}"


def recipe_arguments(recipe: Path | dict, args: TuneArguments, output_dir: Path, parent_run_id: str | None = None):
    """A confirmation's arguments: the recipe file as `textsql train RECIPE --max_steps N ...` reads it (or, for the
    default settings, their recipe's values), trained for the warm-up and timed steps, each step logged, into
    `output_dir`; everything else (evaluation, reporting, the progress bar) as the recipe says, but the SQL scoring
    after the training loop (unless the recipe scores at every evaluation, inside the loop)."""
    own = {
        "max_steps": args.warmup_steps + args.timed_steps,
        "logging_steps": 1,
        "logging_first_step": True,
        "output_dir": str(output_dir),
        "overwrite": True,
        "accelerator": args.accelerator,
    } | candidate_values(parent_run_id)
    if isinstance(recipe, dict):
        model, data, training = arguments_from_dict(recipe | own)
    else:
        flags = [part for key, value in own.items() for part in (f"--{key}", str(value))]
        model, data, training = parse_arguments([str(recipe), *flags])
    if not data.execution_accuracy_each_evaluation:  # scored after the training loop: outside both figures, time only
        data = replace(data, execution_accuracy_samples=0)
    return model, data, training


def measure(candidate: Candidate, args: TuneArguments, world: int, repeat: int, train, arguments_for) -> dict:
    """Train one candidate for the warm-up and timed steps and return its result row; a failure is caught and recorded
    (an out-of-memory named as such) with the last lines of its output. `arguments_for(output_dir)`: its `textsql
    train` arguments."""
    tune_dir = Path(args.tune_dir)
    output_dir = tune_dir / TUNE_RUNS_DIR / run_name(candidate, repeat)
    log = tune_dir / TUNE_LOGS_DIR / f"{run_name(candidate, repeat)}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    try:
        arguments = arguments_for(output_dir)
        with log.open("w") as stream:
            summary = train(arguments, lambda line: stream.write(line + "\n"), args.timeout_s)
    except TrainingTimedOut as error:
        return result_row(
            candidate,
            "timed out",
            repeat=repeat,
            error=f"stopped at its limit of {error.limit_s:g} s (--candidate_timeout_s), with every process it started",
            timeout_s=error.limit_s,
            output_tail=_last_lines(str(error)),
            log=str(log),
            wall_seconds=round(time.perf_counter() - started, 1),
        )
    except TextsqlError as error:
        text = str(error)
        return result_row(
            candidate,
            failure_status(text),
            repeat=repeat,
            error=failure_reason(text),
            output_tail=_last_lines(text),
            log=str(log),
            wall_seconds=round(time.perf_counter() - started, 1),
        )
    try:
        state = json.loads((Path(summary.output_dir) / "trainer_state.json").read_text())
    except (OSError, ValueError) as error:  # a run folder this process cannot read (another pod's disk)
        return result_row(
            candidate, "failed", repeat=repeat, error=f"the run's trainer_state.json cannot be read: {error}"
        )
    samples_per_step = candidate.micro_batch * candidate.accumulation * world
    timed = timed_throughput(state.get("log_history", []), args.warmup_steps, samples_per_step)
    peak, kind = peak_memory(summary)
    if timed is None:
        return result_row(candidate, "failed", repeat=repeat, error="no timed step was logged", log=str(log))
    return result_row(
        candidate,
        "ok",
        repeat=repeat,
        samples_per_second=round(timed[0], 3),
        seconds_per_step=round(timed[1], 4),
        peak_memory_bytes=peak,
        memory_kind=kind,
        world_size=summary.world_size,
        final_loss=summary.last_logged_loss,
        run_samples_per_second=summary.train_samples_per_second,  # the whole run's, as textsql train reports it
        run_dir=summary.output_dir,
        log=str(log),
        wall_seconds=round(time.perf_counter() - started, 1),
        load_average=round(os.getloadavg()[0], 2),
        cpu_cores=os.cpu_count(),
    )


def _last_lines(text: str, count: int = 6) -> str:
    return "\n".join(text.strip().splitlines()[-count:])


def failure_reason(text: str) -> str:
    """The line that says why a training failed: textsql's own message, else the last exception line, else the last.
    A cluster launch's error quotes the failing rank's last lines as "  | line" (or "  rank N | line")."""
    lines = [RANK_QUOTE.sub("", line.strip()) for line in text.strip().splitlines() if line.strip()]
    for line in reversed(lines):
        if line.startswith("textsql train:"):
            return line.removeprefix("textsql train:").strip()
    for line in reversed(lines):
        if ("Error:" in line or "error:" in line) and "launch.py" not in line:
            return line
    return lines[-1] if lines else "no output"


def local_trainer(arguments, echo, timeout_s: float | None = None) -> object:
    """One measurement on this pod: textsql's own launch (child processes, one rank per GPU), stopped with all its
    processes past `timeout_s` (textsql.train.local_launch.TrainingTimedOut)."""
    model, data, training = arguments
    return run_training(model, data, training, training.num_gpus, echo=echo, timeout_s=timeout_s)


def cluster_trainer(cluster):
    """One measurement through a started textsql cluster (textsql.cluster.Cluster) on several pods: past `timeout_s`
    every pod is stopped (TrainingTimedOut, as on one pod); each candidate runs on pods of its own (a pod's command is
    fixed when it is created), also after a failure or a time-out. Every line the launch shows also goes to the
    candidate's log."""

    def train(arguments, echo, timeout_s=None):
        shown = cluster.echo
        cluster.echo = lambda line: (echo(line), shown(line))
        try:
            return cluster.train(*arguments, timeout_s=timeout_s)["summary"]
        finally:
            cluster.echo = shown

    return train


# ---------------------------------------------------------------------------------------------------------------------
# Results: one JSON line per measurement, resumable
# ---------------------------------------------------------------------------------------------------------------------


def fingerprint(args: TuneArguments, base: dict, world: int) -> str:
    """What makes measurements comparable: the model, the data, the global batch, the steps, the ranks, the settings."""
    settings = {
        "model": args.model_id,
        "data": args.dataset_dir,
        "global_batch": args.global_batch_size,
        "world": world,
        "warmup": args.warmup_steps,
        "timed": args.timed_steps,
        "version": RESULTS_VERSION,
        "accelerator": args.accelerator,
        "base": {k: v for k, v in sorted(base.items()) if k not in ("output_dir",)},
    }
    return hashlib.sha256(json.dumps(settings, sort_keys=True, default=str).encode()).hexdigest()[:16]


def read_results(path: Path, print_: str) -> list[dict]:
    """The measurements already in the tune folder for these settings; other settings' results are refused."""
    if not path.exists():
        return []
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    other = [r for r in rows if r.get("fingerprint") != print_]
    if other:
        raise TextsqlError(
            f"{path} holds measurements of other settings (model, data, global batch, steps, training "
            "arguments or an older textsql's results format differ), which are not comparable with these. Pass another --tune_dir, or remove "
            "that folder to measure again."
        )
    return rows


def append_result(path: Path, row: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as stream:
        stream.write(json.dumps(row, default=str) + "\n")
        stream.flush()


# ---------------------------------------------------------------------------------------------------------------------
# Choosing
# ---------------------------------------------------------------------------------------------------------------------


def summarize(rows: list[dict]) -> list[dict]:
    """One row per candidate: its measurements' median samples/s with their min and max (the spread the table states),
    the largest peak, or its failure."""
    by_key: dict[str, list[dict]] = {}
    for row in rows:
        by_key.setdefault(row["key"], []).append(row)
    table = []
    for measured in by_key.values():
        ok = [r for r in measured if r["status"] == "ok"]
        first = measured[0]
        entry = {
            k: first[k]
            for k in (
                "key",
                "strategy",
                "micro_batch",
                "accumulation",
                "adapter",
                "default",
                "predicted_gpu_gb",
                "predicted_fits",
            )
        } | {"levers": first.get("levers") or []}
        if ok:
            rates = [r["samples_per_second"] for r in ok]
            middle = statistics.median(rates)
            entry |= {
                "status": "ok",
                "samples_per_second": middle,
                "samples_per_second_min": min(rates),
                "samples_per_second_max": max(rates),
                "measurements": len(rates),
                "spread": (max(rates) - min(rates)) / middle,
                "run_samples_per_second": statistics.median([r.get("run_samples_per_second") or 0 for r in ok]),
                "load_average_max": max((r.get("load_average") or 0) for r in ok),
                "cpu_cores": ok[0].get("cpu_cores"),
                "peak_memory_bytes": max(r["peak_memory_bytes"] or 0 for r in ok),
                "memory_kind": ok[0]["memory_kind"],
            }
        else:
            entry |= {"status": measured[-1]["status"], "error": measured[-1].get("error"), "measurements": 0}
        table.append(entry)
    return sorted(table, key=lambda e: (e["status"] != "ok", -(e.get("samples_per_second") or 0), e["key"]))


def simplicity(entry: dict) -> tuple:
    """Simpler first: every weight trained (an adapter learns less), fewer speed levers, the strategy table's order
    (plain data parallel, then ZeRO-1, ...), then less accumulation."""
    return (
        bool(entry.get("adapter")),
        len(entry.get("levers") or ()),
        strategy_rank(entry["strategy"]),
        entry["accumulation"],
        entry["key"],
    )


def choose_winner(table: list[dict], tolerance: float) -> dict | None:
    """The simplest candidate within `tolerance` of the fastest; None when nothing ran."""
    ok = [e for e in table if e["status"] == "ok"]
    if not ok:
        return None
    best = max(e["samples_per_second"] for e in ok)
    close = [e for e in ok if e["samples_per_second"] >= best * (1 - tolerance)]
    return min(close, key=simplicity)


# ---------------------------------------------------------------------------------------------------------------------
# The run
# ---------------------------------------------------------------------------------------------------------------------


@dataclass
class TuneResult:
    """What `run_tune` found: every candidate (fastest first, failures last), the winner, the default's speed."""

    table: list[dict]
    winner: dict | None
    default: dict | None
    left_out: list[dict]
    tune_dir: Path
    recipe: Path | None
    plot: Path | None
    measured_now: int
    global_batch_size: int = 0
    confirmation: list[dict] | None = None  # the recipe (and the default settings) trained as textsql train reads them

    @property
    def speedup_over_default(self) -> float | None:
        if not (self.winner and self.default and self.default.get("status") == "ok"):
            return None
        return self.winner["samples_per_second"] / self.default["samples_per_second"]

    def confirmed(self, default: bool) -> dict | None:
        """The confirmation's entry of the recipe (default False) or of the default settings, when it trained."""
        return next((e for e in self.confirmation or () if e["status"] == "ok" and bool(e["default"]) == default), None)

    @property
    def confirmed_speedup(self) -> dict | None:
        """The winner's speed-up over the default settings, both trained from their recipes: in the timed steps, and
        over each whole training loop as textsql train reports it (DeepSpeed's set-up, the warm-up and any evaluation
        inside it included)."""
        recipe, default = self.confirmed(False), self.confirmed(True)
        if not (recipe and default):
            return None
        return {
            "timed_steps": recipe["samples_per_second"] / default["samples_per_second"],
            "whole_run": (
                recipe["run_samples_per_second"] / default["run_samples_per_second"]
                if recipe.get("run_samples_per_second") and default.get("run_samples_per_second")
                else None
            ),
        }


def run_tune(
    args: TuneArguments,
    train_argv: list[str] | tuple = (),
    *,
    cluster=None,
    devices: NodeDevices | None = None,
    echo=print,
) -> TuneResult:
    """Measure every candidate (those in the tune folder's results are not run again), repeat the fastest few, choose,
    and write the table, the plot and the recipe into args.tune_dir. `train_argv`: more `textsql train` arguments for
    every candidate and the recipe. `cluster`: a started textsql.cluster.Cluster to measure on several pods."""
    base_model, base_data, base_training = parse_arguments(
        ["--model_id", args.model_id, "--dataset_dir", args.dataset_dir, *train_argv]
    )
    base = arguments_dict(base_model, base_data, base_training)
    if base.get("lora"):
        raise TextsqlError(
            "--lora True after -- would train every candidate with an adapter under a full fine-tuning's name. Pass "
            "--lora True before -- instead: each setting is then measured with and without a LoRA adapter "
            "(--lora_rank and --lora_targets after -- still apply)."
        )
    if cluster is None and args.nodes != 1:
        raise TextsqlError(
            f"--nodes {args.nodes} needs a started cluster: call textsql.tune.run_tune(args, cluster=...) "
            "with a textsql.cluster.Cluster (its pods are the nodes), or tune on this pod with --nodes 1."
        )
    devices = devices if devices is not None else node_devices(args.accelerator)
    accelerator = choose_accelerator(args.accelerator, devices)
    ranks = ranks_per_node(args.num_gpus, devices) if accelerator == "cuda" else (args.num_gpus or 1)
    world = ranks * args.nodes
    if args.global_batch_size % world:
        raise TextsqlError(
            f"The global batch {args.global_batch_size} does not divide over {world} ranks: pass a "
            f"--global_batch_size that is a multiple of {world}."
        )
    precision = resolve_precision(
        base_training.precision, args.model_id, devices.gpus if accelerator == "cuda" else ()
    ).name
    gpu_memory_gb = args.gpu_memory_gb or (
        devices.gpus[0].memory_bytes / GIB if devices.gpus and devices.gpus[0].memory_bytes else None
    )
    strategies = strategy_choices(args.strategies, accelerator, args.nodes)
    micro_batches = micro_batch_choices(args.global_batch_size // world, args.micro_batches)
    candidates, left_out = plan_candidates(
        args, strategies, micro_batches, world, accelerator, precision, gpu_memory_gb, base
    )
    candidates, refused = _refused_here(candidates, accelerator, devices)
    left_out += refused

    tune_dir = Path(args.tune_dir)
    results_path = tune_dir / TUNE_RESULTS_FILE
    print_ = fingerprint(args, base, world)
    rows = read_results(results_path, print_)
    retried = RETRIED if args.retry_failed else ()
    done = {(r["key"], r["repeat"]) for r in rows if r["status"] not in retried}
    train = cluster_trainer(cluster) if cluster is not None else local_trainer
    echo(
        f"textsql tune: {len(candidates)} candidates at a global batch of {args.global_batch_size} on {world} rank(s) "
        f"({devices.describe()}, {precision}); {args.warmup_steps} warm-up + {args.timed_steps} timed steps each, "
        f"at most {args.timeout_s:g} s; results in {results_path}"
    )
    measured_now = 0
    out_of_memory: dict[tuple, int] = {}  # (strategy, adapter) -> the smallest micro-batch that ran out of memory

    def run_one(candidate: Candidate, repeat: int, position: str, arguments_for=None) -> None:
        """Measure one candidate (`arguments_for`: its arguments when it is not a candidate's own), unless kept."""
        nonlocal measured_now
        if (candidate.key, repeat) in done:
            echo(f"{position} {candidate.key}: measured before, kept ({results_path.name})")
            return
        family = (candidate.strategy, candidate.adapter)
        if family in out_of_memory and candidate.micro_batch > out_of_memory[family]:
            row = result_row(
                candidate,
                "skipped",
                repeat=repeat,
                error=f"micro-batch {out_of_memory[family]} ran out of memory under this strategy",
            )
        else:
            echo(f"{position} {candidate.key}: training {args.warmup_steps} + {args.timed_steps} steps ...")
            row = measure(
                candidate,
                args,
                world,
                repeat,
                train,
                arguments_for or (lambda output_dir: candidate_arguments(runs_base, candidate, args, output_dir)),
            )
            measured_now += 1
        row["fingerprint"] = print_
        append_result(results_path, row)
        rows.append(row)
        done.add((candidate.key, repeat))
        if row["status"] == "out of memory":
            out_of_memory[family] = min(candidate.micro_batch, out_of_memory.get(family, candidate.micro_batch))
        echo(f"{position} {candidate.key}: {describe_row(row)}")

    ordered = sorted(candidates, key=lambda c: (strategy_rank(c.strategy), c.strategy, c.micro_batch, c.adapter))
    parent = start_tune_run(base, asdict(args), tune_dir)  # MLflow: the tune's run, each candidate nested under it
    runs_base = dict(base, mlflow_parent_run_id=parent["run_id"]) if parent else base
    try:
        for i, candidate in enumerate(ordered, 1):
            run_one(candidate, 0, f"[{i}/{len(ordered)}]")
        if args.lever_names:
            causal = family_of(load_config(args.model_id)).causal
            for stage in ("alone", "together"):
                first = summarize([r for r in rows if r["repeat"] == 0 and r["key"] in {c.key for c in ordered}])
                added = lever_candidates(first, {c.key: c for c in ordered}, args.lever_names, causal, stage)
                for i, candidate in enumerate(added, 1):
                    run_one(candidate, 0, f"[lever {stage} {i}/{len(added)}]")
                ordered += added
                candidates += added
        for round_, contenders in enumerate(repeat_rounds(rows, ordered, args), 1):
            for i, candidate in enumerate(contenders, 1):
                run_one(candidate, round_, f"[round {round_ + 1}/{args.repeats}, {i}/{len(contenders)}]")
        by_key = {c.key: c for c in candidates}
        table = summarize([r for r in rows if r["key"] in by_key])
        winner = choose_winner(table, args.tolerance)
        default = next((e for e in table if e["default"]), None)
        result = TuneResult(
            table, winner, default, left_out, tune_dir, None, None, measured_now, args.global_batch_size
        )
        if winner is not None:
            result.recipe = write_recipe(
                tune_dir / TUNE_RECIPE_FILE, winner, base_model, base_data, base_training, args
            )
        if args.confirm and winner is not None:
            settings = (base_model, base_data, base_training)
            confirming = confirmation_runs(result, by_key, args, settings, parent and parent["run_id"])
            for round_ in range(args.repeats):
                order = confirming[:: -1 if round_ % 2 else 1]
                for i, (candidate, arguments_for) in enumerate(order, 1):
                    position = f"[recipe round {round_ + 1}/{args.repeats}, {i}/{len(order)}]"
                    run_one(candidate, round_, position, arguments_for)
            keys = {candidate.key for candidate, _ in confirming}
            result.confirmation = summarize([r for r in rows if r["key"] in keys])
    except BaseException:
        end_tune_run(parent, failed=True)
        raise
    result.measured_now = measured_now
    (tune_dir / TUNE_TABLE_FILE).write_text(format_table(result) + "\n")
    result.plot = plot_tune(result, tune_dir / TUNE_PLOT_FILE)
    end_tune_run(parent, [tune_dir / TUNE_TABLE_FILE, result.plot, result.recipe], winner and winner["key"])
    return result


def confirmation_runs(result: TuneResult, by_key: dict, args: TuneArguments, settings: tuple, parent_id) -> list:
    """What --confirm trains, as (candidate, its arguments for an output folder): the winner from the recipe file tune
    wrote, and textsql train's default settings (when they did not win) from their recipe's values, each as textsql
    train reads them. A candidate trains with tune's own settings (no evaluation, no reporting, no progress bar): these
    say what a user gets."""
    winner, default = result.winner, result.default
    runs = [
        (
            replace(by_key[winner["key"]], from_recipe=True, default=False),
            lambda output_dir: recipe_arguments(result.recipe, args, output_dir, parent_id),
        )
    ]
    if default is not None and default["status"] == "ok" and default["key"] != winner["key"]:
        values = recipe_values(default, *settings, args)
        runs.append(
            (
                replace(by_key[default["key"]], from_recipe=True),
                lambda output_dir: recipe_arguments(values, args, output_dir, parent_id),
            )
        )
    return runs


def repeat_rounds(rows: list[dict], ordered: list[Candidate], args: TuneArguments) -> list[list[Candidate]]:
    """The rounds after the first: the fastest --repeat_top candidates of the first round and textsql train's default
    settings (the winner is compared with them), each round in the reverse order of the one before, so that a
    candidate's place in the order (the machine's load then, what ran just before) does not decide the ranking."""
    if not args.repeat_top or args.repeats < 2:
        return []
    first = summarize([r for r in rows if r["repeat"] == 0 and r["key"] in {c.key for c in ordered}])
    ok = [e for e in first if e["status"] == "ok"]  # fastest first
    chosen = {e["key"] for e in ok[: args.repeat_top]} | {e["key"] for e in ok if e["default"]}
    contenders = [c for c in ordered if c.key in chosen]
    return [contenders[::-1] if round_ % 2 else contenders for round_ in range(1, args.repeats)]


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


def _refused_here(
    candidates: list[Candidate], accelerator: str, devices: NodeDevices
) -> tuple[list[Candidate], list[dict]]:
    """Candidates that cannot run on these devices (FSDP on the CPU), recorded with textsql's reason instead of run."""
    kept, refused = [], []
    for candidate in candidates:
        if is_fsdp(candidate.strategy):
            try:
                check_fsdp_devices({"strategy": "fsdp", "label": candidate.strategy}, accelerator, devices)
            except TextsqlError as error:
                refused.append(result_row(candidate, "refused", error=str(error)))
                continue
        kept.append(candidate)
    return kept, refused


def describe_row(row: dict) -> str:
    if row["status"] == "ok":
        peak = row.get("peak_memory_bytes")
        predicted = f", predicted {row['predicted_gpu_gb']:.2f} GB" if row.get("predicted_gpu_gb") is not None else ""
        return (
            f"{row['samples_per_second']:.1f} samples/s, {row['seconds_per_step'] * 1000:.0f} ms/step, peak "
            f"{(peak or 0) / GIB:.2f} GB {row.get('memory_kind', '')}{predicted}"
        )
    return f"{row['status'].upper()}: {(row.get('error') or '').splitlines()[-1] if row.get('error') else ''}"


# ---------------------------------------------------------------------------------------------------------------------
# Output: the table, the plot, the recipe
# ---------------------------------------------------------------------------------------------------------------------


def format_table(result: TuneResult) -> str:
    """The candidates as Markdown, fastest first: the median samples/s and the min-max of its measurements, the
    planner's prediction beside what happened, then the winner and, when the machine was busy, a note saying so."""
    lines = [
        "| candidate | strategy | adapter | micro-batch | accumulation | samples/s (median) | min-max | vs default "
        "| runs | peak memory (GB) | predicted GPU (GB) | status |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    default_rate = (
        result.default.get("samples_per_second") if result.default and result.default["status"] == "ok" else None
    )
    winner_key = result.winner["key"] if result.winner else None
    for e in result.table + result.left_out:
        rate = e.get("samples_per_second")
        relative = f"{rate / default_rate:.2f}x" if rate and default_rate else ""
        peak = f"{e['peak_memory_bytes'] / GIB:.2f} {e['memory_kind']}" if e.get("peak_memory_bytes") else ""
        predicted = "" if e.get("predicted_gpu_gb") is None else f"{e['predicted_gpu_gb']:.2f}"
        status = (
            e["status"]
            if e["status"] == "ok"
            else f"{e['status']}: {(e.get('error') or '').splitlines()[-1][:90] if e.get('error') else ''}"
        )
        marks = (" **winner**" if e["key"] == winner_key else "") + (" (default)" if e.get("default") else "")
        spread = (
            f"{e['samples_per_second_min']:.1f}-{e['samples_per_second_max']:.1f} (±{e['spread'] / 2:.0%})"
            if e.get("measurements", 0) > 1
            else ""
        )
        lines.append(
            f"| {e['key']}{marks} | {e['strategy']} | {e.get('adapter') or '-'} | {e['micro_batch']} | "
            f"{e['accumulation']} | {'' if rate is None else f'{rate:.1f}'} | {spread} | {relative} | "
            f"{e.get('measurements', 0)} | {peak} | {predicted} | {status} |"
        )
    lines.append("")
    if result.winner is None:
        lines.append("No candidate trained: see the failures above and their logs.")
    else:
        speedup = result.speedup_over_default
        lines.append(
            f"winner: {result.winner['key']} ({result.winner['samples_per_second']:.1f} samples/s"
            + (f", {speedup:.2f}x textsql train's default settings" if speedup else "")
            + ")"
        )
    lines += confirmation_lines(result)
    busy = [e for e in result.table if e.get("cpu_cores") and e.get("load_average_max", 0) > e["cpu_cores"]]
    if busy:
        worst = max(busy, key=lambda e: e["load_average_max"])
        lines.append(
            f"note: the machine was busier than its {worst['cpu_cores']} cores while {len(busy)} candidate(s) trained "
            f"(load average up to {worst['load_average_max']:.1f}): other processes took CPU time from them, so "
            "their figures vary with that load; compare the min-max, or tune again on an idle machine (on a shared "
            "CPU machine, with OMP_NUM_THREADS=1: threads waiting for a busy core slow every step)."
        )
    return "\n".join(lines)


def confirmation_lines(result: TuneResult) -> list[str]:
    """What training the recipe as textsql train reads it gave, beside the candidates' figure: its samples/s in the
    timed steps and over the whole run, against the default settings trained the same way, or its failure."""
    if not result.confirmation:
        return []
    recipe = next((e for e in result.confirmation if not e["default"]), None)
    if recipe is None or recipe["status"] != "ok":
        error = ((recipe or {}).get("error") or "no measurement").splitlines()[-1]
        return [f"its recipe, trained as textsql train reads it: {(recipe or {}).get('status', 'not run')}: {error}"]
    runs = f"median of {recipe['measurements']}" if recipe["measurements"] > 1 else "one run"
    line = (
        f"its recipe, trained as textsql train reads it ({runs}): {recipe['samples_per_second']:.1f} samples/s in the "
        f"timed steps ({result.winner['samples_per_second']:.1f} as a candidate), "
        f"{recipe['run_samples_per_second']:.1f} over the whole training loop (set-up, warm-up and evaluation in it included)"
    )
    speedup, default = result.confirmed_speedup, result.confirmed(True)
    if speedup is None:
        return [line + (" — the default settings won: nothing to compare with" if result.winner["default"] else "")]
    whole = f"{speedup['whole_run']:.2f}x" if speedup["whole_run"] else "-"
    return [
        line,
        f"textsql train's default settings the same way: {default['samples_per_second']:.1f} and "
        f"{default['run_samples_per_second']:.1f} samples/s; the recipe is {speedup['timed_steps']:.2f}x the default "
        f"in the timed steps and {whole} over the whole loop (what a run of this length gains: set-up and "
        "evaluation do not speed up)",
    ]


def recipe_values(winner: dict, model, data, training, args: TuneArguments) -> dict:
    """The winner as `textsql train` arguments: every setting the user gave that differs from textsql's defaults, the
    strategy, the micro-batch and the accumulation."""
    given = arguments_dict(model, data, training)
    defaults = arguments_dict(*parse_arguments([]))
    values = {"model_id": model.model_id, "dataset_dir": data.dataset_dir}
    values |= {k: v for k, v in given.items() if v != defaults.get(k) and k not in ("model_id", "dataset_dir")}
    values |= {k: v for k, v in strategy_values(winner["strategy"]).items() if v is not None}
    values |= {
        "per_device_train_batch_size": winner["micro_batch"],
        "gradient_accumulation_steps": winner["accumulation"],
    }
    values |= ADAPTERS.get(winner.get("adapter") or "", {})
    for lever in winner.get("levers") or ():
        values |= LEVERS[lever]
    if args.num_gpus is not None:
        values["num_gpus"] = args.num_gpus
    return values


def write_recipe(path: Path, winner: dict, model, data, training, args: TuneArguments) -> Path:
    import yaml  # PyYAML comes with transformers

    values = recipe_values(winner, model, data, training, args)
    arguments_from_dict(values)  # the recipe must parse as `textsql train` reads it
    header = (
        f"# The fastest setting `textsql tune` measured ({winner['samples_per_second']:.1f} samples/s, global batch "
        f"of {args.global_batch_size}; table: {TUNE_TABLE_FILE}).\n"
        + (
            f"# Run: textsql train {path}\n"
            if args.nodes == 1
            else f"# Measured on {args.nodes} pods: run it on as many, through a started cluster of {args.nodes} pods "
            f"(textsql.cluster.Cluster(workers={args.nodes - 1}, ...).train(['{path}'])); the accumulation keeps the "
            "global batch at that number of ranks only.\n"
        )
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(header + yaml.safe_dump(values, sort_keys=False))
    return path


def plot_tune(result: TuneResult, path: Path) -> Path | None:
    """Samples/s and peak memory per measured candidate; None (and no file) without matplotlib (the notebooks extra)."""
    try:
        require_notebooks_extra("matplotlib", "The tune plot")
    except TextsqlError:
        return None
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    ok = [e for e in result.table if e["status"] == "ok"]
    if not ok:
        return None
    fig = Figure(figsize=(max(6, 0.7 * len(ok) + 2), 6.5))
    FigureCanvasAgg(fig)  # Agg without pyplot: no global backend switch
    speed, memory = fig.subplots(2, 1, sharex=True)
    names = [e["key"] for e in ok]
    colors = [
        "C1" if result.winner and e["key"] == result.winner["key"] else f"C{0 if not e.get('default') else 2}"
        for e in ok
    ]
    speed.bar(names, [e["samples_per_second"] for e in ok], color=colors)
    speed.set_ylabel("samples/s")
    winner = result.winner["key"] if result.winner else "-"
    speed.set_title(
        f"global batch {result.global_batch_size}: winner {winner} (orange), textsql's defaults (green)", fontsize=10
    )
    memory.bar(names, [e["peak_memory_bytes"] / GIB for e in ok], color=colors)
    memory.set_ylabel(f"peak memory (GB, {ok[0]['memory_kind']})")
    for label in memory.get_xticklabels():
        label.set_rotation(45)
        label.set_horizontalalignment("right")
    fig.tight_layout()
    fig.savefig(path)
    return path


def as_dict(result: TuneResult) -> dict:
    """The result as JSON-able data (`textsql tune --json`)."""
    return {
        "table": result.table,
        "winner": result.winner,
        "default": result.default,
        "left_out": result.left_out,
        "speedup_over_default": result.speedup_over_default,
        "tune_dir": str(result.tune_dir),
        "recipe": str(result.recipe) if result.recipe else None,
        "plot": str(result.plot) if result.plot else None,
        "measured_now": result.measured_now,
        "confirmation": result.confirmation,
        "confirmed_speedup": result.confirmed_speedup,
    }
