"""Several pods: torchrun's elastic agent on every pod (CML workers, local pods), or DeepSpeed's pdsh launcher over
the user's own ssh; decisions made once on the session (docs/multi-pod.md). Names are imported on first use, so that
what every pod runs loads only what it needs."""

from importlib import import_module

_WHERE = {
    "HostSelection": "hostfile",
    "read_hostfile": "hostfile",
    "LaunchFailed": "launch",
    "PreflightError": "launch",
    "launch_training": "pdsh",
    "preflight": "pdsh",
    "Cluster": "pods",
    "WatchLimits": "pods",  # textsql.train.watch's: Cluster(limits=WatchLimits(...))
}
__all__ = sorted(_WHERE)


def __getattr__(name):
    if name in _WHERE:
        return getattr(import_module(f"textsql.cluster.{_WHERE[name]}"), name)
    raise AttributeError(f"module 'textsql.cluster' has no attribute '{name}'")
