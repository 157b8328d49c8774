"""textsql's GPTQ environment: llmcompressor in a virtual environment of its own, created once in the user's cache with
textsql's own torch, and the GPTQ job (textsql/gptq/job.py) run in it as a child process."""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from collections import deque
from contextlib import contextmanager
from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as installed_version
from pathlib import Path

from textsql.errors import TextsqlError
from textsql.paths import user_cache_dir

# requirements-gptq.txt at the repository root (package data through this link, like shipped_dsconfig).
REQUIREMENTS_FILE = Path(__file__).resolve().with_name("requirements-gptq.txt")
JOB_SCRIPT = Path(__file__).resolve().with_name("job.py")
STAMP_FILE = "textsql-gptq-env.json"  # written last: a folder without it is a creation that did not finish
MIN_PYTHON = (3, 11)  # llmcompressor 0.14's Requires-Python
# pip's lines worth showing while the environment is created (the rest goes to the log file).
PIP_PROGRESS = ("Collecting", "Downloading", "Processing", "Installing", "Successfully", "ERROR", "error:")


def pinned_requirements(text: str | None = None) -> dict[str, str]:
    """{package: version} of requirements-gptq.txt's `name==version` lines."""
    text = REQUIREMENTS_FILE.read_text() if text is None else text
    pins = {}
    for line in text.splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, pinned = line.partition("==")
            pins[name.strip()] = pinned.strip()
    return pins


def textsql_torch_version() -> str:
    """The torch textsql runs on, exactly as installed (e.g. 2.13.0+cpu): the environment gets the same build."""
    try:
        return installed_version("torch")
    except PackageNotFoundError:
        raise TextsqlError(
            "torch is not installed; install textsql first (`bash scripts/bootstrap.sh setup`)."
        ) from None


def environment_name(torch_version: str, requirements_text: str, python: tuple[int, int]) -> str:
    """The environment's folder name: the pinned versions that matter, then a hash of everything that makes it."""
    pins = pinned_requirements(requirements_text)
    digest = hashlib.sha256(f"{torch_version}\n{python}\n{requirements_text}".encode()).hexdigest()[:10]
    return (
        f"llmcompressor-{pins.get('llmcompressor', 'unpinned')}_transformers-{pins.get('transformers', 'unpinned')}_"
        f"torch-{torch_version}_py{python[0]}.{python[1]}_{digest}"
    )


def default_environment_dir() -> Path:
    """Where the environment lives unless --gptq_env_dir says otherwise: the user's cache, named by the pins."""
    name = environment_name(textsql_torch_version(), REQUIREMENTS_FILE.read_text(), sys.version_info[:2])
    return user_cache_dir() / "gptq" / name


def environment_python(folder: Path) -> Path:
    return folder / "bin" / "python"


def read_stamp(folder: Path) -> dict | None:
    """The record of a finished creation, or None (absent, unreadable, or made for other pins or another torch)."""
    try:
        stamp = json.loads((folder / STAMP_FILE).read_text())
    except (OSError, json.JSONDecodeError):
        return None
    expected = {"torch": textsql_torch_version(), "requirements": REQUIREMENTS_FILE.read_text()}
    if any(stamp.get(key) != value for key, value in expected.items()) or not environment_python(folder).exists():
        return None
    return stamp


def ensure_environment(folder: str | Path | None = None, wheels: str | Path | None = None, echo=print) -> Path:
    """The GPTQ environment's folder, created first when it is not there (a few minutes; pip's progress is echoed).

    A venv made with this Python; torch first and alone, the exact version textsql runs (so a CPU machine gets the CPU
    build, never a CUDA one), then requirements-gptq.txt with that torch pinned. With `wheels`, pip installs from that
    folder only (--no-index --find-links): air-gapped machines. Two processes asking at once create it once (a lock)."""
    folder = Path(folder) if folder else default_environment_dir()
    if read_stamp(folder):
        return folder
    if sys.version_info[:2] < MIN_PYTHON:
        raise TextsqlError(
            f"GPTQ runs llmcompressor 0.14, which needs Python {MIN_PYTHON[0]}.{MIN_PYTHON[1]} or newer, and textsql "
            f"runs on Python {sys.version.split()[0]}. Install textsql on a newer Python, or choose another --method."
        )
    if wheels is not None and not Path(wheels).is_dir():
        raise TextsqlError(f"--gptq_wheels '{wheels}' is not a folder; pass the folder `pip download` filled.")
    folder.parent.mkdir(parents=True, exist_ok=True)
    with _locked(folder.with_name(folder.name + ".lock")):
        if read_stamp(folder):  # another process created it while this one waited
            return folder
        _create(folder, Path(wheels) if wheels else None, echo)
    return folder


