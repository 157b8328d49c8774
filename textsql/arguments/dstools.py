"""DeepSpeed's tools' flags (--flops_profiler, --ds_monitor, --comms_logger): their defaults and checks."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field

from textsql.errors import TextsqlError
from textsql.paths import COMMS_SUMMARY_FILE, DS_MONITOR_DIR, FLOPS_PROFILE_FILE, TENSORBOARD_DIR
from textsql.strategy.dsconfig import DS_MONITORS


@dataclass
class DsToolsArguments:
    """DeepSpeed's tools, one flag each: the flops profiler (every strategy), its monitors and comms logger (DeepSpeed)."""

    flops_profiler: int = field(
        default=0,
        metadata={
            "help": "Profile optimizer step N (counted from 1, as the log counts) with DeepSpeed's flops profiler, under "
            "every strategy: FLOPs and MACs per step, latency, TFLOPS per GPU and MFU (against the GPU's peak) land in "
            f"run_summary.json and `textsql report`; the per-module table in {FLOPS_PROFILE_FILE} in the run folder. "
            "0 (the default) turns it off. Pick a step after the first, which pays one-time costs."
        },
    )
    ds_monitor: str = field(
        default="",
        metadata={
            "help": "DeepSpeed's monitors, comma-separated: csv, tensorboard, wandb. They record what the DeepSpeed "
            f"engine measures (learning rate, and forward/backward/step times) under {DS_MONITOR_DIR}/csv/ and "
            f"{DS_MONITOR_DIR}/tensorboard/ in the run folder; wandb sends them to W&B (needs `pip install wandb`). "
            "Needs --deepspeed: without DeepSpeed the Trainer's own TensorBoard (tensorboard/ in the run folder) "
            "has the loss, learning rate and gradient norm, and --report_to wandb sends them to W&B."
        },
    )
    comms_logger: bool = field(
        default=False,
        metadata={
            "help": "DeepSpeed's comms logger: every collective DeepSpeed runs is timed, and its summary (operation, "
            f"message size, count, latency, bandwidth) is written to {COMMS_SUMMARY_FILE} in the run folder at the "
            "end of training, with the totals in run_summary.json. Needs --deepspeed (DDP and FSDP do not go "
            "through DeepSpeed's communication layer)."
        },
    )

    @property
    def ds_monitors(self) -> tuple[str, ...]:
        """--ds_monitor's names, in the order given."""
        return tuple(name.strip() for name in (self.ds_monitor or "").split(",") if name.strip())

    def check_ds_tools(self, deepspeed) -> None:
        """Refuse, before anything starts, what the tools cannot do with these arguments; `deepspeed` is --deepspeed."""
        if isinstance(self.flops_profiler, bool) or not isinstance(self.flops_profiler, int) or self.flops_profiler < 0:
            raise TextsqlError(
                f"--flops_profiler is the optimizer step to profile (counted from 1; e.g. 3), or 0 for none, not "
                f"{self.flops_profiler!r}."
            )
        unknown = [name for name in self.ds_monitors if name not in DS_MONITORS]
        if unknown:
            raise TextsqlError(
                f"--ds_monitor names DeepSpeed's monitors, comma-separated ({', '.join(DS_MONITORS)}); "
                f"{', '.join(repr(n) for n in unknown)} is not one of them."
            )
        if self.ds_monitors and not deepspeed:
            raise TextsqlError(
                "--ds_monitor turns on DeepSpeed's monitors, which write what the DeepSpeed engine measures, and this "
                "run has no DeepSpeed. Without DeepSpeed the Trainer's own TensorBoard already logs the loss, learning "
                f"rate and gradient norm to {TENSORBOARD_DIR}/ in the run folder (`textsql tensorboard`), and "
                "--report_to wandb sends them to W&B. Add --deepspeed (zero1, zero2, ...) or leave --ds_monitor out."
            )
        if "wandb" in self.ds_monitors and importlib.util.find_spec("wandb") is None:
            raise TextsqlError(
                "--ds_monitor wandb needs the wandb package, which is not installed in this environment (on every "
                "node). Install it (`pip install wandb`) and log in (`wandb login`, or WANDB_API_KEY; WANDB_MODE=offline "
                "keeps the run local), or leave wandb out of --ds_monitor (csv and tensorboard write into the run folder)."
            )
        if self.comms_logger and not deepspeed:
            raise TextsqlError(
                "--comms_logger times the collectives of DeepSpeed's communication layer, and this run has no "
                "DeepSpeed: DDP and FSDP call torch.distributed directly, which the comms logger does not see. Add "
                "--deepspeed (zero1, zero2, ...) or leave --comms_logger out."
            )
