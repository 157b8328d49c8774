"""Ranks and the process group: this process's rank and world size, the variables DeepSpeed needs outside its launcher
(with torch's store bound to 127.0.0.1), a free port for a rendezvous, gathering numbers and short texts from every
rank (no pickle), DeepSpeed's shared-memory buffers given back, and leaving the group cleanly."""

from __future__ import annotations

import ipaddress
import os
import socket
import sys
import time
from pathlib import Path

from textsql.strategy.opbuilds import PROC

# Where POSIX shared memory lives on Linux: shm_open(name) is /dev/shm/<name>.
SHARED_MEMORY = Path("/dev/shm")
# A rank maps its buffer as it creates it: one no process maps after this long is a dead run's.
SHM_BUFFER_SETTLE_S = 60
TEXT_BYTES = 128  # a text gathered from every rank (a host or GPU name) is cut to this many UTF-8 bytes
_stores: list = []  # the stores this process hosts for its own process group: alive as long as the process


def world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def rank() -> int:
    return int(os.environ.get("RANK", "0"))


def nodes_in_launch() -> int:
    """The nodes of this launch: DeepSpeed's launcher says so in CROSS_SIZE (one node without it)."""
    return int(os.environ.get("CROSS_SIZE", "1"))


def ensure_distributed_env() -> None:
    """DeepSpeed outside its launcher needs the rank variables (else it looks for mpi4py). Every rank is this process:
    it hosts torch's store on 127.0.0.1, which the process group then shares (torch reuses a multi-tenant store of its
    port); torch's own would listen on every address for as long as the process lives."""
    if "RANK" in os.environ:
        return
    store = bound_store("127.0.0.1", int(os.environ.get("MASTER_PORT") or 0))
    _stores.append(store)
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(store.port))


def bound_store(address: str, port: int = 0, shared: bool = True):
    """A torch TCPStore server bound to `address` only, through a socket made here (torch's own binds every address,
    '::'). The store owns the socket from then on: it closes it when it is dropped. `shared`: torch's multi-tenant
    store, which any TCPStore this process opens as a server on the same port gets too (a process group's), and which
    then listens until the last of them is dropped; not shared, only this reference keeps it listening."""
    import torch.distributed as dist

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind((address, port))
    sock.listen(128)
    port = sock.getsockname()[1]
    return dist.TCPStore(address, port, is_master=True, multi_tenant=shared, master_listen_fd=sock.detach())


def close_stores(stores: list) -> list[int]:
    """Drop `stores` (their list the only holder) and return the ports of those still listening: none, unless a
    reference outlives the list. One in a reference cycle (a traceback's frames that hold it, kept in a cycle) is
    freed by a collection now, not whenever the garbage collector next runs."""
    import gc

    import psutil

    ports = {store.port for store in stores}
    stores.clear()

    def listening() -> list[int]:
        connections = psutil.Process().net_connections("tcp")
        return sorted({c.laddr.port for c in connections if c.status == psutil.CONN_LISTEN} & ports)

    if ports and listening():
        gc.collect()
    return listening() if ports else []


def gather_fields(values: dict) -> list[dict]:
    """Every rank's `values` (rank order): whole numbers and short texts (TEXT_BYTES), under the same names on every
    rank. One all_reduce of an integer tensor in which each rank fills its own row: nothing another rank sends is
    unpickled (all_gather_object would run whatever a peer, or anyone who joined the process group, sent)."""
    import torch
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [dict(values)]
    names = sorted(values)
    for name in names:
        if type(values[name]) not in (int, str):
            raise TypeError(f"gather_fields takes whole numbers and texts, not {name}={values[name]!r}")
    row = []
    for name in names:
        value = values[name]
        row += [value] if type(value) is int else list(value.encode()[:TEXT_BYTES].ljust(TEXT_BYTES, b"\0"))
    backend = str(dist.get_backend())
    device = f"cuda:{torch.cuda.current_device()}" if "nccl" in backend and "gloo" not in backend else "cpu"
    table = torch.zeros(dist.get_world_size(), len(row), dtype=torch.int64, device=device)
    table[dist.get_rank()] = torch.tensor(row, dtype=torch.int64)
    dist.all_reduce(table)
    gathered = []
    for numbers in table.tolist():
        fields, at = {}, 0
        for name in names:
            width = 1 if type(values[name]) is int else TEXT_BYTES
            chunk = numbers[at : at + width]
            fields[name] = (
                chunk[0] if width == 1 else bytes(b & 0xFF for b in chunk).rstrip(b"\0").decode(errors="replace")
            )
            at += width
        gathered.append(fields)
    return gathered


