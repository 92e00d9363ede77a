#!/usr/bin/env bash
# Runs every unit test binary and every integration test, and ends with one line
# "N passed, N failed". BUILD selects the build directory (build/ or build/san-*).
# A single test: tests/run_tests.sh [unit-binary-or-py-file-substring]
# A failed integration program is run once more and reported FLAKY when it then passes
# (RETRIES=0 turns that off; unit programs never are).
# Another suite of Python tests (tests/netns: the multi-host cluster, as root):
#   tests/run_tests.sh --suite netns [substring]
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

run_one() { # name, command...
    local name=$1; shift
    local log=$logdir/$(basename "$name").log
    local t0=$SECONDS
    local rc=0 before=$cases_failed
    timeout 600 "$@" >"$log" 2>&1 || rc=$?
    if [ $rc -ne 0 ] && [ "$RETRIES" -gt 0 ] && [[ $name != unit/* ]]; then
        # An integration program runs whole clusters on a shared, noisy machine: one that
        # fails is run once more, and a pass then is reported as FLAKY (its first log kept
        # beside the second), never silently; a real failure fails twice.
        echo "RETRY $name ($((SECONDS - t0)) s): failed once; its log: $log.first"
        grep -E '^(FAIL|ERROR):|Error:' "$log" | head -n 10 | sed 's/^/    /'
        mv "$log" "$log.first"
        rc=0
        timeout 600 "$@" >"$log" 2>&1 || rc=$?
        [ $rc -eq 0 ] && flaky+=("$name")
    fi
    count_cases "$log"
    # a program that failed without reporting a failed case (crash, timeout) counts as one
    [ $rc -ne 0 ] && [ $cases_failed -eq $before ] && cases_failed=$((cases_failed + 1))
    if [ $rc -eq 0 ]; then
        passed=$((passed + 1))
        echo "PASS $name ($((SECONDS - t0)) s)"
    else
        failed=$((failed + 1))
        failures+=("$name")
        echo "FAIL $name ($((SECONDS - t0)) s) — log: $log"
        tail -n 40 "$log" | sed 's/^/    /'
    fi
}

for t in $([ -z "$suite" ] && echo "$BUILD"/tests/test_*); do
    [ -x "$t" ] || continue
    case "$t" in *"$filter"*) ;; *) continue ;; esac
    run_one "unit/$(basename "$t")" "$t"
done
for t in tests/${suite:-integration}/test_*.py; do
    [ -f "$t" ] || continue
    case "$t" in *"$filter"*) ;; *) continue ;; esac
    run_one "${suite:-integration}/$(basename "$t" .py)" "$PY" -m unittest -v "$t"
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
