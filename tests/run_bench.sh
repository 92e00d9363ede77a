#!/usr/bin/env bash
# Runs every benchmark binary ($BUILD/tests/bench_*) and prints its numbers (make bench).
# The engine benchmark needs synthetic 1B-class models, the KV transfer benchmark a
# mid-size one; they are created under build/models/ on first use with tidepool-mkmodel
# (F16 2.2 GB, Q8_0 1.2 GB, about half a minute each; mid-size F16 56 MB; never
# committed). Not part of `make test`. Numbers are ratios within
# one run on one (possibly shared) machine, not absolute claims.
#   tests/run_bench.sh [bench-binary-substring]
# With LLAMA_CPP_DIR=DIR (a llama.cpp build: DIR/build/bin/llama-bench or DIR/bin/llama-bench)
# the engine bench is followed by batch-1 decode side by side with llama-bench on the same
# GGUF files: PEER_REPS (3) alternating runs of `bench_engine --tg` and `llama-bench -p 0
# -n N` (N = 128, 32 for the 1B-class models) per model and per thread count of
# PEER_THREADS (default: the CPUs available), medians, and the ratio tidepool/llama.cpp;
# then prefill of 512 tokens the same way (`bench_engine --pp`, `llama-bench -p 512 -n 0`);
# then aggregate decode at batch 1, 8 and 32 side by side with llama-batched-bench
# (peer_batched below). Last, with LLAMA_CPP_DIR, the serving benchmark: tidepool-bench
# against a local tidepool and llama-server at 1, 16 and 64 streams
# (tools/bench/serve-peer.sh, its settings there).
set -u
cd "$(dirname "$0")/.."
BUILD=${BUILD:-build}
filter=${1:-}
MODELS=build/models
mkdir -p "$MODELS"

need_model() { # path, mkmodel args...
    local path=$1; shift
    if [ ! -f "$path" ]; then
        echo "creating $path (tidepool-mkmodel $*)"
        "$BUILD/bin/tidepool-mkmodel" "$@" --out "$path" || { echo "cannot create $path"; exit 1; }
    fi
}

median() { sort -g | awk '{a[NR] = $1} END {print (NR % 2) ? a[(NR + 1) / 2] : (a[NR / 2] + a[NR / 2 + 1]) / 2}'; }

