#!/usr/bin/env bash
# serve-peer.sh: the serving benchmark side by side with llama-server (make bench with
# LLAMA_CPP_DIR set runs it from tests/run_bench.sh; docs/bench.md "Serving side by side").
#
#   LLAMA_CPP_DIR=/work/llama.cpp tools/bench/serve-peer.sh
#
# Starts, on 127.0.0.1 and free ports, a tidepool cluster (a gateway and one mixed worker
# with SERVE_THREADS compute threads) and two llama-servers on the same GGUF file: one
# slot and SERVE_THREADS threads (its best configuration on a small machine) and
# SERVE_SLOTS slots with continuous batching (-np, SERVE_THREADS threads, 512 tokens of
# context per slot). Then, for each stream count of SERVE_STREAMS, SERVE_REPS rounds of
# tidepool-bench against each server in turn (tidepool, llama 1 slot, llama N slots,
# tidepool, ...: alternating, so a slow minute of a shared machine hits every side), each
# a closed loop of C streams sending SERVE_WAVES * C requests (at least 32), streamed,
# SERVE_OUTPUT tokens each with ignore_eos, prompts of SERVE_WORDS synthetic words sent as
# token ids of the model's own tokenizer (--prompt-tokenizer: llama.cpp splits this
# vocabulary's space-bearing pieces into other tokens, so text prompts would not be the
# same prompts). Each round draws new prompts (tidepool-bench --seed: the round and the
# stream count), the same for every side of the round: a round that repeated earlier
# prompts would time each server's prompt cache instead of its prefill (llama-server keeps
# finished prompts in host memory, tidepool its prefix cache's full blocks);
# SERVE_SAME_PROMPTS=1 repeats one set in every run, as before session 12. Prints per side the medians of output throughput, TPOT p50 and TTFT p50,
# each server's CPU time per output token (all its processes and threads), and the ratios
# against the llama-server configuration of the highest throughput at that stream count:
# tidepool's throughput over its, its TPOT and TTFT over tidepool's (> 1: tidepool shorter). The token counts are checked: every run
# must generate exactly requests * SERVE_OUTPUT tokens and every side must see the same
# prompt tokens, else the ratios are meaningless and the script fails.
#
# Only the processes it started are stopped (by pid), also on Ctrl-C. Exit status: 0, or
# 1 when a server did not start, a run failed, or the token counts differ.
# Settings (environment): BUILD (build), SERVE_MODEL (build/models/stories260K.gguf),
# SERVE_STREAMS ("1 16 64"), SERVE_REPS (3), SERVE_WAVES (4), SERVE_WORDS (32),
# SERVE_OUTPUT (128), SERVE_THREADS (1), SERVE_SLOTS (16), SERVE_LOG_DIR (a temp dir),
# SERVE_SAME_PROMPTS (0).
set -u
cd "$(dirname "$0")/../.."
BUILD=${BUILD:-build}
MODEL=${SERVE_MODEL:-build/models/stories260K.gguf}
STREAMS=${SERVE_STREAMS:-1 16 64}
REPS=${SERVE_REPS:-3}
WAVES=${SERVE_WAVES:-4}
WORDS=${SERVE_WORDS:-32}
OUTPUT=${SERVE_OUTPUT:-128}
THREADS=${SERVE_THREADS:-1}
SLOTS=${SERVE_SLOTS:-16}
SAME_PROMPTS=${SERVE_SAME_PROMPTS:-0}
LOGS=${SERVE_LOG_DIR:-$(mktemp -d /tmp/tidepool-serve-peer.XXXXXX)}
mkdir -p "$LOGS"

ls_bin=""
for c in "${LLAMA_CPP_DIR:-}/build/bin/llama-server" "${LLAMA_CPP_DIR:-}/bin/llama-server"; do
    [ -x "$c" ] && { ls_bin=$c; break; }
done
if [ -z "$ls_bin" ]; then
    echo "serving peer: no llama-server under LLAMA_CPP_DIR=${LLAMA_CPP_DIR:-} (build/bin or bin)"
    exit 1
fi
for b in gateway decode_worker tidepool-bench; do
    [ -x "$BUILD/bin/$b" ] || { echo "serving peer: $BUILD/bin/$b missing (make)"; exit 1; }
done
[ -f "$MODEL" ] || { echo "serving peer: $MODEL missing (make model)"; exit 1; }

