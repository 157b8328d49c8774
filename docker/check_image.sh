#!/usr/bin/env bash
# Build-time checks of a textsql runtime image: the last step of docker/Dockerfile.jupyter and
# docker/Dockerfile.workbench. Any failure fails the build, with the reason.
# Inputs (environment): TORCH_VERSION, DS_BUILD_OPS / DS_BUILD_CPU_ADAM / DS_BUILD_FUSED_ADAM (1 = pre-built),
# CPU_ARCH (the target of pre-built CPU ops), ML_RUNTIME_CUDA_VERSION (from the CML base), CUDA_HOME,
# TEXTSQL_REQUIREMENTS (default: every /etc/textsql/requirements*.txt the image copied, space-separated).
set -euo pipefail
export TEXTSQL_REQUIREMENTS="${TEXTSQL_REQUIREMENTS:-$(echo /etc/textsql/requirements*.txt)}"
fail() { echo "check_image: FAILED: $*" >&2; exit 1; }
ok() { echo "check_image: ok: $*"; }

# 1. nvcc of the base's CUDA release, and the headers DeepSpeed's ops compile against.
command -v nvcc >/dev/null || fail "nvcc not on PATH (CUDA_HOME=${CUDA_HOME:-unset})"
nvcc_release="$(nvcc --version | sed -n 's/.*release \([0-9][0-9]*\.[0-9][0-9]*\).*/\1/p')"
[[ -n "$nvcc_release" ]] || fail "cannot read the nvcc release from: $(nvcc --version | tail -1)"
if [[ -n "${ML_RUNTIME_CUDA_VERSION:-}" ]]; then
  base_release="$(cut -d. -f1,2 <<<"$ML_RUNTIME_CUDA_VERSION")"
  [[ "$nvcc_release" == "$base_release" ]] || fail "nvcc is CUDA $nvcc_release but the base runtime declares CUDA $ML_RUNTIME_CUDA_VERSION (set CUDA_PKG_SUFFIX/CUDA_PKG_VERSION/CUDA_NVTX_VERSION to match the base)"
fi
for header in cuda_runtime.h cublas_v2.h cusparse.h cusolverDn.h curand.h cufft.h; do
  [[ -f "$CUDA_HOME/include/$header" ]] || fail "missing CUDA header $CUDA_HOME/include/$header"
done
[[ -f "$CUDA_HOME/include/nvtx3/nvToolsExt.h" || -f "$CUDA_HOME/include/nvToolsExt.h" ]] || fail "missing NVTX headers"
[[ -f /usr/include/libaio.h ]] || fail "missing libaio headers (libaio-dev)"
ok "nvcc $nvcc_release, CUDA headers, NVTX, libaio"

# 2. Launchers and build tools (pdsh and ssh for user-managed machines; no ssh server: CML pods need none).
for tool in pdsh mpirun ssh g++ ninja objdump pkill; do
  command -v "$tool" >/dev/null || fail "$tool not found"
done
if command -v sshd >/dev/null || [[ -e /usr/sbin/sshd ]]; then fail "an ssh server is installed; textsql's pods start their ranks without ssh"; fi
ok "pdsh, mpirun, ssh, g++, ninja, objdump, pkill; no sshd"