# peer_llama MODEL...: the side-by-side runs described above, batch-1 decode (tg) and then
# prefill of 512 tokens (pp512: `bench_engine --pp` against `llama-bench -p 512 -n 0`).
peer_llama() {
    local lb=""
    for c in "$LLAMA_CPP_DIR/build/bin/llama-bench" "$LLAMA_CPP_DIR/bin/llama-bench"; do
        [ -x "$c" ] && { lb=$c; break; }
    done
    if [ -z "$lb" ]; then
        echo "peer llama.cpp: no llama-bench under LLAMA_CPP_DIR=$LLAMA_CPP_DIR (build/bin or bin)"
        return 1
    fi
    local reps=${PEER_REPS:-3} threads=${PEER_THREADS:-$(nproc)} rc=0
    for kind in tg pp; do
        if [ $kind = tg ]; then
            echo "peer llama.cpp ($lb): batch-1 decode, medians of $reps alternating runs"
        else
            echo "peer llama.cpp ($lb): prefill of 512 tokens, medians of $reps alternating runs"
        fi
        printf '  %-28s %7s %14s %14s %8s\n' model threads "tidepool tok/s" "llama.cpp" ratio
        for model in "$@"; do
            local n=128 largs
            [ "$(stat -L -c %s "$model")" -gt $((256 << 20)) ] && n=32
            if [ $kind = tg ]; then largs=(-p 0 -n "$n"); else largs=(-p 512 -n 0); n=512; fi
            for t in $threads; do
                local tp=() lc=()
                for _ in $(seq "$reps"); do
                    local v
                    v=$("$BUILD/tests/bench_engine" --$kind --threads "$t" "$model" |
                        awk -v k=$kind '$1 == k {print $3}')
                    [ -n "$v" ] && tp+=("$v")
                    # avg_ts: the column so named in llama-bench's CSV header
                    v=$("$lb" -m "$model" "${largs[@]}" -t "$t" -r 1 -o csv 2>/dev/null | awk -F, '
                        NR == 1 { for (i = 1; i <= NF; i++) if ($i == "avg_ts") c = i }
                        NR > 1 && c { gsub(/"/, "", $c); print $c }')
                    [ -n "$v" ] && lc+=("$v")
                done
                if [ ${#tp[@]} -eq 0 ] || [ ${#lc[@]} -eq 0 ]; then
                    echo "  $(basename "$model"): a run failed (tidepool ${#tp[@]}, llama.cpp ${#lc[@]} of $reps)"
                    rc=1
                    continue
                fi
                local mt ml
                mt=$(printf '%s\n' "${tp[@]}" | median)
                ml=$(printf '%s\n' "${lc[@]}" | median)
                printf '  %-28s %7d %14.1f %14.1f %7.2fx   (%s%d; runs: tidepool %s; llama.cpp %s)\n' \
                    "$(basename "$model")" "$t" "$mt" "$ml" "$(awk -v a="$mt" -v b="$ml" 'BEGIN {print a / b}')" \
                    "$kind" "$n" "${tp[*]}" "${lc[*]}"
            done
        done
    done
    return $rc
}

# peer_batched MODEL...: aggregate decode at batch 1, 8 and 32 side by side with
# llama-batched-bench on the same GGUF files: PEER_REPS (3) alternating runs of
# `bench_engine --batched` (every sequence at context 64, batch 1, 8 and 32 time-sliced:
# 64 rounds of 32 tokens of each, 2 on the 1B-class models; tokens / wall) and `llama-batched-bench -npp 64 -ntg N -npl 1,8,32` (its decode rate
# speed_tg over N = 64 steps, 16 on the 1B-class models, after prompts of 64 tokens) per
# model and per thread count of PEER_THREADS, medians, and the ratio tidepool/llama.cpp.
peer_batched() {
    local bb=""
    for c in "$LLAMA_CPP_DIR/build/bin/llama-batched-bench" "$LLAMA_CPP_DIR/bin/llama-batched-bench"; do
        [ -x "$c" ] && { bb=$c; break; }
    done
    if [ -z "$bb" ]; then
        echo "peer llama.cpp: no llama-batched-bench under LLAMA_CPP_DIR=$LLAMA_CPP_DIR (build/bin or bin)"
        return 1
    fi
    local reps=${PEER_REPS:-3} threads=${PEER_THREADS:-$(nproc)} rc=0
    echo "peer llama.cpp ($bb): aggregate decode, medians of $reps alternating runs"
    printf '  %-28s %7s %5s %14s %14s %8s\n' model threads batch "tidepool tok/s" "llama.cpp" ratio
    for model in "$@"; do
        local n=64
        [ "$(stat -c %s "$model")" -gt $((256 << 20)) ] && n=16
        for t in $threads; do
            local tp="" lc=""
            for _ in $(seq "$reps"); do
                # "bd MODEL B TOK/S" lines; llama-batched-bench's jsonl has "pl" and "speed_tg"
                tp+=$("$BUILD/tests/bench_engine" --batched --threads "$t" "$model" | awk '$1 == "bd" {print $3, $4}')
                tp+=$'\n'
                lc+=$("$bb" -m "$model" -c $((32 * (64 + n) + 64)) -npp 64 -ntg "$n" -npl 1,8,32 -t "$t" \
                    --output-format jsonl 2>/dev/null | awk '
                    /"pl"/ { p = $0; sub(/.*"pl": */, "", p); sub(/[,}].*/, "", p)
                             v = $0; sub(/.*"speed_tg": */, "", v); sub(/[,}].*/, "", v); print p, v }')
                lc+=$'\n'
            done
            for B in 1 8 32; do
                local mt ml
                mt=$(printf '%s\n' "$tp" | awk -v B="$B" '$1 == B {print $2}' | sort -g | awk '{a[NR] = $1} END {if (NR) print (NR % 2) ? a[(NR + 1) / 2] : (a[NR / 2] + a[NR / 2 + 1]) / 2}')
                ml=$(printf '%s\n' "$lc" | awk -v B="$B" '$1 == B {print $2}' | sort -g | awk '{a[NR] = $1} END {if (NR) print (NR % 2) ? a[(NR + 1) / 2] : (a[NR / 2] + a[NR / 2 + 1]) / 2}')
                if [ -z "$mt" ] || [ -z "$ml" ]; then
                    echo "  $(basename "$model") batch $B: a run failed"
                    rc=1
                    continue
                fi
                printf '  %-28s %7d %5d %14.1f %14.1f %7.2fx   (runs: tidepool %s; llama.cpp %s)\n' \
                    "$(basename "$model")" "$t" "$B" "$mt" "$ml" "$(awk -v a="$mt" -v b="$ml" 'BEGIN {print a / b}')" \
                    "$(printf '%s\n' "$tp" | awk -v B="$B" '$1 == B {printf "%s ", $2}')" \
                    "$(printf '%s\n' "$lc" | awk -v B="$B" '$1 == B {printf "%s ", $2}')"
            done
        done
    done
    return $rc
}

# a filter that selects nothing is an error (a typo, or the benchmarks not built)
n_match=0
for b in "$BUILD"/tests/bench_* serve; do
    [ "$b" = serve ] || [ -x "$b" ] || continue
    case "$b" in *"$filter"*) n_match=$((n_match + 1)) ;; esac
done
if [ "$n_match" -eq 0 ]; then
    echo "run_bench.sh: no benchmark matches '$filter' (have: $(cd "$BUILD/tests" 2>/dev/null &&
        ls -d bench_* 2>/dev/null | tr '\n' ' ')serve; make bench builds them)" >&2
    exit 2
fi
status=0
for b in "$BUILD"/tests/bench_*; do
    [ -x "$b" ] || continue
    case "$b" in *"$filter"*) ;; *) continue ;; esac
    name=$(basename "$b")
    echo "== $name"
    t0=$SECONDS
    case "$name" in
    bench_engine)
        [ -f "$MODELS/stories260K.gguf" ] || make --no-print-directory BUILD="$BUILD" model >/dev/null
        need_model "$MODELS/synth-1b-f16.gguf" --preset 1b --type f16 --seed 1 --name synth-1b-f16
        need_model "$MODELS/synth-1b-q8_0.gguf" --preset 1b --type q8_0 --seed 1 --name synth-1b-q8_0
        "$b" "$MODELS/stories260K.gguf" "$MODELS/synth-1b-f16.gguf" "$MODELS/synth-1b-q8_0.gguf" \
            || status=1
        if [ -n "${LLAMA_CPP_DIR:-}" ]; then
            peer_llama "$MODELS/stories260K.gguf" "$MODELS/synth-1b-f16.gguf" \
                "$MODELS/synth-1b-q8_0.gguf" || status=1
            peer_batched "$MODELS/stories260K.gguf" "$MODELS/synth-1b-f16.gguf" \
                "$MODELS/synth-1b-q8_0.gguf" || status=1
        else
            echo "peer llama.cpp: skipped (set LLAMA_CPP_DIR to a llama.cpp build to compare)"
        fi
        ;;
    bench_mtp)
        # acceptance and TPOT on the default model with its trained modules; the verify
        # cost on the 1B-class model (a side file of synthetic modules is written beside it)
        [ -f "$MODELS/stories260K.gguf" ] || make --no-print-directory BUILD="$BUILD" model >/dev/null
        need_model "$MODELS/synth-1b-q8_0.gguf" --preset 1b --type q8_0 --seed 1 --name synth-1b-q8_0
        "$b" "$MODELS/stories260K.gguf" models/mtp/stories260K-mtp.gguf \
            "$MODELS/synth-1b-q8_0.gguf" || status=1
        ;;
    bench_kvtransfer)
        # mid-size model for the overlap of transfer and prefill (MHA: 32 KB of KV per token)
        need_model "$MODELS/synth-mid-f16.gguf" --dim 512 --hidden-dim 1536 --layers 8 \
            --heads 8 --kv-heads 8 --ctx 2048 --type f16 --seed 1 --name synth-mid-f16
        "$b" "$MODELS/synth-mid-f16.gguf" || status=1
        ;;
    *)
        "$b" || status=1
        ;;
    esac
    echo "== $name: $((SECONDS - t0)) s"
done
# The serving benchmark against llama-server (tools/bench/serve-peer.sh; filter "serve").
case serve in *"$filter"*)
    echo "== serve-peer"
    t0=$SECONDS
    if [ -n "${LLAMA_CPP_DIR:-}" ]; then
        [ -f "$MODELS/stories260K.gguf" ] || make --no-print-directory BUILD="$BUILD" model >/dev/null
        # in the background, so that a TERM or INT to this script reaches it (it stops
        # its servers) instead of leaving it running to its end
        BUILD=$BUILD tools/bench/serve-peer.sh &
        peer=$!
        trap 'kill "$peer" 2>/dev/null; wait "$peer"; exit 130' INT
        trap 'kill "$peer" 2>/dev/null; wait "$peer"; exit 143' TERM
        wait "$peer" || status=1
        trap - INT TERM
    else
        echo "serving peer: skipped (set LLAMA_CPP_DIR to a llama.cpp build with llama-server)"
    fi
    echo "== serve-peer: $((SECONDS - t0)) s"
    ;;
esac
exit $status
