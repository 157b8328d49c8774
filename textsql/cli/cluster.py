"""`textsql cluster ...`: multi-node training from a terminal or a CML job, the same calls as the notebook.

    textsql cluster train --backend cml --workers 2 --nvidia_gpu 1 -- --model_id t5-small --deepspeed zero2 --epochs 3
    textsql cluster train --backend local --workers 1 -- ...        # this machine: 127.0.0.1 + 127.0.0.2
    textsql cluster train --backend cml --workers 3 --min_workers 1 -- --output_dir runs/NAME ...  # elastic: torchrun --nnodes 2:4
    textsql cluster preflight --backend cml --workers 2 -- ...      # the plan, without starting a pod
    textsql cluster preflight --hostfile H [--ssh_config C] -- ...  # check your own machines
    textsql cluster launch --hostfile H [--ssh_config C] -- ...     # your own machines, over your own ssh (pdsh)
    textsql cluster launch --hostfile H --include "node1:0,1@node2" [--master_port 29600] -- ...   # some of them
    (--include, --exclude, --num_nodes: DeepSpeed's host selection, checked against the hostfile first)
    textsql cluster check-hostfile H

On CML, run `cluster train ...` as a Job for long trainings (script scripts/cml_job.py, these arguments): a session
ends after CML's idle timeout, and with it the workers and the training.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import fields

from textsql.cluster import Cluster, HostSelection, launch_training, preflight, read_hostfile
from textsql.errors import TextsqlError
from textsql.run_summary import format_summary
from textsql.train.watch import WatchLimits

# `textsql cluster SUBCOMMAND`: those that train (or check a training) read `textsql train` arguments after `--`.
TRAINING_SUBCOMMANDS = ("train", "launch", "preflight")


def _split(argv: list[str]) -> tuple[list[str], list[str]]:
    if "--" in argv:
        i = argv.index("--")
        return argv[:i], argv[i + 1 :]
    return argv, []


def _parser(command: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=f"textsql cluster {command}", epilog="Training arguments (those of `textsql train`) follow `--`."
    )
    if command in ("train", "preflight"):
        parser.add_argument("--backend", choices=("cml", "local"), default="cml")
        parser.add_argument("--workers", type=int, default=1, help="worker nodes besides this one (node 0)")
        parser.add_argument("--cpu", type=float, default=4, help="CPUs per worker pod")
        parser.add_argument("--memory", type=float, default=16, help="GiB per worker pod")
        parser.add_argument(
            "--nvidia_gpu", type=int, default=1, help="GPUs per worker (= ranks per worker; 0: one CPU rank)"
        )
        parser.add_argument(
            "--session_slots",
            type=int,
            default=None,
            help="ranks on node 0 (default: one per GPU it sees, one on a CPU)",
        )
        parser.add_argument("--project_dir", default=".")
        parser.add_argument(
            "--name", default="default", help="the cluster's name (one cluster of a name per project at a time)"
        )
        parser.add_argument(
            "--start_timeout", type=float, default=600, help="seconds to wait for the worker pods to start"
        )
        parser.add_argument(
            "--min_workers",
            type=int,
            default=None,
            help="elastic: start once this many workers joined (--nnodes MIN:MAX)",
        )
        parser.add_argument(
            "--max_restarts", type=int, default=0, help="torchrun restarts every pod's ranks this often after a failure"
        )
        parser.add_argument(
            "--forward_env",
            default="",
            help="your own variables every rank gets, by name (or prefix ending in *), separated by commas: "
            "MY_SETTING,MYAPP_* (a name that looks like a credential is never forwarded)",
        )
        for option in fields(WatchLimits):  # the watch of pods and ranks, and the elastic join window
            parser.add_argument(
                f"--{option.name}",
                type=float,
                default=option.default,
                help=f"{option.metadata['help']} (seconds; default: %(default)s)",
            )
    if command in ("launch", "preflight"):
        parser.add_argument(
            "--hostfile",
            required=command == "launch",
            help="your nodes (preflight: check them instead of starting workers)",
        )
        parser.add_argument(
            "--ssh_config",
            default=None,
            help="your ssh client config (default: ssh's own, ~/.ssh/config); host keys are always checked",
        )
        for option in fields(HostSelection):  # with --hostfile only: the workers' own backends choose no hosts
            parser.add_argument(
                f"--{option.name}",
                type=str if option.name in ("include", "exclude") else int,
                default=option.default,
                help=option.metadata["help"] + " With --hostfile.",
            )
    return parser


def _selection(args) -> HostSelection:
    """The host selection of `launch`/`preflight --hostfile` (checked now); refused without --hostfile."""
    selection = HostSelection(**{f.name: getattr(args, f.name) for f in fields(HostSelection)})
    if not getattr(args, "hostfile", None) and selection != HostSelection():
        raise TextsqlError(
            "--include, --exclude, --num_nodes and --master_port choose among the hosts of a hostfile: pass "
            "--hostfile with them (the cml and local backends start the workers you ask for with --workers)."
        )
    return selection


def cluster_cli(argv: list[str]) -> int:
    """Body of `textsql cluster`. Returns the exit status; raises TextsqlError for problems a user can fix."""
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command == "check-hostfile":
        if len(rest) != 1:
            raise TextsqlError("usage: textsql cluster check-hostfile HOSTFILE")
        hosts = read_hostfile(rest[0])
        print(f"{rest[0]}: OK, {len(hosts)} nodes, {sum(h.slots for h in hosts)} ranks (rank 0 on {hosts[0].address})")
        return 0
    if command not in TRAINING_SUBCOMMANDS:
        raise TextsqlError(
            f"unknown cluster command '{command}': use {', '.join(TRAINING_SUBCOMMANDS)} or check-hostfile "
            "(`textsql cluster --help` shows them)."
        )
    own, train_argv = _split(rest)
    args = _parser(command).parse_args(own)
    selection = _selection(args) if command in ("launch", "preflight") else None
    # The training arguments import torch and transformers: only now, so `--help` and check-hostfile answer at once.
    from textsql.arguments.training import parse_arguments

    arguments = parse_arguments(train_argv)  # once: every node and rank gets these, as they are
    if command == "launch":
        result = launch_training(args.hostfile, arguments, ssh_config=args.ssh_config, selection=selection)
    elif getattr(args, "hostfile", None):
        preflight(args.hostfile, arguments, ssh_config=args.ssh_config, selection=selection)
        return 0
    else:
        with Cluster(
            args.backend,
            workers=args.workers,
            cpu=args.cpu,
            memory=args.memory,
            nvidia_gpu=args.nvidia_gpu,
            session_slots=args.session_slots,
            project_dir=args.project_dir,
            name=args.name,
            start_timeout=args.start_timeout,
            min_workers=args.min_workers,
            max_restarts=args.max_restarts,
            limits=WatchLimits(**{option.name: getattr(args, option.name) for option in fields(WatchLimits)}),
            forward_env=tuple(args.forward_env.replace(",", " ").split()),
        ) as cluster:
            if command == "preflight":
                cluster.preflight(*arguments)
                return 0
            result = cluster.train(*arguments)
    print(format_summary(result["summary"]))
    for rank in result["ranks"]:
        print(json.dumps({k: rank.get(k) for k in ("rank", "node_address", "world_size", "global_step", "final_loss")}))
    return 0
