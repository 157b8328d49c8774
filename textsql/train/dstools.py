"""DeepSpeed's tools one flag away: the flops profiler under every strategy, the monitors and the comms logger under
DeepSpeed (their flags: textsql.arguments.dstools); the profiler's figures of one step (for run_summary.json) and the comms
logger's summary."""

from __future__ import annotations

import contextlib
import io
import logging
import time
from pathlib import Path

from transformers import TrainerCallback

from textsql.paths import COMMS_SUMMARY_FILE, FLOPS_PROFILE_FILE
from textsql.sharedfiles import replace_file
from textsql.strategy.devices import peak_tflops

logger = logging.getLogger("textsql.train")

# A step's model FLOPs: the forward, and the backward at twice the forward (DeepSpeed's own rule, its "3 * fwd flops";
# activation checkpointing's recomputed forward is not counted, as MFU does not count it).
FORWARD_AND_BACKWARD = 3


# ---------------------------------------------------------------------------------------------------------------------
# The flops profiler
# ---------------------------------------------------------------------------------------------------------------------


def profiled_step(ds_config: dict | None, flops_profiler: int) -> int:
    """The optimizer step profiled (from 1), or 0: under DeepSpeed what its config says (--flops_profiler wrote it
    there, or the user's own block), else --flops_profiler."""
    if ds_config is None:
        return flops_profiler
    block = ds_config.get("flops_profiler") or {}
    return int(block.get("profile_step", 1)) + 1 if block.get("enabled") is True else 0


def running_ds_config(trainer) -> dict | None:
    """The DeepSpeed config as DeepSpeed runs it ("auto" filled), or None without DeepSpeed."""
    return trainer.accelerator.state.deepspeed_plugin.hf_ds_config.config if trainer.is_deepspeed_enabled else None


def flops_profiler_for(trainer) -> FlopsProfilerCallback | None:
    """A FlopsProfilerCallback added to the Trainer for the step asked for (--flops_profiler, or the DeepSpeed config's
    own flops_profiler block), or None when no step is profiled. The trainer calls it while it is built, and keeps it:
    without DeepSpeed it runs each forward of the step through the callback's `forward`."""
    ds_config = running_ds_config(trainer)
    step = profiled_step(ds_config, getattr(trainer.args, "flops_profiler", 0))
    if not step:
        return None
    callback = FlopsProfilerCallback(trainer, step, trainer.args.output_dir, deepspeed=ds_config is not None)
    callback.note = counting_note(ds_config)
    trainer.add_callback(callback)
    return callback


def timers_to_log_file(engine) -> None:
    """The profiler turns the engine's wall_clock_breakdown timers on, and they print three lines at every step of the
    run: into train.log (DeepSpeed's logger at INFO, which textsql keeps for the file), not the terminal."""
    from deepspeed.utils import logger as deepspeed_logger

    timers_log = engine.timers.log

    def log_to_file(*args, **kwargs):
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            timers_log(*args, **kwargs)
        for line in printed.getvalue().splitlines():
            deepspeed_logger.info(line)

    engine.timers.log = log_to_file


ZERO3_LINEAR_COUNTED_TWICE = (
    "ZeRO-3's memory-efficient linear layers replace F.linear with a function that calls matmul, and DeepSpeed "
    "0.19.8's profiler counts both: the linear layers' FLOPs and MACs are counted twice (set "
    "zero_optimization.memory_efficient_linear to false in the config for the true count, at some activation memory)"
)


def counting_note(ds_config: dict | None) -> str | None:
    """What to know about the profiler's count under this DeepSpeed config (None: nothing)."""
    zero = (ds_config or {}).get("zero_optimization") or {}
    if isinstance(zero, dict) and zero.get("stage") == 3 and zero.get("memory_efficient_linear", True) is not False:
        return ZERO3_LINEAR_COUNTED_TWICE
    return None


def read_profiler(profiler) -> dict:
    """DeepSpeed's own numbers from a FlopsProfiler holding a profiled forward (before its end_profile)."""
    return {
        "forward_flops": int(profiler.get_total_flops()),
        "forward_macs": int(profiler.get_total_macs()),
        "forward_latency_s": float(profiler.get_total_duration()),
        "parameters": int(profiler.get_total_params()),
    }


