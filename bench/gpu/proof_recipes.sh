#!/usr/bin/env bash
# Issue 58's proof on one GPU, run in the background of a device session (docs/gpu.md, "To run: ...
# (issue 58)"): the drafts of both recipes (speculators' default and AdamW without the norms) on the right,
# the off-by-one and the grossly wrong layers, 3 seeds each, and the untrained draft; then, once the vLLM
# wheels are installed (bench/gpu/install.sh leaves SITE/.installed), vLLM's EAGLE-3 acceptance of every
# draft, each prompt stopping at its end of turn: the right layers' drafts first, then the wrong ones.
# vLLM's processes start by spawn (measure_spec_decode sets it on the GPU since; here too, as the run that
# measured was given it): forked, every engine failed to start ("Cannot re-initialize CUDA").
# Needs the training wheels in /tmp/gsite (.gputrain, .gputrain2). Run from the code's root:
#   bash bench/gpu/proof_recipes.sh WORK STEPS      (defaults: /tmp/gproof 2000)
set -u
W=${1:-/tmp/gproof}
STEPS=${2:-2000}
SITE=${GPU_SITE:-/tmp/gpu-site}
mkdir -p "$W/out"
PYTHONPATH=/tmp/gsite:$PWD PYTHONUNBUFFERED=1 python3 bench/gpu/train.py proof --work "$W" --out "$W/out" \
  --rows 1600 --new-tokens 160 --steps "$STEPS" --seeds 3 --measured-rows 200 --total-seq-len 2048 --procs 19 \
  --workers 0 --budget 900 --recipes default,adamw \
  --cases untrained,bf16,off-by-one,gross,bf16.adamw,off-by-one.adamw,gross.adamw
until [ -f "$SITE/.installed" ]; do sleep 5; done
for cases in untrained,bf16,bf16.adamw off-by-one,gross,off-by-one.adamw,gross.adamw; do
  PYTHONPATH=$SITE:$PWD:/tmp/gsite PYTHONUNBUFFERED=1 VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_USE_V2_MODEL_RUNNER=0 \
    DATAGEN_GPU_MEMORY_UTILIZATION=0.13 VLLM_WORKER_MULTIPROC_METHOD=spawn python3 bench/gpu/train.py proof-spec --work "$W" --out "$W/out" \
    --prompts 64 --max-tokens 64 --parallel 5 --stagger 15 --stop-at-eos --run-timeout 240 --budget 600 \
    --cases "$cases"
done
echo "proof-recipes: done"
