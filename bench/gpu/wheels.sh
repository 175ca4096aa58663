#!/usr/bin/env bash
# Build the carried wheel folders .gpuA/ ... (bench/gpu/README.md): vllm==0.24.0 in 44 MiB parts plus the
# dependency wheels the GPU image lacks, for cp312 manylinux x86_64, with FILES.txt and SHA256SUMS
# in .gpuA. Run on a machine with PyPI access, from anywhere:  bash bench/gpu/wheels.sh
# Downloads into WHEELS=${WHEELS:-.cache/gpu-wheels} (reused), then rewrites the .gpu*/ folders.
set -euo pipefail
cd "$(dirname "$0")/../.."                       # repository root
WHEELS="${WHEELS:-.cache/gpu-wheels}"
VLLM="$(python3 -c 'import sys; sys.path.insert(0, "."); from datagen.engines.releases import CUDA_VLLM_RELEASE as v; print(v)' 2>/dev/null || echo 0.24.0)"
PY=${PYTHON:-.venv/bin/python}
DEPS=(pydantic==2.12.5 pydantic-core==2.41.5 annotated-types typing-inspection msgspec pyzmq blake3
  cbor2 cachetools openai==2.8.1 distro jiter sniffio "fastapi<0.137" "starlette>=1.0.1" uvicorn
  python-multipart prometheus-fastapi-instrumentator partial-json-parser lark==1.2.2 xgrammar==0.2.1
  apache-tvm-ffi==0.1.9 "llguidance>=1.7,<1.8" outlines_core==0.2.14 lm-format-enforcer==0.11.3
  interegular compressed-tensors==0.17.0 depyf==0.20.0 astor dill diskcache==5.6.3 gguf mistral_common
  pydantic-extra-types jsonschema referencing jsonschema-specifications rpds-py pybase64 ijson
  setproctitle watchfiles python-json-logger opentelemetry-api opentelemetry-sdk
  opentelemetry-semantic-conventions openai-harmony email-validator dnspython importlib-metadata
  loguru)
mkdir -p "$WHEELS"
dl() { "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
         --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
         --implementation cp --dest "$WHEELS" "$@"; }
dl "vllm==$VLLM"
for d in "${DEPS[@]}"; do   # a pin this index lacks: take the newest it has, and say so
  dl "$d" 2>/dev/null || { name=${d%%[<>=]*}; echo "wheels: $d not found, taking the newest $name" >&2; dl "$name"; }
done
# Pack: vllm in parts, then wheels largest first into the folder with most room (<= 45 MiB each: a folder plus
# the tree stays under a call's 64 MiB while the tree, untracked results included, stays under 19 MiB; at
# 57.75 MB a folder was refused once the tree reached 9.3 MB).
rm -rf .gpu[A-Z]
W=$(ls "$WHEELS"/vllm-"$VLLM"-*.whl)
PARTS=$(mktemp -d); split -b 44M "$W" "$PARTS/$(basename "$W").part"
LIMIT=$((45 * 1024 * 1024))
rest=(); for w in "$WHEELS"/*.whl; do [ "$w" = "$W" ] || rest+=("$w"); done
python3 bench/gpu/pack.py gpu "$LIMIT" bench/gpu/wheels.sh --first "$PARTS"/* --rest "${rest[@]}" --sums "$WHEELS"/*.whl
rm -rf "$PARTS"
grep -qx '/.gpu\*/' .git/info/exclude 2>/dev/null || { mkdir -p .git/info; echo '/.gpu*/' >> .git/info/exclude; }
echo "wheels: $(ls "$WHEELS" | wc -l) wheels; folders: $(ls -d .gpu*/ | xargs)"
