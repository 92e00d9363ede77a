#!/usr/bin/env bash
# The deploy tests (not part of `make test`): the container image, compose and Kubernetes
# manifests, run for real with podman (as root, runc) on this host's loopback.
#
#   tests/deploy/run.sh [image|compose|kube ...]     (default: all three, in that order)
#   tests/deploy/run.sh --update-reference           rewrite tests/deploy/reference.json
#
# Needs: tools/install-deps.sh --deploy (podman, runc, catatonit, podman-compose,
# debootstrap), kubectl on PATH for the Kubernetes test (skipped without it), the default
# model in ../shared/models (TIDEPOOL_MODELS_DIR), and a local build (`make all`) for the
# reference texts (else tests/deploy/reference.json). test_image builds the image
# (deploy/container/build.sh: the debootstrap base first if missing, cached in
# build/container/). Prints each part's time and the image size; logs in
# build/test-logs/deploy/. Exit status 0 when everything passed.
set -u
cd "$(dirname "$0")/../.."
PY=/usr/bin/python3
if [ "$(id -u)" -ne 0 ]; then
    exec sudo --preserve-env=TIDEPOOL_IMAGE,TIDEPOOL_MODELS_DIR,TIDEPOOL_BUILD,DEBIAN_MIRROR,TIDEPOOL_KUBE_OVERLAYS,PATH "$0" "$@"
fi
if [ "${1:-}" = --update-reference ]; then
    exec "$PY" tests/deploy/common.py --update-reference
fi
parts=("$@")
[ ${#parts[@]} -gt 0 ] || parts=(image compose kube)
for tool in podman podman-compose; do
    command -v "$tool" >/dev/null || { echo "run.sh: $tool missing: tools/install-deps.sh --deploy" >&2; exit 1; }
done
command -v kubectl >/dev/null || echo "run.sh: kubectl not on PATH: the podman kube play test is skipped" >&2

logdir=build/test-logs/deploy
mkdir -p "$logdir"
t_all=$SECONDS
failed=() summary=()
for part in "${parts[@]}"; do
    t=tests/deploy/test_$part.py
    [ -f "$t" ] || { echo "run.sh: no $t" >&2; exit 2; }
    log=$logdir/test_$part.log
    t0=$SECONDS
    # SIGTERM at the limit: the tests remove what they created before exiting
    timeout -k 60 1500 "$PY" -m unittest -v "$t" >"$log" 2>&1
    rc=$?
    took=$((SECONDS - t0))
    cases=$(grep -oE '^Ran [0-9]+ tests?' "$log" | grep -oE '[0-9]+' || echo 0)
    skipped=$(grep -oE 'skipped=[0-9]+' "$log" | grep -oE '[0-9]+' || true)
    if [ $rc -eq 0 ]; then
        line="PASS deploy/test_$part ($took s, $cases cases${skipped:+, $skipped skipped})"
    else
        line="FAIL deploy/test_$part ($took s) — log: $log"
        failed+=("$part")
    fi
    echo "$line"
    summary+=("$line")
    [ $rc -eq 0 ] || tail -n 40 "$log" | sed 's/^/    /'
    grep -ho '\[deploy\].*' "$log" | sed 's/^/    /'
done
size=$(grep -ho '^IMAGE SIZE .*' "$logdir"/test_image.log 2>/dev/null | tail -n 1)
echo "deploy tests: $((SECONDS - t_all)) s in all${size:+; ${size#IMAGE SIZE }}"
[ ${#failed[@]} -eq 0 ] || { echo "failed: ${failed[*]}"; exit 1; }
