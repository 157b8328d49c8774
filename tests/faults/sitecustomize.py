"""Fault injection for the cluster tests. Every Python process of a test launch loads this (the tests put this folder
first on PYTHONPATH, which reaches the ranks like any PYTHONPATH); it acts only in a rank's process
(`-m textsql.cluster.rank`), and only when $TEXTSQL_TEST_FAULT asks for it: faults separated by ";", each
`<kind>:<rank>:<where>`, `<rank>` a number or `*` (every rank), `<where>` a path suffix (the file written with
torch.save or safetensors' save_file) or `backward:<n>` (the rank's n-th backward pass: its n-th training step
without gradient accumulation). Kinds:

    kill      the file half written, then SIGKILL (killed while saving)
    enospc    the file half written, then ENOSPC (a failing writer: the disk-full test uses a real tmpfs instead when
              it can mount one)
    block     the main thread waits forever first (a lock, a deadlock: its other threads run on)
    sleep=S   the main thread sleeps S seconds first (a slow save to a network folder, a slow first step), then goes on
"""

import os
import sys

_FAULTS = [f.split(":", 2) for f in os.environ.get("TEXTSQL_TEST_FAULT", "").split(";") if f.count(":") >= 2]
_MINE = [(kind, where) for kind, rank, where in _FAULTS if rank in ("*", os.environ.get("RANK"))]
if _MINE and "textsql.cluster.rank" in getattr(sys, "orig_argv", ()):
    import errno
    import io
    import signal
    import threading
    import time

    import torch

    def _strike(kind: str, what: str, write_half=None) -> bool:
        """The fault, struck now; True when the caller goes on as usual."""
        print(f"textsql test fault: {kind} at {what}", flush=True)
        if kind == "block":
            threading.Event().wait()
        if kind.startswith("sleep="):
            time.sleep(float(kind.split("=", 1)[1]))
            return True
        write_half()
        if kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        raise OSError(errno.ENOSPC, "No space left on device", what)

    def _saving(save, to_bytes):
        def faulty(obj, f, *args, **kwargs):
            hit = [k for k, where in _MINE if isinstance(f, (str, os.PathLike)) and str(f).endswith(where)]
            if hit:

                def write_half():
                    data = to_bytes(obj, *args, **kwargs)
                    with open(f, "wb") as out:
                        out.write(data[: len(data) // 2])

                _strike(hit[0], str(f), write_half)
            return save(obj, f, *args, **kwargs)

        return faulty

    def _torch_bytes(obj, *args, **kwargs):
        buffer = io.BytesIO()
        _save(obj, buffer, *args, **kwargs)
        return buffer.getvalue()

    _save = torch.save
    torch.save = _saving(torch.save, _torch_bytes)
    import safetensors.torch

    safetensors.torch.save_file = _saving(safetensors.torch.save_file, lambda obj, *a, **k: safetensors.torch.save(obj))

    _backward, _passes = torch.Tensor.backward, []

    def _faulty_backward(self, *args, **kwargs):
        _passes.append(1)
        for kind, where in _MINE:
            if where == f"backward:{len(_passes)}":
                _strike(kind, where)
        return _backward(self, *args, **kwargs)

    torch.Tensor.backward = _faulty_backward
