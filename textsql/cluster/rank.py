"""One rank of a multi-pod launch: `python -m textsql.cluster.rank [--textsql_spec=B64]`, started by torchrun on a
pod (the spec in $TEXTSQL_LAUNCH) or by DeepSpeed's launcher over pdsh (the spec in argv, never an environment value).

It dies with the process that started it, tells its pod it is alive and what its training is doing (signed, in a pipe),
checks its pod against what the session decided, checks the run folder for the world size its round trains at, trains
with `textsql.train`, and writes `r<round>-rank-N.started.json`, then `...summary.json` or `...failure.json` (how it
failed, when, its last lines) into the shared launch folder, so that the session names the rank that failed first."""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import socket
import sys
import threading
import time
import traceback
from pathlib import Path

from textsql.cluster.launch import decode, digest, versions, write_record
from textsql.errors import TextsqlError
from textsql.train.watch import KEY_FD_ENV, SIGNAL_FD_ENV, WatchLimits, beat, read_key

LAUNCH_ENV, POD_ENV = "TEXTSQL_LAUNCH", "TEXTSQL_POD_ADDRESS"
ROUND_ENV = "TEXTSQL_ROUND"  # set by the pod: its rendezvous round
RECORD_WAIT_S = 600  # how long the other ranks of a round wait for rank 0's check of the run folder
SPEC_FLAG = "--textsql_spec="


def check_pod(spec: dict, where: str) -> None:
    """This pod against what the session decided: the same versions, the folders and files (by digest, the shared
    launch folder's marker among them), and the devices promised. Raises TextsqlError listing every problem."""
    expect, problems, here = spec["expect"], [], versions()
    for name, want in expect["versions"].items():
        if here.get(name) != want:
            problems.append(f"{name} {here.get(name) or 'is not installed'}, but the session has {want}")
    problems += [f"the folder {path} does not exist here" for path in expect["dirs"] if not os.path.isdir(path)]
    if spec.get("workdir") and os.path.realpath(os.getcwd()) != os.path.realpath(spec["workdir"]):
        problems.append(f"it works in {os.getcwd()}, the session in {spec['workdir']} (relative paths would differ)")
    for path, want in expect["files"].items():
        have = digest(path)
        if have != want:
            shared = path.endswith("shared-marker")
            problems.append(
                f"the session's launch folder is not shared with this pod ({path} is not the session's): "
                "run from a folder every pod sees (the CML project folder)"
                if shared
                else f"{path} {'does not exist here' if have is None else 'differs from the session copy'}"
            )
    if spec["accelerator"] == "cuda":
        import torch

        local = int(os.environ.get("LOCAL_RANK", "0"))
        if not torch.cuda.is_available() or torch.cuda.device_count() <= local:
            problems.append(
                "the session decided on GPUs for every rank, but this rank has none (pass --accelerator cpu?)"
            )
        elif spec["precision"] == "bf16" and not torch.cuda.is_bf16_supported():
            problems.append(f"the session decided on bf16, but {torch.cuda.get_device_name(local)} has no native bf16")
    if problems:
        raise TextsqlError(f"The preflight failed on {where}: " + "; ".join(problems) + ".")


def main(argv: list[str] | None = None) -> int:
    with contextlib.suppress(OSError, AttributeError):  # Linux: dies with its torchrun (or DeepSpeed's node launcher)
        ctypes.CDLL("libc.so.6").prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    words = [a.removeprefix(SPEC_FLAG) for a in (sys.argv[1:] if argv is None else argv) if a.startswith(SPEC_FLAG)]
    if not (words or os.environ.get(LAUNCH_ENV)):
        raise SystemExit(f"textsql.cluster.rank: no {SPEC_FLAG}... argument and no ${LAUNCH_ENV}: a launch sets one")
    spec = decode(words[0] if words else os.environ[LAUNCH_ENV])
    if os.environ.get(SIGNAL_FD_ENV):  # before anything slow: the pod names a rank whose signals stop (hung, stopped)
        pipe, key = int(os.environ[SIGNAL_FD_ENV]), read_key(os.environ.get(KEY_FD_ENV))
        threading.Thread(target=beat, args=(pipe, key, WatchLimits(**spec["limits"])), daemon=True).start()
    rank, local_rank = int(os.environ.get("RANK", "0")), int(os.environ.get("LOCAL_RANK", "0"))
    round_, world = int(os.environ.get(ROUND_ENV, "0")), int(os.environ.get("WORLD_SIZE", "1"))
    hosts = spec.get("hosts")  # pdsh: the hostfile's addresses; DeepSpeed's node launcher sets CROSS_RANK
    address = os.environ.get(POD_ENV) or (hosts[int(os.environ.get("CROSS_RANK", "0"))] if hosts else None)
    address = address or socket.gethostname()
    if spec["accelerator"] == "cpu":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")  # before DeepSpeed is imported
    record = dict(rank=rank, local_rank=local_rank, node_address=address, host=socket.gethostname(), pid=os.getpid())
    record.update(round=round_, world_size=world)
    write_record(spec["launch_dir"], "started", record)
    try:
        check_pod(spec, f"pod {address} (rank {rank})")
        spec["arguments"]["gradient_accumulation_steps"] = start_round(spec, rank, world, round_)
        summary = train(spec)
    except BaseException as error:
        how = "stopped by a signal" if isinstance(error, KeyboardInterrupt) else f"{type(error).__name__}: {error}"
        lines = traceback.format_exc().splitlines() if not isinstance(error, TextsqlError) else []
        failure = dict(
            record, how=how.splitlines()[0][:500] if how else "failed", tail=lines[-15:], ended_at=time.time()
        )
        write_record(spec["launch_dir"], "failure", failure)
        print(f"textsql rank {rank}: {how}", file=sys.stderr, flush=True)
        return 1
    write_record(spec["launch_dir"], "summary", dict(record, **summary))
    return 0


