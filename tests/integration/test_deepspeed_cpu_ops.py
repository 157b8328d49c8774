"""What DeepSpeed's C++ ops leave behind on a machine, given back by textsql: the shared-memory all-reduce buffers of its
CPU communication op (two real ranks: unlinked once every rank mapped them, DeepSpeed's own shared-memory all-reduce
still sums through them, nothing left in /dev/shm), and the build lock of a process killed while it built an op
(torch's own FileBaton held by real processes: a dead one's removed, a live one's waited for); and where the ops are
cached: one folder, whoever starts textsql."""

import json
import mmap
import os
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

from textsql.strategy.opbuilds import NETWORK_BUILD_LIMIT_S, clear_dead_build_locks, extensions_folder
from textsql.train.distributed import SHARED_MEMORY, SHM_BUFFER_SETTLE_S, free_port

# One rank: DeepSpeed initialised as textsql's training does (deepspeed.init_distributed, then the release), then an
# all-reduce through DeepSpeed's shared-memory kernel (its fp32 path needs AVX2; without it DeepSpeed falls back to
# gloo, and the level printed says which ran).
RANK = """
import json, os, torch, deepspeed
from deepspeed import comm
from textsql.train.distributed import deepspeed_shm_buffer, release_deepspeed_shm_buffer
deepspeed.init_distributed(dist_backend="gloo")
buffer = deepspeed_shm_buffer()
created = buffer.exists()
release_deepspeed_shm_buffer()
values = torch.full((4096,), float(int(os.environ["RANK"]) + 1))
comm.inference_all_reduce(values)
row = json.dumps(dict(
    rank=int(os.environ["RANK"]), buffer=buffer.name, created=created, released=not buffer.exists(),
    kernel_level=getattr(comm.comm.cdb, "shm_vector_kernel_level", 0), sums=sorted(set(values.tolist())),
))
open(os.path.join(os.environ["RESULTS_DIR"], os.environ["RANK"] + ".json"), "w").write(row)
comm.barrier()
"""


def test_two_ranks_unlink_their_shm_buffers_and_still_all_reduce_through_them(tmp_path, cpu_env):
    """Also: what dead runs left (this user's buffers nobody maps, older than a minute) goes with the launch; a young
    buffer, or one a process maps, stays."""
    prefix = SHARED_MEMORY / f"deepspeed_allreduce_buffer_{os.getuid()}_127.0.0.1_test{uuid.uuid4().hex[:8]}"
    orphan, young, mapped = (Path(f"{prefix}_{name}") for name in ("orphan", "young", "mapped"))
    for buffer in (orphan, young, mapped):
        buffer.write_bytes(b"\0" * 4096)
    old = time.time() - SHM_BUFFER_SETTLE_S - 5
    for buffer in (orphan, mapped):
        os.utime(buffer, (old, old))
    with open(mapped, "r+b") as file, mmap.mmap(file.fileno(), 4096):
        try:
            launch_two_ranks(tmp_path, cpu_env)
            assert (orphan.exists(), young.exists(), mapped.exists()) == (False, True, True)
        finally:
            for buffer in (orphan, young, mapped):
                buffer.unlink(missing_ok=True)


