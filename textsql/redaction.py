"""What may leave this process: the environment another process gets (an allowlist of names and prefixes the user
extends, textsql's multi-pod launches), and what counts as a secret: names and values never forwarded, printed, or
logged to a tracker."""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

# A name that looks like it holds a credential is never forwarded and never printed, whatever an allowlist, a prefix
# (DS_BEARER) or the user's own list says: TOKEN (not TOKENIZERS_...), SECRET, PASSW(ORD), PASSPHRASE, CREDENTIAL,
# PRIVATE, AUTH, COOKIE, BEARER, KEY anywhere in it (HF_KEY, APIKEY, GLOO_KEYFILE), and PWD, PASS, PAT as a word of it
# (TEXTSQL_DB_PWD, DB_PASS, GITHUB_PAT).
SECRET = re.compile(
    r"TOKEN(?!IZER)|SECRET|PASSW|PASSPHRASE|CREDENTIAL|PRIVATE|AUTH|COOKIE|BEARER|KEY|(?:^|_)(?:PWD|PASS|PAT)(?:_|$)",
    re.IGNORECASE,
)
# Nor is a value holding a URL with credentials in it (scheme://user:password@host, scheme://token@host), or a
# connection string's or query's password, token or signature ("host=db password=...", "...?sig=...&token=...").
URL_CREDENTIALS = re.compile(r"[a-z][a-z0-9+.-]*://[^/\s@]+@", re.IGNORECASE)
VALUE_CREDENTIALS = re.compile(r"(?:^|[\s;&?,-])(?:passw(?:or)?d|pwd|secret|token|sig|signature|api_?key)\s*[=:]", re.I)


def is_secret(name: str, value: str = "") -> bool:
    return bool(SECRET.search(name) or URL_CREDENTIALS.search(value) or VALUE_CREDENTIALS.search(value))


# What reaches the ranks of the session's environment: these names and prefixes (tuning, debugging, caches, builds), and
# those the user adds in $TEXTSQL_FORWARD_ENV (names, or prefixes ending in *, separated by commas or spaces); never a
# variable that looks secret (is_secret). Anything else stays: a secret under a name no filter knows
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


def forwarded(environ=os.environ, names=()) -> dict[str, str]:
    """The allowlisted, non-secret variables of `environ`, the user's additions included: `names` (a launch's
    `forward_env`, names or prefixes ending in *) and $TEXTSQL_FORWARD_ENV."""
    words = [*names, *environ.get(USER_FORWARDED, "").replace(",", " ").split()]
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