def start_round(spec: dict, rank: int, world: int, round_: int) -> int:
    """What the session cannot decide before the launch: the world size an elastic launch trains at, and what a
    restart (a new round) resumes from. Rank 0 checks the run folder for this world size, converts a checkpoint of
    another size's ZeRO run to DeepSpeed's universal format (textsql.cluster.runs.to_universal), sets newer incomplete
    checkpoints aside and records the size and gradient accumulation the run trains at (the global batch kept where it
    divides); the other ranks wait for that record, so that every rank resumes alike. Returns the accumulation."""
    from textsql.cluster.runs import RECORD, kept_accumulation, recorded, resume_plan, set_aside, to_universal
    from textsql.sharedfiles import read_unlinked, replace_file

    run_dir, mine = Path(spec["run_dir"]), {"launch": spec["launch_id"], "round": round_, "world_size": world}
    accumulation = spec["arguments"]["gradient_accumulation_steps"]
    if rank == 0:
        if not spec["arguments"].get("overwrite"):
            plan = resume_plan(run_dir, world, spec["zero_stage"])
            if plan.checkpoint and plan.saved_world_size:
                if spec["zero_stage"] is not None:
                    to_universal(run_dir / plan.checkpoint)
                saved = recorded(run_dir, "gradient_accumulation_steps") or accumulation
                accumulation, said = kept_accumulation(plan.saved_world_size, saved, world)
                kept = f"gradient accumulation {accumulation} keeps its global batch"
                print(
                    f"textsql: {plan.checkpoint} of world size {plan.saved_world_size} resumed at {world}: {said or kept}"
                )
            set_aside(run_dir, plan, f"{spec['launch_id']}-r{round_}")
        run_dir.mkdir(parents=True, exist_ok=True)
        replace_file(run_dir / RECORD, json.dumps(dict(mine, gradient_accumulation_steps=accumulation)) + "\n")
        return accumulation
    deadline = time.monotonic() + RECORD_WAIT_S
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError, ValueError, TextsqlError, AttributeError):
            record = json.loads(read_unlinked(run_dir / RECORD))
            if {key: record.get(key) for key in mine} == mine:
                return int(record.get("gradient_accumulation_steps", accumulation))
        time.sleep(0.2)
    raise TextsqlError(f"Rank 0 did not check the run folder {run_dir} within {RECORD_WAIT_S} s (see its log).")


def train(spec: dict) -> dict:
    """textsql.train with a callback recording this rank's own losses; this rank's summary."""
    from textsql.extras import quiet_lifecycle_logs

    quiet_lifecycle_logs()  # before transformers imports torchao (textsql.extras)
    from transformers import trainer

    from textsql.arguments.training import arguments_from_dict
    from textsql.run_summary import SUMMARY_FILE, format_summary
    from textsql.train import train as train_run
    from textsql.train.callbacks import RankRecorder
    from textsql.train.distributed import end_distributed

    recorder = RankRecorder()
    trainer.DEFAULT_CALLBACKS.append(recorder)  # every Trainer built in this process gets it
    run = train_run(*arguments_from_dict(spec["arguments"]))
    if run is not None:
        print(format_summary(run), flush=True)
    end_distributed(True)
    summary = os.path.realpath(os.path.join(run.output_dir, SUMMARY_FILE)) if run is not None else None
    seen = recorder.seen
    losses = seen["logged_losses"]
    return dict(seen, final_loss=losses[-1] if losses else None, arguments=spec["arguments"], run_summary=summary)


def exit_now(code: int) -> None:
    """End this process, its work and records done: atexit handlers, logs and output flushed, but not the interpreter's
    teardown of torch, transformers and DeepSpeed (3.3 s on 2 cores), which its pod and the session would wait for."""
    import atexit
    import logging

    atexit._run_exitfuncs()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    exit_now(main())
