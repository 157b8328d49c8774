"""One multi-pod launch, decided once on the session: device and precision, the run folder and the checkpoint it
resumes from, what every rank checks itself against, and, after the launch, which rank or pod failed first (from the
records in the shared launch folder). Shared by torchrun pods (textsql.cluster.pods) and pdsh (textsql.cluster.pdsh)."""

from __future__ import annotations

import base64
import hashlib
import json
import re
import secrets
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from textsql.cluster.runs import ResumePlan, absolute_in
from textsql.errors import TextsqlError
from textsql.sharedfiles import read_unlinked

# How a rank fails when another one died first: its collective or socket broke, or its launcher stopped it.
AFTERMATH = re.compile(
    r"Connection (?:closed|reset) by (?:remote )?peer|remote process exited|ncclRemoteError|NCCL communicator was aborted|"
    r"Broken pipe|Socket Timeout|DistNetworkError|DistStoreError|recvBytes failed|Read error|gloo::EnforceNotMet|"
    r"timed out|failed to recv|Connection refused|SIGTERM|SignalException|waiting for its peers",
    re.IGNORECASE,
)
VERSIONED = ("textsql", "deepspeed", "torch", "transformers")


class PreflightError(TextsqlError):
    """The launch cannot start as asked; the message says what is wrong where."""


class LaunchFailed(TextsqlError):
    """A multi-pod launch ended badly. `failures`: the records (first failure first); `resume`: what the next launch
    resumes from."""

    def __init__(self, message: str, failures: list[dict], launch_dir: Path, resume: str | None = None):
        super().__init__(message)
        self.failures, self.launch_dir, self.resume = failures, launch_dir, resume


def encode(data) -> str:
    """JSON as one shell-safe word (base64url): how the spec reaches every rank, unexpanded by any shell."""
    return base64.urlsafe_b64encode(json.dumps(data).encode()).decode()


def decode(word: str):
    return json.loads(base64.urlsafe_b64decode(word.encode()))


def new_launch_id() -> str:
    return time.strftime("%Y%m%d-%H%M%S-") + secrets.token_hex(3)


def versions() -> dict:
    import importlib.metadata as metadata

    found = {"python": sys.version.split()[0]}
    for name in VERSIONED:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = None
    return found


def digest(path) -> str | None:
    try:
        with open(path, "rb") as f:
            return hashlib.sha256(f.read()).hexdigest()
    except OSError:
        return None


@dataclass
class LaunchPlan:
    """Everything a launch does, decided before anything starts; `spec()` is what every rank gets."""

    launch_id: str
    launch_dir: Path
    run_dir: Path
    workdir: Path
    ranks: list[int]  # each pod's, the session's first: decided here once, each pod started with its own
    accelerator: str
    precision: object  # textsql.strategy.devices.PrecisionChoice
    resume: object  # textsql.cluster.runs.ResumePlan
    zero_stage: int | None
    arguments: dict  # textsql.arguments.training_dict: what every rank trains with, exactly
    expect: dict  # what every rank checks itself against (versions, folders, file digests, the shared-folder marker)
    env: dict[str, str] = field(default_factory=dict)  # the allowlisted variables of the session, for every rank
    least: int | None = None  # elastic: the fewest ranks it may train with

    @property
    def world_size(self) -> int:
        return sum(self.ranks)

    def sizes(self) -> str:
        if not self.least or self.least == self.world_size:
            return str(self.world_size)
        return f"{self.least} to {self.world_size} (elastic: the ranks of the pods that joined within the join window)"

    def spec(self, **extra) -> dict:
        names = "launch_id launch_dir workdir run_dir arguments accelerator expect env zero_stage".split()
        spec = {name: str(v) if isinstance(v := getattr(self, name), Path) else v for name in names}
        return dict(spec, precision=self.precision.name, **extra)

    def describe(self) -> str:
        return (
            f"world size {self.sizes()} on {'GPUs (NCCL)' if self.accelerator == 'cuda' else 'CPUs (gloo)'}, "
            f"precision {self.precision.name} ({self.precision.reason}), TF32 {'on' if self.precision.tf32 else 'off'}\n"
            f"run folder {self.run_dir}; the launch {self.resume.sentence()}\n"
            f"launch folder {self.launch_dir} (each pod's log, each rank's record)"
        )


