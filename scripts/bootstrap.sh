#!/usr/bin/env bash
# Set up everything textsql needs in ./.venv (idempotent), then run the demo, the tests or JupyterLab.
#   bash scripts/bootstrap.sh demo [textsql demo args...]
#   bash scripts/bootstrap.sh test [pytest args...]
#   bash scripts/bootstrap.sh lab [textsql lab args...]    (JupyterLab on the notebooks, 127.0.0.1)
set -euo pipefail
cd "$(dirname "$0")/.."
# 2.13.0, not the newest (2.15.0): the only torch of which a CPU build reaches a CPU-only machine here (requirements.txt says why).
TORCH_VERSION="${TEXTSQL_TORCH_VERSION:-2.13.0}"
VENV="${TEXTSQL_VENV:-.venv}"
PY="${PYTHON:-python3}"

stamp_of_inputs() { cat requirements.txt requirements-lab.txt requirements-lifecycle.txt requirements-test.txt requirements-peft.txt requirements-mlflow.txt requirements-grpo.txt pyproject.toml scripts/bootstrap.sh | sha256sum | cut -c1-16; }

setup_python() {
  local stamp; stamp="$(stamp_of_inputs)"
  if [[ -f "$VENV/.textsql-stamp" && "$(cat "$VENV/.textsql-stamp")" == "$stamp" ]]; then return; fi
  echo "== setting up $VENV (torch $TORCH_VERSION first, then the pinned requirements)"
  [[ -x "$VENV/bin/python" ]] || "$PY" -m venv "$VENV"
  "$VENV/bin/python" -m pip install -q --upgrade pip setuptools wheel
  # torch first and alone: on a CPU-only machine this finds the CPU build; a plain unpinned torch would pull GBs of CUDA.
  "$VENV/bin/python" -m pip install -q "torch==$TORCH_VERSION"
  local installed; installed="$("$VENV/bin/python" -c 'from importlib.metadata import version; print(version("torch"))')"  # not `import torch`: numpy is not installed yet, torch would warn
  # Pin exactly the torch now installed for every later pip call, build environments included (PIP_CONSTRAINT is inherited).
  mkdir -p "$VENV/etc"; echo "torch==$installed" > "$VENV/etc/constraints.txt"
  PIP_CONSTRAINT="$PWD/$VENV/etc/constraints.txt" "$VENV/bin/python" -m pip install -q -r requirements.txt -r requirements-lab.txt -r requirements-lifecycle.txt -r requirements-test.txt -r requirements-peft.txt -r requirements-mlflow.txt -r requirements-grpo.txt
  PIP_CONSTRAINT="$PWD/$VENV/etc/constraints.txt" "$VENV/bin/python" -m pip install -q --no-deps -e .
  "$VENV/bin/python" -m ipykernel install --sys-prefix --name python3 >/dev/null
  echo "$stamp" > "$VENV/.textsql-stamp"
}

setup_system() {
  # Debian packages: g++ for DeepSpeed's ops (what training needs: demo, lab, setup); for the tests (`test` only) also
  # sshd + pdsh (multi-node over loopback), chromium (TensorBoard and compare-app screenshots) and libaio-dev
  # (DeepSpeed's async I/O op: zero3_nvme trains in the tests). Only what is missing is installed; skipped without apt
  # or root.
  local missing=()
  command -v g++ >/dev/null || missing+=(g++)
  if [[ "${1:-}" == test ]]; then
    [[ -x /usr/sbin/sshd ]] || missing+=(openssh-server)
    command -v ssh >/dev/null || missing+=(openssh-client)
    command -v pdsh >/dev/null || missing+=(pdsh)
    command -v pkill >/dev/null || missing+=(procps)
    command -v chromium >/dev/null || missing+=(chromium)
    [[ -e /usr/include/libaio.h ]] || missing+=(libaio-dev)
  fi
  ((${#missing[@]})) || return 0
  if command -v apt-get >/dev/null && [[ $(id -u) == 0 ]]; then
    echo "== installing ${missing[*]}"
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
  else
    echo "warning: missing system packages (${missing[*]}); install them with your package manager" >&2
  fi
}

cmd="${1:-}"; shift || true
# DeepSpeed's C++ ops (60-70 s each to build on 2 cores) are cached in the one folder textsql itself decides
# (textsql.strategy.opbuilds.extensions_folder), whoever starts it: nothing to set here.
case "$cmd" in
  demo)
    setup_system demo; setup_python
    exec "$VENV/bin/textsql" demo "$@" ;;
  test)
    setup_system test; setup_python
    # Without arguments, the whole suite as CI runs it: two worker processes (most tests wait on child processes
    # starting, so two cores are busier with two), each test file on one worker (a file's tests share a fixed port
    # or a fixture) in collection order (tests/conftest.py puts the longest files first by tests/durations.json, which
    # this whole run rewrites at its end; pytest-xdist would otherwise start the files with the most tests first,
    # leaving the one-test GPU check for last), the 30 slowest tests listed at the end (what to shorten next). With
    # arguments, exactly the pytest run asked for.
    (($#)) || set -- -ra --durations 30 --timeout 900 -n 2 --dist loadfile --no-loadscope-reorder
    exec "$VENV/bin/python" -m pytest "$@" ;;
  lab)
    setup_system lab; setup_python
    exec "$VENV/bin/textsql" lab "$@" ;;
  setup)
    setup_system setup; setup_python ;;
  *)
    echo "usage: bash scripts/bootstrap.sh {demo|test|lab|setup} [args...]" >&2; exit 2 ;;
esac
