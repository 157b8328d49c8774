"""The Trainer callbacks textsql adds, as module-level classes: imported only when a run trains (transformers loads)."""

from __future__ import annotations

from transformers import TrainerCallback
from transformers.integrations.integration_utils import MLflowCallback
from transformers.trainer_callback import ProgressCallback

from textsql.tracking import Tracking
from textsql.train.watch import advance, begin_training, current, enter


class TextsqlMLflowCallback(MLflowCallback):
    """MLflowCallback's logging of every log line as metrics (rank 0), on the run `tracking` starts; the run ends
    in Tracking.finish, after the final evaluation and the run summary."""

    def __init__(self, tracking: Tracking):
        super().__init__()
        self.tracking = tracking

    def setup(self, args, state, model):
        self._log_artifacts, self._async_log = False, True
        if state.is_world_process_zero:
            self.tracking.start()
        self._initialized = True

    def on_train_end(self, args, state, control, **kwargs):
        pass


def attach(trainer, tracking: Tracking | None) -> None:
    """transformers' MLflow callback (the curves, rank 0) in the Trainer on textsql's run, in place of the one
    --report_to mlflow gave it (which would log every field and end the run before the final evaluation)."""
    trainer.remove_callback(MLflowCallback)
    if tracking is not None:
        trainer.add_callback(TextsqlMLflowCallback(tracking))


class PhaseCallback(TrainerCallback):
    """Announces the training loop's phases to the watch (textsql.train.watch): each step and micro-step, an evaluation
    (from the step that asks for it, each batch progress) and a checkpoint save (from the step that asks for it, until
    the Trainer's on_save); nothing is watched after on_train_end until textsql.train announces the next phase."""

    def on_train_begin(self, args, state, control, **kwargs):
        begin_training()

    def on_step_begin(self, args, state, control, **kwargs):
        advance()

    def on_substep_end(self, args, state, control, **kwargs):
        advance()

    def on_step_end(self, args, state, control, **kwargs):
        advance(step_done=True)
        self._next(control, evaluation=control.should_evaluate, saving=control.should_save)

    on_epoch_end = on_step_end  # the Trainer sets what comes next at an epoch's end too (epoch strategies)

    def on_prediction_step(self, args, state, control, **kwargs):
        advance()

    def on_evaluate(self, args, state, control, **kwargs):
        if current()["name"] == "evaluation":  # not the final one: textsql.train announces what follows it
            # "best" decides to save only after the evaluation: its save is taken for one in case it comes
            best = str(getattr(args, "save_strategy", "")).endswith("best")
            self._next(control, evaluation=False, saving=control.should_save or best)

    def on_save(self, args, state, control, **kwargs):
        if current()["name"] == "checkpoint save":
            enter("step")

    def on_train_end(self, args, state, control, **kwargs):
        enter("after training")

    def _next(self, control, evaluation: bool, saving: bool):
        name = "evaluation" if evaluation else "checkpoint save" if saving else "step"
        if name != current()["name"]:
            enter(name)


class TrainingProgress(ProgressCallback):
    """The Trainer's progress callback without its nested evaluation bar (which fills a log or notebook with escape
    codes)."""

    def on_prediction_step(self, args, state, control, eval_dataloader=None, **kwargs):
        pass


class RankRecorder(TrainerCallback):
    """A rank's own record of its training as the Trainer logs it (textsql.cluster.rank's summary): every logged loss,
    the last train and eval losses, the global step and the world size. One instance may serve every Trainer of a
    process (transformers' DEFAULT_CALLBACKS), which then all add to the same record."""

    def __init__(self):
        self.seen: dict = {"logged_losses": [], "train_loss": None, "eval_loss": None}

    def on_log(self, args, state, control, logs=None, **kwargs):
        logs = logs or {}
        self.seen["logged_losses"] += [logs["loss"]] if "loss" in logs else []
        self.seen.update({k: logs[k] for k in ("train_loss", "eval_loss") if k in logs})
        self.seen.update(global_step=state.global_step, world_size=args.world_size)