def plan_launch(
    arguments,
    *,
    ranks: list[int | None],
    devices,
    workdir: Path,
    log_root: Path,
    env: dict,
    min_pods: int | None = None,
) -> LaunchPlan:
    """Decide and prepare a launch on the session (the run folder is shared by every pod): raises PreflightError.
    `arguments`: textsql.train's three dataclasses or a command line; `ranks`: the ranks each pod asks for, the
    session's first (None: one per GPU it has), then the workers' (their own GPUs); `devices`: the session's
    (textsql.strategy.devices.NodeDevices); `min_pods`: elastic, the launch may train on its first `min_pods` pods
    alone; `env`: the session's variables every rank gets (textsql.redaction.forwarded). Every rank checks that its
    pod matches (textsql.cluster.rank.check_pod)."""
    from textsql.arguments.training import arguments_dict, as_arguments
    from textsql.cluster.runs import interrupted_siblings, planned_run_dir, recorded_world_size, resume_plan
    from textsql.strategy.devices import resolve_run_devices
    from textsql.strategy.dsconfig import resolve_dsconfig_path
    from textsql.train.run import load_strategy

    workdir = Path(workdir).absolute()
    model, data, training = as_arguments(arguments)
    if isinstance(training.deepspeed, dict):
        raise PreflightError("Pass the DeepSpeed config of a multi-pod launch as a file or a shipped name, not a dict.")
    dsconfig = None
    if training.deepspeed:  # the file every rank reads, as this session finds it
        candidate = absolute_in(workdir, training.deepspeed)
        name = str(candidate) if candidate.exists() else training.deepspeed
        dsconfig = absolute_in(workdir, str(resolve_dsconfig_path(name)))
    try:
        resolved = resolve_run_devices(training, model.model_id, devices, ranks_asked=ranks[0])
        accelerator, precision, ranks = resolved.accelerator, resolved.precision, [resolved.ranks, *ranks[1:]]
        world, least = sum(ranks), sum(ranks[: min_pods or len(ranks)])
        strategy = load_strategy(str(dsconfig) if dsconfig else None, training.fsdp_config, training.nvme_path)[1]
    except TextsqlError as error:
        raise PreflightError(str(error)) from None
    if least < world and not training.output_dir:
        raise PreflightError(
            f"An elastic launch trains at a world size known only once its pods joined ({least} to {world} ranks), "
            "and a run folder's name holds the world size: pass --output_dir (output_dir=...) to name the run's folder."
        )
    run_dir = planned_run_dir(model, training, world, workdir, strategy["label"])
    if (run_dir / "run_summary.json").exists() and not training.overwrite:
        raise PreflightError(
            f"{run_dir} holds a finished run (run_summary.json is there). Pass --overwrite True to train again in it, "
            "or choose another --output_dir / --runs_root."
        )
    if not (training.output_dir or training.overwrite):
        for size, folder in sorted(interrupted_siblings(run_dir, world).items()):
            raise PreflightError(
                f"{folder} holds an interrupted run of world size {size}, but this launch has world size {world} "
                f"(and would start a new run in {run_dir.name} from step 0). Pass --output_dir {folder} to resume it "
                f"at this size, or launch with {size} rank(s); or, to start afresh at this size, move that folder away "
                "or pass another --runs_root / --output_dir."
            )
    try:  # an elastic run resumes at the size it trained at, when the launch can reach it (its ranks check it)
        recorded = recorded_world_size(run_dir)
        size = recorded if recorded is not None and least <= recorded <= world else world
        resume = ResumePlan(None) if training.overwrite else resume_plan(run_dir, size, strategy["zero_stage"])
    except TextsqlError as error:
        raise PreflightError(str(error)) from None
    dataset, model_dir = absolute_in(workdir, data.dataset_dir), absolute_in(workdir, model.model_id)
    expect = {
        "versions": versions(),
        "dirs": [str(workdir), str(dataset)] + ([str(model_dir)] if model_dir.exists() else []),
        "files": {str(p): digest(p) for p in (dsconfig, model_dir / "config.json") if p and p.exists()},
    }
    decided = dict(accelerator=accelerator, precision=precision.name, bf16=False, fp16=False)
    decided["deepspeed"] = str(dsconfig) if dsconfig else None
    launch_id = new_launch_id()
    return LaunchPlan(
        launch_id,
        Path(log_root).absolute() / launch_id,
        run_dir,
        workdir,
        ranks,
        accelerator,
        precision,
        resume,
        strategy["zero_stage"],
        dict(arguments_dict(model, data, training), **decided),  # what every rank trains with, exactly
        expect,
        env,
        least,
    )


