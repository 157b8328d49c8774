"""One rank of a multi-pod launch: `python -m textsql.cluster.rank [--textsql_spec=B64]`, started by torchrun on a
pod (the spec in $TEXTSQL_LAUNCH, fixed when the pod was created) or by DeepSpeed's launcher over pdsh (the spec in
argv: the training arguments, never an environment value).

The rank dies with the process that started it (Linux parent-death signal: torchrun starts it in a process session of
its own, so killing only torchrun would otherwise leave it training), checks its pod against what the session decided
(versions, folders, file digests, the shared launch folder, the devices promised), trains with `textsql.train`, and
writes into the shared launch folder: `rank-N.started.json`, then `rank-N.summary.json` (its own view of the run) or
`rank-N.failure.json` (how it failed, when, its last lines) so that the session names the rank that failed first.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import time
import traceback

from textsql.cluster.launch import decode, digest, versions, write_record
from textsql.errors import TextsqlError

LAUNCH_ENV, POD_ENV = "TEXTSQL_LAUNCH", "TEXTSQL_POD_ADDRESS"
SPEC_FLAG = "--textsql_spec="


def set_parent_death_signal(sig) -> bool:
    """Linux: `sig` reaches this process when its parent ends (prctl PR_SET_PDEATHSIG); False where unavailable."""
    try:
        import ctypes

        return ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, int(sig)) == 0
    except (OSError, AttributeError):
        return False


def read_spec(argv: list[str], environ=os.environ) -> dict:
    words = [a.removeprefix(SPEC_FLAG) for a in argv if a.startswith(SPEC_FLAG)]
    word = words[0] if words else environ.get(LAUNCH_ENV)
    if not word:
        raise SystemExit(f"textsql.cluster.rank: no {SPEC_FLAG}... argument and no ${LAUNCH_ENV}: a launch sets one")
    return decode(word)


def check_pod(spec: dict, where: str) -> None:
    """This pod against what the session decided: the same versions, the folders and files (by digest, the shared
    launch folder's marker among them), and the devices promised. Raises TextsqlError listing every problem."""
    expect, problems = spec["expect"], []
    for name, want in expect["versions"].items():
        have = versions().get(name)
        if have != want:
            problems.append(f"{name} {have or 'is not installed'}, but the session has {want}")
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
    set_parent_death_signal(signal.SIGKILL)  # dies with its torchrun (or DeepSpeed's node launcher)
    spec = read_spec(sys.argv[1:] if argv is None else argv)
    rank, local_rank = int(os.environ.get("RANK", "0")), int(os.environ.get("LOCAL_RANK", "0"))
    hosts = spec.get("hosts")  # pdsh: the hostfile's addresses; DeepSpeed's node launcher sets CROSS_RANK
    address = os.environ.get(POD_ENV) or (hosts[int(os.environ.get("CROSS_RANK", "0"))] if hosts else None)
    address = address or socket.gethostname()
    if spec["accelerator"] == "cpu":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")  # before DeepSpeed is imported
    record = dict(rank=rank, local_rank=local_rank, node_address=address, host=socket.gethostname(), pid=os.getpid())
    write_record(spec["launch_dir"], f"rank-{rank}.started.json", record)
    tail: list[str] = []
    try:
        check_pod(spec, f"pod {address} (rank {rank})")
        summary = train(spec, tail)
    except BaseException as error:
        how = "stopped by a signal" if isinstance(error, KeyboardInterrupt) else f"{type(error).__name__}: {error}"
        lines = traceback.format_exc().splitlines() if not isinstance(error, TextsqlError) else []
        write_record(
            spec["launch_dir"],
            f"rank-{rank}.failure.json",
            dict(record, how=how.splitlines()[0][:500] if how else "failed", tail=lines[-15:], ended_at=time.time()),
        )
        print(f"textsql rank {rank}: {how}", file=sys.stderr, flush=True)
        return 1
    write_record(spec["launch_dir"], f"rank-{rank}.summary.json", dict(record, **summary))
    return 0


def train(spec: dict, tail: list[str]) -> dict:
    """textsql.train with a callback recording this rank's own losses; this rank's summary."""
    from textsql.extras import quiet_lifecycle_logs

    quiet_lifecycle_logs()  # before transformers imports torchao (textsql.extras)
    from transformers import TrainerCallback, trainer

    from textsql.run_summary import SUMMARY_FILE, format_summary
    from textsql.train import train as train_run
    from textsql.train.arguments import arguments_from_dict
    from textsql.train.distributed import end_distributed

    seen: dict = {"losses": []}

    class RankRecorder(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            logs = logs or {}
            if "loss" in logs:
                seen["losses"].append(logs["loss"])
            seen.update({k: logs[k] for k in ("train_loss", "eval_loss") if k in logs})
            seen.update(global_step=state.global_step, world_size=args.world_size, output_dir=args.output_dir)

    trainer.DEFAULT_CALLBACKS.append(RankRecorder)  # every Trainer built in this process gets it
    run = train_run(*arguments_from_dict(spec["arguments"]))
    summary_path = None
    if run is not None:
        print(format_summary(run), flush=True)
        summary_path = str(os.path.realpath(os.path.join(run.output_dir, SUMMARY_FILE)))
    end_distributed(True)
    return {
        "world_size": seen.get("world_size"),
        "global_step": seen.get("global_step"),
        "final_loss": seen["losses"][-1] if seen["losses"] else None,
        "train_loss": seen.get("train_loss"),
        "eval_loss": seen.get("eval_loss"),
        "logged_losses": seen["losses"],
        "output_dir": seen.get("output_dir"),
        "arguments": spec["arguments"],
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "run_summary": summary_path,
    }


if __name__ == "__main__":
    sys.exit(main())
