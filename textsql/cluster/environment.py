"""What reaches the ranks of a multi-node launch from the session's environment: an allowlist, never a secret."""

from __future__ import annotations

import fcntl
import os
import re
import socket
import struct
import sys
import tempfile
from pathlib import Path

# Variables a user sets to tune or debug a run; they reach every rank on every node.
FORWARDED = frozenset({
    "PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF", "TORCH_DISTRIBUTED_DEBUG", "TORCH_SHOW_CPP_STACKTRACES", "TORCH_CPP_LOG_LEVEL",
    "TORCH_EXTENSIONS_DIR", "CUDA_LAUNCH_BLOCKING", "CUDA_HOME", "CUDA_DEVICE_ORDER", "LD_LIBRARY_PATH", "VIRTUAL_ENV",
    "PYTHONPATH", "PYTHONHASHSEED", "PYTHONWARNINGS", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "TOKENIZERS_PARALLELISM",
    "TRANSFORMERS_OFFLINE", "TRANSFORMERS_VERBOSITY", "TRANSFORMERS_CACHE",
})
FORWARDED_PREFIXES = ("TORCH_NCCL_", "NCCL_", "GLOO_", "DS_", "HF_", "TEXTSQL_")
# What a node's own login environment contributes to the processes the node agent starts (never the agent's secrets).
SYSTEM = frozenset({"PATH", "HOME", "USER", "LOGNAME", "SHELL", "LANG", "LANGUAGE", "TZ", "TMPDIR", "TERM", "HOSTNAME"})
SYSTEM_PREFIXES = ("LC_",)
# A name that looks like it holds a credential is never forwarded and never printed, whatever the lists above say.
SECRET = re.compile(r"TOKEN|SECRET|PASSW|CREDENTIAL|PRIVATE|API_?KEY|ACCESS_?KEY|AUTH|COOKIE|SESSION_?KEY", re.IGNORECASE)


def is_secret(name: str) -> bool:
    return bool(SECRET.search(name))


def forwarded(environ=os.environ) -> dict[str, str]:
    """The allowlisted, non-secret variables of `environ`: what the user set for the ranks."""
    return {name: value for name, value in environ.items()
            if (name in FORWARDED or name.startswith(FORWARDED_PREFIXES)) and not is_secret(name)}


def system(environ=os.environ) -> dict[str, str]:
    """A node's own basics (PATH with this Python's folder first, HOME, locale, ...), without secrets."""
    env = {name: value for name, value in environ.items()
           if (name in SYSTEM or name.startswith(SYSTEM_PREFIXES)) and not is_secret(name)}
    path = [str(Path(sys.executable).parent), *environ.get("PATH", "/usr/local/bin:/usr/bin:/bin").split(os.pathsep)]
    env["PATH"] = os.pathsep.join(dict.fromkeys(p for p in path if p))
    return env


def node_local_extensions_dir() -> str:
    """Where a node's ranks build DeepSpeed's JIT ops when the user chose no TORCH_EXTENSIONS_DIR: node-local storage.
    torch's default (~/.cache/torch_extensions) is in CML's shared project folder, where every pod would wait on one
    lock file (left behind forever by a pod that dies mid-build) and load ops built for another pod's CPU."""
    return str(Path(tempfile.gettempdir()) / f"textsql-torch-extensions-{os.getuid()}")


def interface_of(address: str) -> str | None:
    """The network interface whose subnet holds `address` (lo for 127.x), for GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME."""
    try:
        target = struct.unpack("!I", socket.inet_aton(socket.gethostbyname(address)))[0]
    except OSError:
        return None
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            request = struct.pack("256s", name.encode()[:15])
            try:
                ip = struct.unpack("!I", fcntl.ioctl(s.fileno(), 0x8915, request)[20:24])[0]  # SIOCGIFADDR
                mask = struct.unpack("!I", fcntl.ioctl(s.fileno(), 0x891B, request)[20:24])[0]  # SIOCGIFNETMASK
            except OSError:
                continue
            if ip & mask == target & mask:
                return name
    return None

