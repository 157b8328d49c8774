"""The run a multi-node launch trains: its folder, the lock that keeps two launches out of it, and which checkpoint a
launch resumes from (the newest one complete for every rank that wrote it; never a partial one): at another world
size, a ZeRO checkpoint converted to DeepSpeed's universal format, its global batch kept where it divides."""

from __future__ import annotations

import json
import os
import re
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path

from textsql.checkpoints import (
    checkpoint_step,
    list_checkpoints,
    missing_parts,
    newest_whole_checkpoint,
    saved_world_size,
    verify_checkpoint,
)
from textsql.errors import TextsqlError
from textsql.paths import LAUNCH_RECORD_FILE as RECORD
from textsql.sharedfiles import open_unlinked, read_unlinked

QUARANTINE_PREFIX = "incomplete-"  # not "checkpoint-*": the Trainer neither resumes from nor rotates what we set aside


def planned_run_dir(model, training, world_size: int, workdir: Path, strategy_label: str | None = None) -> Path:
    """The folder `textsql.train` will write for these arguments (textsql.train's ModelArguments and
    TextsqlTrainingArguments) at this world size, relative paths taken from `workdir`; `strategy_label` is the
    DeepSpeed config's (textsql.strategy.dsconfig.describe_strategy), read from the config when not given."""
    from textsql.train.run import run_dir

    return absolute_in(workdir, str(run_dir(model, training, world_size, strategy_label)))


def absolute_in(workdir: Path, path: str) -> Path:
    """`path`, taken from `workdir` when relative."""
    return Path(path) if Path(path).is_absolute() else (Path(workdir) / path).absolute()


def interrupted_siblings(run_dir: Path, world_size: int) -> dict[int, Path]:
    """Other world sizes' folders of the same run (…-ws<K>-…) that hold an interrupted run: K -> folder."""
    from textsql.run_summary import run_state

    marker = f"-ws{world_size}-"
    if marker not in run_dir.name or not run_dir.parent.is_dir():
        return {}
    head, tail = run_dir.name.split(marker, 1)
    pattern = re.compile(re.escape(head) + r"-ws(\d+)-" + re.escape(tail) + "$")
    found = {}
    for sibling in run_dir.parent.iterdir():
        match = pattern.match(sibling.name)
        if match and int(match[1]) != world_size and run_state(sibling) == "interrupted":
            found[int(match[1])] = sibling
    return found