# 3. No host keys, no private keys, no disabled host key checking anywhere ssh looks.
if compgen -G '/etc/ssh/ssh_host_*' >/dev/null; then fail "host keys left in the image: $(echo /etc/ssh/ssh_host_*)"; fi
key_dirs=(/etc/ssh /etc/textsql)
for home in /root /home/*; do [[ -d "$home/.ssh" ]] && key_dirs+=("$home/.ssh"); done
# (The bracket keeps this line from matching itself: check_image.sh lies in the scanned folder.)
if found="$(grep -rIl -e 'PRIVATE[ ]KEY-----' "${key_dirs[@]}" 2>/dev/null)"; then fail "private keys in the image: $found"; fi
if found="$(grep -rIil -E 'StrictHostKeyChecking[[:space:]=]+no' /etc/ssh 2>/dev/null)"; then fail "host key checking disabled in: $found"; fi
ok "no host keys, no private keys, host key checking not disabled"

# 4. torch: the pinned version, a CUDA build of the same CUDA major as nvcc (DeepSpeed's JIT refuses a major
#    mismatch); then every pin of every requirements file installed at exactly its version, and the extras' packages
#    a CML user reaches for importable (LoRA/QLoRA and the causal-LM road: peft, bitsandbytes; quantization: torchao;
#    the compare app: gradio; CML Experiments: mlflow).
python3 - "$nvcc_release" <<'EOF'
import re, sys
from importlib.metadata import version, PackageNotFoundError
import os
import torch

nvcc = sys.argv[1]
want = os.environ.get("TORCH_VERSION", "")
have = torch.__version__.split("+")[0]
if want and have != want:
    sys.exit(f"check_image: FAILED: torch {torch.__version__} installed, {want} pinned")
if torch.version.cuda is None:
    sys.exit(f"check_image: FAILED: torch {torch.__version__} is not a CUDA build (set TORCH_INDEX_URL to a CUDA index)")
if torch.version.cuda.split(".")[0] != nvcc.split(".")[0]:
    sys.exit(f"check_image: FAILED: torch is built with CUDA {torch.version.cuda}, nvcc is {nvcc}: DeepSpeed cannot build its ops "
             "(choose a torch CUDA variant of the same major with TORCH_INDEX_URL, or a base of that CUDA)")
print(f"check_image: ok: torch {torch.__version__} (CUDA {torch.version.cuda}), nvcc {nvcc}")

bad, files = [], os.environ["TEXTSQL_REQUIREMENTS"].split()
for path in files:
    for line in open(path):
        line = line.split("#", 1)[0].strip()
        m = re.fullmatch(r"([A-Za-z0-9_.\-\[\]]+)==(\S+)", line)
        if not m:
            continue
        name, pinned = re.sub(r"\[.*\]", "", m.group(1)), m.group(2)
        try:
            installed = version(name)
        except PackageNotFoundError:
            installed = None
        if installed != pinned:
            bad.append(f"{os.path.basename(path)}: {name}: {installed or 'missing'} installed, {pinned} pinned")
if bad:
    sys.exit("check_image: FAILED: requirements not honoured: " + "; ".join(bad))
print("check_image: ok: every pin installed (" + ", ".join(os.path.basename(p) for p in files) + ")")

import importlib
for module in ("peft", "bitsandbytes", "torchao", "gradio", "mlflow"):
    try:
        importlib.import_module(module)
    except Exception as error:  # noqa: BLE001 - any failure to import is the finding
        sys.exit(f"check_image: FAILED: {module} (a textsql extra) does not import: {error}")
print("check_image: ok: peft, bitsandbytes, torchao, gradio and mlflow import")
EOF

# 5. Pre-built DeepSpeed ops, when asked for.
ops_report="$(python3 - <<'EOF'
import importlib.util, os, pathlib, sys

# Read what DeepSpeed's setup.py recorded, without importing deepspeed (and its accelerator detection).
spec = importlib.util.find_spec("deepspeed")
if spec is None:
    sys.exit("check_image: FAILED: deepspeed is not installed")
recorded = pathlib.Path(list(spec.submodule_search_locations)[0]) / "git_version_info_installed.py"
namespace = {}
if recorded.exists():
    exec(recorded.read_text(), namespace)
installed_ops = namespace.get("installed_ops", {})

wanted = []
if os.environ.get("DS_BUILD_OPS") == "1":
    wanted += ["cpu_adam", "fused_adam"]
for op in ("cpu_adam", "fused_adam"):
    if os.environ.get("DS_BUILD_" + op.upper()) == "1":
        wanted.append(op)
missing = sorted({op for op in wanted if not installed_ops.get(op)})
if missing:
    sys.exit(f"check_image: FAILED: DeepSpeed ops requested but not pre-built: {missing}")
built = sorted(op for op, on in installed_ops.items() if on)
print(f"check_image: ok: DeepSpeed pre-built ops: {built or 'none (compiled just in time on the GPU pod)'}")
if installed_ops.get("cpu_adam"):
    print("cpu_adam " + str(next(pathlib.Path(list(spec.submodule_search_locations)[0], "ops", "adam").glob("cpu_adam_op*.so"))))
EOF
)"
printf '%s\n' "$ops_report" | grep -v '^cpu_adam ' || true

# 6. A pre-built cpu_adam runs on every CPU of CPU_ARCH, whatever the build host had: no AVX-512 instructions
#    (zmm registers) unless the target is x86-64-v4.
cpu_adam="$(printf '%s\n' "$ops_report" | sed -n 's/^cpu_adam //p')"
if [[ -n "$cpu_adam" ]]; then
  if [[ "${CPU_ARCH:-x86-64-v3}" != x86-64-v4 ]] && objdump -d "$cpu_adam" | grep -q '%zmm'; then
    fail "$cpu_adam uses AVX-512 instructions: it was compiled for the build host, not for CPU_ARCH=${CPU_ARCH:-x86-64-v3} (build with CXX=/etc/textsql/portable-cxx.sh)"
  fi
  ok "cpu_adam compiled for ${CPU_ARCH:-x86-64-v3}, not for the build host"
fi
