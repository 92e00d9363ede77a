#!/usr/bin/env bash
# Runs every unit test binary and every integration test, and ends with one line
# "N passed, N failed". BUILD selects the build directory (build/ or build/san-*).
# A single test: tests/run_tests.sh [unit-binary-or-py-file-substring]
# A failed integration program is run once more and reported FLAKY when it then passes
# (RETRIES=0 turns that off; unit programs never are).
# Another suite of Python tests (tests/netns: the multi-host cluster, as root):
#   tests/run_tests.sh --suite netns [substring]
# JOBS programs run at a time (default 3: most of a program's time is spent waiting on
# servers, sleeps and timeouts, not computing); the timing-sensitive ones in SERIAL run
# afterwards, one at a time with nothing beside them, and so does the re-run of a program
# that failed beside others. JOBS=1 runs everything one at a time, in name order, as before.
# Each program's output goes whole to its log; the PASS/FAIL lines come as programs end.
set -u
cd "$(dirname "$0")/.."
BUILD=${BUILD:-build}
export TIDEPOOL_BUILD=$BUILD
export TIDEPOOL_TEST_MODEL=${TIDEPOOL_TEST_MODEL:-build/models/stories260K.gguf}
# Sanitizer reports fail the test; leaks too.
export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1:abort_on_error=1:halt_on_error=1}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}
PY=/usr/bin/python3
suite=
if [ "${1:-}" = --suite ]; then
    suite=${2:?--suite needs a folder name under tests/}
    shift 2
fi
filter=${1:-}
passed=0
failed=0
cases_passed=0
cases_failed=0
failures=()
flaky=()
# integration programs that fail are run once more (RETRIES=0: never); see run_one
RETRIES=${RETRIES:-1}
logdir=$BUILD/test-logs
mkdir -p "$logdir"

# Add the test cases a log reports to cases_passed / cases_failed (cmocka and unittest).
count_cases() {
    local log=$1 n f
    n=$(grep -oE '^\[==========\] [0-9]+ test\(s\) run' "$log" | grep -oE '[0-9]+' | head -n 1)
    if [ -n "$n" ]; then
        f=$(grep -oE '^\[  FAILED  \] [0-9]+ test' "$log" | grep -oE '[0-9]+' | head -n 1)
        f=${f:-0}
        cases_passed=$((cases_passed + n - f)); cases_failed=$((cases_failed + f))
        return
    fi
    n=$(grep -oE '^Ran [0-9]+ test' "$log" | grep -oE '[0-9]+' | tail -n 1)
    if [ -n "$n" ]; then
        f=$(grep -oE '^FAILED \((failures|errors)=[0-9]+(, (failures|errors)=[0-9]+)?' "$log" |
            grep -oE '[0-9]+' | awk '{s += $1} END {print s + 0}')
        local s
        s=$(grep -oE 'skipped=[0-9]+' "$log" | grep -oE '[0-9]+' | tail -n 1)
        f=${f:-0}; s=${s:-0}
        cases_passed=$((cases_passed + n - f - s)); cases_failed=$((cases_failed + f))
    fi
}

# Programs that run alone (after the others, nothing beside them): their cases assert on
# timing windows that a neighbour's CPU use can push past (each has failed once under load
# and passed on the re-run: docs/testing.md "Parallel runs").
SERIAL="integration/test_tidal integration/test_tidal_bench integration/test_preempt
        integration/test_batch integration/test_bench integration/test_http_errors
        integration/test_stats integration/test_prefix_cache"
# shellcheck disable=SC2116,SC2086  # one space between names, and around them
SERIAL=" $(echo $SERIAL) "
JOBS=${JOBS:-3}
[ -n "$suite" ] && JOBS=1   # the netns suite owns the network namespaces: one at a time

# The end of one run of a program: count its cases, print PASS or FAIL (and its log's tail).
# name, rc, start (SECONDS)
report() {
    local name=$1 rc=$2 start=$3
    local log=$logdir/$(basename "$name").log before=$cases_failed
    count_cases "$log"
    # a program that failed without reporting a failed case (crash, timeout) counts as one
    [ "$rc" -ne 0 ] && [ $cases_failed -eq $before ] && cases_failed=$((cases_failed + 1))
    if [ "$rc" -eq 0 ]; then
        passed=$((passed + 1))
        echo "PASS $name ($((SECONDS - start)) s)"
    else
        failed=$((failed + 1))
        failures+=("$name")
        echo "FAIL $name ($((SECONDS - start)) s) — log: $log"
        tail -n 40 "$log" | sed 's/^/    /'
    fi
}

