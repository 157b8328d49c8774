"""The training's phase now (a step, an evaluation, a save), each phase's limit, and the signed signal to its pod."""

from __future__ import annotations

import contextlib
import hmac
import json
import os
import re
import sys
import threading
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from textsql.errors import TextsqlError

# Phases whose progress is not watched (loading, what follows the last save): only a rank's heartbeat counts there.
UNWATCHED = ("setup", "after training", "finishing")
SAVES = ("checkpoint save", "final save")
EVALUATIONS = ("evaluation", "final evaluation")
STEP_FLOOR_S = 30.0  # a learned step limit is at least this (a step of a second: named half a minute after it stops)
STEP_MULTIPLE = 4  # times the slowest step seen since the first
# Set by a pod, the numbers of inherited pipe ends (not what they carry): the key, and where a rank's signals go
KEY_FD_ENV, SIGNAL_FD_ENV = "TEXTSQL_KEY_FD", "TEXTSQL_SIGNAL_FD"
# Where a thread waits for its peers: code of torch.distributed, DDP, autograd (DDP's all-reduce) or DeepSpeed's comm
COLLECTIVE = re.compile(r"torch/distributed/|torch/nn/parallel/distributed|torch/autograd/|deepspeed/comm/")


def _limit(default: float, help: str):
    return field(default=default, metadata={"help": help})


