#!/bin/bash
# tidepool-entrypoint: the image's entrypoint. The first word of the command picks the role:
#
#   gateway [flag ...]     the gateway (HTTP 8000, ctl 5557, stats 5558)
#   prefill [flag ...]     a prefill worker          (prefill_worker --role prefill)
#   decode  [flag ...]     a decode worker           (decode_worker --role decode)
#   mixed   [flag ...]     prefill and decode in one (prefill_worker --role mixed)
#   convert [flag ...]     tidepool-convert (llama2.c -> GGUF)
#   keygen  [flag ...]     tidepool-keygen (CURVE key pairs, docs/security.md)
#   health  [flag ...]     tidepool-health (the HEALTHCHECK)
#   help                   this text
#   anything else          run as a command (e.g. bash)
#
# Settings come from TIDEPOOL_* environment variables (each program's --help lists its own:
# `podman run IMAGE gateway --help`) or flags after the role; a flag wins over the
# environment. The program is exec'ed: it is PID 1 and gets SIGTERM itself, which makes it
# drain (it blocks SIGTERM and reads it from a signalfd / libevent, so the kernel's PID 1
# rule that drops signals without a handler does not apply).
#
# Before the program starts:
#   - the model: TIDEPOOL_MODEL (or --model) names a GGUF file, used as is, or a llama2.c
#     directory (a checkpoint *.bin and tok*.bin), converted once into TIDEPOOL_MODEL_CACHE
#     (default /tmp/tidepool-models, must be writable). Unset: the model baked into the image
#     (/opt/tidepool/models/*.gguf), else /models/stories260K (a mounted volume).
#   - workers: TIDEPOOL_WORKER_ID defaults to the host name (a StatefulSet pod's name: stable
#     across restarts); TIDEPOOL_KV_ADVERTISE, when unset and the kv socket binds every
#     interface, to tcp://<this host's address>:<kv port>; TIDEPOOL_THREADS, when unset, to
#     the container's CPU limit (cgroup quota), so a 2-CPU container does not run a thread
#     per host CPU.
#   - CURVE (docs/security.md): TIDEPOOL_CURVE_KEYS names a mounted key directory (a Secret,
#     a bind mount): gateway.key and gateway.pub, and each worker's <worker id>.key (or one
#     worker.key shared by every worker) with its .pub, flat or under workers/. The secret
#     key this process needs is copied to a private 0600 file under /tmp (a mounted Secret
#     is root- or group-owned), its authorized keys are every *.pub but gateway.pub, and
#     TIDEPOOL_CURVE_SECRET_KEY / _GATEWAY_KEY / _AUTHORIZED_KEYS are set from them.
#   - API keys (docs/deploy.md): the gateway's TIDEPOOL_API_KEY_FILE, when it names a file
#     that is not the container user's own mode-0600 file (a Kubernetes Secret mounted with
#     fsGroup is group-readable, and root- or group-owned), is copied to a private 0600 file
#     under /tmp, and TIDEPOOL_API_KEY_FILE names the copy. The gateway refuses the original
#     otherwise (a key file must be readable by its owner only). An --api-key-file flag is
#     passed on as it is.
set -euo pipefail
BIN=/opt/tidepool/bin
log() { echo "tidepool-entrypoint: $*" >&2; }
usage() { awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; }

role=${1:-help}
[ $# -gt 0 ] && shift
case "$role" in
gateway) prog=gateway; pre=() ;;
prefill) prog=prefill_worker; pre=(--role prefill) ;;
decode) prog=decode_worker; pre=(--role decode) ;;
mixed) prog=prefill_worker; pre=(--role mixed) ;;
convert) exec "$BIN/tidepool-convert" "$@" ;;
keygen) exec "$BIN/tidepool-keygen" "$@" ;;
health) exec "$BIN/tidepool-health" "$@" ;;
help | -h | --help) usage; exit 0 ;;
*) exec "$role" "$@" ;;
esac

args=("$@")
for a in "${args[@]}"; do
    case "$a" in --help | -h) exec "$BIN/$prog" "${pre[@]}" "${args[@]}" ;; esac
done

# --- the model
model=${TIDEPOOL_MODEL:-}
model_at=-1 # index of the --model value in args (a flag wins over the environment)
norm=()
for a in "${args[@]}"; do
    case "$a" in --model=*) norm+=(--model "${a#--model=}") ;; *) norm+=("$a") ;; esac