def prepare(plan: LaunchPlan) -> None:
    """Get the run folder and the launch folder ready (the session holds the run lock): newer incomplete checkpoints
    set aside (renamed, never deleted: textsql.train resumes from the newest one left), the chosen one checked before
    any rank loads it, and the marker by which every rank proves it sees this launch folder. Rank 0 writes the run's
    record once its world size is known (textsql.cluster.rank.start_round)."""
    from textsql.checkpoints import verify_checkpoint
    from textsql.cluster.runs import set_aside
    from textsql.sharedfiles import replace_file

    set_aside(plan.run_dir, plan.resume, plan.launch_id)
    if plan.resume.checkpoint:
        verify_checkpoint(plan.run_dir / plan.resume.checkpoint)
    plan.run_dir.mkdir(parents=True, exist_ok=True)
    (plan.launch_dir / "ranks").mkdir(parents=True)
    marker = plan.launch_dir / "shared-marker"
    replace_file(marker, secrets.token_hex(16))
    plan.expect["files"][str(marker)] = digest(marker)


def write_record(launch_dir, kind: str, record: dict) -> None:
    """A rank's record of one kind for its round (torchrun's restarts start a new round), or a pod's (rank -1)."""
    from textsql.sharedfiles import replace_file

    rank, round_ = record["rank"], record.get("round", 0)
    name = f"r{round_}-rank-{rank}.{kind}.json" if rank >= 0 else f"pod-{record['node_address']}.{kind}.json"
    replace_file(Path(launch_dir) / "ranks" / name, json.dumps(record))


def read_records(launch_dir: Path, kind: str, round_: int | None = None) -> list[dict]:
    """The records of one kind (`failure`, `summary`, `started`) in the launch folder, of one round when given (a
    pod's own count in every round); a broken one is skipped."""
    found = []
    for path in sorted((Path(launch_dir) / "ranks").glob(f"*.{kind}.json")):
        try:
            record = json.loads(read_unlinked(path))
        except (OSError, ValueError, TextsqlError):
            continue
        if isinstance(record, dict) and type(record.get("rank")) is int and type(record.setdefault("round", 0)) is int:
            if round_ is None or record["round"] == round_ or record["rank"] < 0:
                found.append(record)
    return found


def last_round(launch_dir: Path) -> int:
    """The newest round any rank started or failed in (0: no restart)."""
    return max((r["round"] for kind in ("started", "failure") for r in read_records(launch_dir, kind)), default=0)


def secondary(record: dict) -> bool:
    """A rank that failed because another one did: its connection to a peer broke, or it was told to stop."""
    return bool(AFTERMATH.search(str(record.get("how", "")) + "\n" + "\n".join(map(str, record.get("tail", [])))))


def first_failure(failures: list[dict]) -> dict:
    """The rank that failed first: the earliest record of those that did not merely lose a peer."""
    pool = [f for f in failures if not secondary(f)] or failures
    return min(pool, key=lambda f: f.get("ended_at") or float("inf"))


