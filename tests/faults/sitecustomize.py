"""Fault injection for the cluster tests. Every Python process of a test launch loads this (the tests put this folder
first on PYTHONPATH, which reaches the ranks like any PYTHONPATH); it acts only in a rank's process
(`-m textsql.cluster.rank`), and only when $TEXTSQL_TEST_FAULT asks for it:

    kill:<rank>:<path suffix>    that rank writes half of the file, then SIGKILLs itself (killed while saving)
    enospc:<rank>:<path suffix>  that rank writes half of the file, then fails with ENOSPC (a failing writer: the
                                 disk-full test uses a real tmpfs instead when it can mount one)
    block:<rank>:<path suffix>   that rank's main thread waits forever before it writes the file (a lock, a deadlock:
                                 its other threads run on)
"""

import os
import sys

_FAULT = os.environ.get("TEXTSQL_TEST_FAULT")
if _FAULT and "textsql.cluster.rank" in getattr(sys, "orig_argv", ()):
    _kind, _rank, _suffix = _FAULT.split(":", 2)
    if os.environ.get("RANK") == _rank:
        import errno
        import io
        import signal

        import torch

        _save = torch.save

        def _faulty_save(obj, f, *args, **kwargs):
            if not (isinstance(f, (str, os.PathLike)) and str(f).endswith(_suffix)):
                return _save(obj, f, *args, **kwargs)
            if _kind == "block":
                import threading

                print(f"textsql test fault: block while writing {f}", flush=True)
                threading.Event().wait()
            buffer = io.BytesIO()
            _save(obj, buffer, *args, **kwargs)
            with open(f, "wb") as out:
                out.write(buffer.getvalue()[: len(buffer.getvalue()) // 2])
            print(f"textsql test fault: {_kind} while writing {f}", flush=True)
            if _kind == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            raise OSError(errno.ENOSPC, "No space left on device", str(f))

        torch.save = _faulty_save
