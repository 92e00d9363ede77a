#!/usr/bin/env bash
# Builds the Debian 12 (bookworm) base image the tidepool image starts FROM, locally, with
# no container registry: debootstrap --variant=minbase into a temporary directory, trimmed,
# packed into a tarball cached under build/container/, then `podman import`ed.
#
#   deploy/container/base.sh [--force] [--tag IMAGE] [--mirror URL]
#
# Does nothing when the image exists already (--force rebuilds it, and the tarball too).
# When only the tarball exists (e.g. a CI cache of build/container/), it is imported
# without running debootstrap again. Needs root (runs itself under sudo when not root),
# debootstrap and podman (tools/install-deps.sh --deploy).
#
# Environment: TIDEPOOL_BASE_IMAGE (default localhost/tidepool-debian:12),
# TIDEPOOL_BASE_TAR (default build/container/debian-12-minbase.tar.gz), DEBIAN_MIRROR
# (default: the first Debian archive in this host's apt sources). The image's apt sources
# name the same mirror, so `apt-get install` in the Containerfile uses it too.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
IMAGE=${TIDEPOOL_BASE_IMAGE:-localhost/tidepool-debian:12}
TAR=${TIDEPOOL_BASE_TAR:-$ROOT/build/container/debian-12-minbase.tar.gz}
MIRROR=${DEBIAN_MIRROR:-}
FORCE=0
SUITE=bookworm

usage() { awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; }
while [ $# -gt 0 ]; do
    case "$1" in
    --force) FORCE=1; shift ;;
    --tag) IMAGE=$2; shift 2 ;;
    --mirror) MIRROR=$2; shift 2 ;;
    -h|--help) usage; exit 0 ;;
    *) echo "base.sh: unknown argument '$1' (see --help)" >&2; exit 2 ;;
    esac
done
log() { echo "base.sh: $*" >&2; }

if [ "$(id -u)" -ne 0 ]; then
    exec sudo --preserve-env=TIDEPOOL_BASE_IMAGE,TIDEPOOL_BASE_TAR,DEBIAN_MIRROR "$0" \
        $([ $FORCE -eq 1 ] && echo --force) --tag "$IMAGE" ${MIRROR:+--mirror "$MIRROR"}
fi
for tool in podman debootstrap; do
    command -v "$tool" >/dev/null ||
        { log "$tool not found: run tools/install-deps.sh --deploy"; exit 1; }
done

if [ $FORCE -eq 0 ] && podman image exists "$IMAGE"; then
    log "$IMAGE exists (--force rebuilds it)"
    exit 0
fi

# The Debian mirror: the first non-security archive in the host's apt sources (deb822
# "URIs:" or one-line "deb URL"), so a host behind a local mirror or proxy builds through it.
host_mirror() {
    cat /etc/apt/sources.list /etc/apt/sources.list.d/*.list /etc/apt/sources.list.d/*.sources \
        2>/dev/null |
        awk '/^[[:space:]]*URIs:/ { for (i = 2; i <= NF; i++) print $i }
             /^[[:space:]]*deb[[:space:]]/ { for (i = 2; i <= NF; i++) if ($i ~ /:\/\//) { print $i; break } }' |
        grep -v -- '-security' | head -n 1
}
[ -n "$MIRROR" ] || MIRROR=$(host_mirror || true)
[ -n "$MIRROR" ] || { log "no Debian mirror in /etc/apt/sources*: set DEBIAN_MIRROR"; exit 1; }
MIRROR=${MIRROR%/}
# security updates live beside the archive (…/debian → …/debian-security) on Debian's mirrors
SECURITY=${DEBIAN_SECURITY_MIRROR:-${MIRROR}-security}

if [ $FORCE -eq 1 ] || [ ! -s "$TAR" ]; then
    t0=$SECONDS
    work=$(mktemp -d /tmp/tidepool-base.XXXXXX)
    trap 'rm -rf "$work"' EXIT
    rootfs=$work/rootfs
    log "debootstrap --variant=minbase $SUITE from $MIRROR (a few minutes)"
    debootstrap --variant=minbase --components=main "$SUITE" "$rootfs" "$MIRROR" \
        >"$work/debootstrap.log" 2>&1 ||
        { tail -n 30 "$work/debootstrap.log" >&2; log "debootstrap failed"; exit 1; }
    cat >"$rootfs/etc/apt/sources.list" <<EOF
deb $MIRROR $SUITE main
deb $MIRROR $SUITE-updates main
deb $SECURITY $SUITE-security main
EOF
    # An image, not a machine: no recommends, no docs or man pages from later installs, no
    # package cache. Keep the apt lists out (the Containerfile runs apt-get update).
    cat >"$rootfs/etc/apt/apt.conf.d/90tidepool" <<'EOF'
APT::Install-Recommends "false";
APT::Install-Suggests "false";
Acquire::Languages "none";
EOF
    cat >"$rootfs/etc/dpkg/dpkg.cfg.d/90tidepool-nodoc" <<'EOF'
path-exclude=/usr/share/doc/*
path-include=/usr/share/doc/*/copyright
path-exclude=/usr/share/man/*
path-exclude=/usr/share/info/*
path-exclude=/usr/share/locale/*
path-include=/usr/share/locale/locale.alias
EOF
    rm -rf "$rootfs"/var/lib/apt/lists/* "$rootfs"/var/cache/apt/*.bin \
        "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/log/* "$rootfs"/tmp/* \
        "$rootfs"/usr/share/man/* "$rootfs"/usr/share/info/*
    find "$rootfs"/usr/share/doc -mindepth 2 ! -name copyright -delete 2>/dev/null || true
    find "$rootfs"/usr/share/locale -mindepth 1 -maxdepth 1 ! -name locale.alias \
        -exec rm -rf {} + 2>/dev/null || true
    : >"$rootfs/etc/machine-id"
    mkdir -p "$(dirname "$TAR")"
    tar --numeric-owner --xattrs -C "$rootfs" -c . | gzip -1 >"$TAR.tmp"
    mv "$TAR.tmp" "$TAR"
    log "rootfs cached in $TAR ($(du -h "$TAR" | cut -f1)) in $((SECONDS - t0)) s"
fi

podman import --quiet \
    --change 'ENV LANG=C.UTF-8' \
    --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'CMD ["/bin/bash"]' \
    --message "debootstrap --variant=minbase $SUITE" \
    "$TAR" "$IMAGE" >/dev/null
log "imported $IMAGE ($(podman image inspect --format '{{.Size}}' "$IMAGE" | awk '{printf "%.0f MB", $1 / 1e6}'))"
