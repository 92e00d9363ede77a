#!/usr/bin/env bash
# tidal-bench: tidal scheduling on vs static prefill:decode splits, on 8 EMULATED workers.
#
# Every figure this prints is EMULATED: the workers run the small real model and pad each
# prefill batch and decode step to the cost model's time for PRESET (--emulate, see
# docs/scheduler.md "Emulated workers"); KV transfers are padded to the emulated model's
# bytes, over the real (loopback) link.
#
# For each configuration it starts a gateway and 8 workers on free loopback ports, runs
# tidepool-bench --workload phase-shift (docs/bench.md) against it, stops exactly the
# processes it started, and prints the request goodput. Configurations: every static split
# in SPLITS, then tidal (--tidal) starting from TIDAL_START.
#
# Environment (all optional):
#   BUILD=build  PRESET=a100-llama3-8b  SPLITS="2:6 4:4 6:2"  TIDAL_START=4:4
#   PHASE_S=10 (seconds per phase)  PHASES=4  RATE=12 (requests/s)
#   SLO="ttft:500,tpot:40"  MODEL=build/models/stories260K.gguf
#   TIDAL_ARGS="--tidal-min-role-s 3 --smooth-s 2 --tidal-max-changes 2 --stats-window-s 5
#               --ttft-slo-ms 500 --tpot-slo-ms 40" (the policy's latency targets = SLO)
set -euo pipefail

cd "$(dirname "$0")/.."
BUILD=${BUILD:-build}
BIN=$BUILD/bin
PRESET=${PRESET:-a100-llama3-8b}
SPLITS=${SPLITS:-"2:6 4:4 6:2"}
TIDAL_START=${TIDAL_START:-4:4}
PHASE_S=${PHASE_S:-10}
PHASES=${PHASES:-4}
RATE=${RATE:-12}
SLO=${SLO:-ttft:500,tpot:40}
MODEL=${MODEL:-build/models/stories260K.gguf}
TIDAL_ARGS=${TIDAL_ARGS:-"--tidal-min-role-s 3 --smooth-s 2 --tidal-max-changes 2 --stats-window-s 5 --ttft-slo-ms 500 --tpot-slo-ms 40"}
N=$(python3 -c "print(int($RATE * $PHASE_S * $PHASES))")

for b in gateway prefill_worker tidepool-bench; do
    [ -x "$BIN/$b" ] || { echo "tidal-bench: $BIN/$b missing: run make first" >&2; exit 2; }
done
[ -f "$MODEL" ] || { echo "tidal-bench: model $MODEL missing" >&2; exit 2; }

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }

PIDS=()
stop_all() {
    local p
    for p in "${PIDS[@]}"; do kill -TERM "$p" 2>/dev/null || true; done
    for p in "${PIDS[@]}"; do wait "$p" 2>/dev/null || true; done
    PIDS=()
}
trap stop_all EXIT INT TERM

# run_one LABEL N_PREFILL N_DECODE [gateway args...]: prints "LABEL goodput"
run_one() {
    local label=$1 np=$2 nd=$3
    shift 3
    local tmp port ctl i role
    tmp=$(mktemp -d /tmp/tidal-bench.XXXXXX)
    port=$(free_port)
    ctl="tcp://127.0.0.1:$(free_port)"
    "$BIN/gateway" --host 127.0.0.1 --port "$port" --ctl-bind "$ctl" --model "$MODEL" \
        --stats-bind "" --state-db "" --heartbeat-ms 200 --log-level warn "$@" \
        >"$tmp/gateway.log" 2>&1 &
    PIDS+=($!)
    for ((i = 0; i < np + nd; i++)); do
        role=prefill
        ((i >= np)) && role=decode
        "$BIN/prefill_worker" --role "$role" --gateway "$ctl" --model "$MODEL" \
            --worker-id "w$i" --kv-bind "tcp://127.0.0.1:$(free_port)" --emulate "$PRESET" \
            --heartbeat-ms 200 --log-level warn >"$tmp/w$i.log" 2>&1 &
        PIDS+=($!)
    done
    local deadline=$((SECONDS + 60)) n=0
    while ((SECONDS < deadline)); do
        n=$(curl -s "http://127.0.0.1:$port/workers" 2>/dev/null |
            python3 -c 'import json,sys; print(len(json.load(sys.stdin)["workers"]))' 2>/dev/null ||
            echo 0)
        ((n == np + nd)) && break
        sleep 0.2
    done
    if ((n != np + nd)); then
        echo "tidal-bench: $label: only $n of $((np + nd)) workers registered (logs in $tmp)" >&2
        stop_all
        return 1
    fi
    "$BIN/tidepool-bench" --url "http://127.0.0.1:$port" --workload phase-shift \
        --phase-seconds "$PHASE_S" --phase-short-len 8 --input-len-range 60:120 \
        --output-len-range 100:200 --request-rate "$RATE" --num-prompts "$N" --seed 1 \
        --goodput "$SLO" --result-json "$tmp/result.json" --no-progress >"$tmp/bench.txt" 2>&1 ||
        { echo "tidal-bench: $label: the bench failed (see $tmp/bench.txt)" >&2; stop_all; return 1; }
    local changes
    changes=$(curl -s "http://127.0.0.1:$port/workers" | python3 -c \
        'import json,sys; print(sum(w.get("role_changes", 0) for w in json.load(sys.stdin)["workers"]))')
    stop_all
    python3 - "$tmp/result.json" "$label" "$changes" <<'EOF'
import json, sys
r = json.load(open(sys.argv[1]))
print("%-14s goodput %6.2f req/s  throughput %6.2f req/s  role changes %s  (EMULATED)"
      % (sys.argv[2], r.get("request_goodput") or 0.0, r.get("request_throughput") or 0.0,
         sys.argv[3]))
EOF
}

echo "tidal-bench: 8 EMULATED workers ($PRESET), phase-shift ${PHASES}x${PHASE_S}s at $RATE req/s," \
    "SLO $SLO"
for s in $SPLITS; do
    run_one "static $s" "${s%%:*}" "${s##*:}"
done
# shellcheck disable=SC2086  # TIDAL_ARGS is a list of flags
run_one "tidal from $TIDAL_START" "${TIDAL_START%%:*}" "${TIDAL_START##*:}" --tidal $TIDAL_ARGS
