#!/usr/bin/env bash
# The GPU check in one call, on the device machine (bench/gpu/README.md). From the repository root:
#   bash bench/gpu/run.sh [check.py args...]      # carry: bench/gpu/wheels (made here by bench/gpu/prepare.sh)
# Installs the carried wheels into a folder of their own (never touching the image's torch), then runs every step of
# bench/gpu/check.py, writing $OUT/gpu_check.json (rewritten after each step) and $OUT/gpu_check.log.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT="${OUT:-$PWD/gpu-check-out}"; mkdir -p "$OUT"
SITE="${GPU_CHECK_SITE:-/tmp/textsql-site}"
started=$SECONDS
if ! ls bench/gpu/wheels/*.whl >/dev/null 2>&1; then
  echo "bench/gpu/wheels/ is empty: run bash bench/gpu/prepare.sh on a machine with the package index, and carry bench/gpu/wheels" >&2
  exit 2
fi
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" bench/gpu/wheels/*.whl \
  || { echo "installing the wheels failed" >&2; exit 2; }
export PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}" PATH="$SITE/bin:$PATH" PYTHONUNBUFFERED=1
echo "== wheels installed in $((SECONDS - started)) s; torch $(python3 -c 'import torch; print(torch.__version__, torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU")')"
real=(); [[ -f bench/gpu/real/wikisql/train.jsonl ]] && real=(--real bench/gpu/real)
python3 bench/gpu/check.py --output "$OUT/gpu_check.json" --log "$OUT/gpu_check.log" --total_budget_s "${GPU_CHECK_SECONDS:-500}" "${real[@]}" "$@"
status=$?
echo "== bench/gpu/run.sh: $((SECONDS - started)) s in all, exit status $status"
exit $status
