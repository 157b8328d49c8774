"""One rank of a multi-node launch: `python -m textsql.cluster.rank [--local_rank=N] --textsql_launch=ID --textsql_spec=B64`.

The DeepSpeed launcher on each node starts this instead of `textsql.train` directly. The spec (base64 JSON, one
shell-safe word, so no shell on the way can expand anything) carries the training arguments exactly and the log
folder; the environment of the ranks (an allowlist, per node) is in a file of the user's private folder on the node,
written before the launch (textsql.cluster.environment.save_rank_env), so no value of it is in any process's argv. This supervisor runs the training in a child
process (the rank's process: it holds the model) and
- keeps the rank's whole output in `<log folder>/rank-<RANK>.log` (on the rank's own node),
- passes every line on, prefixed `[rank N] `, so the session sees all ranks, told apart,
- when the training process ends with an error or a signal, prints one `textsql-rank-exit: {json}` line that names the
  rank, the host, how and when it ended and the tail of its output, so the session can name the rank that failed
  first and stop the others at once instead of waiting for a timeout,
- at the end of a good run prints `textsql-rank-summary: {json}`: this rank's own view of the run (world size,
  steps, final losses), which the session gathers from every rank.
The launch id on the command line lets a user-managed launch find and stop exactly this run's processes on a node.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from textsql.cluster.environment import load_rank_env
from textsql.cluster.node import set_parent_death_signal
from textsql.errors import TextsqlError
from textsql.sharedfiles import open_unlinked, replace_file

RANK_EXIT_MARKER = "textsql-rank-exit: "
RANK_SUMMARY_MARKER = "textsql-rank-summary: "
LAUNCH_FLAG = "--textsql_launch="
SPEC_FLAG = "--textsql_spec="


def _set_parent_death_signal() -> None:
    """The training process dies with its supervisor (Linux prctl PR_SET_PDEATHSIG), so no rank is ever orphaned."""
    set_parent_death_signal(signal.SIGKILL)


def read_spec(argv: list[str]) -> dict:
    from textsql.cluster.node import decode

    words = [a for a in argv if a.startswith(SPEC_FLAG)]
    if len(words) != 1:
        raise SystemExit(
            f"textsql.cluster.rank: expected one {SPEC_FLAG}... argument (it is written by the session's launch)"
        )
    return decode(words[0].removeprefix(SPEC_FLAG))


def rank_environment(launch_id: str, environ=os.environ) -> dict[str, str]:
    """The launcher's environment (RANK, WORLD_SIZE, MASTER_*, CUDA_VISIBLE_DEVICES, ...) plus the variables the
    session chose for this node's ranks, which its prepare step left in this user's private folder (never in argv);
    CROSS_RANK is the node rank DeepSpeed's node launcher sets."""
    env = dict(environ)
    env.update(load_rank_env(launch_id, int(environ.get("CROSS_RANK", "0"))))
    return env


def launch_id_of(argv: list[str]) -> str:
    words = [a.removeprefix(LAUNCH_FLAG) for a in argv if a.startswith(LAUNCH_FLAG)]
    if len(words) != 1:
        raise SystemExit(
            f"textsql.cluster.rank: expected one {LAUNCH_FLAG}... argument (it is written by the session's launch)"
        )
    return words[0]


def supervise(argv: list[str]) -> int:
    spec = read_spec(argv)
    try:
        env = rank_environment(launch_id_of(argv))
    except TextsqlError as error:
        raise SystemExit(f"textsql.cluster.rank: {error}") from None
    rank = int(env.get("RANK", "0"))
    log_dir = Path(spec.get("log_dir") or ".")
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"rank-{rank}.log"
    spec_word = next(a for a in argv if a.startswith(SPEC_FLAG))
    command = [
        sys.executable,
        "-u",
        "-c",
        "import sys; from textsql.cluster.rank import train_main; sys.exit(train_main())",
        spec_word,
    ]
    prefix = f"[rank {rank}] "
    tail: list[str] = []
    with open_unlinked(log_path, "a", buffering=1) as log:
        child = subprocess.Popen(
            command,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            text=True,
            errors="replace",
            preexec_fn=_set_parent_death_signal,
        )
        replace_file(log_dir / f"rank-{rank}.pid", f"{child.pid}\n")
        signalled = []

        def forward(signum, frame):
            signalled.append(signum)
            if child.poll() is None:
                child.send_signal(signum)

        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, forward)
        reader = threading.Thread(target=_pump, args=(child.stdout, log, prefix, tail), daemon=True)
        reader.start()
        code = child.wait()
        ended = time.time()
        reader.join(timeout=5)
    if code != 0:
        how = f"killed by {signal.Signals(-code).name}" if code < 0 else f"exited with status {code}"
        record = {
            "rank": rank,
            "local_rank": int(env.get("LOCAL_RANK", "0")),
            "node_rank": int(env.get("CROSS_RANK", "0")),
            "host": socket.gethostname(),
            "pid": child.pid,
            "code": code,
            "how": how,
            "ended_at": ended,
            "told_to_stop": bool(signalled),
            "log": str(log_path.absolute()),
            "tail": tail[-15:],
        }
        print(prefix + RANK_EXIT_MARKER + json.dumps(record), flush=True)
        return 1
    return 0


def _pump(stream, log, prefix: str, tail: list[str]) -> None:
    for line in stream:
        log.write(line)
        sys.stdout.write(prefix + line)
        sys.stdout.flush()
        tail.append(line.rstrip("\n"))
        del tail[:-40]


def train_main() -> int:
    """The rank's training process: textsql.train with a callback that records this rank's own losses."""
    from textsql.extras import quiet_lifecycle_logs

    quiet_lifecycle_logs()  # before transformers imports torchao (textsql.extras)
    from transformers import TrainerCallback, trainer

    from textsql.errors import TextsqlError
    from textsql.train.arguments import arguments_from_dict
    from textsql.train.distributed import end_distributed
    from textsql.train.local_launch import train_and_report

    seen: dict = {"losses": []}

    class RankRecorder(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            logs = logs or {}
            if "loss" in logs:
                seen["losses"].append(logs["loss"])
            for key in ("train_loss", "eval_loss"):
                if key in logs:
                    seen[key] = logs[key]
            seen.update(
                global_step=state.global_step,
                world_size=args.world_size,
                process_index=args.process_index,
                output_dir=args.output_dir,
            )

    trainer.DEFAULT_CALLBACKS.append(RankRecorder)  # every Trainer built in this process gets it
    arguments = read_spec(sys.argv[1:])["arguments"]
    try:
        parsed = arguments_from_dict(arguments)
    except TextsqlError as error:
        print(f"textsql train: {error}", file=sys.stderr)
        return 2
    code = train_and_report(*parsed)
    if code == 0:
        summary = {
            "rank": int(os.environ.get("RANK", "0")),
            "local_rank": int(os.environ.get("LOCAL_RANK", "0")),
            "host": socket.gethostname(),
            "world_size": seen.get("world_size"),
            "process_index": seen.get("process_index"),
            "global_step": seen.get("global_step"),
            "final_loss": seen["losses"][-1] if seen["losses"] else None,
            "train_loss": seen.get("train_loss"),
            "eval_loss": seen.get("eval_loss"),
            "logged_losses": seen["losses"],
            "output_dir": seen.get("output_dir"),
            "arguments": arguments,
            "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        }
        print(RANK_SUMMARY_MARKER + json.dumps(summary), flush=True)
    end_distributed(code == 0)
    return code


if __name__ == "__main__":
    sys.exit(supervise(sys.argv[1:]))
