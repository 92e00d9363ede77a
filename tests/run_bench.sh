#!/usr/bin/env bash
# Runs every benchmark binary ($BUILD/tests/bench_*) and prints its numbers (make bench).
# The engine benchmark needs synthetic 1B-class models; they are created under
# build/models/ on first use with tidepool-mkmodel (F16 2.2 GB, Q8_0 1.2 GB; about half
# a minute each; never committed). Not part of `make test`. Numbers are ratios within
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
    *)
        "$b" || status=1
        ;;
    esac
    echo "== $name: $((SECONDS - t0)) s"
done
exit $status
