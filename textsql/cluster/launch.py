"""Multi-node launches: decide once on node 0 from every node's facts, prepare the nodes, run DeepSpeed's launcher on
every node, stream and watch every rank, stop every node on the first failure, and say what the next launch resumes.

Two ways to reach the nodes share everything here: node agents (textsql.cluster.node; CML worker pods and the local
backend, `deepspeed --no_ssh --node_rank i` on each node) and, for user-managed machines, DeepSpeed's pdsh launcher
over the user's own ssh (textsql.cluster.pdsh). A node is asked things through `ask(op, {address: request})`.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import queue
import re
import secrets
import shlex
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

from textsql.cluster.hostfile import Host, rank_layout, ranks_of
from textsql.cluster.rank import LAUNCH_FLAG, RANK_EXIT_MARKER, RANK_SUMMARY_MARKER, SPEC_FLAG
from textsql.cluster.runs import absolute_in
from textsql.errors import TextsqlError
from textsql.sharedfiles import open_unlinked

RANK_LINE = re.compile(r"^(?P<host>[^\s]+): \[rank (?P<rank>\d+)\] (?P<text>.*)$")
# How a rank fails when another one died first: its collective or socket broke, or its launcher stopped it.
AFTERMATH = re.compile(
    r"Connection (?:closed|reset) by (?:remote )?peer|remote process exited|ncclRemoteError|NCCL communicator was aborted|"
    r"Broken pipe|Socket Timeout|DistNetworkError|recvBytes failed|Read error|gloo::EnforceNotMet|timed out|"
    r"failed to recv|Connection refused",
    re.IGNORECASE,
)
STOP_WAIT_SECONDS = 35  # agents SIGKILL what SIGTERM did not end after 10 s; a node silent longer than this is lost
NOT_STOPPED = "lost: did not stop"  # a node that did not report its launcher's end after the stop (not a cause)


class PreflightError(TextsqlError):
    """One or more nodes are not ready; the message says what is wrong where."""


class LaunchFailed(TextsqlError):
    """A multi-node launch ended badly. `failures`: the rank records (first failing rank first); `resume`: which
    checkpoint the next launch starts from."""

    def __init__(self, message: str, failures: list[dict], launch_dir: Path, resume: str | None = None):
        super().__init__(message)
        self.failures = failures
        self.launch_dir = launch_dir
        self.resume = resume


def new_launch_id() -> str:
    return time.strftime("%Y%m%d-%H%M%S-") + secrets.token_hex(3)


# ---------------------------------------------------------------------------------------------------------------------
# Decisions, made once on node 0 from every node's facts
# ---------------------------------------------------------------------------------------------------------------------


@dataclass
class NodeFacts:
    """One node as the session sees it: its address, what its agent (or ssh probe) reported, the ranks asked of it."""

    address: str
    facts: dict
    ranks: int | None = None  # None: one per visible GPU (one on a CPU node)
    slots: list[int] | None = (
        None  # which of its GPUs (by number, as the hostfile counts them); None: the first `ranks`
    )


@dataclass
class Decision:
    hosts: list[Host]
    accelerator: str
    precision: object  # textsql.strategy.devices.PrecisionChoice
    threads: dict[str, int]
    gpu_ids: dict[str, list[int] | None]

    @property
    def world_size(self) -> int:
        return sum(h.slots for h in self.hosts)


def decide(nodes: list[NodeFacts], model, training) -> Decision:
    """CPU or GPU, precision, ranks, GPUs and threads of every node: from all nodes' devices, never node 0's alone.
    `model` and `training` are textsql.train's ModelArguments and TextsqlTrainingArguments."""
    from textsql.strategy.devices import (
        NodeDevices,
        all_gpus,
        check_nodes_agree,
        choose_accelerator,
        precision_from_trainer_flags,
        ranks_per_node,
        resolve_precision,
        threads_per_rank,
    )

    broken = [
        f"{n.address}: torch cannot see its GPUs: {n.facts['devices_error']}"
        for n in nodes
        if "devices_error" in n.facts
    ]
    if broken:
        raise PreflightError("Preflight found problems:\n" + "\n".join(f"  {p}" for p in broken))
    devices = {n.address: NodeDevices.from_dict(n.facts["devices"]) for n in nodes}
    requested = training.accelerator
    if requested == "cpu":
        accelerator = "cpu"
    else:
        for n in nodes:
            try:
                choose_accelerator(requested, devices[n.address])
            except TextsqlError as error:
                raise PreflightError(f"{n.address}: {error}") from None
        gpu_ranks = {n.address: ranks_per_node(n.ranks, devices[n.address]) for n in nodes}
        accelerator = check_nodes_agree(devices, gpu_ranks)
    cpu_only = NodeDevices()
    ranks = {
        n.address: ranks_per_node(n.ranks, devices[n.address] if accelerator == "cuda" else cpu_only) for n in nodes
    }
    precision = resolve_precision(
        precision_from_trainer_flags(training.precision, training.bf16, training.fp16),
        model.model_id,
        all_gpus(devices) if accelerator == "cuda" else (),
        force_fp16=training.force_fp16,
    )
    return Decision(
        hosts=[Host(n.address, ranks[n.address]) for n in nodes],
        accelerator=accelerator,
        precision=precision,
        threads={n.address: threads_per_rank(devices[n.address], ranks[n.address]) for n in nodes},
        gpu_ids={
            n.address: _gpu_ids(n, ranks[n.address], devices[n.address]) if accelerator == "cuda" else None
            for n in nodes
        },
    )