class FileLock:
    """An exclusive lock held while a cluster or a launch lives: flock on a file (released by the kernel when the
    process dies, so a restarted notebook kernel never finds its own stale lock; a second open file of this process
    conflicts too). The file records who holds it, for the message that refuses the next one."""

    def __init__(self, path: Path, what: str, fix: str, owner: dict):
        import fcntl

        self.path = Path(path).absolute()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.file = open_unlinked(self.path, "a+")  # never through a link a collaborator planted
        try:
            fcntl.flock(self.file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self.file.close()
            raise TextsqlError(f"{what} is in use by {_read_owner(self.path)}. {fix}") from None
        self.file.seek(0)
        self.file.truncate()
        since = time.strftime("%Y-%m-%d %H:%M:%S")
        self.file.write(json.dumps(dict(owner, host=socket.gethostname(), pid=os.getpid(), since=since)))
        self.file.flush()

    def release(self) -> None:
        if self.file is not None:
            self.file.close()  # closing releases the flock
            self.file = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.release()


def _read_owner(path: Path) -> str:
    try:
        owner = json.loads(read_unlinked(path))
        return f"process {int(owner['pid'])} on {str(owner['host'])[:100]} since {str(owner['since'])[:40]}" + (
            f" (launch {str(owner['launch'])[:60]})" if owner.get("launch") else ""
        )
    except (OSError, ValueError, KeyError, TypeError, AttributeError, TextsqlError):
        return "another process"


def run_lock(run_dir: Path, launch_id: str) -> FileLock:
    """Held by the session for the whole launch: a second launch into the same run folder is refused."""
    return FileLock(
        run_dir.parent / f".{run_dir.name}.textsql-lock",
        f"The run folder {run_dir}",
        "Two launches into one run would overwrite each other's checkpoints: wait for it to end (or stop it), "
        "or give this launch another --output_dir / --runs_root.",
        {"launch": launch_id},
    )


@dataclass
class ResumePlan:
    """The checkpoint every rank resumes from (None: start at step 0) and what is set aside, with the reasons."""

    checkpoint: str | None
    set_aside: dict[str, list[str]] = field(default_factory=dict)  # checkpoint -> why it cannot be resumed from
    saved_world_size: int | None = None  # the world size that wrote it, where it is not the launch's

    def sentence(self) -> str:
        by_step = sorted(self.set_aside.items(), key=lambda item: checkpoint_step(item[0]), reverse=True)
        why = "".join(f"; {name} is incomplete: {', '.join(reasons[:3])}" for name, reasons in by_step)
        if self.checkpoint is None:
            return f"starts from step 0 (no checkpoint is complete on every node{why})"
        resized = f", written at world size {self.saved_world_size}" if self.saved_world_size else ""
        return f"resumes from {self.checkpoint} (the newest checkpoint complete on every node{resized}{why})"


def _count(value) -> int | None:
    """`value` where it is a whole number of at least 1 (a record's world size or accumulation), else None."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 1 else None


def recorded(run_dir: Path, name: str) -> int | None:
    """A whole number the run folder's launch record holds (None: no record, or not that number in it)."""
    try:
        return _count(json.loads(read_unlinked(Path(run_dir) / RECORD)).get(name))
    except (OSError, ValueError, AttributeError, TextsqlError):
        return None


def recorded_world_size(run_dir: Path) -> int | None:
    """The world size in a run folder's launch record (None: no record). The shared folder is anyone's to write:
    anything but a record textsql wrote is refused, naming the file."""
    if not (Path(run_dir) / RECORD).exists():
        return None
    try:
        record = json.loads(read_unlinked(Path(run_dir) / RECORD))
    except ValueError as error:
        record = f"not JSON ({error})"
    size = _count(record.get("world_size")) if isinstance(record, dict) else None
    if size is not None:
        return size
    what = record if isinstance(record, str) else f"no world size in it ({json.dumps(record)[:120]})"
    raise TextsqlError(
        f"{Path(run_dir) / RECORD} is not a launch record textsql wrote: {what}. It says how many ranks wrote the run's "
        "checkpoints. If the run is yours, remove the file (the checkpoints' own file names then tell the world size) "
        "and launch again; if you did not change it, someone with access to the project did."
    )


def choose_checkpoint(
    listing: dict[str, dict[str, bool]],
    world_size: int,
    zero_stage: int | None,
    *,
    recorded_world_size: int | None = None,
    run_dir: Path | str = "the run folder",
) -> ResumePlan:
    """The newest checkpoint of `listing` (textsql.checkpoints.list_checkpoints of the run folder) that every rank
    that wrote it finished. At another world size: DDP's whole-model files as they are, ZeRO's shards once converted
    (to_universal); FSDP's sharded files and ZeRO-Infinity's swapped ones are refused (resize_refusal)."""
    saved = saved_world_size(listing, recorded_world_size)
    names = sorted(listing, key=checkpoint_step, reverse=True)
    # Without a record, fewer ranks' files than the world size may just be a save that a dead rank left unfinished.
    certain = recorded_world_size is not None or (saved or 0) > world_size or (saved == 1) != (world_size == 1)
    resized = saved is not None and saved != world_size and certain
    if resized and (why := resize_refusal(listing)):
        raise TextsqlError(
            f"{run_dir} holds checkpoints of a run with world size {saved} ({', '.join(names[:3])}), but this launch "
            f"has world size {world_size}: {why}. Launch again with {saved} rank(s) to resume it, or choose another "
            "--output_dir / --runs_root to start a new run."
        )
    size = saved if resized else world_size
    newest, set_aside = newest_whole_checkpoint(
        run_dir, lambda name, files: missing_parts(files, checkpoint_step(name), size, zero_stage), listing
    )
    return ResumePlan(newest.name if newest else None, set_aside, saved if resized else None)


def resize_refusal(listing: dict[str, dict[str, bool]]) -> str | None:
    """Why a run's checkpoints cannot be resumed at another world size (None: they can)."""
    names = {name for files in listing.values() for name in files}
    if any(name.startswith(("pytorch_model_fsdp", "optimizer_0")) for name in names):
        return "FSDP's sharded checkpoints are loaded only by as many ranks as wrote them"
    if any("/offloaded_tensors/" in name for name in names):
        return "ZeRO-Infinity's checkpoints hold each rank's optimizer state as it swapped it to NVMe"
    return None


def to_universal(checkpoint: Path) -> bool:
    """A ZeRO checkpoint's shards (global_step<N>/) converted once to DeepSpeed's universal format beside them
    (global_step<N>_universal/, named by its `latest_universal` file, written last), which DeepSpeed loads into any
    number of ranks (its config's checkpoint.load_universal). False: nothing to convert (no DeepSpeed shards)."""
    import shutil
    from argparse import Namespace

    states = sorted(p for p in Path(checkpoint).glob("global_step*") if p.is_dir() and p.name[11:].isdigit())
    if not states:
        return False
    if (Path(checkpoint) / "latest_universal").is_file():
        return True
    verify_checkpoint(checkpoint)  # the conversion unpickles the shards: the run folder may be writable by others
    from deepspeed.checkpoint.ds_to_universal import main as convert

    output = states[-1].with_name(states[-1].name + "_universal")
    shutil.rmtree(output, ignore_errors=True)  # what a conversion cut short left
    convert(
        Namespace(
            input_folder=str(states[-1]),
            output_folder=str(output),
            num_extract_workers=1,  # no worker processes: a rank converts it before it trains
            num_merge_workers=1,
            keep_temp_folder=False,
            strict=True,
            inject_missing_state=True,  # transformers' models carry none of Megatron's universal-checkpoint info
        )
    )
    return True


def kept_accumulation(saved_world: int, saved_accumulation: int, world: int) -> tuple[int, str | None]:
    """The gradient accumulation that keeps a resized run's global batch (the same micro-batches per step), and a
    line when none can: the batch then changes, and the Trainer's skip of the batches seen is counted in steps."""
    micro = saved_world * saved_accumulation
    if micro % world == 0:
        return micro // world, None
    return saved_accumulation, (
        f"the global batch of {micro} micro-batches ({saved_world} ranks x {saved_accumulation}) cannot be kept at "
        f"world size {world}: it becomes {world * saved_accumulation}, and resuming skips as many of the epoch's "
        "samples as the new batch would have read by that step (some never read, or some read twice)"
    )


def set_aside(run_dir: Path, resume: ResumePlan, suffix: str) -> None:
    """The checkpoints newer than the one resumed from renamed, never deleted (textsql.train resumes from the newest)."""
    chosen = checkpoint_step(resume.checkpoint) if resume.checkpoint else -1
    for name in resume.set_aside:
        if checkpoint_step(name) > chosen and (Path(run_dir) / name).is_dir():
            (Path(run_dir) / name).rename(Path(run_dir) / f"{QUARANTINE_PREFIX}{name}-{suffix}")


def resume_plan(run_dir: Path, world_size: int, zero_stage: int | None) -> ResumePlan:
    """What a launch of `world_size` ranks into `run_dir` resumes from, as the folder is now."""
    return choose_checkpoint(
        list_checkpoints(run_dir),
        world_size,
        zero_stage,
        recorded_world_size=recorded_world_size(run_dir),
        run_dir=run_dir,
    )
