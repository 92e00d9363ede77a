#!/usr/bin/env bash
# tidal-bench: tidal scheduling vs static prefill:decode splits on 8 EMULATED workers, with
# and without offline work, and tidepool-sim on the very same requests.
#
# Every figure this prints is EMULATED: the workers run the small real model (stories260K)
# and pad each prefill batch and decode step to the cost model's time for PRESET (--emulate;
# docs/scheduler.md "Emulated workers"). The default preset is a100-llama3-8b slowed down
# ten times (":dilate=10"): the real work under the emulation (8 small models, the gateway,
# the client, on 2 shared CPUs) must stay small next to the emulated time, and an A100's
# own prefill is about as fast as this host's CPU running the 260K-parameter model.
# docs/scheduler.md "tools/tidal-bench.sh: tidal against static splits" explains the
# workload, every default and the results.
#
# With TRACE=FILE (a tidepool-sim trace: tools/bench/traces/, tools/bench/gen-trace.py) every
# run replays that trace's online lines instead (tidepool-bench --trace), and, when it has
# offline lines (and OFFLINE=1), step 3 submits them as one Batch API job (prompts of their
# exact token counts) next to the online replay, and a last run serves the job alone for
# as long (the cluster's capacity for it); /metrics' offline token counter is sampled
# every second in both, and the OFFLINE part reports the offline tokens served in the
# online troughs as a share of the spare capacity there (docs/tidal.md).
#
# Steps (each configuration gets a fresh gateway and 8 workers on free loopback ports; only
# the processes started here are stopped):
#   1. every static split in SPLITS (about 2.8 min each: an overloaded split drags its
#      backlog up to the client's timeout past the last arrival);
#   2. tidal (--tidal) from TIDAL_START (2.2 min);
#   3. tidal plus a Batch API job of OFFLINE_LINES offline requests, the same online load
#      (OFFLINE=0: skipped; 2.2 min plus the batch's end);
#   4. tidepool-sim --compare-static on the trace of the run in step 1 (same requests, same
#      engine settings, same policy knobs), its ranking next to the emulated one;
#   5. (SIM1000=1) the wall time of tidepool-sim with 1000 workers (35 s).
# About 13 minutes with the defaults; SPLITS="4:4 5:3" (the two best static splits) 10;
# SPLITS="1:7 2:6 3:5 4:4 5:3 6:2 7:1" (every one) 24.
#
# Environment (all optional):
#   BUILD=build  PRESET=a100-llama3-8b:dilate=10:token-scale=0.1 (the traces' token scale:
#     the workers' KV cache and the simulator's hold the A100's capacity x 0.1, 41152 tokens)
#   MAX_SEQS=48  MAX_BATCH_TOKENS=1024
#   SPLITS="3:5 4:4 5:3" (SPLITS=" ", a space: no static split, tidal only; an empty
#     SPLITS means the default)  TIDAL_START=4:4  SEED=1
#   PHASE_S=30  PHASES=4  RATE=16 (prefill-heavy req/s)  DECODE_RATE=41 (decode-heavy req/s)
#   PROMPT_WORDS=95:125 (prefill-heavy prompts)  OUTPUT_TOKENS=20:60 (decode-heavy answers)
#   SHORT_LEN=8 (the short side of each phase)  SLO=ttft:5000,tpot:500
#   TIDAL_ARGS="--tidal-min-role-s 3 --smooth-s 2 --tidal-max-changes 4 --tidal-min-per-role 2
#               --stats-window-s 5"
#   PREFILL_TOK_S= (the policy's prefill capacity; default: tidepool-sim's cost-model figure)
#   DECODE_TOK_S= (the policy's decode token capacity, --decode-tokens-per-s; default:
#     tidepool-sim's cost-model figure, as the simulator's policy has it; 0: unknown)
#   OFFLINE=1  OFFLINE_LINES=400  OFFLINE_WORDS=8  OFFLINE_TOKENS=60  OFFLINE_WAIT_S=600 (aging)
#   SIM1000=1  KEEP=0 (1: keep the run directories)  MODEL=build/models/stories260K.gguf
#   TRACE= (a trace file; empty: the phase-shift workload above)  OFFLINE_TIMEOUT_S=3600
#   BIN_S=5 (trace mode: the bins the troughs are found in)  WARM_S=10
#   TRACE_TIME_SCALE=, TRACE_WINDOW_S= (trace mode): replay a retimed copy of TRACE instead,
#     gen-trace.py --from-trace TRACE --time-scale TRACE_TIME_SCALE --duration-s
#     TRACE_WINDOW_S (the first TRACE_WINDOW_S s of the trace's own times; empty: all)
#   NICE=-10 when run as root, else 0: the niceness of the whole run (gateway, workers, the
#     client, the simulator: renice of this script, inherited), so that other work on the
#     host (builds, tests) takes CPU from the emulated cluster last
#   KV_PAD=0: the workers' --emulate-kv-pad (1: every KV transfer padded to the emulated
#     model's 131072 bytes per token, real bytes over loopback: at 30 req/s that is hundreds
#     of MB/s, seconds per transfer on this host, where the emulated link takes milliseconds)
#   PREFIX_CACHE=0: the workers' --prefix-cache (0: off, as the simulator, which models no
#     prefix cache; the trace's prompts are token runs at random offsets of one token
#     pool (2,048 words or more), so some share leading blocks by chance: with it on, 5.6-6.6 %
#     of the prompt tokens of azure-conv at 100 % hit (more with more prefill workers),
#     3.6-3.9 % of azure-code's: prefill capacity the simulator does not have)
#   TIE_PCT=2: two emulated runs whose goodputs differ by less than this many percent (of
#     the larger) are a tie (the noise of one run on a shared host); the simulator's ties are
#     exact (it is deterministic)
set -euo pipefail

