"""How long a training takes on this machine, told once from the time its own first steps took: the steps left and
the evaluations' forward passes at the measured step time (a constant scaled by the load once said 10 minutes where a
run took over 100)."""

from __future__ import annotations

import logging
import math
import os
import time

from transformers import TrainerCallback

logger = logging.getLogger("textsql.train")


def training_estimate_s(
    step_s: float, steps: int, evaluations: int, eval_examples: int, train_batch: int, eval_batch: int
) -> float:
    """Seconds a whole training takes at `step_s` a training step: its steps, and its evaluations' forward passes over
    `eval_examples` in batches of `eval_batch`, an example's forward a third of its training step (a step is a forward,
    a backward about twice as long, and the optimizer's small share)."""
    per_evaluation = math.ceil(eval_examples / eval_batch) * eval_batch / train_batch * step_s / 3
    return steps * step_s + evaluations * per_evaluation


def describe_estimate(seconds: float, step_s: float, first: int, last: int, load: float, cores: int) -> str:
    """The estimate as a run prints it, with what it was measured on."""
    length = f"{seconds:.0f} s" if seconds < 90 else f"{seconds / 60:.0f} minutes"
    ends = time.strftime("%H:%M", time.localtime(time.time() + seconds))
    return (
        f"timed here: {step_s * 1000:.0f} ms a step over steps {first}-{last} (load {load:.1f} on {cores} cores), so "
        f"the training takes about {length} in all, evaluations included (until about {ends})."
    )


class TrainingTimer(TrainerCallback):
    """Times the training's own steps after a few warm-up ones and says once (`echo`: rank 0's log by default, the
    demo's own lines) how long the whole training takes on this machine, at this load (training_estimate_s);
    `estimate_s` keeps it. A few seconds of steps, not a constant: the machine, its load and the model decide. Every
    run has one (textsql.train.run adds it unless the caller's callbacks hold one)."""

    # The steps after the first 50 (which hold the run's longest batch: length-grouped sampling puts it first), then 50
    # more: about one of the sampler's megabatches (up to 50 batches, each sorted longest first), its average length.
    def __init__(self, echo=None, eval_examples: int = 0, warmup_steps: int = 50, timed_steps: int = 50):
        self.echo, self.eval_examples = echo or logger.info, eval_examples
        self.warmup_steps, self.timed_steps = warmup_steps, timed_steps
        self.started = None
        self.estimate_s = None

    def window(self, max_steps: int) -> tuple[int, int]:
        """(warm-up steps, timed steps): fewer in a short run, so it is timed before it ends."""
        return min(self.warmup_steps, max_steps // 10), max(1, min(self.timed_steps, max_steps // 5))

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step == self.window(state.max_steps)[0]:
            self.started = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        warmup, timed = self.window(state.max_steps)
        if state.global_step == warmup + timed and self.started is not None:
            step_s = (time.perf_counter() - self.started) / timed
            evaluations = math.ceil(state.num_train_epochs) if args.eval_strategy == "epoch" else 0
            if args.eval_strategy == "steps":
                evaluations = state.max_steps // state.eval_steps
            self.estimate_s = training_estimate_s(
                step_s,
                state.max_steps,
                evaluations,
                self.eval_examples,
                args.per_device_train_batch_size,
                args.per_device_eval_batch_size,
            )
            cores, load = os.cpu_count() or 1, os.getloadavg()[0]
            self.echo(describe_estimate(self.estimate_s, step_s, warmup + 1, warmup + timed, load, cores))
