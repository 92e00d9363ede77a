#!/usr/bin/env bash
# Runs the libFuzzer harnesses (make fuzz builds them: $FUZZ_BIN/fuzz_<name>), one at a
# time, each for FUZZ_SECONDS, on its seed corpus (tests/fuzz/corpus/<name>/, read only)
# and saved crash inputs (tests/fuzz/crashes/<name>/); new inputs go to
# $FUZZ_WORK/corpus/<name>/, a crash input to $FUZZ_WORK/artifacts/<name>/. Prints one line
# per harness (executions, executions per second) and fails when any harness found a
# crash, a leak, a sanitizer report or a timeout.
#   tests/fuzz/run.sh [name...]       (default: every harness built)
# FUZZ_ARGS adds libFuzzer flags (e.g. -runs=N); FUZZ_NICE (default 10) is the niceness.
set -u
cd "$(dirname "$0")/../.."
FUZZ_BIN=${FUZZ_BIN:-build/fuzz/bin}
FUZZ_WORK=${FUZZ_WORK:-build/fuzz}
FUZZ_SECONDS=${FUZZ_SECONDS:-60}
FUZZ_NICE=${FUZZ_NICE:-10}
export TIDEPOOL_TEST_MODEL=${TIDEPOOL_TEST_MODEL:-build/models/stories260K.gguf}
export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}
names=("$@")
if [ ${#names[@]} -eq 0 ]; then
    for b in "$FUZZ_BIN"/fuzz_*; do
        [ -x "$b" ] && names+=("$(basename "$b" | sed 's/^fuzz_//')")
    done
fi
[ ${#names[@]} -gt 0 ] || { echo "fuzz: no harnesses in $FUZZ_BIN (make fuzz-build)" >&2; exit 1; }
for n in "${names[@]}"; do
    if [ ! -x "$FUZZ_BIN/fuzz_$n" ]; then
        known=$(for b in "$FUZZ_BIN"/fuzz_*; do [ -x "$b" ] && basename "$b" | sed 's/^fuzz_//'; done | tr '\n' ' ')
        echo "fuzz: no harness named '$n' (in $FUZZ_BIN: ${known:-none; make fuzz-build})" >&2
        exit 2
    fi
done
failed=()
for n in "${names[@]}"; do
    bin=$FUZZ_BIN/fuzz_$n
    work=$FUZZ_WORK/corpus/$n
    art=$FUZZ_WORK/artifacts/$n
    log=$FUZZ_WORK/logs/$n.log
    mkdir -p "$work" "$art" "$(dirname "$log")"
    dirs=("$work" "tests/fuzz/corpus/$n")
    # saved crash inputs (regressions) are read too, when there are any
    if [ -n "$(ls -A "tests/fuzz/crashes/$n" 2>/dev/null | grep -v '^\.')" ]; then
        dirs+=("tests/fuzz/crashes/$n")
    fi
    # inputs past these sizes only slow a harness down (the decoders' limits are far below
    # them, or the cost is quadratic on purpose: BPE merges)
    case $n in
    tokenizer|kvx|api|batch_lines|multipart|protocol|wire) maxlen=-max_len=4096 ;;
    *) maxlen= ;;
    esac
    [ "$n" = tokenizer ] && maxlen=-max_len=512
    t0=$SECONDS
    rc=0
    # shellcheck disable=SC2086
    nice -n "$FUZZ_NICE" "$bin" -max_total_time="$FUZZ_SECONDS" -timeout=20 -rss_limit_mb=2048 \
        -print_final_stats=1 -artifact_prefix="$art/" $maxlen ${FUZZ_ARGS:-} "${dirs[@]}" >"$log" 2>&1 ||
        rc=$?
    execs=$(grep -oE 'stat::number_of_executed_units: [0-9]+' "$log" | grep -oE '[0-9]+$' | tail -n 1)
    secs=$((SECONDS - t0))
    rate=$(grep -oE 'exec/s: [0-9]+' "$log" | tail -n 1 | grep -oE '[0-9]+')
    cov=$(grep -oE 'cov: [0-9]+' "$log" | tail -n 1 | grep -oE '[0-9]+')
    if [ $rc -eq 0 ]; then
        echo "fuzz_$n: ${execs:-?} executions (${rate:-?}/s, coverage ${cov:-?}) in $secs s, 0 crashes"
    else
        failed+=("$n")
        echo "FAIL fuzz_$n (exit $rc) after ${execs:-?} executions — log: $log, inputs: $art/"
        grep -E 'ERROR|SUMMARY|fuzz check failed|Test unit written' "$log" | head -n 10 | sed 's/^/    /'
    fi
done
if [ ${#failed[@]} -gt 0 ]; then
    echo "fuzz: failed: ${failed[*]} (a crash input: save it under tests/fuzz/crashes/<name>/ once fixed)"
    exit 1
fi
echo "fuzz: ${#names[@]} harnesses, 0 crashes"
