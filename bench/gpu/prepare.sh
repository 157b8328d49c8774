#!/usr/bin/env bash
# Run HERE (a machine with the package index), before a GPU window: put into bench/gpu/wheels/ (ignored by git) every
# wheel the GPU machine's image lacks, for its Python (3.12, x86-64), within the device tool's 64 MiB limit on what
# travels. The GPU machine has no network: bench/gpu/run.sh installs these with --no-index and leaves its torch alone.
#   bash bench/gpu/prepare.sh            # ~1 minute; prints the folder's size
# What the image has (the device tool's KINDS.md, 2026-11): torch 2.11 + CUDA 13.0, transformers 5.17, accelerate
# 1.15, peft, safetensors, tokenizers 0.23.2, huggingface_hub 1.33, sentencepiece, pyarrow, pandas, tensorboard,
# ninja, py-cpuinfo, psutil, msgpack, einops; no DeepSpeed, datasets, bitsandbytes, torchao, babel or pydantic.
set -euo pipefail
cd "$(dirname "$0")/../.."
WHEELS=bench/gpu/wheels
PY="${PYTHON:-.venv/bin/python}"
PYVER="${GPU_PYTHON_VERSION:-3.12}"
rm -rf "$WHEELS"; mkdir -p "$WHEELS"
platforms=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64; do
  platforms+=(--platform "$p")
done
# The pins of requirements*.txt where the image's version is older than textsql needs or the package is missing;
# the dependencies the image lacks named one by one (--no-deps: pip cannot resolve against the image from here).
# liger-kernel: Liger Kernel's Triton kernels (--fused_loss liger), pure Python on the Triton CUDA torch ships.
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version "$PYVER" --implementation cp "${platforms[@]}" \
  -d "$WHEELS" \
  transformers==5.24.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 fsspec==2026.9.0 \
  regex==2026.11.19 hjson==3.1.0 pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.7.0 typing-inspection==0.4.4 \
  peft==0.21.2 babel==2.19.0 torchao==0.18.0 bitsandbytes==0.50.2 \
  liger-kernel==0.8.5 2>&1 | grep -v "is ignored: it is neither" || true
# DeepSpeed has no wheel on the package index: build one from its source release, every op left to JIT (compiled on
# the GPU machine at first use, with its CUDA), so the wheel is pure Python and fits any torch.
DS_BUILD_OPS=0 "$PY" -m pip wheel -q --no-deps --no-build-isolation -w "$WHEELS" deepspeed==0.19.8 2>&1 \
  | grep -v "is ignored: it is neither" || true
# Two wheels are mostly what the GPU check never loads: bitsandbytes' libraries for every other CUDA and ROCm release
# (43 MB) and babel's 1,000 locales (10 MB; WikiSQL's scoring parses numbers in the default English locale).
"$PY" bench/gpu/slim_wheel.py "$WHEELS"/bitsandbytes-*.whl --keep 'bitsandbytes/libbitsandbytes_(cuda13\d|cpu)\.so$' \
  --drop '\.so$'
"$PY" bench/gpu/slim_wheel.py "$WHEELS"/babel-*.whl --keep 'locale-data/(root|en|en_US|en_001)\.dat$' \
  --drop 'locale-data/.*\.dat$'
ls -la "$WHEELS"
du -sh "$WHEELS" | awk '{print "== bench/gpu/wheels: " $1 " (the device tool carries at most 64 MiB with the working tree)"}'
# The real WikiSQL lines and T5's tokenizer and configs (../shared/real, beside a developer's checkout), so the GPU's
# figures carry real lengths and t5's 32k-token output layer: copied into bench/gpu/real (ignored; never committed).
REAL="${TEXTSQL_REAL_FILES:-../shared/real}"
rm -rf bench/gpu/real
if [[ -f "$REAL/wikisql/train.jsonl" && -f "$REAL/t5/spiece.model" ]]; then
  mkdir -p bench/gpu/real/wikisql bench/gpu/real/t5/t5-base bench/gpu/real/t5/t5-large
  cp "$REAL"/wikisql/{train,test}{,.tables}.jsonl bench/gpu/real/wikisql/
  cp "$REAL"/t5/spiece.model bench/gpu/real/t5/
  cp "$REAL"/t5/t5-base/config.json bench/gpu/real/t5/t5-base/
  cp "$REAL"/t5/t5-large/config.json bench/gpu/real/t5/t5-large/
  du -sh bench/gpu/real | awk '{print "== bench/gpu/real: " $1 " (carry it too)"}'
else
  echo "== no real files at $REAL: the check runs on generated data"
fi
# The real Qwen2 tokenizer for the causal-LM step (Qwen2.5-0.5B's shape): 11 MiB.
if [[ -f "$REAL/qwen2/tokenizer.json" ]]; then
  mkdir -p bench/gpu/real/qwen2 && cp "$REAL"/qwen2/* bench/gpu/real/qwen2/
  du -sh bench/gpu/real | awk '{print "== bench/gpu/real with qwen2: " $1}'
fi