PIDS=() BENCH_PID=""
stop_all() {
    local p
    for p in $BENCH_PID "${PIDS[@]}"; do kill "$p" 2>/dev/null; done
    for p in $BENCH_PID "${PIDS[@]}"; do wait "$p" 2>/dev/null; done
    PIDS=() BENCH_PID=""
}
trap 'stop_all' EXIT
trap 'exit 130' INT TERM

free_port() {
    python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}
# wait_up URL PATTERN PID...: until GET URL answers with PATTERN in its body (30 s); fails
# at once when one of the PIDs has exited (a setting it refused: its log says why)
wait_up() {
    local url=$1 pattern=$2 i p
    shift 2
    for i in $(seq 300); do
        curl -sf "$url" 2>/dev/null | grep -q "$pattern" && return 0
        for p in "$@"; do kill -0 "$p" 2>/dev/null || return 1; done
        sleep 0.1
    done
    return 1
}
# not_up SIDE LOG...: the failure message, with the end of each log
not_up() {
    local side=$1 f
    shift
    echo "serving peer: $side did not start (logs in $LOGS)"
    for f in "$@"; do tail -n 3 "$f" | sed "s|^|  $(basename "$f"): |"; done
    exit 1
}

# --- the servers (SIDE_NAME, SIDE_PORT, SIDE_PIDS: the pids whose CPU time a side counts)
declare -A SIDE_PORT SIDE_PIDS
SIDES=(tidepool llama-1slot "llama-${SLOTS}slot")

port=$(free_port) ctl=tcp://127.0.0.1:$(free_port) kv=tcp://127.0.0.1:$(free_port)
"$BUILD/bin/gateway" --host 127.0.0.1 --port "$port" --ctl-bind "$ctl" --model "$MODEL" \
    --stats-bind "" --state-db "" >"$LOGS/gateway.log" 2>&1 &
PIDS+=($!) && gw=$!
"$BUILD/bin/decode_worker" --role mixed --gateway "$ctl" --model "$MODEL" --worker-id mixed-0 \
    --kv-bind "$kv" --threads "$THREADS" >"$LOGS/mixed-0.log" 2>&1 &
PIDS+=($!)
SIDE_PORT[tidepool]=$port SIDE_PIDS[tidepool]="$gw $!"
start_llama() { # side slots
    local p
    p=$(free_port)
    "$ls_bin" -m "$MODEL" --host 127.0.0.1 --port "$p" -t "$THREADS" -tb "$THREADS" -np "$2" \
        -c $((512 * $2)) --no-webui >"$LOGS/$1.log" 2>&1 &
    PIDS+=($!)
    SIDE_PORT[$1]=$p SIDE_PIDS[$1]=$!
}
start_llama llama-1slot 1
start_llama "llama-${SLOTS}slot" "$SLOTS"
wait_up "http://127.0.0.1:${SIDE_PORT[tidepool]}/health" '"mixed":1' ${SIDE_PIDS[tidepool]} ||
    not_up tidepool "$LOGS/gateway.log" "$LOGS/mixed-0.log"
for s in llama-1slot "llama-${SLOTS}slot"; do
    wait_up "http://127.0.0.1:${SIDE_PORT[$s]}/health" ok ${SIDE_PIDS[$s]} ||
        not_up "$s" "$LOGS/$s.log"
done

cpu_ticks() { # pids...: user + system clock ticks of every thread
    local p t=0
    for p in "$@"; do t=$((t + $(awk '{print $14 + $15}' "/proc/$p/stat"))); done
    echo $t
}
HZ=$(getconf CLK_TCK)

# run SIDE C N OUT.json SEED ROUND: one bench run; appends "side c round tput tpot ttft out
# in ok fail cpu_us/tok"
run() {
    local side=$1 c=$2 n=$3 out=$4 seed=$5 round=$6 t0 t1
    [ "$SAME_PROMPTS" = 1 ] && seed=0
    t0=$(cpu_ticks ${SIDE_PIDS[$side]})
    "$BUILD/bin/tidepool-bench" --url "http://127.0.0.1:${SIDE_PORT[$side]}" --seed "$seed" \
        --num-prompts "$n" --concurrency "$c" --input-len "$WORDS" --output-len "$OUTPUT" \
        --ignore-eos --prompt-tokenizer "$MODEL" --no-progress --timeout-s 300 \
        --result-json "$out" >"$out.txt" 2>&1 &
    BENCH_PID=$! # waited for in the background: a TERM or INT runs the trap now, not after
    wait "$BENCH_PID"
    BENCH_PID=""
    t1=$(cpu_ticks ${SIDE_PIDS[$side]})
    python3 - "$out" "$side" "$c" $((t1 - t0)) "$HZ" "$round" <<'EOF' >>"$LOGS/runs.txt" || echo "$side $c $round FAILED" >>"$LOGS/runs.txt"
import json, sys
r = json.load(open(sys.argv[1]))
ticks, hz = int(sys.argv[4]), int(sys.argv[5])
out = r["total_output_tokens"]
print(sys.argv[2], sys.argv[3], sys.argv[6], r["output_throughput"], r["median_tpot_ms"],
      r["median_ttft_ms"],
      out, r["total_input_tokens"], r["completed"], r["failed"],
      ticks * 1e6 / hz / out if out else 0)
EOF
}