def _synchronize() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


class FlopsProfilerCallback(TrainerCallback):
    """Profiles one optimizer step on rank 0 and keeps DeepSpeed's figures of it.

    Under DeepSpeed the engine runs the profiler (its config block): this callback reads the figures from the engine's
    FlopsProfiler just before the engine prints its table. Otherwise (no DeepSpeed, DDP, FSDP) a FlopsProfiler on the
    model runs around each forward of the step (the supervised trainer's compute_loss calls `forward`), and the table is printed
    here. Either way the figures are those of the step's last micro-batch, and the step's wall time is measured here.
    """

    def __init__(self, trainer, step: int, output_dir: Path, deepspeed: bool):
        self.trainer, self.step, self.deepspeed = trainer, step, deepspeed
        self.output_file = Path(output_dir) / FLOPS_PROFILE_FILE
        self.profiler = None
        self.note: str | None = None  # counting_note: what to know about the count under this config
        self.measured: dict | None = None
        self.step_latency_s: float | None = None
        self.armed = False
        self._started: float | None = None
        self._printing_s = 0.0

    def on_train_begin(self, args, state, control, **kwargs):
        if not state.is_world_process_zero:
            return
        if self.deepspeed:
            profiler = getattr(self.trainer.model_wrapped, "flops_profiler", None)
            if profiler is None:
                logger.warning("The DeepSpeed engine has no flops profiler: its config block is not enabled.")
                return
            from deepspeed.utils.timer import FORWARD_GLOBAL_TIMER  # here: DeepSpeed picks its accelerator on import

            engine, print_model_profile = self.trainer.model_wrapped, profiler.print_model_profile

            def read_then_print(*print_args, **print_kwargs):
                self.measured = read_profiler(profiler)
                # The engine starts the profiler inside the model's forward pre-hooks, too late for the model's own
                # timing hook (its latency reads as time since 1970): the forward latency is the engine's timer's, as
                # the table prints it (the profiler turns DeepSpeed's wall_clock_breakdown timers on).
                self.measured["forward_latency_s"] = engine.timers(FORWARD_GLOBAL_TIMER).elapsed(reset=False) / 1000
                began = time.perf_counter()
                print_model_profile(*print_args, **print_kwargs)
                self._printing_s += time.perf_counter() - began  # not part of the step's work

            profiler.print_model_profile = read_then_print
            timers_to_log_file(engine)
        else:
            from deepspeed.profiling.flops_profiler import FlopsProfiler

            self.profiler = FlopsProfiler(self.trainer.model)

    def on_step_begin(self, args, state, control, **kwargs):
        if state.is_world_process_zero and state.global_step == self.step - 1:
            _synchronize()
            self._printing_s = 0.0
            self._started = time.perf_counter()
            self.armed = self.profiler is not None

    def on_step_end(self, args, state, control, **kwargs):
        if self._started is None or state.global_step != self.step:
            return
        _synchronize()
        self.step_latency_s = time.perf_counter() - self._started - self._printing_s
        self._started, self.armed = None, False
        if self.profiler is not None and self.profiler.started:
            self.measured = read_profiler(self.profiler)
            self.profiler.print_model_profile(
                profile_step=self.step, module_depth=-1, top_modules=1, detailed=True, output_file=str(self.output_file)
            )
            self.profiler.end_profile()

    @contextlib.contextmanager
    def forward(self):
        """Around one micro-batch's forward: profiled on the armed step (no DeepSpeed), untouched otherwise."""
        if not self.armed:
            yield
            return
        self.profiler.start_profile()  # resets: the figures are those of the step's last micro-batch, as DeepSpeed's
        try:
            yield
        finally:
            self.profiler.stop_profile()

    def figures(self, **run) -> dict:
        """flops_figures of what was measured; `run` as flops_figures takes it."""
        figures = flops_figures(self.measured, self.step, self.step_latency_s, deepspeed=self.deepspeed, **run)
        return dict(figures, note=self.note) if self.note and figures["profiled"] else figures


