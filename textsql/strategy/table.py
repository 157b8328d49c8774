"""The training strategies textsql names: one row each (ZeRO stage, what is offloaded), in the order of expected speed."""

from __future__ import annotations

# The training strategies textsql names, one table for the planner, the report and the labels of describe_strategy.
# Fastest first; the recommendation is the first that fits. Why this order:
# - none: plain PyTorch (DDP on several GPUs); its gradient all-reduce overlaps the backward pass.
# - zero1: the same communication volume as DDP (reduce-scatter + all-gather = one all-reduce) plus a little
#   bookkeeping; it only saves optimizer-state memory.
# - zero2: the same volume again, but gradients are reduced bucket by bucket into partitions during the backward
#   pass, with more synchronisation than ZeRO-1.
# - zero3: 1.5x the communication (parameters are all-gathered for the forward and again for the backward), but all
#   of it GPU to GPU and overlapped by prefetching.
# - zero2_offload: every step copies all gradients to the host and runs Adam on the pod's CPU cores (DeepSpeedCPUAdam),
#   then copies the parameters back over PCIe. CML pods get a handful of CPU cores, so that step is the bottleneck.
#   (Hugging Face's DeepSpeed guide lists stage 2 + offload ahead of stage 3; on GPU-rich, CPU-poor pods we put
#   GPU-only ZeRO-3 first.)
# - zero3_offload: all of zero2_offload's host traffic plus the parameters themselves streamed from host memory.
STRATEGIES = ("none", "zero1", "zero2", "zero3", "zero2_offload", "zero3_offload")


# name -> (ZeRO stage, optimizer offloaded, parameters offloaded); stage 0 means no DeepSpeed
STRATEGY_LAYOUT = {
    "none": (0, False, False),
    "zero1": (1, False, False),
    "zero2": (2, False, False),
    "zero2_offload": (2, True, False),
    "zero3": (3, False, False),
    "zero3_offload": (3, True, True),
}


def strategy_rank(label: str) -> int:
    """Where a strategy label sorts: the table's order (fastest first), others (zero1_offload, zero3_nvme, ...) after."""
    return STRATEGIES.index(label) if label in STRATEGIES else len(STRATEGIES)
