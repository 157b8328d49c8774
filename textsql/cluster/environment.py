"""What reaches the ranks of a multi-node launch from the session's and the pod's environment: an allowlist, never a
secret; and a pod's private build folder."""

from __future__ import annotations

import ipaddress
import os
import socket
import stat
import sys
import tempfile
from pathlib import Path

from textsql.errors import TextsqlError
from textsql.redaction import is_secret

# What reaches the ranks of the session's environment: these names and prefixes (tuning, debugging, caches, builds), and
# those the user adds in $TEXTSQL_FORWARD_ENV (names, or prefixes ending in *, separated by commas or spaces); never a
# variable that looks secret (textsql.redaction). Anything else stays: a secret under a name no filter knows
# (TEXTSQL_DB_CONN, HF_HUB_DOWNLOAD_SIG) is not forwarded because it is not asked for. MLFLOW_*: rank 0 logs the run.
FORWARDED = frozenset(
    """PYTORCH_CUDA_ALLOC_CONF PYTORCH_ALLOC_CONF TORCH_DISTRIBUTED_DEBUG TORCH_SHOW_CPP_STACKTRACES TORCH_CPP_LOG_LEVEL
    TORCH_EXTENSIONS_DIR TORCH_CUDA_ARCH_LIST MAX_JOBS CC CXX CUDA_LAUNCH_BLOCKING CUDA_HOME CUDA_DEVICE_ORDER
    LD_LIBRARY_PATH VIRTUAL_ENV PYTHONPATH PYTHONHASHSEED PYTHONWARNINGS PYTHONUNBUFFERED OMP_NUM_THREADS
    MKL_NUM_THREADS TOKENIZERS_PARALLELISM TRANSFORMERS_OFFLINE TRANSFORMERS_VERBOSITY TRANSFORMERS_CACHE HF_HOME
    HF_HUB_CACHE HF_HUB_OFFLINE HF_DATASETS_CACHE HF_DATASETS_OFFLINE HF_HUB_DISABLE_TELEMETRY HF_ENDPOINT
    HF_HUB_DISABLE_PROGRESS_BARS XDG_CACHE_HOME SSL_CERT_FILE REQUESTS_CA_BUNDLE MLFLOW_TRACKING_URI
    MLFLOW_EXPERIMENT_NAME TEXTSQL_PROJECT_DIR""".split()
)
FORWARDED_PREFIXES = ("TORCH_NCCL_", "NCCL_", "GLOO_", "DS_")
USER_FORWARDED = "TEXTSQL_FORWARD_ENV"
# A pod keeps its own of these for its ranks, besides the lists above: its devices (CML or the local backend set them).
POD_OWN = frozenset({"CUDA_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES"})
# A machine's basics (never a secret): DeepSpeed's pdsh runner gets them, and every pod's ranks.
SYSTEM = frozenset({"PATH", "HOME", "USER", "LOGNAME", "SHELL", "LANG", "LANGUAGE", "TZ", "TMPDIR", "TERM", "HOSTNAME"})
SYSTEM_PREFIXES = ("LC_",)


def forwarded(environ=os.environ) -> dict[str, str]:
    """The allowlisted, non-secret variables of `environ`, the user's additions ($TEXTSQL_FORWARD_ENV) included."""
    words = environ.get(USER_FORWARDED, "").replace(",", " ").split()
    names = FORWARDED | {w for w in words if not w.endswith("*")}
    return _allowed(environ, names, FORWARDED_PREFIXES + tuple(w[:-1] for w in words if w.endswith("*") and w[:-1]))


def system(environ=os.environ) -> dict[str, str]:
    """A node's own basics (PATH with this Python's folder first, HOME, locale, ...), without secrets."""
    path = [str(Path(sys.executable).parent), *environ.get("PATH", "/usr/local/bin:/usr/bin:/bin").split(os.pathsep)]
    return dict(_allowed(environ, SYSTEM, SYSTEM_PREFIXES), PATH=os.pathsep.join(dict.fromkeys(p for p in path if p)))


def for_pod(environ=os.environ) -> dict[str, str]:
    """What a pod's torchrun and ranks keep of the environment they were given (a CML worker's holds the project's
    variables, secrets too): its basics, its devices and the allowlisted variables."""
    return {**system(environ), **_allowed(environ, POD_OWN, ()), **forwarded(environ)}


def _allowed(environ, names: frozenset, prefixes: tuple) -> dict[str, str]:
    return {k: v for k, v in environ.items() if (k in names or k.startswith(prefixes)) and not is_secret(k, v)}


def node_local_extensions_dir() -> str:
    """Where a node's ranks build DeepSpeed's JIT ops when the user chose no TORCH_EXTENSIONS_DIR: node-local storage.
    torch's default (~/.cache/torch_extensions) is in CML's shared project folder, where every pod would wait on one
    lock file (left behind forever by a pod that dies mid-build) and load ops built for another pod's CPU.

    It is <tmp>/textsql-<uid>/torch-extensions, private to this user: a build folder another local user could write
    would let them plant the library. The top folder is made with mode 0700; one that exists must be a real folder
    (not a symbolic link) of this user that nobody else can write (a readable one is made private), or TextsqlError
    says so: another local user may have made it first."""
    root = Path(tempfile.gettempdir()) / f"textsql-{os.getuid()}"
    try:
        root.mkdir(mode=0o700)
    except FileExistsError:
        pass
    info = os.lstat(root)
    problem = None
    if stat.S_ISLNK(info.st_mode):
        problem = f"it is a symbolic link (to {os.readlink(root)})"
    elif not stat.S_ISDIR(info.st_mode):
        problem = "it is not a folder"
    elif info.st_uid != os.getuid():
        problem = f"it belongs to user id {info.st_uid}, not to you (user id {os.getuid()})"
    elif info.st_mode & 0o022:
        problem = f"others can write into it (mode {stat.S_IMODE(info.st_mode):o})"
    if problem:
        raise TextsqlError(
            f"{root} is not your private folder: {problem}. Another local user could have put a compiled library there "
            f"that DeepSpeed would load into your training. If it is yours, remove it (rm -rf {root}); otherwise set "
            "TORCH_EXTENSIONS_DIR to a folder on this machine's local disk that only you can write."
        )
    if stat.S_IMODE(info.st_mode) != 0o700:
        os.chmod(root, 0o700)  # nobody else could write into it: only close it for reading
    folder = root / "torch-extensions"
    folder.mkdir(mode=0o700, exist_ok=True)  # inside a private folder nobody else can make a link
    return str(folder)


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