def _gpu_ids(node: NodeFacts, ranks: int, devices) -> list[int]:
    """The GPU ids of a node's ranks: its first `ranks` visible ones, or the chosen slots among them (--include)."""
    from textsql.strategy.devices import node_gpu_ids

    if node.slots is None:
        return node_gpu_ids(ranks, devices, node.facts.get("visible_devices"))
    visible = node_gpu_ids(len(devices.gpus), devices, node.facts.get("visible_devices"))
    missing = [slot for slot in node.slots if slot >= len(visible)]
    if missing:
        raise PreflightError(
            f"{node.address}: slot(s) {missing} were chosen, but it has {len(visible)} GPU(s) visible "
            f"({devices.describe()}). Choose slots below {len(visible)} in --include / --exclude, or fix its slots= "
            "in the hostfile."
        )
    return [visible[slot] for slot in node.slots]


def rank_environments(
    decision: Decision, nodes: list[NodeFacts], environ, log_dir: Path
) -> tuple[dict, dict[str, dict]]:
    """(what every rank gets, what each node's ranks get besides, by node rank). The user's allowlisted variables win
    over textsql's choices; secrets never go."""
    from textsql.cluster.environment import forwarded
    from textsql.strategy.devices import use_accelerator

    common = forwarded(environ)
    common["PYTHONUNBUFFERED"] = "1"
    use_accelerator(decision.accelerator, common)  # DS_ACCELERATOR=cpu, or an error if the user forced it on GPUs
    per_node = {}
    for index, node in enumerate(nodes):
        env = {}
        if "OMP_NUM_THREADS" not in common:
            env["OMP_NUM_THREADS"] = str(decision.threads[node.address])  # CPU Adam (offload) is OpenMP-parallel
        interface = node.facts.get("interface")
        for name in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
            if interface and name not in common:
                env[name] = interface
        if "TORCH_EXTENSIONS_DIR" not in common and node.facts.get("local_extensions_error"):
            raise PreflightError(f"{node.address}: {node.facts['local_extensions_error']}")
        if "TORCH_EXTENSIONS_DIR" not in common and node.facts.get("local_extensions_dir"):
            env["TORCH_EXTENSIONS_DIR"] = node.facts["local_extensions_dir"]
        per_node[str(index)] = env
    return common, per_node


