"""Checkpoint folders: which ones a save finished (a run resumes from the newest of those), and, since others can write
them, that every pickle in one loads with torch's weights-only unpickler before anything loads it (DeepSpeed loads its
own with weights_only=False, which would run any object pickled in them)."""

from __future__ import annotations

import json
import os
import re
import stat
import struct
import zipfile
from pathlib import Path

from textsql.errors import TextsqlError
from textsql.paths import CHECKPOINT_PREFIX

CHECKPOINT = re.compile(rf"^{CHECKPOINT_PREFIX}(\d+)$")
TRAINER_STATE = "trainer_state.json"  # the Trainer writes it last in a checkpoint: without it the save did not finish
PICKLE_SUFFIXES = frozenset({".pt", ".pth", ".bin", ".pkl", ".pickle", ".ckpt"})
# What real checkpoints pickle beyond torch's tensors and plain containers (found by training tiny runs: DeepSpeed
# ZeRO-2 and ZeRO-3 + offload, and the Trainer without DeepSpeed). The check builds them as inert stand-ins, so not
# even their own constructors run while a file is checked.
ALLOWED_GLOBALS = frozenset(
    {
        # DeepSpeed's optimizer shards (global_stepN/*_optim_states.pt)
        "deepspeed.runtime.zero.config.ZeroStageEnum",
        "deepspeed.utils.tensor_fragment.fragment_address",
        "deepspeed.runtime.fp16.loss_scaler.LossScaler",
        "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
        # the Trainer's RNG states (rng_state*.pth): numpy's generator state
        "numpy._core.multiarray._reconstruct",
        "numpy.core.multiarray._reconstruct",
        "numpy.ndarray",
        "numpy.dtype",
        # the Trainer's training_args.bin (nothing loads it at resume; `torch.load` by hand would)
        "textsql.arguments.training.TextsqlTrainingArguments",
        # where the class lived before (textsql.train's module, then package): checkpoints of older runs still resume
        "textsql.train.arguments.TextsqlTrainingArguments",
        "__main__.TextsqlTrainingArguments",
        "textsql.train.TextsqlTrainingArguments",
        "transformers.training_args.TrainingArguments",
        "transformers.training_args_seq2seq.Seq2SeqTrainingArguments",
        "trl.trainer.grpo_config.GRPOConfig",  # a `--stage grpo` run's (TRL's GRPOTrainer saves its config)
        "transformers.training_args.OptimizerNames",
        "transformers.training_args.ParallelMode",
        "transformers.debug_utils.DebugOption",
        "transformers.trainer_utils.IntervalStrategy",
        "transformers.trainer_utils.SaveStrategy",
        "transformers.trainer_utils.HubStrategy",
        "transformers.trainer_utils.SchedulerType",
        "transformers.trainer_utils.FSDPOption",
        "transformers.trainer_pt_utils.AcceleratorConfig",
        "transformers.integrations.deepspeed.HfTrainerDeepSpeedConfig",
        "transformers.integrations.deepspeed.HfDeepSpeedConfig",
        "transformers.generation.configuration_utils.GenerationConfig",
        "accelerate.state.PartialState",
        "accelerate.utils.dataclasses.DistributedType",
        "accelerate.utils.dataclasses.DeepSpeedPlugin",
        "accelerate.utils.dataclasses.GradientAccumulationPlugin",
    }
)
DEEPSPEED_TAG = re.compile(r"^[\w.-]+$")


class _Inert:
    """What an allow-listed global becomes while a file is checked: it takes any arguments and state, runs nothing."""

    def __new__(cls, *args, **kwargs):
        return object.__new__(cls)

    def __init__(self, *args, **kwargs):
        pass

    def __setstate__(self, state):
        pass

    def __setitem__(self, key, value):
        pass