done
args=("${norm[@]}")
for ((i = 0; i + 1 < ${#args[@]}; i++)); do
    if [ "${args[i]}" = --model ]; then model=${args[i + 1]}; model_at=$((i + 1)); fi
done
if [ -z "$model" ]; then
    model=$(ls /opt/tidepool/models/*.gguf 2>/dev/null | head -n 1 || true)
    [ -n "$model" ] || model=/models/stories260K
fi
if [ -d "$model" ]; then
    name=$(basename "${model%/}")
    cache=${TIDEPOOL_MODEL_CACHE:-/tmp/tidepool-models}
    gguf=$cache/$name.gguf
    ckpt=$(ls "$model"/*.bin 2>/dev/null | grep -v '/tok[^/]*\.bin$' | head -n 1 || true)
    tok=$(ls "$model"/tok*.bin 2>/dev/null | head -n 1 || true)
    if [ -z "$ckpt" ] || [ -z "$tok" ]; then
        log "$model: not a llama2.c model directory (no checkpoint *.bin and tok*.bin)"
        exit 2
    fi
    if [ ! -s "$gguf" ] || [ "$ckpt" -nt "$gguf" ]; then
        mkdir -p "$cache" || { log "cannot create $cache (TIDEPOOL_MODEL_CACHE): read-only?"; exit 2; }
        # a private temporary name, then rename: containers sharing the cache never see half
        "$BIN/tidepool-convert" --checkpoint "$ckpt" --tokenizer "$tok" --name "$name" \
            --out "$gguf.tmp.$$" >&2 || { rm -f "$gguf.tmp.$$"; log "converting $model failed"; exit 2; }
        mv -f "$gguf.tmp.$$" "$gguf"
        log "converted $model to $gguf"
    fi
    model=$gguf
elif [ ! -f "$model" ]; then
    log "model $model not found: mount the models at /models (-v DIR:/models:ro) and set" \
        "TIDEPOOL_MODEL to a GGUF file or a llama2.c directory in it"
    exit 2
fi
if [ $model_at -ge 0 ]; then args[model_at]=$model; fi
export TIDEPOOL_MODEL=$model

# --- workers
if [ "$prog" != gateway ]; then
    export TIDEPOOL_WORKER_ID=${TIDEPOOL_WORKER_ID:-${HOSTNAME:-$(hostname)}}
    kv_bind=${TIDEPOOL_KV_BIND:-tcp://127.0.0.1:5560}
    if [ -z "${TIDEPOOL_KV_ADVERTISE:-}" ]; then
        case "$kv_bind" in
        tcp://0.0.0.0:* | tcp://\*:*)
            addr=$(getent ahostsv4 "$(hostname)" 2>/dev/null | awk '$1 !~ /^127\./ { print $1; exit }')
            if [ -n "$addr" ]; then
                export TIDEPOOL_KV_ADVERTISE=tcp://$addr:${kv_bind##*:}
            else
                log "no address for $(hostname): set TIDEPOOL_KV_ADVERTISE to an endpoint the other workers reach"
            fi
            ;;
        esac
    fi
    if [ -z "${TIDEPOOL_THREADS:-}" ]; then
        quota= period=
        if [ -r /sys/fs/cgroup/cpu.max ]; then
            read -r quota period </sys/fs/cgroup/cpu.max || true
        elif [ -r /sys/fs/cgroup/cpu/cpu.cfs_quota_us ]; then
            quota=$(cat /sys/fs/cgroup/cpu/cpu.cfs_quota_us)
            period=$(cat /sys/fs/cgroup/cpu/cpu.cfs_period_us)
        fi
        case "$quota" in '' | max | -*) ;; *)
            export TIDEPOOL_THREADS=$(((quota + period - 1) / period)) ;;
        esac
    fi
fi

# --- CURVE keys
if [ -n "${TIDEPOOL_CURVE_KEYS:-}" ]; then
    kd=${TIDEPOOL_CURVE_KEYS%/}
    priv=$(umask 077 && mktemp -d /tmp/tidepool-keys.XXXXXX) || { log "cannot create a key directory in /tmp"; exit 2; }
    mkdir -m 0700 "$priv/authorized"
    for f in "$kd"/*.pub "$kd"/workers/*.pub; do
        [ -f "$f" ] && [ "$(basename "$f")" != gateway.pub ] && cp "$f" "$priv/authorized/"
    done
    if [ "$prog" = gateway ]; then
        key=$kd/gateway.key
    else
        key=
        for k in "$kd/$TIDEPOOL_WORKER_ID.key" "$kd/workers/$TIDEPOOL_WORKER_ID.key" \
            "$kd/worker.key" "$kd/workers/worker.key"; do
            [ -f "$k" ] && { key=$k; break; }
        done
        [ -n "$key" ] || { log "$kd: no $TIDEPOOL_WORKER_ID.key nor worker.key (TIDEPOOL_CURVE_KEYS)"; exit 2; }
        export TIDEPOOL_CURVE_GATEWAY_KEY=$kd/gateway.pub
    fi
    (umask 077 && cat "$key" >"$priv/self.key") || { log "cannot read $key"; exit 2; }
    export TIDEPOOL_CURVE_SECRET_KEY=$priv/self.key TIDEPOOL_CURVE_AUTHORIZED_KEYS=$priv/authorized
    # the stats socket is CURVE too: dashboards/*.pub are its subscribers when present
    # (else the workers' keys are)
    if [ "$prog" = gateway ] && [ -d "$kd/dashboards" ]; then
        mkdir -m 0700 "$priv/dashboards"
        for f in "$kd"/dashboards/*.pub; do
            [ -f "$f" ] && cp "$f" "$priv/dashboards/"
        done
        export TIDEPOOL_STATS_AUTHORIZED_KEYS=$priv/dashboards
    fi
fi

# --- API keys
if [ "$prog" = gateway ] && [ -n "${TIDEPOOL_API_KEY_FILE:-}" ]; then
    kf=$TIDEPOOL_API_KEY_FILE
    if [ ! -O "$kf" ] || [ -n "$(find "$kf" -maxdepth 0 -perm /077 2>/dev/null)" ]; then
        [ -f "$kf" ] && [ -r "$kf" ] || { log "$kf: cannot read the API key file (TIDEPOOL_API_KEY_FILE)"; exit 2; }
        kpriv=$(umask 077 && mktemp -d /tmp/tidepool-api-keys.XXXXXX) || { log "cannot create a key directory in /tmp"; exit 2; }
        (umask 077 && cat "$kf" >"$kpriv/api-keys") || { log "cannot read $kf"; exit 2; }
        export TIDEPOOL_API_KEY_FILE=$kpriv/api-keys
        log "API keys: $kf is not a private file of this user; using a private copy"
    fi
fi

exec "$BIN/$prog" "${pre[@]}" "${args[@]}"