# Whether a failed run of name gets a second one: integration programs, unless RETRIES=0.
# An integration program runs whole clusters on a shared, noisy machine: one that fails is
# run once more (alone), and a pass then is reported as FLAKY (its first log kept beside the
# second), never silently; a real failure fails twice.
retry_first() { # name, start: prints RETRY, keeps the first log; 0 when a re-run is due
    local name=$1 start=$2 log=$logdir/$(basename "$1").log
    [ "$RETRIES" -gt 0 ] && [[ $name != unit/* ]] || return 1
    echo "RETRY $name ($((SECONDS - start)) s): failed once; its log: $log.first"
    grep -E '^(FAIL|ERROR):|Error:' "$log" | head -n 10 | sed 's/^/    /'
    mv "$log" "$log.first"
}

run_one() { # name, command...: in the foreground, nothing beside it
    local name=$1; shift
    local log=$logdir/$(basename "$name").log
    local t0=$SECONDS rc=0
    timeout 600 "$@" >"$log" 2>&1 </dev/null || rc=$?
    if [ $rc -ne 0 ] && retry_first "$name" "$t0"; then
        rc=0
        timeout 600 "$@" >"$log" 2>&1 </dev/null || rc=$?
        [ $rc -eq 0 ] && flaky+=("$name")
    fi
    report "$name" $rc "$t0"
}

# The programs, in name order: "name<TAB>command words" (no word has a space or a tab).
progs=()
for t in $([ -z "$suite" ] && echo "$BUILD"/tests/test_*); do
    [ -x "$t" ] || continue
    case "$t" in *"$filter"*) ;; *) continue ;; esac
    progs+=("unit/$(basename "$t")"$'\t'"$t")
done
for t in tests/${suite:-integration}/test_*.py; do
    [ -f "$t" ] || continue
    case "$t" in *"$filter"*) ;; *) continue ;; esac
    progs+=("${suite:-integration}/$(basename "$t" .py)"$'\t'"$PY -m unittest -v $t")
done

serial=()   # name<TAB>command: run alone after the parallel part
retry=()    # name<TAB>command: failed beside others, run once more alone at the very end
declare -A job_name=() job_start=() job_cmd=()   # pid -> name, start, command (the running ones)
# The parallel part: up to JOBS programs at a time; when one ends, its report.
# A failure is run again among the serial ones, alone (and a pass then is FLAKY).
finish_one() {
    local pid rc=0
    wait -n -p pid "${!job_name[@]}" || rc=$?
    local name=${job_name[$pid]} start=${job_start[$pid]} cmd=${job_cmd[$pid]}
    unset "job_name[$pid]" "job_start[$pid]" "job_cmd[$pid]"
    if [ $rc -ne 0 ] && retry_first "$name" "$start"; then
        retry+=("$name"$'\t'"$cmd")
        return
    fi
    report "$name" $rc "$start"
}
stop_jobs() { # on INT/TERM: stop the programs this script started (their timeout, by pid)
    local pid
    for pid in "${!job_name[@]}"; do kill -TERM "$pid" 2>/dev/null; done
    exit 130
}
trap stop_jobs INT TERM
for p in "${progs[@]}"; do
    name=${p%%$'\t'*}
    if [ "$JOBS" -le 1 ] || [[ $SERIAL == *" $name "* ]]; then
        serial+=("$p")
        continue
    fi
    while [ ${#job_name[@]} -ge "$JOBS" ]; do finish_one; done
    # shellcheck disable=SC2086  # the command's words
    timeout 600 ${p#*$'\t'} >"$logdir/$(basename "$name").log" 2>&1 </dev/null &
    job_name[$!]=$name
    job_start[$!]=$SECONDS
    job_cmd[$!]=${p#*$'\t'}
done
while [ ${#job_name[@]} -gt 0 ]; do finish_one; done
trap - INT TERM

# The serial part, one at a time: the timing-sensitive programs (all of them with JOBS=1),
# then the re-runs of programs that failed beside others.
for p in ${serial[@]+"${serial[@]}"}; do
    # shellcheck disable=SC2086  # the command's words
    run_one "${p%%$'\t'*}" ${p#*$'\t'}
done
for p in ${retry[@]+"${retry[@]}"}; do
    name=${p%%$'\t'*}
    t0=$SECONDS rc=0
    # shellcheck disable=SC2086
    timeout 600 ${p#*$'\t'} >"$logdir/$(basename "$name").log" 2>&1 </dev/null || rc=$?
    [ $rc -eq 0 ] && flaky+=("$name")
    report "$name" $rc "$t0"
done

if [ ${#flaky[@]} -gt 0 ]; then
    echo "FLAKY (failed once, passed when run again): ${flaky[*]}"
fi
if [ ${#failures[@]} -gt 0 ]; then
    echo "failed: ${failures[*]}"
fi
echo "test programs: $passed passed, $failed failed"
echo "$cases_passed passed, $cases_failed failed"
[ "$failed" -eq 0 ]