cd "$(dirname "$0")/.."
BUILD=${BUILD:-build}
BIN=$BUILD/bin
PRESET=${PRESET:-a100-llama3-8b:dilate=10:token-scale=0.1}
MAX_SEQS=${MAX_SEQS:-48}
MAX_BATCH_TOKENS=${MAX_BATCH_TOKENS:-1024}
SPLITS=${SPLITS:-"3:5 4:4 5:3"}
TIDAL_START=${TIDAL_START:-4:4}
SEED=${SEED:-1}
PHASE_S=${PHASE_S:-30}
PHASES=${PHASES:-4}
RATE=${RATE:-16}
DECODE_RATE=${DECODE_RATE:-41}
PROMPT_WORDS=${PROMPT_WORDS:-95:125}
OUTPUT_TOKENS=${OUTPUT_TOKENS:-20:60}
SHORT_LEN=${SHORT_LEN:-8}
SLO=${SLO:-ttft:5000,tpot:500}
TIDAL_ARGS=${TIDAL_ARGS:-"--tidal-min-role-s 3 --smooth-s 2 --tidal-max-changes 4 --tidal-min-per-role 2 --stats-window-s 5"}
PREFILL_TOK_S=${PREFILL_TOK_S:-}
DECODE_TOK_S=${DECODE_TOK_S:-}
OFFLINE=${OFFLINE:-1}
OFFLINE_LINES=${OFFLINE_LINES:-400}
OFFLINE_WORDS=${OFFLINE_WORDS:-8}
OFFLINE_TOKENS=${OFFLINE_TOKENS:-60}
OFFLINE_WAIT_S=${OFFLINE_WAIT_S:-600}
SIM1000=${SIM1000:-1}
KEEP=${KEEP:-0}
MODEL=${MODEL:-build/models/stories260K.gguf}
TRACE=${TRACE:-}
OFFLINE_TIMEOUT_S=${OFFLINE_TIMEOUT_S:-3600}
BIN_S=${BIN_S:-5}
WARM_S=${WARM_S:-10}
NICE=${NICE:-$( [ "$(id -u)" = 0 ] && echo -10 || echo 0)}
TIE_PCT=${TIE_PCT:-2}
KV_PAD=${KV_PAD:-0}
KV_PAD_ARG=false
[ "$KV_PAD" = 1 ] && KV_PAD_ARG=true
PREFIX_CACHE=${PREFIX_CACHE:-0}
PREFIX_CACHE_ARG=false
[ "$PREFIX_CACHE" = 1 ] && PREFIX_CACHE_ARG=true
if [ "$NICE" != 0 ]; then
    renice -n "$NICE" -p $$ >/dev/null ||
        { echo "tidal-bench: renice -n $NICE failed (NICE=0 to run at the default)" >&2; exit 2; }
fi

for b in gateway prefill_worker tidepool-bench tidepool-sim; do
    [ -x "$BIN/$b" ] || { echo "tidal-bench: $BIN/$b missing: run make first" >&2; exit 2; }
done
[ -f "$MODEL" ] || { echo "tidal-bench: model $MODEL missing" >&2; exit 2; }
TTFT_SLO=$(sed -n 's/.*ttft:\([0-9.]*\).*/\1/p' <<<"$SLO")
TPOT_SLO=$(sed -n 's/.*tpot:\([0-9.]*\).*/\1/p' <<<"$SLO")
[ -n "$TTFT_SLO" ] && [ -n "$TPOT_SLO" ] ||
    { echo "tidal-bench: SLO must give ttft:MS and tpot:MS" >&2; exit 2; }
DURATION=$(python3 -c "print($PHASE_S * $PHASES)")
# A request still running this long after it was sent cannot meet the SLOs any more (TTFT
# SLO + the longest answer at the TPOT SLO): the client gives up on it, which bounds the
# backlog an overloaded configuration drags past the last arrival.
TIMEOUT_S=$(python3 -c "print(($TTFT_SLO + max(${OUTPUT_TOKENS##*:}, $SHORT_LEN) * $TPOT_SLO) / 1e3 + 5)")
[ -z "$TRACE" ] || [ -f "$TRACE" ] || { echo "tidal-bench: TRACE $TRACE: no such file" >&2; exit 2; }
OUT=$(mktemp -d /tmp/tidal-bench.XXXXXX)
TRACE_TIME_SCALE=${TRACE_TIME_SCALE:-}
TRACE_WINDOW_S=${TRACE_WINDOW_S:-}
if [ -n "$TRACE" ] && { [ -n "$TRACE_TIME_SCALE" ] || [ -n "$TRACE_WINDOW_S" ]; }; then
    retime=(--from-trace "$TRACE")
    [ -n "$TRACE_TIME_SCALE" ] && retime+=(--time-scale "$TRACE_TIME_SCALE")
    [ -n "$TRACE_WINDOW_S" ] && retime+=(--duration-s "$TRACE_WINDOW_S")
    python3 tools/bench/gen-trace.py "${retime[@]}" >"$OUT/retimed.csv" ||
        { echo "tidal-bench: gen-trace.py ${retime[*]} failed" >&2; rm -rf "$OUT"; exit 2; }
    TRACE="$TRACE (${retime[*]:2})"
    TRACE_FILE=$OUT/retimed.csv
else
    TRACE_FILE=$TRACE
fi
N_OFFLINE=0
N_LINES=0
if [ -n "$TRACE" ]; then
    # the trace split by class (the simulator's rules for the class column), its duration
    # (the last online arrival) and the client's deadline (its longest online answer)
    read -r DURATION TIMEOUT_S N_OFFLINE N_LINES < <(python3 - "$TRACE_FILE" "$OUT" "$TTFT_SLO" "$TPOT_SLO" <<'PYEOF'
import sys
path, out, ttft, tpot = sys.argv[1], sys.argv[2], float(sys.argv[3]), float(sys.argv[4])
on, off, last, longest = [], [], 0.0, 1
for line in open(path):
    s = line.strip()
    if not s or s.startswith("#") or not (s[0].isdigit() or s[0] == "."):
        continue
    f = s.split(",")
    cls = f[3].strip().lower() if len(f) > 3 else ""
    if cls in ("offline", "1", "flex", "batch"):
        off.append(s)
    else:
        on.append(s)
        last, longest = max(last, float(f[0])), max(longest, int(float(f[2])))
head = "arrival_s,prompt_tokens,output_tokens,class\n"
open(out + "/online.csv", "w").write(head + "".join(l + "\n" for l in on))
open(out + "/offline.csv", "w").write(head + "".join(l + "\n" for l in off))
print(last, (ttft + longest * tpot) / 1e3 + 5, len(off), len(on) + len(off))
PYEOF
    )