echo "serving peer: tidepool (gateway + 1 mixed worker, $THREADS thread) vs $ls_bin" \
     "(1 slot; $SLOTS slots), $(basename "$MODEL"), $WORDS-word prompts as token ids," \
     "$OUTPUT output tokens, streamed; medians of $REPS alternating runs (logs: $LOGS)"
: >"$LOGS/runs.txt"
for s in "${SIDES[@]}"; do # warm-up (first requests, page cache, allocator)
    run "$s" 4 8 "$LOGS/warmup.json" 1 0
done
: >"$LOGS/runs.txt"
for c in $STREAMS; do
    n=$((c * WAVES))
    [ $n -lt 32 ] && n=32
    for r in $(seq "$REPS"); do
        for s in "${SIDES[@]}"; do
            run "$s" "$c" "$n" "$LOGS/run-$s-c$c-r$r.json" $((1000 * c + r)) "$r"
        done
    done
done

python3 - "$LOGS/runs.txt" "$OUTPUT" "$WAVES" "${SIDES[@]}" <<'EOF'
import statistics, sys
path, output, waves, sides = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4:]
runs, bad = {}, []
for line in open(path):
    f = line.split()
    if len(f) < 4 or f[3] == "FAILED":
        bad.append("a run of %s at %s streams failed" % (f[0], f[1]))
        continue
    side, c, rnd = f[0], int(f[1]), int(f[2])
    tput, tpot, ttft, out, inp, ok, fail, cpu = map(float, f[3:])
    n = max(32, c * waves)
    if fail or ok != n or out != n * output:
        bad.append("%s at %d streams: %d ok, %d failed, %d output tokens (want %d)"
                   % (side, c, ok, fail, out, n * output))
    runs.setdefault(c, {}).setdefault(side, []).append((tput, tpot, ttft, inp, cpu, rnd))
med = statistics.median
print("  %-6s %-16s %12s %10s %10s %13s %10s" % ("streams", "server", "tok/s", "TPOT p50",
      "TTFT p50", "prompt tok", "CPU us/tok"))
for c in sorted(runs):
    row = runs[c]
    by_round = {} # every side of a round sent the same prompts
    for s, v in row.items():
        for r in v:
            by_round.setdefault(r[5], {})[s] = r[3]
    for rnd, inputs in sorted(by_round.items()):
        if len(set(inputs.values())) != 1:
            bad.append("%d streams, round %d: the sides saw different prompt tokens %s"
                       % (c, rnd, inputs))
    m = {}
    for s in sides:
        if s not in row:
            continue
        v = row[s]
        m[s] = (med(r[0] for r in v), med(r[1] for r in v), med(r[2] for r in v))
        print("  %-7d %-16s %12.1f %8.3f ms %7.2f ms %13d %10.1f   (tok/s: %s)"
              % (c, s, m[s][0], m[s][1], m[s][2], sum(r[3] for r in v), med(r[4] for r in v),
                 " ".join("%.0f" % r[0] for r in v)))
    peers = [s for s in m if s != "tidepool"]
    if "tidepool" in m and peers:
        best = max(peers, key=lambda s: m[s][0])
        t = m["tidepool"]
        print("  %-7d tidepool / %s (the best llama-server here): throughput %.2fx, TPOT p50"
              " %.2fx, TTFT p50 %.2fx shorter" % (c, best, t[0] / m[best][0],
                                                 m[best][1] / t[1] if t[1] else 0,
                                                 m[best][2] / t[2] if t[2] else 0))
for b in bad:
    print("  MISMATCH: " + b + " (the ratios above are not comparable)")
sys.exit(1 if bad else 0)
EOF