def verify_checkpoint(folder, *, recursive: bool = True) -> list[Path]:
    """Refuse (TextsqlError naming the file) a checkpoint or model folder holding a pickle that torch's weights-only
    unpickler refuses with only ALLOWED_GLOBALS allowed, a linked sub-folder, or a DeepSpeed `latest` tag that points
    outside it; returns the pickles checked. `recursive`: a checkpoint, sub-folders too (DeepSpeed's global_stepN/),
    and no symbolic link at all; otherwise a model folder, whose own files from_pretrained reads (they may be links,
    as in the Hugging Face cache: what they point to is checked)."""
    folder = Path(folder)
    if recursive and stat.S_ISLNK(os.lstat(folder).st_mode):
        _refuse(folder, folder, "it is a symbolic link (a checkpoint textsql or the Trainer saved is a real folder)")
    checked = []
    for root, dirs, files in os.walk(folder):
        if not recursive:
            dirs.clear()  # from_pretrained reads nothing below a model folder
        for name in dirs:
            if os.path.islink(os.path.join(root, name)):
                _refuse(
                    Path(root) / name,
                    folder,
                    "it is a symbolic link to a folder (what it points to would be loaded unchecked)",
                )
        for name in sorted(files):
            path = Path(root) / name
            if recursive and path.is_symlink():
                _refuse(path, folder, "it is a symbolic link (a checkpoint textsql or the Trainer saved holds none)")
            if name == "latest" and Path(root) == folder:
                _check_tag(path, folder)
            elif _is_pickle(path):
                _check_pickle(path, folder, model_folder=not recursive)
                checked.append(path)
    return checked


def _is_pickle(path: Path) -> bool:
    """By name, or by content for a pickle or torch zip archive under another name (safetensors are never pickles)."""
    if path.suffix in PICKLE_SUFFIXES:
        return True
    if path.suffix == ".safetensors":
        return False
    try:
        with open(path, "rb") as f:
            head = f.read(4)
    except OSError:
        return False
    return head.startswith(b"PK\x03\x04") or (len(head) >= 2 and head[0] == 0x80 and 2 <= head[1] <= 5)


def _check_tag(path: Path, folder: Path) -> None:
    tag = path.read_text(errors="replace").strip()
    if not DEEPSPEED_TAG.match(tag) or tag in (".", "..") or not (folder / tag).is_dir():
        _refuse(path, folder, f"DeepSpeed's tag names '{tag[:80]}', which is not a sub-folder of this checkpoint")


def _check_pickle(path: Path, folder: Path, model_folder: bool = False) -> None:
    import pickle
    import zipfile

    import numpy  # torch imports it anyway: only to name numpy's dtype classes
    import torch

    # numpy's dtype classes (numpy.dtypes.UInt32DType, ...), as numpy 2 pickles the RNG state's dtype
    names = set(ALLOWED_GLOBALS) | {f"numpy.dtypes.{name}" for name in dir(numpy.dtypes) if name.endswith("DType")}
    try:
        with torch.serialization.safe_globals([(_Inert, name) for name in sorted(names)]):
            # mmap: the unpickler runs on the pickle alone, tensor data is mapped, not read
            torch.load(path, map_location="cpu", weights_only=True, mmap=zipfile.is_zipfile(path))
    except (
        pickle.UnpicklingError,
        RuntimeError,
        ValueError,
        TypeError,
        AttributeError,
        EOFError,
        OSError,
        KeyError,
        IndexError,
    ) as error:
        _refuse(path, folder, f"torch's weights-only loader refuses it ({_reason(error)})", model_folder)


def _reason(error: Exception) -> str:
    """torch's refusal in one line: the global or the operation it refused."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    for line in lines:
        if "GLOBAL" in line or "Unsupported" in line or "unrecognized" in line or "Can only" in line:
            return line.removeprefix("WeightsUnpickler error: ").split(" was not an allowed global")[0][:300]
    return (lines[0] if lines else type(error).__name__)[:300]


def verify_model_folder(name) -> None:
    """Before from_pretrained (or peft) reads a local model folder: its own pickles (pytorch_model.bin, an adapter's
    adapter_model.bin, ...) checked as a checkpoint's are (verify_checkpoint, the folder alone); a hub name: nothing."""
    if Path(name).is_dir():
        verify_checkpoint(name, recursive=False)