fi
# an upper bound of the arrivals (the bench stops them at DURATION)
MAX_N=$(python3 -c "import math; print(int(2 * $PHASE_S * math.ceil($PHASES / 2) * ($RATE + $DECODE_RATE)) + 100)")
# the gateway's queue must hold a trace's offline lines, all queued at once
MAX_QUEUE=$((N_OFFLINE + 1024))
T_START=$SECONDS

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }

PIDS=()
stop_all() {
    local p
    for p in "${PIDS[@]}"; do kill -TERM "$p" 2>/dev/null || true; done
    for p in "${PIDS[@]}"; do wait "$p" 2>/dev/null || true; done
    PIDS=()
}
cleanup() {
    stop_all
    if [ "$KEEP" = 1 ]; then echo "tidal-bench: runs kept in $OUT" >&2; else rm -rf "$OUT"; fi
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# CPU seconds (user + system) the processes in PIDS have used so far.
cpu_s() {
    local p t=0
    for p in "${PIDS[@]}"; do
        [ -r "/proc/$p/stat" ] && t=$((t + $(awk '{print $14 + $15}' "/proc/$p/stat")))
    done
    python3 -c "import os; print($t / os.sysconf('SC_CLK_TCK'))"
}

# run_one NAME N_PREFILL N_DECODE OFFLINE(0|1) [gateway args...]: one configuration; leaves
# $OUT/NAME/{result.json,trace.csv,info.json,*.log}. Trace mode: RUN_TRACE is the file the
# bench replays, and with RUN_LIMIT_S set the bench is stopped (SIGINT: it reports what
# ended by then) that long after it started.
RUN_TRACE=""
RUN_LIMIT_S=""
run_one() {
    local name=$1 np=$2 nd=$3 offline=$4
    shift 4
    local dir=$OUT/$name port ctl i role db=""
    mkdir -p "$dir"
    port=$(free_port)
    ctl="tcp://127.0.0.1:$(free_port)"
    [ "$offline" = 1 ] && db="$dir/gateway.db"
    # --dead-after-ms: an emulated worker sleeps through a prefill batch (2 s at the
    # defaults) without heartbeats; --heartbeat-ms 200: the policy runs every 200 ms.
    # a private cluster, open: API keys of the caller's environment are not its
    env -u TIDEPOOL_API_KEY -u TIDEPOOL_ADMIN_API_KEY -u TIDEPOOL_API_KEY_FILE \
    "$BIN/gateway" --host 127.0.0.1 --port "$port" --ctl-bind "$ctl" --model "$MODEL" \
        --stats-bind "" --state-db "$db" --heartbeat-ms 200 --dead-after-ms 10000 \
        --ttft-slo-ms "$TTFT_SLO" --tpot-slo-ms "$TPOT_SLO" --max-queue "$MAX_QUEUE" \
        --log-level warn "$@" \
        >"$dir/gateway.log" 2>&1 &
    PIDS+=($!)
    for ((i = 0; i < np + nd; i++)); do
        role=prefill
        ((i >= np)) && role=decode
        # --threads 1: 8 workers share 2 CPUs; --max-seqs, --max-batch-tokens: the engine
        # settings the simulator is given too
        "$BIN/prefill_worker" --role "$role" --gateway "$ctl" --model "$MODEL" \
            --worker-id "w$i" --kv-bind "tcp://127.0.0.1:$(free_port)" --emulate "$PRESET" \
            --emulate-kv-pad "$KV_PAD_ARG" --prefix-cache "$PREFIX_CACHE_ARG" --threads 1 --max-seqs "$MAX_SEQS" \
            --max-batch-tokens "$MAX_BATCH_TOKENS" \
            --heartbeat-ms 200 --log-level warn >"$dir/w$i.log" 2>&1 &
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
        echo "tidal-bench: $name: only $n of $((np + nd)) workers registered (logs in $dir)" >&2
        KEEP=1
        exit 1
    fi
    local batch_id=""
    if [ "$offline" = 1 ] && [ -n "$TRACE" ]; then
        # the trace's offline lines as one Batch API job: each prompt exactly its
        # prompt_tokens ids (BOS, then ids of the server's /tokenize), as tidepool-bench
        # --trace builds them
        batch_id=$(python3 - "$port" "$OUT/offline.csv" <<'PYEOF'
import json, random, sys, urllib.request
port, path = sys.argv[1], sys.argv[2]
base = "http://127.0.0.1:%s" % port
def post(url, body, ctype="application/json"):
    req = urllib.request.Request(base + url, data=body, method="POST",
                                 headers={"Content-Type": ctype} if ctype else {})
    return json.load(urllib.request.urlopen(req))
tok = lambda text, sp: post("/tokenize", json.dumps({"prompt": text,
                                                      "add_special_tokens": sp}).encode())["tokens"]
rnd = random.Random(11)
words = "the cat ran to a big red ball in the park and saw a little dog".split()
pool = tok(" ".join(rnd.choice(words) for _ in range(2048)), False)
w, wo = tok("the", True), tok("the", False)
bos = [w[0]] if len(w) == len(wo) + 1 else []
lines = []
for i, line in enumerate(l for l in open(path) if l[:1].isdigit() or l[:1] == "."):
    f = line.strip().split(",")
    p, o = int(float(f[1])), int(float(f[2]))
    off = rnd.randrange(len(pool))
    ids = (bos + [pool[(off + k) % len(pool)] for k in range(p)])[:p]
    lines.append(json.dumps({"custom_id": "offline-%d" % i, "method": "POST",
                             "url": "/v1/completions",
                             "body": {"model": "stories260K", "prompt": ids, "max_tokens": o,
                                      "min_tokens": o, "ignore_eos": True, "temperature": 0}}))
fid = post("/v1/files?purpose=batch&filename=offline.jsonl", ("\n".join(lines) + "\n").encode(),
           None)["id"]
print(post("/v1/batches", json.dumps({"input_file_id": fid, "endpoint": "/v1/completions",
                                      "completion_window": "24h"}).encode())["id"])
PYEOF
        )
    elif [ "$offline" = 1 ]; then
        batch_id=$(python3 - "$port" "$OFFLINE_LINES" "$OFFLINE_WORDS" "$OFFLINE_TOKENS" <<'EOF'
import json, random, sys, urllib.request
port, n, words, tokens = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
base = "http://127.0.0.1:%s" % port
vocab = "the cat ran to a big red ball in the park and saw a little dog".split()
rnd = random.Random(7)
lines = "".join(json.dumps({"custom_id": "offline-%d" % i, "method": "POST",
                            "url": "/v1/completions",
                            "body": {"model": "stories260K", "max_tokens": tokens,
                                     "temperature": 0, "ignore_eos": True,
                                     "prompt": " ".join(rnd.choice(vocab) for _ in range(words))}})
                + "\n" for i in range(n))
req = urllib.request.Request(base + "/v1/files?purpose=batch&filename=offline.jsonl",
                             data=lines.encode(), method="POST")
fid = json.load(urllib.request.urlopen(req))["id"]
req = urllib.request.Request(base + "/v1/batches", method="POST",
                             headers={"Content-Type": "application/json"},
                             data=json.dumps({"input_file_id": fid, "endpoint": "/v1/completions",
                                              "completion_window": "24h"}).encode())
print(json.load(urllib.request.urlopen(req))["id"])
EOF
        )
    fi
    local cpu0 t0 rc=0
    cpu0=$(cpu_s)
    t0=$(date +%s.%N)
    local load=(--workload phase-shift --phase-seconds "$PHASE_S" --request-rate "$RATE"
                --decode-rate "$DECODE_RATE" --duration-s "$DURATION" --num-prompts "$MAX_N"
                --input-len-range "$PROMPT_WORDS" --output-len-range "$OUTPUT_TOKENS"
                --phase-short-len "$SHORT_LEN" --ignore-eos)
    [ -n "$TRACE" ] && load=(--trace "$RUN_TRACE" --offline-timeout-s "$OFFLINE_TIMEOUT_S")
    local sampler=""
    if [ -n "$TRACE" ] && [ -n "$batch_id" ]; then
        # the offline token counter once a second: "seconds since the start, tokens"
        (while :; do
            printf '%s %s\n' "$(python3 -c "print($(date +%s.%N) - $t0)")" "$(curl -s \
                "http://127.0.0.1:$port/metrics" | sed -n \
                's/^tidepool_offline_generation_tokens_total{[^}]*} \([0-9.e+]*\)$/\1/p')"
            sleep 1
        done) >"$dir/offline-series.txt" 2>/dev/null &
        sampler=$!
    fi
    if [ "$RUN_TRACE" = none ]; then # the batch job alone, for RUN_LIMIT_S
        sleep "$RUN_LIMIT_S"
    else
        "$BIN/tidepool-bench" --url "http://127.0.0.1:$port" "${load[@]}" \
            --seed "$SEED" --goodput "$SLO" --timeout-s "$TIMEOUT_S" \
            --result-json "$dir/result.json" --trace-out "$dir/trace.csv" --no-progress \
            >"$dir/bench.txt" 2>&1 || rc=$?
    fi
    if [ -n "$sampler" ]; then
        kill "$sampler" 2>/dev/null || true
        wait "$sampler" 2>/dev/null || true
    fi
    if ((rc != 0)); then
        echo "tidal-bench: $name: the bench failed (see $dir/bench.txt)" >&2
        KEEP=1
        exit 1
    fi
    local cpu1 t1
    cpu1=$(cpu_s)
    t1=$(date +%s.%N)
    curl -s "http://127.0.0.1:$port/workers" >"$dir/workers.json"
    curl -s "http://127.0.0.1:$port/metrics" >"$dir/metrics.txt"
    python3 -c "import json; json.dump({'cpu_s': $cpu1 - $cpu0, 'wall_s': $t1 - $t0}, open('$dir/info.json', 'w'))"
    if [ -n "$batch_id" ] && [ -n "$TRACE" ]; then
        curl -s "http://127.0.0.1:$port/v1/batches/$batch_id" >"$dir/batch.json"
    elif [ -n "$batch_id" ]; then
        # the batch as the online run ended, then how long the rest takes with the cluster to
        # itself (at most 120 s more)
        curl -s "http://127.0.0.1:$port/v1/batches/$batch_id" >"$dir/batch.json"
        local t_end=$((SECONDS + 120)) st=""
        while ((SECONDS < t_end)); do
            st=$(curl -s "http://127.0.0.1:$port/v1/batches/$batch_id" |
                python3 -c 'import json,sys; print(json.load(sys.stdin)["status"])')
            [ "$st" = completed ] && break
            sleep 1
        done
        curl -s "http://127.0.0.1:$port/v1/batches/$batch_id" >"$dir/batch-end.json"
        python3 -c "import json; d = json.load(open('$dir/info.json')); d['batch_after_s'] = $(date +%s.%N) - $t1; json.dump(d, open('$dir/info.json', 'w'))"
    fi
    stop_all
}

