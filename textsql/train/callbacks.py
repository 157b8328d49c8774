"""The Trainer callbacks textsql adds, as module-level classes: imported only when a run trains (transformers loads)."""

from __future__ import annotations

from transformers.integrations.integration_utils import MLflowCallback

from textsql.tracking import Tracking


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
