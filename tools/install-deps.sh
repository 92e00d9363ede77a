#!/usr/bin/env bash
# Installs the Debian 12 packages tidepool builds, tests and runs with. Idempotent: does
# nothing when everything is present. Needs root (uses sudo when not root).
# libncurses-dev: tidepool-top. libsqlite3-dev: the gateway's Batch API state (--state-db).
# libsodium-dev: the gateway's API keys (hashed, compared in constant time).
# python3-msgpack: the stats-socket tests. clang, libclang-rt-14-dev: libFuzzer for `make fuzz`
# (tests/fuzz/; the replay in `make test` needs neither).
# nodejs (and npm, Debian's own package when no npm is on PATH): the official OpenAI Node
# SDK test (tests/integration/test_openai_sdk.py; skipped without them). prometheus: only for
# promtool, which checks GET /metrics in the tests (~23 MB download; on a host with systemd
# its server service starts too: `systemctl disable --now prometheus` if unwanted).
#
#   tools/install-deps.sh            the packages above
#   tools/install-deps.sh --deploy   also those of the container image and its tests
#                                    (tests/deploy/run.sh): podman (rootful, runc), its pod
#                                    pause binary (catatonit: podman kube play), podman-compose,
#                                    debootstrap and the Debian archive keyring for the local
#                                    base image (deploy/container/base.sh), and Debian's
#                                    kubectl (kubernetes-client) when none is on PATH
#                                    (tests/deploy/test_kube.py renders with kubectl kustomize).
set -eu
PKGS=(build-essential pkg-config libzmq3-dev libmsgpack-dev libevent-dev libjansson-dev
      libxxhash-dev libcmocka-dev libinih-dev libcurl4-openssl-dev curl iproute2 python3 python3-zmq
      tmux libncurses-dev python3-msgpack prometheus libsqlite3-dev libsodium-dev clang
      libclang-rt-14-dev nodejs)
command -v npm >/dev/null 2>&1 || PKGS+=(npm)
DEPLOY_PKGS=(podman runc catatonit podman-compose debootstrap debian-archive-keyring)
case "${1:-}" in
--deploy)
    PKGS+=("${DEPLOY_PKGS[@]}")
    command -v kubectl >/dev/null 2>&1 || PKGS+=(kubernetes-client)
    ;;
'') ;;
*) echo "usage: tools/install-deps.sh [--deploy]" >&2; exit 2 ;;
esac
missing=()
for p in "${PKGS[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
[ ${#missing[@]} -eq 0 ] && exit 0
echo "installing: ${missing[*]}" >&2
SUDO=
[ "$(id -u)" -eq 0 ] || SUDO=sudo
$SUDO apt-get update -qq
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
