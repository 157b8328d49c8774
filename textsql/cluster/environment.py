"""A node's private build folder for DeepSpeed's ops (what reaches the ranks of the environment is textsql.redaction's
decision: an allowlist, never a secret)."""

from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path

from textsql.errors import TextsqlError


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