def _refuse(path: Path, folder: Path, why: str, model_folder: bool = False):
    if model_folder:
        raise TextsqlError(
            f"{path} is refused: {why}. A model folder's pickled weights may hold only tensors; loading this one could "
            f"run code that anyone who can write {folder} put there. Load a folder that you or textsql wrote (textsql "
            "saves safetensors, which hold no code), or, if you made this file yourself and trust it, load it outside "
            "textsql and save it with save_pretrained (safetensors) into a folder only you can write."
        )
    raise TextsqlError(
        f"{path} is refused: {why}. A checkpoint may hold only tensors and the settings DeepSpeed and the Trainer save; "
        f"loading this one could run code that anyone who can write {folder.parent} put there. Move {folder} out of the way "
        "(training then resumes from an earlier checkpoint, or pass --overwrite True to start at step 0), or, if you "
        "made this file yourself and trust it, load it outside textsql."
    )


# ---------------------------------------------------------------------------------------------------------------------
# Which checkpoints a save finished
# ---------------------------------------------------------------------------------------------------------------------


def file_is_whole(path: Path) -> bool:
    """Whether a checkpoint file was written to the end: torch's zip archives have their central directory last,
    safetensors their data after a header that says how long everything is, JSON files parse."""
    try:
        size = path.stat().st_size
        if size == 0:
            return False
        if path.suffix in (".pt", ".pth", ".bin"):
            if not zipfile.is_zipfile(path):
                return path.suffix == ".bin"  # a legacy (non-zip) torch file: nothing to check but its size
            with zipfile.ZipFile(path) as archive:
                return bool(archive.namelist())
        if path.suffix == ".safetensors":
            with open(path, "rb") as f:
                (length,) = struct.unpack("<Q", f.read(8))
                header = json.loads(f.read(length))
            ends = [t["data_offsets"][1] for name, t in header.items() if name != "__metadata__"]
            return size == 8 + length + max(ends, default=0)
        if path.suffix == ".json":
            json.loads(path.read_text())
        return True
    except (OSError, ValueError, zipfile.BadZipFile, struct.error, KeyError, TypeError, IndexError):
        return False


def list_checkpoints(run_dir: Path) -> dict[str, dict[str, bool]]:
    """Every checkpoint-N folder of `run_dir`: relative path of each file -> whether it is whole."""
    run_dir = Path(run_dir)
    found = {}
    if not run_dir.is_dir():
        return found
    for folder in run_dir.iterdir():
        if CHECKPOINT.match(folder.name) and folder.is_dir():
            files = {}
            for path in sorted(folder.rglob("*")):
                if path.is_file() and path.suffix != ".py":
                    files[str(path.relative_to(folder))] = file_is_whole(path)
            found[folder.name] = files
    return found


def checkpoint_step(name: str) -> int:
    """N of a checkpoint-N folder name."""
    return int(CHECKPOINT.match(name)[1])


def save_problems(name: str, files: dict[str, bool]) -> list[str]:
    """Why the save of checkpoint `name` (its files: name -> whole) did not finish (empty: it did)."""
    problems = [] if TRAINER_STATE in files else [f"{TRAINER_STATE} is missing (the save did not finish)"]
    return problems + [f"{file} is cut short" for file, whole in files.items() if not whole]