@contextmanager
def _locked(path: Path):
    with open(path, "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _create(folder: Path, wheels: Path | None, echo) -> None:
    torch_version = textsql_torch_version()
    log = folder.with_name(folder.name + ".log")
    log.write_text("")
    echo(
        f"Creating textsql's GPTQ environment in {folder}: llmcompressor and its pins (requirements-gptq.txt) beside "
        f"torch {torch_version}, the one textsql runs. This happens once; it takes minutes and about 1.5 GB "
        f"(pip's every line: {log})."
    )
    started = time.perf_counter()
    shutil.rmtree(folder, ignore_errors=True)  # what an interrupted creation left
    python = environment_python(folder)
    _stream([sys.executable, "-m", "venv", str(folder)], "creating the virtual environment", log, echo, wheels)
    pip = [str(python), "-m", "pip", "install", "--no-input"]
    if wheels:
        pip += ["--no-index", "--find-links", str(wheels)]
    env = _pip_environment()
    _stream(pip + [f"torch=={torch_version}"], f"installing torch {torch_version}", log, echo, wheels, env)
    constraints = folder / "textsql-constraints.txt"
    constraints.write_text(f"torch=={torch_version}\n")
    env["PIP_CONSTRAINT"] = str(constraints)  # every later pip call keeps this torch, build environments included
    _stream(pip + ["-r", str(REQUIREMENTS_FILE)], "installing requirements-gptq.txt", log, echo, wheels, env)
    found = subprocess.run(
        [str(python), "-I", "-c", "import llmcompressor, torch; print('torch', torch.__version__)"],
        capture_output=True,
        text=True,
    )
    # llmcompressor prints a notice of its own when imported on a machine without a GPU: read the last line only.
    lines = found.stdout.strip().splitlines()
    got = lines[-1].removeprefix("torch ").strip() if lines and lines[-1].startswith("torch ") else ""
    if found.returncode or got != torch_version:
        raise TextsqlError(
            f"The GPTQ environment in {folder} was created but does not work as it should (torch "
            f"{got or '?'} instead of {torch_version}; {found.stderr.strip()[-600:]}). Delete the "
            "folder and run the command again; if it fails the same way, report it with that output."
        )
    seconds = time.perf_counter() - started
    size = sum(path.stat().st_size for path in folder.rglob("*") if path.is_file() and not path.is_symlink())
    stamp = {
        "torch": torch_version,
        "requirements": REQUIREMENTS_FILE.read_text(),
        "python": sys.version.split()[0],
        "created_seconds": round(seconds, 1),
        "bytes": size,
        "from_wheels": str(wheels) if wheels else None,
    }
    (folder / STAMP_FILE).write_text(json.dumps(stamp, indent=2) + "\n")
    echo(f"The GPTQ environment is ready: {seconds:.0f} s, {size / 2**30:.2f} GiB in {folder}.")


def _pip_environment() -> dict[str, str]:
    """The environment pip runs in: the user's (proxies, index settings), without textsql's own constraints or paths."""
    env = {key: value for key, value in os.environ.items() if key not in ("PIP_CONSTRAINT", "PYTHONPATH", "PYTHONHOME")}
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    return env


def _stream(command: list[str], step: str, log: Path, echo, wheels: Path | None, env: dict | None = None) -> None:
    """Run one creation step, echoing pip's progress lines and keeping every line in `log`; refuse with the fix."""
    last = deque(maxlen=15)
    with open(log, "a") as keep:
        keep.write(f"\n$ {' '.join(command)}\n")
        process = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env or _pip_environment()
        )
        for line in process.stdout:
            keep.write(line)
            line = line.rstrip()
            if line:
                last.append(line)
            if line.lstrip().startswith(PIP_PROGRESS):
                echo(f"  {line.strip()}")
        code = process.wait()
    if code:
        tail = "\n".join(last)
        if "venv" in command:
            fix = (
                "Python's venv module did not work here (Debian and Ubuntu ship it apart: install python3-venv for "
                "this Python), then run the command again."
            )
        elif wheels:
            fix = (
                f"pip found no suitable file in {wheels} for something above: fill that folder on a machine with the "
                "same OS, CPU architecture and Python, with `pip download -d DIR torch=="
                + textsql_torch_version()
                + "` "
                "(from the index your textsql torch came from) and `pip download -d DIR -r requirements-gptq.txt`, "
                "then copy it here."
            )
        else:
            fix = (
                "pip could not get a package: check the network or your pip index settings (pip.conf, "
                "PIP_INDEX_URL, PIP_EXTRA_INDEX_URL, proxies; the exact torch " + textsql_torch_version() + " must be "
                "on one of its indexes). On an air-gapped machine, fill a folder with `pip download -d DIR torch=="
                + textsql_torch_version()
                + "` and `pip download -d DIR -r requirements-gptq.txt` on a machine with the same OS, CPU "
                "architecture and Python, copy it here and pass --gptq_wheels DIR (pip --no-index --find-links DIR)."
            )
        raise TextsqlError(
            f"Creating the GPTQ environment failed while {step} (exit status {code}). {fix} Nothing half-made is used: "
            f"the next run starts it again. pip's last lines:\n{tail}\nFull log: {log}"
        )


def run_job(folder: Path, arguments: list[str], log: Path) -> None:
    """Run textsql/gptq/job.py with `arguments` in the environment at `folder`: isolated from textsql's paths
    (python -I), offline (everything it reads is a local folder), its output on this process's stderr (llmcompressor's
    progress bars), its log at INFO in `log`."""
    env = _pip_environment()
    env.update(
        HF_HUB_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        TOKENIZERS_PARALLELISM="false",
        LLM_COMPRESSOR_LOG_LEVEL="WARNING",
        LLM_COMPRESSOR_LOG_FILE=str(log),
        LLM_COMPRESSOR_LOG_FILE_LEVEL="INFO",
    )
    command = [str(environment_python(folder)), "-I", str(JOB_SCRIPT), *arguments]
    done = subprocess.run(command, env=env, stdout=2)  # stdout onto stderr: textsql's stdout keeps its results
    if done.returncode:
        raise TextsqlError(
            f"The GPTQ job failed (exit status {done.returncode}); its output is above and llmcompressor's log is in "
            f"{log}. If the model's architecture is the cause, quantize it with another --method (bnb-nf4 is 4-bit "
            "too); if the environment is, delete its folder and run the command again to create it anew."
        )
