"""scripts/bootstrap.sh's system packages: `setup` (and demo, lab) asks for what training needs, `test` also for the
suite's own (sshd, pdsh, chromium, libaio). The script runs here as a user who is not root, on a PATH holding only the
few tools it calls itself, with a venv whose stamp is current: it only says which packages it would install."""

import hashlib
import shutil
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
STAMPED = (
    "requirements.txt requirements-lab.txt requirements-lifecycle.txt requirements-test.txt requirements-peft.txt "
    "requirements-mlflow.txt requirements-grpo.txt pyproject.toml scripts/bootstrap.sh"
).split()  # the script's stamp_of_inputs


def asked_for(command: str, tmp_path: Path) -> str:
    tools = tmp_path / "bin"
    tools.mkdir(exist_ok=True)
    for tool in ("cat", "sha256sum", "cut", "dirname"):
        if not (tools / tool).exists():
            (tools / tool).symlink_to(shutil.which(tool))
    venv = tmp_path / "venv"
    venv.mkdir(exist_ok=True)
    stamp = hashlib.sha256(b"".join((REPO / name).read_bytes() for name in STAMPED)).hexdigest()[:16]
    (venv / ".textsql-stamp").write_text(stamp + "\n")
    (venv / "bin").mkdir(exist_ok=True)
    for program in ("textsql", "python"):  # what demo and lab hand over to: print nothing, succeed
        (venv / "bin" / program).write_text("#!/bin/sh\nexit 0\n")
        (venv / "bin" / program).chmod(0o755)
    env = {"PATH": str(tools), "TEXTSQL_VENV": str(venv), "BASH_FUNC_id%%": "() { echo 1000; }"}
    done = subprocess.run(
        [shutil.which("bash"), str(REPO / "scripts" / "bootstrap.sh"), command],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert "setting up" not in done.stdout, "the stamp is current: the venv is not set up again"
    return done.stderr


def test_setup_asks_for_what_training_needs_and_test_for_the_suites_packages_too(tmp_path):
    for command in ("setup", "demo", "lab"):
        warning = asked_for(command, tmp_path)
        assert "missing system packages (g++)" in warning, (command, warning)
    warning = asked_for("test", tmp_path)  # (sshd and libaio are looked for as files, which this machine may have)
    for package in ("g++", "pdsh", "chromium", "openssh-client"):
        assert package in warning, warning