@dataclass
class WatchLimits:
    """How long a pod and a rank may go without a sign of life or of progress before the launch names them (seconds).
    The defaults assume the largest run textsql plans: a 7B model under ZeRO-3 on A100 pods, saving its checkpoints
    (~112 GB of fp32 weights and Adam moments across the ranks) to a network project folder at ~100-500 MB/s a pod."""

    silence_seconds: float = _limit(
        20.0, "a pod, or a rank whose process uses no CPU, without a heartbeat for this long is lost (frozen, hung)"
    )
    first_heartbeat_timeout: float = _limit(
        40.0,
        "a pod's first heartbeat (once it has loaded torch) is due this long after it started or its CML worker ran",
    )
    first_step_timeout: float = _limit(
        900.0, "the first training step of each rank's process (ZeRO-3 gathers, allocator warm-up, a cold file system)"
    )
    step_timeout: float = _limit(
        600.0,
        f"the most a later step may take: the limit is learned, {STEP_FLOOR_S:.0f} s + {STEP_MULTIPLE} x the slowest "
        "step since the first, and never more than this",
    )
    eval_timeout: float = _limit(600.0, "an evaluation (or the final one) without a batch done for this long")
    save_timeout: float = _limit(900.0, "a checkpoint save or the final save without a byte written for this long")
    join_window: float = _limit(
        120.0,
        "elastic launches (min_workers): how long the pods that came wait for the others before training starts "
        "without them (CML schedules workers tens of seconds apart)",
    )

    def __post_init__(self):
        for option in fields(self):
            value = getattr(self, option.name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                raise TextsqlError(f"{option.name} must be a number of seconds above 0, not {value!r}.")
        if self.first_heartbeat_timeout < self.silence_seconds:
            raise TextsqlError(
                f"first_heartbeat_timeout ({self.first_heartbeat_timeout}) must be at least silence_seconds "
                f"({self.silence_seconds}): a pod's first heartbeat comes after its start, the next ones every "
                "silence_seconds / 4."
            )

    def of(self, phase: dict, waiting: bool) -> tuple[float | None, str]:
        """How long a rank in `phase` (current()) may go without progress, and what that assumes; None: unwatched. A
        rank `waiting` for its peers in a collective gets the longest limit: its peers may be in a save or the first
        step, which their own pods judge, so that they are named, not it."""
        name = phase["name"]
        if name in UNWATCHED:
            return None, "not watched"
        if waiting:
            return max(self.first_step_timeout, self.step_timeout, self.eval_timeout, self.save_timeout), (
                "the longest limit: its peers may be in a slow save or first step"
            )
        if name in SAVES:
            return self.save_timeout, f"--save_timeout {self.save_timeout:.0f} s without a byte written"
        if name in EVALUATIONS:
            return self.eval_timeout, f"--eval_timeout {self.eval_timeout:.0f} s without a batch done"
        if phase["steps"] == 0:
            return self.first_step_timeout, f"--first_step_timeout {self.first_step_timeout:.0f} s for the first step"
        slowest = phase["slowest"] or phase["first"]
        learned = STEP_FLOOR_S + STEP_MULTIPLE * slowest
        if learned >= self.step_timeout:
            return (
                self.step_timeout,
                f"--step_timeout {self.step_timeout:.0f} s (its slowest step took {slowest:.1f} s)",
            )
        return learned, f"{STEP_FLOOR_S:.0f} s + {STEP_MULTIPLE} x its slowest step ({slowest:.1f} s)"

    def as_dict(self) -> dict:
        return asdict(self)


class _Phase:
    """The phase now, when its progress last moved and what was learned of the steps; read by a watching thread."""

    def __init__(self):
        self.lock = threading.Lock()
        self.state = {"name": "setup", "since": time.time(), "steps": 0, "first": None, "slowest": None, "done": 0}
        self.step_began = None


_phase = _Phase()


def current() -> dict:
    """A copy of this process's phase: name, since (wall time of its last progress), steps (training steps done by
    this training loop), first (its first step's seconds), slowest (the slowest step since, None before the second), done."""
    with _phase.lock:
        return dict(_phase.state)


def enter(name: str) -> None:
    """The training starts a phase (one of UNWATCHED, SAVES, EVALUATIONS or "step"): its progress counts from now."""
    with _phase.lock:
        _phase.state.update(name=name, since=time.time(), done=0)
        _phase.step_began = time.monotonic() if name == "step" else None


def begin_training() -> None:
    """A training loop starts (each trainer.train() of the process): its first step is a first step again."""
    with _phase.lock:
        _phase.state.update(steps=0, first=None, slowest=None)
    enter("step")


def advance(step_done: bool = False) -> None:
    """The phase moved (a batch, a micro-batch, a byte written); `step_done`: a training step ended."""
    with _phase.lock:
        state, now = _phase.state, time.monotonic()
        state.update(since=time.time(), done=state["done"] + 1)
        if step_done and _phase.step_began is not None:
            took, _phase.step_began = now - _phase.step_began, now
            if state["steps"] == 0:
                state["first"] = took
            else:
                state["slowest"] = max(took, state["slowest"] or 0.0)
            state["steps"] += 1


@contextlib.contextmanager
def phase(name: str, after: str = "finishing"):
    """`name` for the block, then `after`."""
    enter(name)
    try:
        yield
    finally:
        enter(after)


def key_pipe(key: bytes) -> int:
    """A pipe's read end holding `key`, for a child to inherit (pass_fds) and read once."""
    read, write = os.pipe()
    os.write(write, key)  # far below a pipe's buffer: never blocks
    os.close(write)
    return read


def read_key(fd: str | None) -> bytes:
    """The key a pod hands a process through an inherited pipe (never an environment: /proc/PID/environ keeps what a
    process was started with, for any process of the user to read): read once, the pipe closed."""
    if not fd:
        raise TextsqlError(f"${KEY_FD_ENV} is not set: a pod of a launch starts this process with its key.")
    try:
        return os.read(int(fd), 256).strip()
    finally:
        os.close(int(fd))


def mac(key: bytes, text: str) -> str:
    return hmac.new(key, text.encode(), "sha256").hexdigest()


def signal_line(signal_: dict, key: bytes) -> bytes:
    """A rank's signal to its pod, one line of JSON signed with the key only it and its pod hold: what another process
    of the user writes into the pipe (/proc/PID/fd lets it) counts for nothing."""
    body = json.dumps(signal_, sort_keys=True)
    return (json.dumps({"signal": body, "mac": mac(key, body)}) + "\n").encode()


def read_signal(line: bytes, key: bytes, pid: int) -> dict | None:
    """A rank's signal (signal_line) as its pod reads it: None unless whole, signed with `key` and of process `pid`."""
    with contextlib.suppress(ValueError, TypeError, KeyError, AttributeError):
        outer = json.loads(line)
        if hmac.compare_digest(str(outer["mac"]), mac(key, str(outer["signal"]))):
            signal_ = json.loads(outer["signal"])
            return signal_ if signal_.get("pid") == pid and type(signal_.get("count")) is int else None
    return None


def beat(pipe: int, key: bytes, limits: WatchLimits) -> None:
    """This rank's heartbeat into the pipe its pod reads: every silence/4 s a new count, signed, with the training's
    phase (above), when its progress last moved (a save's: the bytes this process wrote) and its limit, and whether
    the main thread waits in a collective, for its peers (its pod then judges it by the longest limit: the peers' own
    pods name the one that holds them up). A stopped or hung process stops it (textsql.cluster.pods._heartbeat)."""
    main, count, written = threading.main_thread().ident, 0, None
    os.set_blocking(pipe, False)  # a pod that stopped reading never blocks it
    while True:  # where the main thread is now: its innermost frame (a lock taken inside a backward is no collective)
        frame = sys._current_frames().get(main)
        waiting = bool(frame and COLLECTIVE.search(frame.f_code.co_filename))
        now_written = _bytes_written()
        if current()["name"] in SAVES and written is not None and now_written > written:
            advance()
        phase, count = current(), count + 1
        limit, assumed = limits.of(phase, waiting)
        signal_ = dict(count=count, pid=os.getpid(), phase=phase["name"], since=phase["since"], limit=limit)
        with contextlib.suppress(OSError):  # far below PIPE_BUF: written whole or not at all (a pipe full, or gone)
            os.write(pipe, signal_line(dict(signal_, assumed=assumed, collective=waiting), key))
        written = _bytes_written()  # its own signal's bytes are no save's progress
        time.sleep(limits.silence_seconds / 4)


def _bytes_written() -> int:
    """The bytes this process has handed to write() so far (Linux's /proc/self/io); 0 where unknown."""
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in Path("/proc/self/io").read_text().splitlines():
            if line.startswith("wchar:"):
                return int(line.split()[1])
    return 0
