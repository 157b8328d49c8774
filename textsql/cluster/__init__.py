"""Multi-node training: hostfiles, worker nodes (CML pods or local loopback sshd), SSH, and the DeepSpeed pdsh launch.

Names are imported on first use, so that `python -m textsql.cluster.worker` and `python -m textsql.cluster.rank`
(what every node runs) load only what they need.
"""

from importlib import import_module

_WHERE = {
    "Host": "hostfile", "HostfileError": "hostfile", "parse_hostfile": "hostfile", "read_hostfile": "hostfile", "write_hostfile": "hostfile",
    "LaunchFailed": "launch", "PreflightError": "launch", "launch_training": "launch", "preflight": "launch",
    "Cluster": "workers", "CmlBackend": "workers", "LocalBackend": "workers",
}
__all__ = sorted(_WHERE)


def __getattr__(name):
    if name in _WHERE:
        return getattr(import_module(f"textsql.cluster.{_WHERE[name]}"), name)
    raise AttributeError(f"module 'textsql.cluster' has no attribute '{name}'")