def flops_figures(
    measured: dict | None,
    step: int,
    step_latency_s: float | None,
    *,
    deepspeed: bool,
    accumulation: int,
    micro_batch: int,
    precision: str,
    tf32: bool,
    gpu: str | None,
    last_step: int,
) -> dict:
    """run_summary.json's flops_profile: the profiled step's figures per GPU, its TFLOPS and MFU (or why none)."""
    figures = {
        "step": step,
        "profiled": measured is not None and bool(step_latency_s),
        "file": FLOPS_PROFILE_FILE,
        "by": "the DeepSpeed engine (its flops_profiler config block)"
        if deepspeed
        else "deepspeed.profiling.flops_profiler.FlopsProfiler on the model",
    }
    if not figures["profiled"]:
        figures["reason"] = (
            f"step {step} was not run (the run ended at step {last_step}, or resumed past it)"
            if last_step < step or measured is None
            else "the step's figures were not read"
        )
        return figures
    per_step = FORWARD_AND_BACKWARD * accumulation
    flops = measured["forward_flops"] * per_step
    tflops = flops / step_latency_s / 1e12
    figures.update(
        measured,
        micro_batch=micro_batch,
        gradient_accumulation_steps=accumulation,
        flops_per_step=flops,
        macs_per_step=measured["forward_macs"] * per_step,
        step_latency_s=step_latency_s,
        tflops_per_gpu=tflops,
    )
    peak = peak_tflops(gpu) if gpu else None
    usable, kind = peak.for_precision(precision, tf32) if peak else (None, None)
    if usable:
        figures.update(peak_tflops=usable, peak=f"{peak.gpu} {kind} ({peak.source})", mfu=tflops / usable)
    else:
        figures.update(peak_tflops=None, peak=f"no peak known ({gpu or 'CPU'})", mfu=None)
    return figures


# ---------------------------------------------------------------------------------------------------------------------
# The comms logger
# ---------------------------------------------------------------------------------------------------------------------


def comms_logger_enabled(ds_config: dict | None) -> bool:
    return bool(ds_config and (ds_config.get("comms_logger") or {}).get("enabled") is True)


def own_latencies_in_comms_logger() -> None:
    """DeepSpeed 0.19.8's comms logger records each operation's latency as the running total of that operation's timer
    (timed_op reads elapsed(reset=False)), so every later call looks slower and the table's latencies and bandwidths
    grow with the run. Where DeepSpeed still does so, record each operation's own time: the difference from the
    previous total of the same name. Call before the first collective (the DeepSpeed engine's set-up runs some)."""
    import inspect

    from deepspeed.comm import comm

    comms = comm.comms_logger
    if getattr(comms, "textsql_own_latencies", False) or "elapsed(reset=False)" not in inspect.getsource(comm.timed_op):
        return
    append, totals = comms.append, {}

    def append_own_latency(raw_name, record_name, latency, msg_size):
        own = latency - totals.get(record_name, 0.0)
        totals[record_name] = latency
        append(raw_name, record_name, own, msg_size)

    comms.append, comms.textsql_own_latencies = append_own_latency, True


def write_comms_summary(output_dir: Path, is_rank_zero: bool) -> dict:
    """deepspeed.comm.log_summary() on every rank (it synchronizes them): its table into COMMS_SUMMARY_FILE (rank 0),
    and per operation the count, total latency and bytes, for run_summary.json."""
    import deepspeed.comm as dist

    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        stats = dist.log_summary(return_dict=True) or {}
    if is_rank_zero:
        replace_file(Path(output_dir) / COMMS_SUMMARY_FILE, printed.getvalue())
    totals = {}
    for operation, sizes in (stats.get("summary") or {}).items():
        totals[operation] = {
            "count": sum(entry["count"] for entry in sizes.values()),
            "total_latency_ms": sum(entry["total_latency_ms"] for entry in sizes.values()),
            "bytes": sum(entry["count"] * entry["msg_size_bytes"] for entry in sizes.values()),
        }
    return {"file": COMMS_SUMMARY_FILE, "operations": totals}
