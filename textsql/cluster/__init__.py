"""Multi-node training without SSH: one agent per node, connected back to the session; DeepSpeed's own launcher.

Design (issue #13):
- Node 0 is the session (CML) or this machine (local backend). `Cluster.start()` opens a control server on node 0's
  address (an ephemeral port; one random token per start), starts node 0's agent as a local process and one agent
  per worker: `cml.workers_v1.launch_workers(code=..., env=...)` on CML, a local process per loopback address
  (127.0.0.2, ...) in the local backend, each with its own GPUs and share of cores. The token, the server's address
  and everything else a pod must know travel in its environment; nothing secret is ever written to the shared
  project folder (no sshd, no keys, no authorized keys, no known hosts).
- An agent (`textsql.cluster.node`) connects back, proves it holds the token (HMAC over fresh nonces; the session
  proves it too), reports its facts (GPUs, cores, interface, versions) and waits for orders. It ends — stopping
  what it runs — when its connection breaks or falls silent: a kernel that exits or is restarted takes its workers
  with it, and a later start stops whatever an earlier one left (`.textsql/cluster/<name>/workers.json`).
- `Cluster.train(argv)` is one launch: decide once on node 0 from every node's facts (textsql.strategy.devices: CPU or GPU,
  precision, ranks, GPUs and threads per node), probe every node for the run (files, shared run folder,
  checkpoints), lock the run folder (a second launch into it is refused), choose the checkpoint to resume from (the
  newest complete on every node, incomplete newer ones set aside, another world size refused), then each agent runs
  `deepspeed --hostfile H --no_ssh --node_rank i ... --module textsql.cluster.rank --textsql_spec=<base64 JSON>`:
  the training arguments and the ranks' environment (an allowlist, no secrets) reach every rank exactly, through
  no shell. `textsql.train` and the DeepSpeed configs are the same as on one pod.
- The session streams every rank's output, names the rank that failed first (not a peer that only lost its
  connection), stops every node within seconds, and says which checkpoint the next launch resumes from.
- User-managed nodes (`textsql cluster launch --hostfile H`, textsql.cluster.pdsh) get the same decisions and the
  same rank program through DeepSpeed's pdsh launcher over the user's own ssh setup, host keys checked.

Names are imported on first use, so that what every node runs (`textsql.cluster.node`, `textsql.cluster.rank`)
loads only what it needs.
"""

from importlib import import_module

_WHERE = {
    "Host": "hostfile",
    "HostfileError": "hostfile",
    "HostSelection": "hostfile",
    "parse_hostfile": "hostfile",
    "read_hostfile": "hostfile",
    "write_hostfile": "hostfile",
    "LaunchFailed": "launch",
    "PreflightError": "launch",
    "launch_training": "pdsh",
    "preflight": "pdsh",
    "Cluster": "workers",
    "CmlBackend": "workers",
    "LocalBackend": "workers",
}
__all__ = sorted(_WHERE)


def __getattr__(name):
    if name in _WHERE:
        return getattr(import_module(f"textsql.cluster.{_WHERE[name]}"), name)
    raise AttributeError(f"module 'textsql.cluster' has no attribute '{name}'")
