"""Where a run trains and in what precision (--accelerator, --num_gpus, --precision, --force_fp16): the flags, their
checks; a mixin of textsql train's arguments that tune shares (strategy.devices.resolve_run_devices decides them)."""

from __future__ import annotations

from dataclasses import dataclass, field

from textsql.errors import TextsqlError
from textsql.strategy.devices import DEVICE_CHOICES, PRECISIONS


@dataclass
class DeviceArguments:
    """The device, the ranks on a pod and the precision a run asks for."""

    precision: str = field(
        default="auto",
        metadata={
            "help": "auto (bf16 where every GPU has it natively: compute capability 8.0+, with TF32 for the rest; fp32 "
            "on older GPUs and the CPU), bf16, fp32 (true fp32 matmuls, no TF32) or fp16. The Trainer's --bf16/--fp16 "
            "flags mean the same."
        },
    )
    force_fp16: bool = field(
        default=False, metadata={"help": "Allow fp16 on T5 anyway (it overflows to NaN on t5-large)."}
    )
    # Not `device`: that is the Trainer's property for the torch device it sets up.
    accelerator: str = field(
        default="auto",
        metadata={
            "help": "auto (the GPUs when there are any), cuda (stop with an error when this process sees no GPU, "
            "instead of training on the CPU) or cpu."
        },
    )
    num_gpus: int | None = field(
        default=None,
        metadata={
            "help": "Ranks on this pod when `textsql train` is started directly: one per visible GPU by default "
            "(started through the deepspeed launcher), 1 to train on one GPU. Ignored under a launcher."
        },
    )

    def check_devices(self):
        """The flags' own checks (the devices they meet are resolve_run_devices' to check)."""
        if self.precision not in PRECISIONS:
            raise TextsqlError(f"--precision must be one of {', '.join(PRECISIONS)}, not '{self.precision}'.")
        if self.accelerator not in DEVICE_CHOICES:
            raise TextsqlError(f"--accelerator must be one of {', '.join(DEVICE_CHOICES)}, not '{self.accelerator}'.")
        if self.num_gpus is not None and self.num_gpus < 1:
            raise TextsqlError(
                f"--num_gpus must be at least 1 (or left out for one rank per visible GPU), not {self.num_gpus}."
            )
