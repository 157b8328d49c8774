"""`textsql cluster ...`: multi-node training from a terminal or a CML job, the same calls as the notebook.

    textsql cluster train --backend cml --workers 2 --nvidia_gpu 1 -- --model_id t5-small --deepspeed zero2 --epochs 3
    textsql cluster train --backend local --workers 1 -- ...        # this machine: 127.0.0.1 + 127.0.0.2
    textsql cluster launch --hostfile H --ssh_config C -- ...       # nodes whose sshd you started yourself
    textsql cluster preflight --hostfile H --ssh_config C -- ...
    textsql cluster check-hostfile H
    textsql cluster worker --cluster-dir D --token T               # a node's sshd (what workers run)
"""

from __future__ import annotations

import argparse
import json

from textsql.errors import TextsqlError


def _split(argv: list[str]) -> tuple[list[str], list[str]]:
    if "--" in argv:
        i = argv.index("--")
        return argv[:i], argv[i + 1:]
    return argv, []


def _parser(command: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=f"textsql cluster {command}", epilog="Training arguments (those of `textsql train`) follow `--`.")
    if command == "train":
        parser.add_argument("--backend", choices=("cml", "local"), default="cml")
        parser.add_argument("--workers", type=int, default=1, help="worker nodes besides this one (node 0)")
        parser.add_argument("--cpu", type=float, default=4)
        parser.add_argument("--memory", type=float, default=16, help="GiB per worker")
        parser.add_argument("--nvidia_gpu", type=int, default=1, help="GPUs per worker (= ranks per node)")
        parser.add_argument("--project_dir", default=".")
        parser.add_argument("--ssh_port", type=int, default=2222)
    else:
        parser.add_argument("--hostfile", required=True)
        parser.add_argument("--ssh_config", required=True, help="ssh client config naming key, port and known_hosts for every host")
        parser.add_argument("--ssh_port", type=int, default=2222)
    return parser


def cluster_cli(argv: list[str]) -> int:
    """Body of `textsql cluster`. Returns the exit status; raises TextsqlError for problems a user can fix."""
    from textsql.cluster import Cluster, launch_training, preflight, read_hostfile
    from textsql.train import format_summary

    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command == "worker":
        from textsql.cluster.worker import main

        return main(rest)
    if command == "check-hostfile":
        if len(rest) != 1:
            raise TextsqlError("usage: textsql cluster check-hostfile HOSTFILE")
        hosts = read_hostfile(rest[0])
        print(f"{rest[0]}: OK, {len(hosts)} nodes, {sum(h.slots for h in hosts)} ranks (rank 0 on {hosts[0].address})")
        return 0
    if command not in ("train", "launch", "preflight"):
        print(__doc__)
        return 2
    own, train_argv = _split(rest)
    args = _parser(command).parse_args(own)
    if command == "train":
        with Cluster(args.backend, workers=args.workers, cpu=args.cpu, memory=args.memory, nvidia_gpu=args.nvidia_gpu,
                     project_dir=args.project_dir, ssh_port=args.ssh_port) as cluster:
            print(cluster.describe())
            result = cluster.train(train_argv)
    elif command == "preflight":
        preflight(read_hostfile(args.hostfile), args.ssh_config, train_argv)
        return 0
    else:
        result = launch_training(args.hostfile, args.ssh_config, train_argv, ssh_port=args.ssh_port)
    print(format_summary(result["summary"]))
    for rank in result["ranks"]:
        print(json.dumps({k: rank[k] for k in ("rank", "node_address", "world_size", "global_step", "final_loss")}))
    return 0