def failure_message(
    failures: list[dict], lost: dict[str, str], launch_dir: Path, resume: str | None, restarts: list[dict] = ()
) -> str:
    """The error a failed launch raises. `lost`: pods that ended without a rank's record, or went silent (address ->
    how), named first unless a rank had failed on its own before; `restarts`: the first failure of each round that
    torchrun restarted."""
    pods_first = bool(lost) and all(secondary(f) for f in failures)
    lines = [f"Pod {address} was lost first: {how}." for address, how in lost.items()] if pods_first else []
    first = first_failure(failures) if failures else None
    alike = [f for f in failures if not secondary(f)]
    phases = {f.get("phase") if "no progress" in str(f.get("how")) else None for f in alike}
    if first and not pods_first and len(alike) > 1 and len(phases) == 1 and None not in phases:  # all slow alike
        ranks = ", ".join(f"{f['rank']} on pod {f.get('node_address')}" for f in sorted(alike, key=lambda f: f["rank"]))
        lines.append(
            f"Every rank that failed (ranks {ranks}) was in its {phases.pop()} without progress past its limit: it is "
            "slow on every rank (a slow file system, a model larger than the limits assume), not one rank blocked. "
            "Raise its limit (textsql cluster train --help, Cluster(limits=WatchLimits(...)))."
        )
        first, failures = None, [f for f in failures if secondary(f)]
    if first and not pods_first:
        where = f"Rank {first['rank']} on pod {first.get('node_address', '?')}"
        lines += [f"{where} failed first: {first.get('how', 'failed')}."] + [
            f"  | {t}" for t in first.get("tail", [])[-15:]
        ]
    for other in sorted((f for f in failures if f is not first or pods_first), key=lambda f: f.get("ended_at") or 0):
        lines.append(
            f"Then rank {other['rank']} on {other.get('node_address', '?')}: {str(other.get('how'))[:200]}"
            f"{' (stopped because of it)' if secondary(other) else ''}."
        )
    lines = lines or ["The launch ended without a run summary."]
    if restarts:
        lines.append(
            f"The restarts are used up: torchrun restarted every rank {len(restarts)} time(s), after "
            + ", then ".join(
                f"rank {r['rank']} on pod {r.get('node_address', '?')} failed in round {r['round']} "
                f"({str(r.get('how'))[:200]})"
                for r in restarts
            )
            + "."
        )
    lines.append(f"Every process of the launch was stopped. Logs: {launch_dir} (pod-<address>.log).")
    if resume:
        lines.append(f"Launch again with the same arguments: the next launch {resume}.")
    return "\n".join(lines)


def finish(plan: LaunchPlan, lost: dict[str, str], command: list[str]) -> dict:
    """Once every process of the launch is stopped: raises LaunchFailed naming the rank or pod that failed first (in
    the last round: torchrun restarted the earlier ones), with what the next launch resumes from; else the run's
    summary, each rank's own summary, the first failure of each round torchrun restarted, where the logs are."""
    from textsql.cluster.runs import recorded_world_size, resume_plan
    from textsql.run_summary import read_summary

    last = last_round(plan.launch_dir)
    failures = read_records(plan.launch_dir, "failure", last)
    restarts = [first_failure(f) for r in range(last) if (f := read_records(plan.launch_dir, "failure", r))]
    if failures or lost:
        try:  # what the next launch will do, from the run folder's checkpoints as they are now (after the stop)
            size = recorded_world_size(plan.run_dir) or plan.world_size
            resume = resume_plan(plan.run_dir, size, plan.zero_stage).sentence()
        except TextsqlError as error:
            resume = f"cannot tell which checkpoint it resumes from: {error}"
        message = failure_message(failures, lost, plan.launch_dir, resume, restarts)
        raise LaunchFailed(message, failures, plan.launch_dir, resume)
    ranks = sorted(read_records(plan.launch_dir, "summary", last), key=lambda r: r["rank"])
    if not ranks or ranks[0]["rank"] != 0 or not ranks[0].get("run_summary"):
        raise LaunchFailed(f"The launch ended without rank 0's summary (logs: {plan.launch_dir}).", [], plan.launch_dir)
    summary = read_summary(ranks[0]["run_summary"])
    return dict(summary=summary, ranks=ranks, restarts=restarts, launch_dir=plan.launch_dir, command=command, plan=plan)


def new_lines(path: Path, offsets: dict[str, int]) -> list[str]:
    """The complete lines appended to the log `path` since the last call (`offsets`: how far each log was read)."""
    try:
        with open(path, "rb") as f:
            f.seek(offsets.get(str(path), 0))
            data = f.read()
    except OSError:
        return []
    end = data.rfind(b"\n") + 1
    offsets[str(path)] = offsets.get(str(path), 0) + end
    return data[:end].decode(errors="replace").splitlines()
