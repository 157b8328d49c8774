"""The training strategies textsql names: one row each (ZeRO stage or FSDP sharding, what is offloaded), in the order of
expected speed."""

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
# - zero3_nvme (ZeRO-Infinity): zero3_offload's layout with parameters and optimizer states swapped to an NVMe folder
#   (--nvme_path) through DeepSpeed's async I/O op: every step reads and writes the optimizer states on disk, so it
#   is the slowest, for a model that fits nowhere else. It needs a path, so tune leaves it out of its defaults.
# PyTorch FSDP2 (fully_shard) beside them, each after its DeepSpeed twin (the Accelerate comparison: SHARD_GRAD_OP ~
# ZeRO-2, FULL_SHARD ~ ZeRO-3), so that at equal cost the table prefers DeepSpeed, which textsql has run longest:
# - fsdp_shard_grad_op: parameters stay gathered from the forward to the backward pass (no second all-gather).
# - fsdp_hybrid_shard: sharded inside a pod, replicated across pods: all-gathers stay on the pod's fast links; on one pod
#   it is fsdp_full_shard.
# - fsdp_full_shard: every unit gathered for the forward and again for the backward, like ZeRO-3.
# - fsdp_full_shard_offload: parameters, gradients and Adam on the host; the step runs on the pod's CPU cores.
DEEPSPEED_STRATEGIES = ("none", "zero1", "zero2", "zero3", "zero2_offload", "zero3_offload", "zero3_nvme")
FSDP_STRATEGIES = ("fsdp_shard_grad_op", "fsdp_hybrid_shard", "fsdp_full_shard", "fsdp_full_shard_offload")
STRATEGIES = (
    "none",
    "zero1",
    "zero2",
    "fsdp_shard_grad_op",
    "zero3",
    "fsdp_hybrid_shard",
    "fsdp_full_shard",
    "zero2_offload",
    "fsdp_full_shard_offload",
    "zero3_offload",
    "zero3_nvme",
)
# The strategies whose offload goes to an NVMe folder instead of host memory (their STRATEGY_LAYOUT offload flags say
# what is offloaded): training needs --nvme_path and DeepSpeed's async I/O op (libaio).
NVME_STRATEGIES = ("zero3_nvme",)


# name -> (ZeRO stage, optimizer offloaded, parameters offloaded); stage 0 means no DeepSpeed
STRATEGY_LAYOUT = {
    "none": (0, False, False),
    "zero1": (1, False, False),
    "zero2": (2, False, False),
    "zero2_offload": (2, True, False),
    "zero3": (3, False, False),
    "zero3_offload": (3, True, True),
    "zero3_nvme": (3, True, True),
}

# name -> (reshard_after_forward, everything offloaded to the host, hybrid: sharded in a pod, replicated across pods)
FSDP_LAYOUT = {
    "fsdp_shard_grad_op": (False, False, False),
    "fsdp_hybrid_shard": (True, False, True),
    "fsdp_full_shard": (True, False, False),
    "fsdp_full_shard_offload": (True, True, False),
}


def is_fsdp(label: str) -> bool:
    """Whether a strategy label names PyTorch FSDP (its own memory model, its own launch checks)."""
    return label in FSDP_LAYOUT


def strategy_rank(label: str) -> int:
    """Where a strategy label sorts: the table's order (fastest first), others (zero1_offload, zero2_nvme, ...) after."""
    return STRATEGIES.index(label) if label in STRATEGIES else len(STRATEGIES)
