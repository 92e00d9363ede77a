#!/usr/bin/env bash
# Builds the tidepool image from a fresh clone: the local Debian 12 base image first when it
# is missing (deploy/container/base.sh), then deploy/container/Containerfile. No container
# registry is used.
#
#   deploy/container/build.sh [--tag IMAGE] [--model DIR|FILE] [--no-cache] [--force-base]
#
# --tag      image name (default TIDEPOOL_IMAGE, else localhost/tidepool:latest)
# --model    bake a model into the image: a llama2.c directory (converted to GGUF at build
#            time) or a GGUF file; it becomes the image's default model. Without it the
#            model comes from a volume at run time (TIDEPOOL_MODEL=/models/...).
# Prints the image's size at the end. Needs root (podman as root, runc); re-runs under sudo.
# TIDEPOOL_BUILD_NETWORK (default host) is the network of the build's RUN steps (apt-get).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
IMAGE=${TIDEPOOL_IMAGE:-localhost/tidepool:latest}
BASE=${TIDEPOOL_BASE_IMAGE:-localhost/tidepool-debian:12}
MODEL= NO_CACHE=() FORCE_BASE=()
usage() { awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; }
while [ $# -gt 0 ]; do
    case "$1" in
    --tag) IMAGE=$2; shift 2 ;;
    --model) MODEL=$2; shift 2 ;;
    --no-cache) NO_CACHE=(--no-cache); shift ;;
    --force-base) FORCE_BASE=(--force); shift ;;
    -h|--help) usage; exit 0 ;;
    *) echo "build.sh: unknown argument '$1' (see --help)" >&2; exit 2 ;;
    esac
done
log() { echo "build.sh: $*" >&2; }
if [ "$(id -u)" -ne 0 ]; then
    exec sudo --preserve-env=TIDEPOOL_IMAGE,TIDEPOOL_BASE_IMAGE,TIDEPOOL_BASE_TAR,DEBIAN_MIRROR,TIDEPOOL_BUILD_NETWORK \
        "$0" --tag "$IMAGE" ${MODEL:+--model "$MODEL"} "${NO_CACHE[@]}" "${FORCE_BASE[@]}"
fi
cd "$ROOT"
t0=$SECONDS
TIDEPOOL_BASE_IMAGE=$BASE deploy/container/base.sh "${FORCE_BASE[@]}"

# A model to bake must be inside the build context: it is copied to build/container/model/
# (the one part of build/ the context keeps, .containerignore).
build_args=(--build-arg "BASE=$BASE")
if [ -n "$MODEL" ]; then
    [ -e "$MODEL" ] || { log "--model $MODEL: not found"; exit 2; }
    name=$(basename "${MODEL%/}" .gguf)
    stage=build/container/model
    rm -rf "$stage" && mkdir -p "$stage/$name"
    trap 'rm -rf "$stage"' EXIT # a copy for the build context only
    if [ -d "$MODEL" ]; then
        cp "$MODEL"/*.bin "$stage/$name/"
    else
        cp "$MODEL" "$stage/$name/$name.gguf"
    fi
    build_args+=(--build-arg "MODEL=$stage/$name" --build-arg "MODEL_NAME=$name")
fi

log "building $IMAGE from $BASE"
old=$(podman image inspect --format '{{.Id}}' "$IMAGE" 2>/dev/null || true)
podman build --format docker --pull=never --network "${TIDEPOOL_BUILD_NETWORK:-host}" \
    "${NO_CACHE[@]}" "${build_args[@]}" -f deploy/container/Containerfile -t "$IMAGE" .
# the image this tag named before, now untagged: removed unless a container still uses it
# (the build stage's layers stay: they are the cache of the next build)
new=$(podman image inspect --format '{{.Id}}' "$IMAGE")
if [ -n "$old" ] && [ "$old" != "$new" ]; then podman rmi "$old" >/dev/null 2>&1 || true; fi
size=$(podman image inspect --format '{{.Size}}' "$IMAGE")
log "$IMAGE built in $((SECONDS - t0)) s: $(awk -v s="$size" 'BEGIN { printf "%.1f MB", s / 1e6 }')"
podman images --filter "reference=$IMAGE"