label() { tr ':' '-' <<<"$1"; }

WORKLOAD="phase-shift $PHASES x ${PHASE_S} s: prefill-heavy $RATE req/s ($PROMPT_WORDS words,"
WORKLOAD+=" $SHORT_LEN tokens out), decode-heavy $DECODE_RATE req/s ($SHORT_LEN words,"
WORKLOAD+=" $OUTPUT_TOKENS tokens out)"
[ -n "$TRACE" ] &&
    WORKLOAD="trace $TRACE ($((N_LINES - N_OFFLINE)) online lines over $DURATION s, $N_OFFLINE offline)"
echo "tidal-bench: EMULATED cluster of 8 workers ($PRESET, max-seqs $MAX_SEQS, max-batch-tokens" \
    "$MAX_BATCH_TOKENS); $WORKLOAD; SLO $SLO; seed $SEED" >&2
RUN_TRACE=$OUT/online.csv
CONFIGS=()
for s in $SPLITS; do
    echo "tidal-bench: static $s ..." >&2
    run_one "static-$(label "$s")" "${s%%:*}" "${s##*:}" 0
    CONFIGS+=("static-$(label "$s")")
done
# The trace: every request's arrival and token counts, from the first run that has one.
SIM_TRACE=""
[ -n "$TRACE" ] && SIM_TRACE=$OUT/online.csv
for c in "${CONFIGS[@]}"; do [ -n "$SIM_TRACE" ] || SIM_TRACE=$OUT/$c/trace.csv; break; done
# The simulator gets the workers' engine settings, the gateway's behaviour (decode room
# reserved at dispatch, a 200 ms policy tick, no switching cost) and the policy knobs of
# TIDAL_ARGS.
tidal_arg() { # tidal_arg FLAG DEFAULT: FLAG's value in TIDAL_ARGS
    local v
    v=$(sed -n "s/.*$1[ =]\([0-9.]*\).*/\1/p" <<<"$TIDAL_ARGS")
    echo "${v:-$2}"
}
SIM_ARGS=(--workers 8 --preset "$PRESET" --max-seqs "$MAX_SEQS" --max-batch-tokens
          "$MAX_BATCH_TOKENS" --decode-reserve dispatch --tick-ms 200 --switch-ms 0
          --ttft-slo-ms "$TTFT_SLO" --tpot-slo-ms "$TPOT_SLO" --initial-prefill "${TIDAL_START%%:*}"
          --min-role-s "$(tidal_arg --tidal-min-role-s 30)" --smooth-s "$(tidal_arg --smooth-s 5)"
          --max-changes "$(tidal_arg --tidal-max-changes 2)"
          --min-per-role "$(tidal_arg --tidal-min-per-role 1)")
