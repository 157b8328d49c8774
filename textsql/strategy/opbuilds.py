"""DeepSpeed's just-in-time op builds (TORCH_EXTENSIONS_DIR): one folder whoever starts textsql, and a build lock that a
killed process left is cleared, never waited on forever.

torch builds an op under `<folder>/<op>/lock`, created by torch.utils.file_baton.FileBaton and held open while the
build runs; every other process loading the op waits while that file exists, with no limit. A process killed during
the build (stopped, out of memory, a timeout) leaves the file, and every later DeepSpeed run on the machine hangs in
its first op load, silently. On a local disk a lock is the build of a live process exactly when some process has the
file open, which /proc shows on Linux; on a network filesystem (a CML project folder shared by every pod) the builder
may be on another machine, so there a lock no process here holds is dead only once no build could still be running."""

from __future__ import annotations

import logging
import os
import re
import stat
import sys
import tempfile
import time
from importlib.metadata import version
from pathlib import Path

from textsql.errors import TextsqlError
from textsql.paths import OP_CACHE_DIR, user_cache_dir

logger = logging.getLogger(__name__)

PROC = Path("/proc")
# Filesystem types (prefixes of /proc's) that other machines may write: their locks' builders can be out of sight.
NETWORK_FILESYSTEMS = ("nfs", "cifs", "smb", "lustre", "gpfs", "ceph", "glusterfs", "fuse", "9p", "virtiofs")
# An op builds in 1-3 minutes on 2 cores: a lock this old on a network filesystem, held by no process here, is dead.
NETWORK_BUILD_LIMIT_S = 900


OP_BUILD_VARIABLES = ("TORCH_EXTENSIONS_DIR", "PATH")  # what use_op_cache sets


def extensions_folder(environ=os.environ) -> Path:
    """Where DeepSpeed's ops are built and cached: TORCH_EXTENSIONS_DIR when set (by the user, or by a multi-pod launch:
    each pod's own, node_local_extensions_dir), else one folder in textsql's user cache, whoever starts textsql (the
    command, a notebook, bootstrap.sh, a rank), per torch build and Python: an op built against one torch does not load
    into another, where torch's own default folder tells only the Python and CUDA versions apart."""
    if environ.get("TORCH_EXTENSIONS_DIR"):
        return Path(environ["TORCH_EXTENSIONS_DIR"])
    build = re.sub(r"[^\w.]", "-", f"torch-{version('torch')}-py{sys.version_info.major}{sys.version_info.minor}")
    return user_cache_dir(environ) / OP_CACHE_DIR / build


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


def use_op_cache(environ=os.environ) -> Path:
    """Set up this process (`environ`) for DeepSpeed's op builds, before it loads an op, in the process that loads it
    (never in a multi-pod session: each pod decides its own): TORCH_EXTENSIONS_DIR as extensions_folder() (torch reads
    it when an op loads; processes started from here inherit it), and the ninja installed beside this Python first on
    PATH, where there is one. torch builds with whichever `ninja` PATH finds, and two ninjas (pip's 1.13, a Linux
    distribution's 1.11) hash a build's command differently, so each rebuilt every op the other built (minutes each):
    `.venv/bin/textsql` from bootstrap.sh and `textsql` in an activated shell found different ones. The folder."""
    folder = extensions_folder(environ)
    environ["TORCH_EXTENSIONS_DIR"] = str(folder)
    here = str(Path(sys.executable).parent)
    if (Path(here) / "ninja").is_file():
        rest = [part for part in environ.get("PATH", "").split(os.pathsep) if part and part != here]
        environ["PATH"] = os.pathsep.join([here, *rest])
    return folder


def build_locks(folder: Path) -> list[Path]:
    """The op build locks under `folder`: <op>/lock, or <python-and-device>/<op>/lock in torch's default folder."""
    return sorted([*folder.glob("*/lock"), *folder.glob("*/*/lock")])


def lock_holders(lock: Path, proc: Path = PROC) -> list[int]:
    """The processes of this machine that have `lock` open (those whose descriptors this user may read)."""
    target = os.path.realpath(lock)
    holders = []
    for descriptors in proc.glob("[0-9]*/fd"):
        try:
            if any(os.readlink(fd) == target for fd in descriptors.iterdir()):
                holders.append(int(descriptors.parent.name))
        except OSError:  # gone meanwhile, or another user's
            continue
    return holders


def filesystem_type(path: Path, proc: Path = PROC) -> str:
    """The type of the filesystem `path` is on ('ext4', 'nfs4', 'overlay', ...), from /proc/self/mountinfo's entry with
    the longest mount point above it."""
    real, longest, kind = os.path.realpath(path), "", ""
    for line in (proc / "self" / "mountinfo").read_text().splitlines():
        fields = line.split()
        mount_point = fields[4].replace("\\040", " ")
        inside = real == mount_point or real.startswith(mount_point.rstrip("/") + "/")
        if inside and len(mount_point) >= len(longest):
            longest, kind = mount_point, fields[fields.index("-") + 1]
    return kind


def clear_dead_build_locks(folder: Path | None = None, poll_s: float = 0.5, proc: Path = PROC) -> list[str]:
    """Wait for the op builds in progress in `folder` (extensions_folder() by default) and remove each lock whose builder
    is gone; the names of the ops whose locks were removed. Call it before DeepSpeed loads an op: a build that dies
    while this waits is noticed, where torch's wait would never end. Nothing is removed where /proc cannot tell
    (not Linux)."""
    folder = extensions_folder() if folder is None else folder
    if not sys.platform.startswith("linux") or not proc.is_dir():
        return []
    shared = filesystem_type(folder, proc).startswith(NETWORK_FILESYSTEMS)
    cleared, announced = [], set()
    while True:
        building = {}
        for lock in build_locks(folder):
            try:
                seen = lock.stat()
                holders = lock_holders(lock, proc)
                now = lock.stat()
                if holders or (shared and time.time() - now.st_mtime < NETWORK_BUILD_LIMIT_S):
                    building[lock] = holders
                elif (now.st_ino, now.st_mtime_ns) == (seen.st_ino, seen.st_mtime_ns):
                    # The same file before and after the look at /proc: no build started there meanwhile.
                    lock.unlink()
                    cleared.append(lock.parent.name)
                    logger.warning(
                        "Removed the build lock of DeepSpeed's %s op (%s): the process building it was killed before "
                        "it finished; this run builds it again.",
                        lock.parent.name,
                        lock,
                    )
            except FileNotFoundError:  # its build finished meanwhile
                continue
        if not building:
            return cleared
        for lock, holders in building.items():
            if lock not in announced:
                announced.add(lock)
                builder = f"process {', '.join(map(str, holders))}" if holders else "another machine sharing the folder"
                logger.info(
                    "Waiting for DeepSpeed's %s op, which %s is building (%s).", lock.parent.name, builder, lock
                )
        time.sleep(poll_s)
