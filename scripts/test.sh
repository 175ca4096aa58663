#!/usr/bin/env bash
# The whole suite (`make test`): two pytest processes side by side.
#
# The tests in WAITING spend most of their time waiting on Prefect's minimum timeouts (heartbeats
# every 30 s, a 60 s lost-host window, 60 s range leases: about ten minutes) and use little CPU;
# everything else keeps the CPUs busy with vLLM engines and step programs. Run one after the other,
# the waiting is added to the suite's time; run beside each other, it is hidden. Each process
# starts its own S3 and Prefect servers on free ports and builds its own models under its own
# pytest temp dir, so they share nothing but the Docker engine (the waiting tests use none).
#
#   PY       the interpreter (default .venv/bin/python)
#   SEED     run both processes in the random order of this seed (pytest-randomly)
#   SHUFFLE  non-empty: pick a seed
#   SERIAL   non-empty: one process, every test in file order of tests/ (no overlap)
# Extra arguments go to both pytest processes.
set -u
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
WAITING=(tests/flows/test_scale_out.py)

seed=${SEED:-}
if [ -z "$seed" ] && [ -n "${SHUFFLE:-}" ]; then seed=$(od -An -N4 -tu4 /dev/urandom | tr -d ' '); fi
order=()
if [ -n "$seed" ]; then order=(-p randomly "--randomly-seed=$seed"); echo "test order: shuffled with seed $seed"; fi

if [ -n "${SERIAL:-}" ]; then
    "$PY" -m pytest -q "${order[@]}" "$@" tests; status=$?
else
    log=$(mktemp -t datagen-waiting-tests.XXXXXX)
    "$PY" -m pytest -q "${order[@]}" "$@" "${WAITING[@]}" >"$log" 2>&1 &
    waiting=$!
    ignore=(); for t in "${WAITING[@]}"; do ignore+=("--ignore=$t"); done
    "$PY" -m pytest -q "${order[@]}" "$@" "${ignore[@]}" tests; status=$?
    wait "$waiting"; waiting_status=$?
    echo; echo "== ${WAITING[*]} (run beside the rest):"; cat "$log"; rm -f "$log"
    # pytest exits 5 when it collected nothing (a -k that matches no waiting test): not a failure
    if [ "$waiting_status" -ne 0 ] && [ "$waiting_status" -ne 5 ]; then
        [ "$status" -eq 0 ] && status=$waiting_status
    fi
fi
if [ -n "$seed" ]; then echo "test order: shuffled with seed $seed (SEED=$seed make test replays it)"; fi
exit "$status"