def newest_whole_checkpoint(run_dir, problems=save_problems, listing=None) -> tuple[Path | None, dict[str, list[str]]]:
    """The newest checkpoint-N of `run_dir` without `problems` (by default: its save finished, trainer_state.json
    there and every file whole), and each newer one set aside -> why. A process killed while saving (out of memory, a
    pod taken back) leaves a folder the Trainer would try to resume from and fail; this is the one place a run decides
    where it resumes (a multi-node launch passes its own `problems`, every rank's files: textsql.cluster.runs).
    `listing`: list_checkpoints(run_dir), when already read."""
    listing = list_checkpoints(run_dir) if listing is None else listing
    set_aside = {}
    for name in sorted(listing, key=checkpoint_step, reverse=True):
        if not (found := problems(name, listing[name])):
            return Path(run_dir) / name, set_aside
        set_aside[name] = found
    return None, set_aside


# What every rank of a multi-node run writes (textsql.cluster.runs decides where a launch resumes with these).
RNG = re.compile(r"^rng_state(?:_(\d+))?\.pth$")
SHARD = re.compile(r"(?:^|/)(?:[a-z0-9]+_)?zero_pp_rank_(\d+)_mp_rank_\d+_(optim|model)_states\.pt$")


def missing_parts(files: dict[str, bool], step: int, world_size: int, zero_stage: int | None) -> list[str]:
    """What checkpoint-<step> (its files: name -> whole) lacks for every rank to resume from it (empty: nothing).

    DeepSpeed (zero_stage not None) writes model states (one per rank under ZeRO-3) and one optimizer shard per rank
    under global_step<N>/; without DeepSpeed rank 0 writes model, optimizer and scheduler. Every rank writes its RNG
    state. The run folder is shared by every pod (each rank checks it sees the launch folder), so this is every node's.
    """
    missing = []

    def need(name: str, what: str) -> None:
        if name not in files:
            missing.append(f"{what} ({name}) is missing")
        elif not files[name]:
            missing.append(f"{what} ({name}) is cut short")

    need(TRAINER_STATE, "the trainer state")
    for rank in range(world_size):
        need("rng_state.pth" if world_size == 1 else f"rng_state_{rank}.pth", f"rank {rank}'s RNG state")
    if zero_stage is None:
        weights = [n for n in files if n in ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin")]
        if not weights:
            missing.append("the model weights (model.safetensors) are missing")
        for name in weights:
            need(name, "the model weights")
        need("optimizer.pt", "the optimizer state")
        need("scheduler.pt", "the scheduler state")
        return missing
    states = f"global_step{step}"
    for rank in range(world_size):
        if zero_stage >= 1:
            need(_shard(files, states, rank, "optim"), f"rank {rank}'s optimizer shard")
        if zero_stage == 3:
            need(_shard(files, states, rank, "model"), f"rank {rank}'s model states")
    if zero_stage < 3:
        need(f"{states}/mp_rank_00_model_states.pt", "the model states")
    return missing


def _shard(files: dict[str, bool], folder: str, rank: int, kind: str) -> str:
    """The file name of a rank's shard as written (a bf16_ prefix under bf16), or the plain name when absent."""
    for name in files:
        match = SHARD.search(name)
        if name.startswith(folder + "/") and match and int(match[1]) == rank and match[2] == kind:
            return name
    return f"{folder}/zero_pp_rank_{rank}_mp_rank_00_{kind}_states.pt"


def saved_world_size(listing: dict[str, dict[str, bool]], recorded: int | None) -> int | None:
    """How many ranks wrote the run's checkpoints: what the last launch recorded, else what the file names say
    (rng_state.pth is a single process's; rng_state_<r>.pth and ZeRO shards name their rank)."""
    if not listing or recorded:
        return recorded if listing else None
    names = [name for files in listing.values() for name in files]
    if "rng_state.pth" in names:
        return 1
    ranks = {int(m[1]) for name in names if (m := RNG.match(name) or SHARD.search(name)) and m[1] is not None}
    several = any(RNG.match(name) for name in names)  # rng_state_<r>.pth: more than one rank
    return max(max(ranks) + 1, 2 if several else 1) if ranks else None
