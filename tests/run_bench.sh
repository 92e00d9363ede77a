#!/usr/bin/env bash
# Runs every benchmark binary ($BUILD/tests/bench_*) and prints its numbers (make bench).
# The engine benchmark needs synthetic 1B-class models, the KV transfer benchmark a
# mid-size one; they are created under build/models/ on first use with tidepool-mkmodel
# (F16 2.2 GB, Q8_0 1.2 GB, about half a minute each; mid-size F16 56 MB; never
# committed). Not part of `make test`. Numbers are ratios within
# one run on one (possibly shared) machine, not absolute claims.
#   tests/run_bench.sh [bench-binary-substring]
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
exit $status