if [ -z "$PREFILL_TOK_S" ] || [ -z "$DECODE_TOK_S" ]; then
    [ -n "$SIM_TRACE" ] || { echo "tidal-bench: set PREFILL_TOK_S and DECODE_TOK_S when SPLITS is \" \" (no static split)" >&2; exit 2; }
    # "capacity estimates per worker: prefill P tok/s, decode S seqs, D tok/s"
    CAP_LINE=$("$BIN/tidepool-sim" "${SIM_ARGS[@]}" --trace "$SIM_TRACE" --policy static:2 2>/dev/null |
        grep 'capacity estimates per worker' || true)
    [ -n "$PREFILL_TOK_S" ] ||
        PREFILL_TOK_S=$(sed -n 's/.*capacity estimates per worker: prefill \([0-9]*\) tok\/s.*/\1/p' <<<"$CAP_LINE")
    [ -n "$DECODE_TOK_S" ] ||
        DECODE_TOK_S=$(sed -n 's/.*, decode [0-9]* seqs, \([0-9]*\) tok\/s.*/\1/p' <<<"$CAP_LINE")
fi
# the policy's capacity figures, the simulator's (its policy gets the same)
POLICY_CAP=(--prefill-tokens-per-s "$PREFILL_TOK_S" --decode-tokens-per-s "${DECODE_TOK_S:-0}")
# shellcheck disable=SC2086  # TIDAL_ARGS is a list of flags
{
    echo "tidal-bench: tidal from $TIDAL_START (policy capacity per worker: prefill $PREFILL_TOK_S tok/s, decode ${DECODE_TOK_S:-0} tok/s) ..." >&2
    run_one tidal "${TIDAL_START%%:*}" "${TIDAL_START##*:}" 0 --tidal $TIDAL_ARGS \
        "${POLICY_CAP[@]}"
    CONFIGS+=(tidal)
    [ -n "$SIM_TRACE" ] || SIM_TRACE=$OUT/tidal/trace.csv
    if [ "$OFFLINE" = 1 ] && [ -n "$TRACE" ] && ((N_OFFLINE > 0)); then
        # the online lines with the offline ones queued as a Batch API job; then the job
        # alone for as long: the cluster's capacity for it
        echo "tidal-bench: tidal + the trace's $N_OFFLINE offline lines as a Batch API job ..." >&2
        run_one tidal-offline "${TIDAL_START%%:*}" "${TIDAL_START##*:}" 1 --tidal $TIDAL_ARGS \
            "${POLICY_CAP[@]}" --offline-max-wait-s "$OFFLINE_WAIT_S"
        echo "tidal-bench: tidal, the Batch API job alone ..." >&2
        RUN_TRACE=none
        RUN_LIMIT_S=$(python3 -c "print(int($DURATION + 1))")
        run_one offline-only "${TIDAL_START%%:*}" "${TIDAL_START##*:}" 1 --tidal $TIDAL_ARGS \
            "${POLICY_CAP[@]}" --offline-max-wait-s "$OFFLINE_WAIT_S"
        RUN_TRACE=$OUT/online.csv
        RUN_LIMIT_S=""
    elif [ "$OFFLINE" = 1 ] && [ -z "$TRACE" ]; then
        echo "tidal-bench: tidal + a Batch API job of $OFFLINE_LINES offline requests ..." >&2
        run_one tidal-offline "${TIDAL_START%%:*}" "${TIDAL_START##*:}" 1 --tidal $TIDAL_ARGS \
            "${POLICY_CAP[@]}" --offline-max-wait-s "$OFFLINE_WAIT_S"
    fi
}
# How a decode worker left decode in the tidal run: migrated its sequences, or drained them
# (before live migration): the simulator does the same.
ROLE_CHANGE=$(python3 -c "import json; w = json.load(open('$OUT/tidal/workers.json'))['workers']
print('migrate' if sum(x.get('migrated_out', 0) for x in w) > 0 else 'drain')")
"$BIN/tidepool-sim" "${SIM_ARGS[@]}" --role-change "$ROLE_CHANGE" --trace "$SIM_TRACE" \
    --compare-static >"$OUT/sim.txt" 2>&1
# trace mode with offline lines: the simulator's tidal on the whole trace too
if [ -n "$TRACE" ] && ((N_OFFLINE > 0)); then
    "$BIN/tidepool-sim" "${SIM_ARGS[@]}" --role-change "$ROLE_CHANGE" --trace "$TRACE_FILE" \
        --policy tidal >"$OUT/sim-offline.txt" 2>&1
fi
if [ "$SIM1000" = 1 ]; then
    echo "tidal-bench: tidepool-sim with 1000 workers ..." >&2
    for mode in "" --compare-static; do
        # shellcheck disable=SC2086
        "$BIN/tidepool-sim" --workers 1000 --workload phase-shift $mode >"$OUT/sim1000$mode.txt" \
            2>"$OUT/sim1000$mode.err"
    done
fi

echo "tidal-bench: EMULATED cluster of 8 workers ($PRESET, max-seqs $MAX_SEQS, max-batch-tokens" \
    "$MAX_BATCH_TOKENS; nice $NICE; KV padding $KV_PAD_ARG; prefix cache $PREFIX_CACHE_ARG); $WORKLOAD; SLO $SLO; seed $SEED; tidal: $TIDAL_ARGS" \
    "${POLICY_CAP[*]}"
OFFLINE_WAIT_S=$OFFLINE_WAIT_S TRACE=$TRACE DURATION=$DURATION BIN_S=$BIN_S WARM_S=$WARM_S \
    TIE_PCT=$TIE_PCT python3 - "$OUT" "$TTFT_SLO" "$TPOT_SLO" "$SIM1000" "$OFFLINE" \
    "$((SECONDS - T_START))" \
    "${CONFIGS[@]}" <<'EOF'
import json, os, re, sys
out, ttft_slo, tpot_slo = sys.argv[1], float(sys.argv[2]), float(sys.argv[3])
sim1000, offline, elapsed, configs = sys.argv[4] == "1", sys.argv[5] == "1", sys.argv[6], sys.argv[7:]
trace_mode = bool(os.environ.get("TRACE"))
# goodput: trace mode, requests meeting the SLOs / the trace's arrival span (the same for
# every run, as the simulator's); phase-shift, / the bench's duration (vLLM's definition)
gp = lambda x: (x["r"]["trace"]["goodput"] if trace_mode else x["r"]["request_goodput"]) or 0

def load(name):
    d = os.path.join(out, name)
    r = json.load(open(os.path.join(d, "result.json")))
    info = json.load(open(os.path.join(d, "info.json")))
    workers = json.load(open(os.path.join(d, "workers.json")))["workers"]
    met = {"all": [0, 0], "prefill-heavy": [0, 0], "decode-heavy": [0, 0]}
    for q in r["requests"]:
        if q["state"] == "not_sent" or trace_mode:
            continue
        ok = q["success"] and q["ttft_ms"] <= ttft_slo and (
            q["output_tokens"] <= 1 or
            (q["e2el_ms"] - q["ttft_ms"]) / (q["output_tokens"] - 1) <= tpot_slo)
        for k in ("all", q["phase"]):
            met[k][0] += ok
            met[k][1] += 1
    if trace_mode:  # the bench's figures: online requests, TTFT from their arrival
        t = r["trace"]
        met["all"] = [t["online_good"], t["online"]]
    pct = {k: 100.0 * v[0] / v[1] if v[1] else float("nan") for k, v in met.items()}
    # the mean TPOT as tidepool-sim counts it: over every finished online request, 0 for
    # one of a single output token (the bench's mean leaves those out)
    tp = [(q["e2el_ms"] - q["ttft_ms"]) / (q["output_tokens"] - 1) if q["output_tokens"] > 1
          else 0.0 for q in r["requests"]
          if q.get("state") == "ok" and q.get("class") in (None, "online")]
    tpot_sim_def = sum(tp) / len(tp) if tp else float("nan")
    return {"name": name, "r": r, "good": met["all"][0], "n": met["all"][1], "pct": pct,
            "cpu": info["cpu_s"] / info["wall_s"], "changes": sum(w.get("role_changes", 0)
                                                                for w in workers),
            "split": "%d:%d" % (sum(w["role"] == "prefill" for w in workers),
                                sum(w["role"] == "decode" for w in workers)),
            "dir": d, "tpot_sim_def": tpot_sim_def}

runs = [load(c) for c in configs]
label = lambda x: x["name"].replace("static-", "static ").replace("-", ":") if x["name"].startswith(
    "static") else "tidal"
print("EMULATED: one run each; goodput = requests meeting both SLOs / %s; CPU = cores the "
      "gateway and workers used" % ("the trace's arrival span" if trace_mode else
                                    "the bench's duration (vLLM's definition)"))
print("%-14s %8s %8s %6s %8s %8s %9s %9s %9s %5s %6s %6s" % (
    "EMULATED", "goodput", "good", "SLO", "P-phase", "D-phase", "TTFT p99", "TPOT mean",
    "failed", "role", "final", "CPU"))
print("%-14s %8s %8s %6s %8s %8s %9s %9s %9s %5s %6s %6s" % (
    "", "req/s", "of all", "met %", "met %", "met %", "ms", "ms", "", "chg", "P:D", "cores"))
for x in runs:
    r = x["r"]
    print("%-14s %8.2f %8s %6.1f %8.1f %8.1f %9.0f %9.1f %9d %5d %6s %6.2f" % (
        label(x), gp(x), "%d/%d" % (x["good"], x["n"]), x["pct"]["all"],
        x["pct"]["prefill-heavy"], x["pct"]["decode-heavy"], r["p99_ttft_ms"], r["mean_tpot_ms"],
        r["failed"], x["changes"], x["split"], x["cpu"]))
tie = float(os.environ.get("TIE_PCT", "2")) / 100
def rel(a, b):
    """'=' when a and b differ by at most TIE_PCT % of the larger, else '>' or '<'."""
    if abs(a - b) <= tie * max(abs(a), abs(b)):
        return "="
    return ">" if a > b else "<"
def ranking(items):
    """'A > B = C': items [(label, value)] by value, '=' between neighbours within TIE_PCT."""
    items = sorted(items, key=lambda kv: (-kv[1], kv[0] != "tidal"))
    return "".join(("" if i == 0 else " %s " % rel(items[i - 1][1], kv[1]).replace("<", ">"))
                   + kv[0] for i, kv in enumerate(items))
print("ranking (EMULATED, by requests meeting both SLOs; '=': within %g %%): %s" % (
    100 * tie, ranking([(label(x), x["good"]) for x in runs])))
tidal = next((x for x in runs if x["name"] == "tidal"), None)
statics = [x for x in runs if x["name"].startswith("static")]
if tidal and statics:
    best = max(statics, key=lambda x: x["good"])
    g_t, g_b = gp(tidal), gp(best)
    ratio = g_t / g_b if g_b > 0 else float("inf")
    print("tidal / best static (%s): %s goodput (%.2f vs %.2f req/s%s); %s requests meeting the "
          "SLOs (%d vs %d); >= 0.99x: %s" % (
              label(best), "%.3fx" % ratio, g_t, g_b, " of arrival span" if trace_mode else "",
              "%.3fx" % (tidal["good"] / best["good"]) if best["good"] else "inf",
              tidal["good"], best["good"], "met" if ratio >= 0.99 else "NOT met"))

# the simulator on the same trace
sim = open(os.path.join(out, "sim.txt")).read()
rows = {}
for line in sim.splitlines():
    f = line.split()
    if len(f) >= 7 and re.match(r"^(tidal|static:\d+)$", f[0]) and re.match(r"^[0-9.]+$", f[1]):
        rows[f[0]] = (float(f[1]), float(f[2]), float(f[5]))  # goodput, SLO %, TPOT mean
n_workers = 8
def sim_key(x):
    return "tidal" if x["name"] == "tidal" else "static:" + x["name"].split("-")[1]
print()
print("SIMULATED (tidepool-sim --trace: the same requests, engine settings and policy knobs; "
      "%s)" % (re.search(r"engine: (.*)", sim).group(1) if re.search(r"engine: (.*)", sim) else ""))
print("%-14s %10s %10s %12s %12s %10s %10s" % ("", "EMU SLO %", "SIM SLO %", "EMU goodput",
                                               "SIM goodput", "EMU TPOT", "SIM TPOT"))
for x in runs:
    s = rows.get(sim_key(x))
    print("%-14s %10.1f %10s %12.2f %12s %10.1f %10s" % (
        label(x), x["pct"]["all"], "%.1f" % s[1] if s else "-", gp(x),
        "%.2f" % s[0] if s else "-", x["tpot_sim_def"], "%.1f" % s[2] if s else "-"))
print("(SIM goodput divides by the arrival window, EMU goodput by %s; TPOT: mean ms over the "
      "finished requests, 0 for a one-token answer, as the simulator counts it (the EMULATED "
      "table's TPOT leaves those out); the emulated one near the simulated one means the workers "
      "were not short of CPU)" % ("the same" if trace_mode else "the bench's duration"))
sim_label = lambda k: k if k == "tidal" else "static %s:%d" % (k[7:], n_workers - int(k[7:]))
print("ranking (SIMULATED, every split, by SLO attainment; '=': within %g %%): %s" % (
    100 * tie, ranking([(sim_label(k), v[1]) for k, v in rows.items()])))
# every pair of the configurations run here, compared in both (within TIE_PCT in both: the
# simulator's small differences are below what one emulated run resolves)
pairs = []
for i, x in enumerate(runs):
    for y in runs[i + 1:]:
        sx, sy = rows.get(sim_key(x)), rows.get(sim_key(y))
        if sx and sy:
            pairs.append((label(x), label(y), rel(x["good"], y["good"]), rel(sx[1], sy[1])))
if pairs:
    print("pairs (EMULATED vs SIMULATED): " + "; ".join(
        "%s %s %s%s" % (a, e, b, "" if e == m else " (SIMULATED %s)" % m)
        for a, b, e, m in pairs))
print("the emulated and simulated rankings of the configurations run here: %s" % (
    "only one configuration run" if not pairs else
    "the SAME (every pair, ties within %g %%)" % (100 * tie)
    if all(e == m for _, _, e, m in pairs) else
    "NOT the same (%d of %d pairs differ)" % (sum(e != m for _, _, e, m in pairs), len(pairs))))

if offline and tidal and trace_mode and os.path.isdir(os.path.join(out, "offline-only")):
    # Offline work in the troughs. Bins of BIN_S s; a trough bin is one whose online
    # arrivals (the trace) are below the mean per bin (the night half of a tide). Offline
    # tokens per bin: the gateway's offline token counter (counted as each line is
    # answered), sampled every second. Online tokens per bin: each completed request's
    # output tokens spread evenly over its generation (first token -> end). Capacity: the
    # offline tokens per second of the Batch API job alone (after WARM_S s of warm-up, up
    # to the online part's duration). Spare capacity in a trough bin: capacity x BIN_S -
    # the online tokens generated there in the run without offline work (the same shapes: a
    # token of one costs what a token of the other does).
    dur, bin_s = float(os.environ["DURATION"]), float(os.environ["BIN_S"])
    warm = float(os.environ["WARM_S"])
    nb = max(1, int(dur // bin_s))

    def spread(res, cls):
        v = [0.0] * nb
        for q in res["requests"]:
            if q["state"] != "ok" or q.get("class") != cls:
                continue
            a = q["start_s"] + q["ttft_ms"] / 1e3
            b = q["start_s"] + q["e2el_ms"] / 1e3
            n = q["output_tokens"]
            if b <= a:
                if int(a // bin_s) < nb:
                    v[int(a // bin_s)] += n
                continue
            for k in range(max(0, int(a // bin_s)), min(nb, int(b // bin_s) + 1)):
                lo, hi = max(a, k * bin_s), min(b, (k + 1) * bin_s)
                if hi > lo:
                    v[k] += n * (hi - lo) / (b - a)
        return v
    arr = [0] * nb
    for line in open(os.path.join(out, "online.csv")):
        f = line.split(",")
        if f[0][:1].isdigit() and int(float(f[0]) // bin_s) < nb:
            arr[int(float(f[0]) // bin_s)] += 1
    mean_arr = sum(arr) / nb
    trough = [a < mean_arr for a in arr]
    n_tr = sum(trough)
    def series(name):
        """Offline tokens per bin from the sampled counter (linear between samples)."""
        pts = []
        for line in open(os.path.join(out, name, "offline-series.txt")):
            f = line.split()
            if len(f) == 2:
                pts.append((float(f[0]), float(f[1])))
        pts.sort()
        def at(t):
            if not pts or t <= pts[0][0]:
                return pts[0][1] if pts else 0.0
            for (t0, v0), (t1, v1) in zip(pts, pts[1:]):
                if t <= t1:
                    return v0 + (v1 - v0) * (t - t0) / (t1 - t0) if t1 > t0 else v1
            return pts[-1][1]
        return [at((k + 1) * bin_s) - at(k * bin_s) for k in range(nb)]
    both = json.load(open(os.path.join(out, "tidal-offline", "batch.json")))
    cap_bins = series("offline-only")
    k0 = min(nb - 1, int(warm // bin_s))
    cap = sum(cap_bins[k0:]) / ((nb - k0) * bin_s)
    online_alone = spread(tidal["r"], "online")
    off_both = series("tidal-offline")
    spare = [max(0.0, cap * bin_s - online_alone[k]) for k in range(nb)]
    sp_t = sum(s for s, t in zip(spare, trough) if t)
    off_t = sum(o for o, t in zip(off_both, trough) if t)
    sp_all, off_all = sum(spare), sum(off_both)
    x = load("tidal-offline")
    print()
    print("OFFLINE IN THE TROUGHS (EMULATED, tidal; the trace's %d offline lines queued at t = 0 "
          "as a Batch API job; %d of %d bins of %g s are troughs)" % (
              both["request_counts"]["total"], n_tr, nb, bin_s))
    print("capacity for the offline lines alone: %.1f tok/s (after %g s); online alone used "
          "%.1f tok/s in the troughs, %.1f tok/s outside them" % (
              cap, warm,
              sum(o for o, t in zip(online_alone, trough) if t) / max(1e-9, n_tr * bin_s),
              sum(o for o, t in zip(online_alone, trough) if not t) /
              max(1e-9, (nb - n_tr) * bin_s)))
    print("%-16s %10s %10s %12s %12s %10s" % ("", "online SLO", "goodput", "offline tok",
                                              "spare tok", "share of"))
    print("%-16s %10s %10s %12s %12s %10s" % ("", "met %", "req/s", "served", "", "spare"))
    print("%-16s %10.1f %10.2f %12s %12s %10s" % (
        "without offline", tidal["pct"]["all"], tidal["r"]["trace"]["goodput"] or 0, "-", "-",
        "-"))
    print("%-16s %10.1f %10.2f %12.0f %12.0f %10.2f   (troughs)" % (
        "with offline", x["pct"]["all"], x["r"]["trace"]["goodput"] or 0, off_t, sp_t,
        off_t / sp_t if sp_t else float("nan")))
    print("%-16s %10s %10s %12.0f %12.0f %10.2f   (whole run)" % (
        "", "", "", off_all, sp_all, off_all / sp_all if sp_all else float("nan")))
    print("online SLO attainment with offline work: %+.1f points (%d/%d vs %d/%d requests); "
          "batch lines completed when the online replay ended: %d of %d (%d failed)" % (
              x["pct"]["all"] - tidal["pct"]["all"], x["good"], x["n"], tidal["good"],
              tidal["n"], both["request_counts"]["completed"], both["request_counts"]["total"],
              both["request_counts"]["failed"]))
    so = os.path.join(out, "sim-offline.txt")
    rows_o = [l.split() for l in open(so) if l.startswith("tidal ")] if os.path.exists(so) else []
    if rows_o and len(rows_o[0]) > 9:
        print("SIMULATED, the whole trace (tidal): online SLO met %s%%, offline %s tok/s over "
              "the simulated run" % (rows_o[0][2], rows_o[0][9]))
elif offline and tidal and not trace_mode:
    x = load("tidal-offline")
    b = json.load(open(os.path.join(x["dir"], "batch.json")))
    metrics = open(os.path.join(x["dir"], "metrics.txt")).read()
    def metric(name):
        m = re.search(r"^tidepool_%s(?:\{[^}]*\})? ([0-9.e+]+)$" % name, metrics, re.M)
        return float(m.group(1)) if m else 0.0
    dur = x["r"]["duration"]
    print()
    print("OFFLINE (EMULATED, tidal, the same online workload; a Batch API job of %d lines "
          "submitted at the start, aging after %s s)" % (b["request_counts"]["total"],
                                                        os.environ.get("OFFLINE_WAIT_S", "?")))
    print("%-16s %10s %8s %8s %10s %10s %10s %8s" % ("", "online SLO", "P-phase", "D-phase",
                                                    "goodput", "offline", "offline", "preempt"))
    print("%-16s %10s %8s %8s %10s %10s %10s %8s" % ("", "met %", "met %", "met %", "req/s",
                                                    "done", "tok/s", ""))
    for name, y, done, toks, pre in (
            ("without offline", tidal, "-", "-", "-"),
            ("with offline", x, "%d" % b["request_counts"]["completed"],
             "%.1f" % (metric("offline_generation_tokens_total") / dur),
             "%d" % metric("offline_preemptions_total"))):
        print("%-16s %10.1f %8.1f %8.1f %10.2f %10s %10s %8s" % (
            name, y["pct"]["all"], y["pct"]["prefill-heavy"], y["pct"]["decode-heavy"],
            y["r"]["request_goodput"] or 0, done, toks, pre))
    be = json.load(open(os.path.join(x["dir"], "batch-end.json")))
    info = json.load(open(os.path.join(x["dir"], "info.json")))
    print("(offline done: batch lines completed during the online run's %.0f s; offline tok/s over "
          "it. Afterwards, with the cluster to itself, the batch was %s %.0f s later: %d of %d "
          "lines done, %d failed)" % (dur, be["status"], info.get("batch_after_s", 0),
                                      be["request_counts"]["completed"],
                                      be["request_counts"]["total"],
                                      be["request_counts"]["failed"]))

if sim1000:
    print()
    for mode in ("", "--compare-static"):
        err = open(os.path.join(out, "sim1000%s.err" % mode)).read()
        txt = open(os.path.join(out, "sim1000%s.txt" % mode)).read()
        m = re.search(r"(\d+) run\(s\) in ([0-9.]+) s wall", err)
        last = [l for l in txt.splitlines() if l.startswith("tidal ranks")]
        print("tidepool-sim --workers 1000 --workload phase-shift %s: %s run(s) in %s s wall%s" % (
            mode, m.group(1) if m else "?", m.group(2) if m else "?",
            ("; " + last[0]) if last else ""))
print("tidal-bench: %s s in all" % elapsed)
EOF
