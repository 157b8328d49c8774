"""Ranks and the process group: this process's rank and world size, the variables DeepSpeed needs outside its launcher,
a free port for a rendezvous, gathering a value from every rank, and leaving the group cleanly."""

from __future__ import annotations

import os
import socket
import sys


def world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def rank() -> int:
    return int(os.environ.get("RANK", "0"))


def nodes_in_launch() -> int:
    """The nodes of this launch: DeepSpeed's launcher says so in CROSS_SIZE (one node without it)."""
    return int(os.environ.get("CROSS_SIZE", "1"))


def ensure_distributed_env() -> None:
    """DeepSpeed outside its launcher needs the rank variables (else it looks for mpi4py)."""
    if "RANK" in os.environ:
        return
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))


def gather_to_all(value) -> list:
    """Every rank's value (rank order) when running distributed, else just this one."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [value]
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, value)
    return gathered


def end_distributed(succeeded: bool) -> None:
    """Leave the process group before the interpreter exits, as torch asks of every program: otherwise gloo's or NCCL's
    threads are torn down at exit, which can abort a rank that has finished ("terminate called without an active
    exception"). After a failure the other ranks may never arrive, so there is no barrier then."""
    if "torch" not in sys.modules:  # --help, a bad argument: nothing was started
        return
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return
    if succeeded:
        dist.barrier()
    dist.destroy_process_group()


def free_port(address: str = "127.0.0.1") -> int:
    """A TCP port free on `address` now (the OS picks it): for a rendezvous, a control server, a test's server."""
    with socket.socket() as s:
        s.bind((address, 0))
        return s.getsockname()[1]
