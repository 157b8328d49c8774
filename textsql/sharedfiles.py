"""textsql's own files in the shared project folder (locks, state, records, logs), never opened through a link.

Every collaborator of a CML project can write the project folder: a symbolic link planted where textsql writes would
make the owner's process overwrite (or append to) the link's target. So these files are opened with O_NOFOLLOW and
must be plain files with one name (no hard link either); whole files are replaced atomically, through a new file.
"""

from __future__ import annotations

import errno
import os
import secrets
import stat
from pathlib import Path

from textsql.errors import TextsqlError

_FLAGS = {
    "r": os.O_RDONLY,
    "w": os.O_WRONLY | os.O_CREAT,
    "a": os.O_WRONLY | os.O_CREAT | os.O_APPEND,  # "w" cuts after the checks
    "r+": os.O_RDWR,
    "a+": os.O_RDWR | os.O_CREAT,
}


def open_unlinked(
    path, mode: str = "r", *, binary: bool = False, exclusive: bool = False, permissions: int = 0o644, **kwargs
):
    """open(path, mode) for a plain file that is not a link: refused with TextsqlError (naming it) when the last part
    of `path` is a symbolic link, a hard link or not a plain file (a FIFO would block). `exclusive`: the file must be
    new. Modes r, w, a, r+ (read and write an existing file), a+ (read and write, created when missing, not cut)."""
    flags = _FLAGS[mode] | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK | (os.O_EXCL | os.O_CREAT if exclusive else 0)
    try:
        descriptor = os.open(path, flags, permissions)
    except OSError as error:
        if error.errno == errno.ELOOP:
            _refuse(path, "it is a symbolic link")
        if error.errno == errno.ENXIO:  # a FIFO nobody reads (or a device)
            _refuse(path, "it is not a plain file")
        raise
    info = os.fstat(descriptor)
    if not stat.S_ISREG(info.st_mode) or info.st_nlink > 1:
        os.close(descriptor)
        _refuse(
            path,
            "it is not a plain file"
            if not stat.S_ISREG(info.st_mode)
            else f"it has {info.st_nlink} names (a hard link)",
        )
    os.set_blocking(descriptor, True)
    if mode == "w":
        os.ftruncate(descriptor, 0)
    python_mode = {"a+": "r+"}.get(mode, mode) + ("b" if binary else "")
    return os.fdopen(descriptor, python_mode, **kwargs)


def read_unlinked(path) -> str:
    """The text of a file that is not a link (FileNotFoundError when there is none)."""
    with open_unlinked(path, "r", encoding="utf-8", errors="replace") as f:
        return f.read()


def replace_file(path, text: str, permissions: int = 0o644) -> Path:
    """Write `text` to `path` atomically: into a new file of a random name beside it, then renamed over it (a link
    planted at `path` is replaced, its target never written)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(6)}.tmp")
    with open_unlinked(tmp, "w", exclusive=True, permissions=permissions, encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, path)
    return path


def _refuse(path, why: str):
    raise TextsqlError(
        f"{path} is refused: {why}. textsql writes its own files in the shared project folder only as plain "
        "files, never through a link, which a collaborator could point at a file of yours. Remove it "
        f"(rm {path}) and run again; if you did not put it there, someone with access to the project did."
    )