@dataclass
class LaunchPlan:
    """Everything a launch does, decided before anything starts."""

    launch_id: str
    nodes: list[NodeFacts]
    decision: Decision
    workdir: Path
    log_dir: Path
    run_dir: Path
    shared_output: bool
    resume: object  # textsql.cluster.runs.ResumePlan
    zero_stage: int | None
    arguments: dict  # textsql.train.arguments_dict: what every rank trains with, exactly
    env: dict[str, str]
    node_env: dict[str, dict[str, str]]
    master_port: int
    node_files: dict[str, str] = field(default_factory=dict)
    probes: dict[str, dict] = field(default_factory=dict)

    @property
    def hosts(self) -> list[Host]:
        return self.decision.hosts

    @property
    def master_addr(self) -> str:
        return self.hosts[0].address

    @property
    def hostfile(self) -> Path:
        return self.log_dir / "hostfile"

    def launcher_hosts(self) -> tuple[str, list[str]]:
        """The DeepSpeed hostfile text and the launcher's device arguments (--include when GPUs are not 0..n-1)."""
        from textsql.strategy.devices import multi_node_launcher_args

        entries, args = multi_node_launcher_args(
            [(h.address, h.slots, self.decision.gpu_ids[h.address]) for h in self.hosts]
        )
        return "".join(f"{address} slots={slots}\n" for address, slots in entries), args

    def spec(self) -> str:
        from textsql.cluster.node import encode

        return encode(
            {"arguments": self.arguments, "log_dir": str(self.log_dir)}
        )  # the ranks' environment: see prepare_requests

    def deepspeed_command(self, executable: str, extra: list[str]) -> list[str]:
        """DeepSpeed's runner, its arguments from `extra` (--no_ssh --node_rank i, or --launcher pdsh), then the rank
        program with the launch id and the spec: every training argument inside the spec, exactly."""
        _, device_args = self.launcher_hosts()
        return [
            executable,
            "-u",
            "-m",
            "deepspeed.launcher.runner",
            "--hostfile",
            str(self.hostfile),
            *extra,
            "--master_addr",
            self.master_addr,
            "--master_port",
            str(self.master_port),
            "--log_level",
            "warning",
            *device_args,
            "--module",
            "textsql.cluster.rank",
            f"{LAUNCH_FLAG}{self.launch_id}",
            f"{SPEC_FLAG}{self.spec()}",
        ]

    def record(self) -> dict:
        return {
            "launch": self.launch_id,
            "world_size": self.decision.world_size,
            "nodes": [h.line() for h in self.hosts],
            "zero_stage": self.zero_stage,
            "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }

    def prepare_requests(self) -> dict[str, dict]:
        """What each node does before its launcher starts (see textsql.cluster.node.prepare)."""
        from textsql.checkpoints import checkpoint_step

        hostfile, _ = self.launcher_hosts()
        chosen = checkpoint_step(self.resume.checkpoint) if self.resume.checkpoint else -1
        newer = [name for name in self.resume.set_aside if checkpoint_step(name) > chosen]
        requests = {}
        for index, node in enumerate(self.nodes):
            request = {
                "launch_id": self.launch_id,
                "mkdirs": [str(self.log_dir)],
                "files": dict(self.node_files, **{str(self.hostfile): hostfile}),
                "node_rank": index,
                "rank_env": dict(self.env, **self.node_env[str(index)]),
            }
            if index == 0 or not self.shared_output:
                request.update(
                    run_dir=str(self.run_dir), set_aside=newer, resume=self.resume.checkpoint, record=self.record()
                )
            extensions = self.node_env[str(index)].get("TORCH_EXTENSIONS_DIR")
            if extensions:
                request["clear_stale_locks_in"] = extensions
            requests[node.address] = request
        return requests

    def describe(self) -> str:
        from textsql.strategy.devices import NodeDevices

        d = self.decision
        lines = [f"{'node':<5}{'address':<17}{'ranks':<7}{'threads':<9}{'GPUs':<8}devices"]
        for index, node in enumerate(self.nodes):
            ids = d.gpu_ids[node.address]
            lines.append(
                f"{index:<5}{node.address:<17}{d.hosts[index].slots:<7}{self.node_env[str(index)].get('OMP_NUM_THREADS', self.env.get('OMP_NUM_THREADS', '-')):<9}"
                f"{','.join(map(str, ids)) if ids else '-':<8}{NodeDevices.from_dict(node.facts['devices']).describe()}"
            )
        lines.append(
            f"world size {d.world_size} on {'GPUs (NCCL)' if d.accelerator == 'cuda' else 'CPUs (gloo)'}, precision {d.precision.name} "
            f"({d.precision.reason}), TF32 {'on' if d.precision.tf32 else 'off'}"
        )
        lines.append(
            f"run folder {self.run_dir} ({'shared by every node' if self.shared_output else 'NOT shared: each node saves its own checkpoints'}); "
            f"the launch {self.resume.sentence()}"
        )
        return "\n".join(lines)


def _dsconfig_file(training, workdir: Path) -> tuple[Path | None, dict | None]:
    """(the DeepSpeed config file the ranks will read, its content): a path relative to workdir, or a shipped name,
    checked here first; (None, None) without DeepSpeed."""
    from textsql.strategy.dsconfig import load_dsconfig, resolve_dsconfig_path

    name = training.deepspeed
    if not name:
        return None, None
    if isinstance(name, dict):
        raise PreflightError(
            "Pass the DeepSpeed config of a multi-node launch as a file (or a shipped name), not a dict: "
            "every node reads the same file."
        )
    candidate = absolute_in(workdir, name)
    path = absolute_in(workdir, str(resolve_dsconfig_path(str(candidate) if candidate.exists() else name)))
    return path, load_dsconfig(path)  # raises with every problem of the file


def plan_launch(
    nodes: list[NodeFacts],
    arguments,
    ask,
    *,
    workdir: Path,
    log_root: Path,
    environ=os.environ,
    launch_id: str | None = None,
    master_port: int | None = None,
) -> LaunchPlan:
    """Decide, probe every node for this run, and plan it; raises PreflightError listing every problem by node.
    `arguments`: textsql.train's three argument dataclasses, or a command line (parsed once, here).
    `ask(op, {address: request})` asks every node at once and returns {address: answer}. `master_port`: rank 0's
    port (--master_port), else a free one on the first node."""
    from textsql.cluster.hostfile import address_problem, check_addresses
    from textsql.cluster.runs import choose_checkpoint, interrupted_siblings, planned_run_dir, recorded_world_size
    from textsql.strategy.dsconfig import describe_strategy
    from textsql.train.arguments import arguments_dict, as_arguments
    from textsql.train.distributed import free_port

    workdir = Path(workdir).absolute()
    launch_id = launch_id or new_launch_id()
    log_dir = Path(log_root).absolute() / launch_id
    bad = [f"{n.address}: {problem}" for n in nodes if (problem := address_problem(n.address))]
    if bad:
        raise PreflightError("These node addresses cannot be used:\n" + "\n".join(f"  {b}" for b in bad))
    check_addresses([Host(n.address) for n in nodes])  # unresolvable names, two entries of one machine
    model, data, training = as_arguments(arguments)
    decision = decide(nodes, model, training)
    dsconfig, dsconfig_content = _dsconfig_file(training, workdir)
    strategy = describe_strategy(dsconfig_content)
    if (
        training.fsdp_config
    ):  # FSDP2: a shipped name or a file every node reads (hybrid: sharded in a pod, replicated across)
        from textsql.strategy.fsdpconfig import describe_fsdp_strategy
        from textsql.train.run import load_fsdp_strategy

        strategy = describe_fsdp_strategy(load_fsdp_strategy(training.fsdp_config))
    zero_stage = strategy["zero_stage"]
    run_dir = planned_run_dir(model, training, decision.world_size, workdir, strategy["label"])
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    marker = run_dir.parent / f".textsql-shared-probe-{secrets.token_hex(4)}"
    marker_text = secrets.token_hex(16)
    with open_unlinked(marker, "w", exclusive=True) as f:
        f.write(marker_text)
    dataset = absolute_in(workdir, data.dataset_dir)
    model_dir = absolute_in(workdir, model.model_id)
    model_dir = model_dir if model_dir.exists() else None
    request = {
        "dirs": [str(workdir), str(dataset)] + ([str(model_dir)] if model_dir else []),
        "files": [str(p) for p in (dsconfig,) if p] + ([str(model_dir / "config.json")] if model_dir else []),
        "shared_marker": {"path": str(marker), "digest": hashlib.sha256(marker_text.encode()).hexdigest()},
        "run_dir": str(run_dir),
    }
    try:
        probes = ask("probe", {n.address: request for n in nodes})
    finally:
        marker.unlink(missing_ok=True)
    problems = probe_problems(nodes, probes, workdir=workdir, dataset=dataset)
    if problems:
        raise PreflightError(f"Preflight found {len(problems)} problem(s):\n" + "\n".join(f"  {p}" for p in problems))
    shared = all(p.get("shared_output") for p in probes.values())
    head = probes[nodes[0].address]
    overwrite = training.overwrite
    if head.get("finished") and not overwrite:
        raise PreflightError(
            f"{run_dir} holds a finished run (run_summary.json is there). Pass --overwrite True to train again in it, "
            "or choose another --output_dir / --runs_root."
        )
    world = decision.world_size
    if overwrite:
        from textsql.cluster.runs import ResumePlan

        resume = ResumePlan(None)
    else:
        if not training.output_dir:
            for size, folder in sorted(interrupted_siblings(run_dir, world).items()):
                raise PreflightError(
                    f"{folder} holds an interrupted run of world size {size}, but this launch has world size {world} (and would "
                    f"start a new run in {run_dir.name} from step 0). Launch with {size} rank(s) to resume it; or, to start "
                    "afresh at this size, move that folder away or pass another --runs_root / --output_dir."
                )
        if shared:
            views, ranks_by_view = {nodes[0].address: head["checkpoints"]}, {nodes[0].address: list(range(world))}
        else:
            views = {n.address: probes[n.address]["checkpoints"] for n in nodes}
            ranks_by_view = {n.address: ranks_of(decision.hosts, n.address) for n in nodes}
        try:
            recorded = recorded_world_size(head.get("record"), run_dir)
            resume = choose_checkpoint(
                views, ranks_by_view, world, zero_stage, recorded_world_size=recorded, run_dir=run_dir
            )
        except TextsqlError as error:
            raise PreflightError(str(error)) from None
    # Decided here once for every rank: the device, the precision (the Trainer's own flags folded into it), the files.
    decided = {
        "accelerator": decision.accelerator,
        "precision": decision.precision.name,
        "bf16": False,
        "fp16": False,
        "deepspeed": str(dsconfig) if dsconfig else None,
    }
    node_files = {}
    if not shared:
        decided["save_on_each_node"] = True
        if dsconfig is not None:  # DeepSpeed saves each node's shards by its local ranks there
            config = copy.deepcopy(dsconfig_content)
            config.setdefault("checkpoint", {})["use_node_local_storage"] = True
            local = log_dir / f"node-local-{dsconfig.name}"
            node_files[str(local)] = json.dumps(config, indent=2) + "\n"
            decided["deepspeed"] = str(local)
    rank_arguments = dict(arguments_dict(model, data, training), **decided)
    common, per_node = rank_environments(decision, nodes, environ, log_dir)
    return LaunchPlan(
        launch_id,
        nodes,
        decision,
        workdir,
        log_dir,
        run_dir,
        shared,
        resume,
        zero_stage,
        rank_arguments,
        common,
        per_node,
        master_port or free_port(nodes[0].address),
        node_files,
        probes,
    )


def probe_problems(nodes: list[NodeFacts], probes: dict[str, dict], *, workdir: Path, dataset: Path) -> list[str]:
    """What is wrong where, from each node's facts and probe, compared with node 0's."""
    problems = []
    reference = nodes[0].facts
    for index, node in enumerate(nodes):
        facts, probe = node.facts, probes.get(node.address) or {}
        where = node.address + (" (node 0)" if index == 0 else "")
        if index:
            if facts["python"] != reference["python"]:
                problems.append(
                    f"{where}: Python {facts['python']}, but node 0 ({nodes[0].address}) has {reference['python']}"
                )
            for name, have in facts["versions"].items():
                want = reference["versions"].get(name)
                if have != want:
                    problems.append(
                        f"{where}: {name} {have or 'is not installed'}, but node 0 ({nodes[0].address}) has {want}"
                    )
        for path, is_dir in probe.get("dirs", {}).items():
            if not is_dir:
                what = (
                    "working folder"
                    if path == str(workdir)
                    else "dataset folder"
                    if path == str(dataset)
                    else "model folder"
                )
                problems.append(f"{where}: the {what} {path} does not exist there")
        for path, digest in probe.get("files", {}).items():
            want = (probes.get(nodes[0].address) or {}).get("files", {}).get(path)
            if digest is None:
                problems.append(f"{where}: {path} does not exist there")
            elif index and digest != want:
                problems.append(f"{where}: {path} differs from node 0's copy")
    return problems


# ---------------------------------------------------------------------------------------------------------------------
# Watching a launch
# ---------------------------------------------------------------------------------------------------------------------


@dataclass
class LaunchMonitor:
    """What the streamed output of a launch says: rank failures, nodes whose launcher ended badly or that were lost,
    each rank's summary and log tail. Lines come as `<node address>: <text>`, ranks' as `<address>: [rank N] <text>`."""

    failures: list[dict] = field(default_factory=list)
    node_exits: dict[str, object] = field(default_factory=dict)
    ranks: dict[int, dict] = field(default_factory=dict)
    tails: dict[int, list[str]] = field(default_factory=dict)
    summary_path: str | None = None
    failed_at: float | None = None
    lost_at: dict[str, float] = field(default_factory=dict)  # nodes whose agent vanished or fell silent: since when

    def feed(self, line: str) -> None:
        from textsql.train.local_launch import SUMMARY_MARKER

        match = RANK_LINE.match(line)
        text = match["text"] if match else line
        if match:
            tail = self.tails.setdefault(int(match["rank"]), [])
            tail.append(text)
            del tail[:-40]
        if RANK_EXIT_MARKER in text:
            record = rank_report(text.split(RANK_EXIT_MARKER, 1)[1])
            if record is not None:  # else output that only looks like a report; the node's exit status still counts
                self.failures.append(dict(_failure_defaults(record), node_address=match and match["host"]))
        elif RANK_SUMMARY_MARKER in text:
            record = rank_report(text.split(RANK_SUMMARY_MARKER, 1)[1])
            if record is not None:
                self.ranks[record["rank"]] = dict(record, node_address=match and match["host"])
        elif SUMMARY_MARKER in text:
            self.summary_path = text.split(SUMMARY_MARKER, 1)[1].strip()
        self._check()

    def node_ended(self, address: str, code, at: float | None = None) -> None:
        """A node's launcher ended (exit status), or the node was lost ("lost: <why>", its agent gone `at` that
        wall-clock time)."""
        self.node_exits[address] = code
        if str(code).startswith("lost") and code != NOT_STOPPED:
            self.lost_at.setdefault(address, time.time() if at is None else at)
        self._check()

    def _check(self) -> None:
        bad_exit = any(code != 0 for code in self.node_exits.values())
        if (self.failures or bad_exit) and self.failed_at is None:
            self.failed_at = time.monotonic()


def rank_report(payload: str) -> dict | None:
    """A rank's JSON report (textsql.cluster.rank), or None for text that only looks like one: a training's own
    output, or a report cut short or garbled on the way."""
    try:
        record = json.loads(payload)
    except (ValueError, RecursionError):
        return None
    if not isinstance(record, dict) or type(record.get("rank")) is not int:
        return None
    return record


def _failure_defaults(record: dict) -> dict:
    """A failure report with every field the error message reads, of the type it reads."""
    tail = record.get("tail")
    ended = record.get("ended_at")
    return dict(
        record,
        how=str(record.get("how") or "failed"),
        host=str(record.get("host") or "?"),
        log=str(record.get("log") or "?"),
        tail=[str(t) for t in tail] if isinstance(tail, list) else [],
        ended_at=ended if type(ended) in (int, float) else None,
    )


def describe_loss(reason: str) -> str:
    """Why a node's agent is gone, for people: it fell silent (frozen, cut off) or vanished (died, with its pod)."""
    if reason.startswith("silent"):
        return f"its agent went {reason}"
    return f"its agent vanished ({reason}: the agent, or its pod, died)"


def secondary(record: dict) -> bool:
    """A rank that failed because another one did: its launcher stopped it, or its connection to a peer broke."""
    return bool(record.get("told_to_stop")) or bool(AFTERMATH.search("\n".join(record.get("tail", []))))


def first_failure(failures: list[dict]) -> dict:
    """The rank that failed first: the earliest of those that did not merely lose a peer (reports come through one
    stream per node, so not in the order the ranks died)."""
    pool = [f for f in failures if not secondary(f)] or failures
    return min(pool, key=lambda f: f.get("ended_at") or float("inf"))


def failure_message(
    monitor: LaunchMonitor, hosts: list[Host], launch_dir: Path, resume: str | None
) -> tuple[str, list[dict]]:
    """The error a failed launch raises, and the rank records with the first failing rank first. A node whose agent
    vanished or fell silent before any rank failed on its own is named first: its peers' failures only followed."""
    failures = list(monitor.failures)
    node_of = {h.address: i for i, h in enumerate(hosts)}
    layout = rank_layout(hosts)
    real = [f.get("ended_at") or float("inf") for f in failures if not secondary(f)]
    first_real = min(real, default=float("inf"))
    lost_first = [address for at, address in sorted((at, a) for a, at in monitor.lost_at.items() if at <= first_real)]
    stopped = "Every process of the launch was stopped on every node."
    if lost_first:
        lines = []
        for address in lost_first:
            on_host = [r for r, (h, _) in layout.items() if h == address]
            lines.append(
                f"Node {node_of.get(address, '?')} ({address}, rank(s) {', '.join(map(str, on_host))}) was lost first: "
                f"{describe_loss(str(monitor.node_exits[address]).removeprefix('lost: '))}."
            )
            for rank in on_host:
                lines += [f"  rank {rank} | {t}" for t in monitor.tails.get(rank, [])[-10:]]
        failures.sort(key=lambda f: f.get("ended_at") or float("inf"))
        for other in failures:
            lines.append(
                f"Then rank {other['rank']} on {other.get('node_address') or other['host']}: {other['how']}"
                f"{' (stopped because of it)' if secondary(other) else ''} (log {other['log']})."
            )
        lost_nodes = ", ".join(f"node {node_of.get(a, '?')}" for a in lost_first)
        stopped = (
            f"Every process of the launch was stopped on every node that still answered; those of {lost_nodes} end "
            "with its agent (a guard stops them when the agent dies; the agent stops them when it no longer hears "
            "the session; stopping the workers, the default, ends it)."
        )
    elif failures:
        first = first_failure(failures)
        failures.remove(first)
        failures.sort(key=lambda f: f.get("ended_at") or float("inf"))
        failures.insert(0, first)
        address = first.get("node_address") or first["host"]
        lines = [
            f"Rank {first['rank']} on node {node_of.get(address, '?')} ({address}, host {first['host']}) failed first: {first['how']}.",
            f"Its log: {first['log']} (on that node). Last lines:",
        ]
        lines += [f"  | {t}" for t in first["tail"]]
        for other in failures[1:]:
            lines.append(
                f"Then rank {other['rank']} on {other.get('node_address') or other['host']}: {other['how']}"
                f"{' (stopped because of it)' if secondary(other) else ''} (log {other['log']})."
            )
    else:
        bad = {a: c for a, c in monitor.node_exits.items() if c != 0} or monitor.node_exits
        lines = []
        for address, code in bad.items():
            on_host = [r for r, (h, _) in layout.items() if h == address]
            what = (
                f"was lost ({str(code).removeprefix('lost: ')})"
                if str(code).startswith("lost")
                else f"ended with exit status {code}"
            )
            lines.append(
                f"Node {node_of.get(address, '?')} ({address}, rank(s) {', '.join(map(str, on_host))}): its launcher {what} without a rank report."
            )
            for rank in on_host:
                lines += [f"  rank {rank} | {t}" for t in monitor.tails.get(rank, [])[-10:]]
        if not lines:
            lines = ["The launch ended without a run summary."]
    lines.append(f"{stopped} Whole output: {launch_dir / 'launch.log'}.")
    if resume:
        lines.append(f"Launch again with the same arguments: the next launch {resume}.")
    return "\n".join(lines), failures


def resume_sentence(plan: LaunchPlan, ask) -> str:
    """What the next launch will do, from every node's checkpoints as they are now (after the stop)."""
    from textsql.cluster.runs import choose_checkpoint

    nodes = plan.nodes if not plan.shared_output else plan.nodes[:1]
    try:
        probes = ask("probe", {n.address: {"run_dir": str(plan.run_dir)} for n in nodes})
        world = plan.decision.world_size
        views = {n.address: probes[n.address]["checkpoints"] for n in nodes}
        ranks = {
            n.address: list(range(world)) if plan.shared_output else ranks_of(plan.hosts, n.address) for n in nodes
        }
        return choose_checkpoint(
            views, ranks, world, plan.zero_stage, recorded_world_size=world, run_dir=plan.run_dir
        ).sentence()
    except TextsqlError as error:
        return f"cannot tell which checkpoint it resumes from: {error}"


def run_on_agents(
    links: list,
    plan: LaunchPlan,
    *,
    events: queue.Queue,
    echo=print,
    grace_seconds: float = 5,
    timeout_s: float | None = None,
) -> dict:
    """The launch through node agents (links in node order): prepare every node, start `deepspeed --no_ssh --node_rank
    i` on each, stream, and stop every node on the first failure, an interrupt or past `timeout_s` (seconds from the
    start, start-up included). Returns the result dict; raises LaunchFailed, the interrupt or
    textsql.train.local_launch.TrainingTimedOut, after stopping every node's processes (the agents stay)."""
    from textsql.cluster.coordinator import ask_all
    from textsql.cluster.interrupts import interrupts_deferred

    def ask(op, payloads):
        by_address = {link.address: link for link in links}
        return ask_all([by_address[a] for a in payloads], op, payloads)

    while True:  # anything an earlier launch left in the queue is not this launch's
        try:
            events.get_nowait()
        except queue.Empty:
            break
    plan.log_dir.mkdir(parents=True, exist_ok=True)
    ask("prepare", plan.prepare_requests())
    commands = {}
    for index, link in enumerate(links):
        commands[link.address] = plan.deepspeed_command(
            link.facts["executable"], ["--no_ssh", "--node_rank", str(index)]
        )
    echo("node 0: " + _shown(commands[links[0].address]))
    echo("training arguments (the same on every rank): " + json.dumps(plan.arguments))
    echo(f"launch folder {plan.log_dir} (launch.log here; rank-N.log on each rank's node)")
    monitor = LaunchMonitor()
    running = {link.address for link in links}
    stopping_since = None
    started = []
    tail: deque[str] = deque(maxlen=6)  # a time-out's message ends with the last lines
    deadline = time.monotonic() + timeout_s if timeout_s else None
    with open_unlinked(plan.log_dir / "launch.log", "w", buffering=1) as log:
        try:
            for index, link in enumerate(links):
                env = dict(plan.env, **plan.node_env[str(index)])
                answer = link.ask(
                    "run", command=commands[link.address], env=env, cwd=str(plan.workdir), launch_id=plan.launch_id
                )
                link.launcher = (answer.get("pid"), plan.launch_id) if isinstance(answer, dict) else None
                started.append(link)
            while running:
                try:
                    link, message = events.get(timeout=0.5)
                except queue.Empty:
                    link, message = None, None
                if message is not None and message.get("launch_id", plan.launch_id) == plan.launch_id:
                    op = message.get("op")
                    if op == "line":
                        line = f"{link.address}: {message['text']}"
                        log.write(line + "\n")
                        echo(line)
                        monitor.feed(line)
                        tail.append(line)
                    elif op in ("exit", "lost"):
                        running.discard(link.address)
                        if op == "exit":
                            monitor.node_ended(link.address, message.get("code"))
                        else:
                            monitor.node_ended(link.address, f"lost: {message.get('reason')}", at=message.get("at"))
                now = time.monotonic()
                if deadline is not None and now > deadline and stopping_since is None and monitor.failed_at is None:
                    from textsql.train.local_launch import TrainingTimedOut

                    raise TrainingTimedOut(timeout_s, list(tail))  # stopped below, as an interrupt is
                if (
                    stopping_since is None
                    and monitor.failed_at is not None
                    and now - monitor.failed_at >= grace_seconds
                ):
                    echo(f"textsql: a rank failed or a node was lost; stopping launch {plan.launch_id} on every node")
                    stopping_since = _stop_all(links)
                if stopping_since is not None and now - stopping_since > STOP_WAIT_SECONDS:
                    for address in running:
                        monitor.node_ended(address, NOT_STOPPED)
                    break
        except BaseException:
            with interrupts_deferred(echo):
                why = "past its time limit" if deadline is not None and time.monotonic() > deadline else "interrupted"
                echo(f"textsql: {why}; stopping launch {plan.launch_id} on every node")
                _stop_all(started)
                _wait_for_exits(events, {link.address for link in started} & running, log)
            raise
    if monitor.failed_at is not None or monitor.summary_path is None:
        resume = resume_sentence(plan, ask)
        message, failures = failure_message(monitor, plan.hosts, plan.log_dir, resume)
        raise LaunchFailed(message, failures, plan.log_dir, resume)
    return launch_result(plan, monitor, commands[links[0].address])


def _stop_all(links: list) -> float:
    for link in links:
        link.send(op="stop")
    return time.monotonic()


def _wait_for_exits(events: queue.Queue, running: set[str], log) -> None:
    deadline = time.monotonic() + STOP_WAIT_SECONDS
    while running and time.monotonic() < deadline:
        try:
            link, message = events.get(timeout=0.5)
        except queue.Empty:
            continue
        if message.get("op") == "line":
            log.write(f"{link.address}: {message['text']}\n")
        elif message.get("op") in ("exit", "lost"):
            running.discard(link.address)


def launch_result(plan: LaunchPlan, monitor: LaunchMonitor, command: list[str]) -> dict:
    """What a finished launch returns (every backend): the run's summary, each rank's own summary, where the logs are."""
    from textsql.run_summary import read_summary

    summary = read_summary(monitor.summary_path)
    return {
        "summary": summary,
        "ranks": [monitor.ranks[r] for r in sorted(monitor.ranks)],
        "launch_dir": plan.log_dir,
        "command": command,
        "shared_output": plan.shared_output,
        "plan": plan,
    }


def _shown(command: list[str]) -> str:
    """A command for people: the spec (base64) shortened, the training arguments are echoed separately."""
    return " ".join(shlex.quote(a if not a.startswith(SPEC_FLAG) else SPEC_FLAG + "...") for a in command)