def deepspeed_shm_buffer() -> Path | None:
    """This rank's all-reduce buffer from DeepSpeed's CPU communication op, or None where DeepSpeed makes none.

    On the CPU, with every rank on one machine (its launcher's LOCAL_SIZE equal to WORLD_SIZE), `deepspeed_shm_comm`
    creates one ~69 MB POSIX shared-memory segment per rank, named by DeepSpeed's shm.cpp from the user id,
    MASTER_ADDR, MASTER_PORT and the rank."""
    local_size = os.environ.get("LOCAL_SIZE")
    if local_size is None or int(local_size) != world_size():
        return None
    address, port = os.environ.get("MASTER_ADDR", ""), os.environ.get("MASTER_PORT", "")
    return SHARED_MEMORY / f"deepspeed_allreduce_buffer_{os.getuid()}_{address}_{port}_{rank()}"


def release_deepspeed_shm_buffer() -> None:
    """Unlink this rank's DeepSpeed all-reduce buffer (deepspeed_shm_buffer) once every rank has mapped every other's.

    DeepSpeed never unlinks it, so each run launched by its launcher on the CPU left ~69 MB per rank in /dev/shm, which
    is memory, until a reboot: a day of test runs left 13 GB of a 24 GiB machine's memory there (sglang's CI met the
    same: SIGBUS once /dev/shm was full). Unlinked after a barrier, the mappings stay valid for
    the whole run and the memory goes back when the last rank exits, however it exits. Call it on every rank, right
    after deepspeed.init_distributed()."""
    buffer = deepspeed_shm_buffer()
    if buffer is None:
        return
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()  # each rank's init_distributed returned: each has opened every other rank's segment
    buffer.unlink(missing_ok=True)
    if rank() == 0:  # every rank is on this machine: one of them looks for what earlier runs left
        for orphan in orphaned_deepspeed_shm_buffers():  # before this release existed, or killed before it
            orphan.unlink(missing_ok=True)


def orphaned_deepspeed_shm_buffers(proc: Path = PROC) -> list[Path]:
    """This user's DeepSpeed all-reduce buffers in /dev/shm that no process maps (from /proc/<pid>/maps) and that are
    older than SHM_BUFFER_SETTLE_S: memory that dead runs left."""
    settled = time.time() - SHM_BUFFER_SETTLE_S
    candidates = []
    for buffer in SHARED_MEMORY.glob(f"deepspeed_allreduce_buffer_{os.getuid()}_*"):
        try:
            if buffer.stat().st_mtime < settled:
                candidates.append(buffer)
        except FileNotFoundError:
            continue
    for maps in proc.glob("[0-9]*/maps") if candidates else ():
        try:
            mapped = maps.read_text()
        except OSError:  # gone meanwhile, or another user's
            continue
        candidates = [buffer for buffer in candidates if str(buffer) not in mapped]
    return sorted(candidates)


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


def interface_of(address: str) -> str | None:
    """The network interface whose subnet holds `address` (lo for 127.x), for GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME."""
    import psutil

    try:
        target = ipaddress.ip_address(socket.gethostbyname(address))
    except OSError:
        return None
    for name, addresses in psutil.net_if_addrs().items():
        for a in addresses:
            if a.family == socket.AF_INET and a.netmask:
                if target in ipaddress.ip_network(f"{a.address}/{a.netmask}", strict=False):
                    return name
    return None
