"""`textsql tune`'s measuring: one candidate's warm-up and timed steps here or on a cluster, or why it failed."""

from __future__ import annotations

import json
import os
import re
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

from textsql.arguments.training import arguments_from_dict, parse_arguments
from textsql.arguments.tune import TuneArguments
from textsql.errors import TextsqlError
from textsql.paths import (
    TUNE_LOGS_DIR,
    TUNE_RESULTS_FILE,
    TUNE_RUNS_DIR,
)
from textsql.planner.shape import GIB
from textsql.strategy.devices import NodeDevices
from textsql.strategy.fsdpconfig import check_fsdp_devices
from textsql.strategy.table import is_fsdp
from textsql.tracking import candidate_values
from textsql.train.local_launch import TrainingTimedOut, run_training
from textsql.tune.space import Candidate, candidate_arguments, result_row
from textsql.tune.store import CONFIRM_PREFIX, RETRIED, append_result, fingerprint, read_results

RANK_QUOTE = re.compile(r"^(rank \d+ )?\| ")  # how textsql.cluster.launch.failure_message quotes a rank's output


OUT_OF_MEMORY_MARKERS = ("out of memory", "outofmemoryerror", "cuda error: out of memory", "cannot allocate memory")


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


def describe_row(row: dict) -> str:
    if row["status"] == "ok":
        peak = row.get("peak_memory_bytes")
        predicted = f", predicted {row['predicted_gpu_gb']:.2f} GB" if row.get("predicted_gpu_gb") is not None else ""
        return (
            f"{row['samples_per_second']:.1f} samples/s, {row['seconds_per_step'] * 1000:.0f} ms/step, peak "
            f"{(peak or 0) / GIB:.2f} GB {row.get('memory_kind', '')}{predicted}"
        )
    return f"{row['status'].upper()}: {(row.get('error') or '').splitlines()[-1] if row.get('error') else ''}"


def refused_here(
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


@dataclass
class Measurements:
    """The tune's measurements as they accumulate: the results file's rows (kept ones are not measured again), the
    micro-batches that ran out of memory under each strategy (larger ones are then skipped), how many ran now."""

    args: TuneArguments
    base: dict
    world: int
    train: object  # local_trainer, or a cluster's (cluster_trainer)
    echo: object
    tune_dir: Path
    results_path: Path
    fingerprint: str
    rows: list
    done: set
    out_of_memory: dict = field(default_factory=dict)  # (strategy, adapter) -> the smallest that ran out of memory
    measured_now: int = 0
    runs_base: dict | None = None  # the base, with the tune's MLflow run as every candidate's parent

    @classmethod
    def open(cls, args: TuneArguments, base: dict, world: int, cluster, echo) -> Measurements:
        """The tune folder's results for these settings (their fingerprint), and the trainer: here or a cluster's."""
        tune_dir = Path(args.tune_dir)
        results_path = tune_dir / TUNE_RESULTS_FILE
        print_ = fingerprint(args, base, world)
        rows = read_results(results_path, print_)
        retried = RETRIED if args.retry_failed else ()
        done = {(r["key"], r["repeat"]) for r in rows if r["status"] not in retried}
        train = cluster_trainer(cluster) if cluster is not None else local_trainer
        return cls(args, base, world, train, echo, tune_dir, results_path, print_, rows, done)

    def run(self, candidate: Candidate, repeat: int, position: str, arguments_for=None) -> None:
        """Measure one candidate (`arguments_for`: its arguments when it is not a candidate's own), unless kept."""
        args, echo = self.args, self.echo
        if (candidate.key, repeat) in self.done:
            echo(f"{position} {candidate.key}: measured before, kept ({self.results_path.name})")
            return
        family = (candidate.strategy, candidate.adapter)
        if family in self.out_of_memory and candidate.micro_batch > self.out_of_memory[family]:
            row = result_row(
                candidate,
                "skipped",
                repeat=repeat,
                error=f"micro-batch {self.out_of_memory[family]} ran out of memory under this strategy",
            )
        else:
            echo(f"{position} {candidate.key}: training {args.warmup_steps} + {args.timed_steps} steps ...")
            runs_base = self.runs_base or self.base
            row = measure(
                candidate,
                args,
                self.world,
                repeat,
                self.train,
                arguments_for or (lambda output_dir: candidate_arguments(runs_base, candidate, args, output_dir)),
            )
            self.measured_now += 1
        row["fingerprint"] = self.fingerprint
        append_result(self.results_path, row)
        self.rows.append(row)
        self.done.add((candidate.key, repeat))
        if row["status"] == "out of memory":
            smallest = min(candidate.micro_batch, self.out_of_memory.get(family, candidate.micro_batch))
            self.out_of_memory[family] = smallest
        echo(f"{position} {candidate.key}: {describe_row(row)}")