def launch_two_ranks(tmp_path, cpu_env):
    script = tmp_path / "rank.py"
    script.write_text(RANK)
    port = free_port()
    # LOCAL_SIZE is what DeepSpeed's own launcher sets and what its op reads: every rank on this machine.
    env = dict(cpu_env, LOCAL_SIZE="2", RESULTS_DIR=str(tmp_path), PYTHONPATH=os.pathsep.join(sys.path))
    launch = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]
    launch += ["--master-addr", "127.0.0.1", "--master-port", str(port), str(script)]
    done = subprocess.run(launch, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = [json.loads((tmp_path / f"{rank}.json").read_text()) for rank in (0, 1)]
    for row in rows:
        assert row["buffer"] == f"deepspeed_allreduce_buffer_{os.getuid()}_127.0.0.1_{port}_{row['rank']}"
        assert row["created"] and row["released"], row
        assert row["sums"] == [3.0], row  # 1 + 2 on every element, through the unlinked buffers
    # DeepSpeed's shared-memory kernel ran where this CPU has its instructions (AVX2: fp32), gloo's all-reduce otherwise.
    flags = set(Path("/proc/cpuinfo").read_text().split())
    expected = 2 if "avx512bw" in flags else 1 if "avx2" in flags else 0
    assert rows[0]["kernel_level"] == rows[1]["kernel_level"] == expected, rows
    assert sorted(SHARED_MEMORY.glob(f"deepspeed_allreduce_buffer_*_{port}_*")) == []


# A build in progress as torch runs it: the lock taken with torch's FileBaton and held open.
BUILDER = """
import sys, time
from torch.utils.file_baton import FileBaton
assert FileBaton(sys.argv[1]).try_acquire()
print("building", flush=True)
time.sleep(600)
"""


def start_build(lock: Path) -> subprocess.Popen:
    lock.parent.mkdir(parents=True)
    builder = subprocess.Popen([sys.executable, "-c", BUILDER, str(lock)], stdout=subprocess.PIPE, text=True)
    assert builder.stdout.readline() == "building\n"
    return builder


def wait_until(condition, limit_s: float = 60) -> None:
    deadline = time.monotonic() + limit_s
    while not condition():
        assert time.monotonic() < deadline, "not within the limit"
        time.sleep(0.05)


def clearing_in_background(folder: Path, **kwargs) -> tuple[threading.Thread, dict]:
    result = {}
    thread = threading.Thread(
        target=lambda: result.update(cleared=clear_dead_build_locks(folder, 0.05, **kwargs)), daemon=True
    )
    thread.start()
    return thread, result


def test_a_killed_builds_lock_is_removed_and_a_live_build_waited_for(tmp_path):
    folder = tmp_path / "torch-extensions"
    killed = start_build(folder / "cpu_adam" / "lock")
    killed.kill()
    killed.wait()
    assert (folder / "cpu_adam" / "lock").exists()  # what torch's wait would wait on forever
    building = start_build(folder / "fused_adam" / "lock")
    try:
        thread, result = clearing_in_background(folder)
        wait_until(lambda: not (folder / "cpu_adam" / "lock").exists())
        time.sleep(0.5)
        assert thread.is_alive() and (folder / "fused_adam" / "lock").exists()  # its builder lives: waited for
        building.kill()  # killed in the middle of the build, while textsql waits
        building.wait()
        thread.join(timeout=60)
        assert not thread.is_alive() and result["cleared"] == ["cpu_adam", "fused_adam"]
        assert list(folder.glob("*/lock")) == []
    finally:
        building.kill()


def test_on_a_network_filesystem_a_lock_nobody_here_holds_is_dead_only_once_no_build_could_still_run(tmp_path):
    """The folder on NFS, as a CML project folder shared by the pods (a /proc whose mount table says so, and which
    shows no process): the lock may be a build on another pod until it is older than any build."""
    folder, proc = tmp_path / "project" / "torch-extensions", tmp_path / "proc"
    (proc / "self").mkdir(parents=True)
    (proc / "self" / "mountinfo").write_text(
        "22 1 252:1 / / rw,relatime shared:1 - ext4 /dev/vda rw\n"
        f"90 22 0:52 /projects {tmp_path / 'project'} rw,relatime shared:40 - nfs4 nfs.example:/projects rw\n"
    )
    lock = folder / "cpu_adam" / "lock"
    lock.parent.mkdir(parents=True)
    lock.touch()
    thread, result = clearing_in_background(folder, proc=proc)
    time.sleep(0.5)
    assert thread.is_alive() and lock.exists()
    old = time.time() - NETWORK_BUILD_LIMIT_S - 1
    os.utime(lock, (old, old))
    thread.join(timeout=30)
    assert not thread.is_alive() and result["cleared"] == ["cpu_adam"] and not lock.exists()


def test_one_op_cache_whoever_starts_textsql(tmp_path, cpu_env, assets):
    """A shell that never ran bootstrap.sh (no TORCH_EXTENSIONS_DIR) and whose PATH finds another ninja first (the
    system's, as `.venv/bin/textsql` without an activated environment does) gets the folder and the ninja the package
    decides for its ranks: a dead build lock planted in that folder is cleared by the rank, and the op the suite built
    there (linked in) loads without being rebuilt; torch's own default folder is never made. A user's folder is kept."""
    from textsql.paths import user_cache_dir

    cache, venv = tmp_path / "cache", str(Path(sys.executable).parent)
    path = os.pathsep.join(part for part in cpu_env["PATH"].split(os.pathsep) if part != venv)
    env = {k: v for k, v in cpu_env.items() if k != "TORCH_EXTENSIONS_DIR"} | {"XDG_CACHE_HOME": str(cache)}
    env["PATH"] = path
    folder = extensions_folder(env)
    assert folder.parent == user_cache_dir(env) / "torch-extensions" and folder.is_relative_to(cache)
    assert extensions_folder(dict(env, TORCH_EXTENSIONS_DIR="/mine")) == Path("/mine")
    assert "TORCH_EXTENSIONS_DIR" not in (Path(__file__).parents[2] / "scripts" / "bootstrap.sh").read_text()
    built = Path(cpu_env["TORCH_EXTENSIONS_DIR"]) / "deepspeed_shm_comm"
    built.mkdir(parents=True, exist_ok=True)  # built there by the suite's first DeepSpeed run, or by this one
    library = built / "deepspeed_shm_comm.so"
    before = library.stat().st_mtime_ns if library.exists() else None
    folder.mkdir(parents=True)
    (folder / "deepspeed_shm_comm").symlink_to(built)
    (folder / "killed_op").mkdir()
    (folder / "killed_op" / "lock").touch()  # a build whose process is gone
    data_dir, model_dir = assets
    command = [sys.executable, "-m", "textsql", "train", "--model_id", str(model_dir), "--dataset_dir", str(data_dir)]
    command += ["--runs_root", str(tmp_path / "runs"), "--deepspeed", "zero2", "--max_steps", "1"]
    command += ["--per_device_train_batch_size", "4", "--max_eval_samples", "4", "--execution_accuracy_samples", "0"]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert f"killed_op op ({folder / 'killed_op' / 'lock'})" in done.stdout + done.stderr
    assert not (folder / "killed_op" / "lock").exists() and not (cache / "torch_extensions").exists()
    if before is not None:
        assert library.stat().st_mtime_ns == before, "the op was built again"
