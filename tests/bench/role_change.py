"""Decode -> prefill role changes under load (docs/scheduler.md "Live role changes",
"Role-change latency"): a gateway, 1 prefill and 2 decode EMULATED workers (the
tidal-bench's engine: a100-llama3-8b:dilate=10, --threads 1, --max-seqs 48,
--max-batch-tokens 1024), tidepool-bench's phase-shift load scaled to 3 of its 8 workers,
and every PERIOD_S one decode worker ordered to prefill (POST /workers/{id}/role), then back
to decode. Prints each change's duration as the worker measures it (ROLE received ->
switched: HEARTBEAT role_us, /workers last_role_change_ms) and as the gateway does (ROLE sent
-> registered again: its "done in" log line), the time until the last sequence the worker
moved had landed (its log line "every move and incoming transfer over"), and the median and
p90 of the decode -> prefill ones. Not part of make bench (Python, about 2.5 minutes):
    python3 tests/bench/role_change.py            # env: RATE DECODE_RATE DURATION_S PERIOD_S
Every figure is EMULATED (docs/scheduler.md "Emulated workers")."""
import json
import os
import re
import statistics
import subprocess
import sys
import time
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "integration"))
from cluster import BIN, Cluster  # noqa: E402

RATE = float(os.environ.get("RATE", "6"))           # prefill-heavy phases, req/s
DECODE_RATE = float(os.environ.get("DECODE_RATE", "15"))  # decode-heavy phases, req/s
DURATION_S = float(os.environ.get("DURATION_S", "120"))
PERIOD_S = float(os.environ.get("PERIOD_S", "5"))   # between two orders
PRESET = os.environ.get("PRESET", "a100-llama3-8b:dilate=10")


def workers(c):
    st, body = c.request("GET", "/workers")
    assert st == 200, body
    return {w["id"]: w for w in body["workers"]}


def wait_changed(c, wid, role, n_before, timeout=30):
    """Wait until wid is ready in role with more role changes than n_before; its figures."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        w = workers(c).get(wid, {})
        if w.get("role") == role and w.get("state") == "ready" and \
                w.get("role_changes", 0) > n_before:
            return w
        time.sleep(0.02)
    raise AssertionError("%s did not reach %s" % (wid, role))


def pct(v, q):
    v = sorted(v)
    return v[min(len(v) - 1, int(q * len(v)))]


def main():
    wargs = ["--emulate", PRESET, "--threads", "1", "--max-seqs", "48",
             "--max-batch-tokens", "1024", "--log-level", "info"]
    with Cluster(roles=("prefill", "decode", "decode"), worker_args=wargs,
                 gateway_args=["--dead-after-ms", "10000", "--log-level", "info"]) as c:
        bench = subprocess.Popen(
            [os.path.join(BIN, "tidepool-bench"), "--url", "http://127.0.0.1:%d" % c.port,
             "--workload", "phase-shift", "--phase-seconds", "30", "--request-rate", str(RATE),
             "--decode-rate", str(DECODE_RATE), "--duration-s", str(DURATION_S),
             "--num-prompts", "100000", "--input-len-range", "95:125",
             "--output-len-range", "20:60", "--phase-short-len", "8", "--ignore-eos",
             "--seed", "1", "--timeout-s", "60", "--no-progress"],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        d2p, p2d = [], []
        t_end = time.time() + DURATION_S
        time.sleep(PERIOD_S)
        while time.time() < t_end - PERIOD_S:
            figs = workers(c)
            # the decode worker running the most sequences leaves the role
            dec = sorted((w for w in figs.values() if w["role"] == "decode"),
                         key=lambda w: -w["running"])
            if len(dec) < 2:
                time.sleep(0.2)
                continue
            w = dec[0]
            n0 = w.get("role_changes", 0)
            st, body = c.request("POST", "/workers/%s/role" % w["id"], {"role": "prefill"})
            assert st == 202, body
            got = wait_changed(c, w["id"], "prefill", n0)
            d2p.append(got["last_role_change_ms"])
            print("decode -> prefill %s: %d running, %.1f ms" % (w["id"], w["running"],
                                                                 d2p[-1]), flush=True)
            time.sleep(PERIOD_S / 2)
            st, body = c.request("POST", "/workers/%s/role" % w["id"], {"role": "decode"})
            assert st == 202, body
            got = wait_changed(c, w["id"], "decode", n0 + 1)
            p2d.append(got["last_role_change_ms"])
            print("prefill -> decode %s: %.1f ms" % (w["id"], p2d[-1]), flush=True)
            time.sleep(PERIOD_S / 2)
        out, _ = bench.communicate(timeout=DURATION_S + 120)
        figs = workers(c)
        gw = [float(x) for x in re.findall(r"decode -> prefill done in ([0-9.]+) ms",
                                           c.log("gateway"))]
        # the moves and the KV still arriving, over after the switch (decode role left behind)
        tail = [float(x) for n in ("decode-1", "decode-2") for x in re.findall(
            r"every move and incoming transfer over ([0-9.]+) ms after the order", c.log(n))]
        print(out[-1500:])
        print(json.dumps({k: {f: v.get(f) for f in ("migrated_out", "migrations_failed",
                                                     "migrated_in", "migration_ms_mean",
                                                     "kv_blocks_free", "kv_blocks_total")}
                          for k, v in figs.items()}))
        for name, v in (("decode -> prefill (worker)", d2p),
                        ("decode -> prefill (gateway)", gw),
                        ("decode -> prefill: last move over (worker)", tail),
                        ("prefill -> decode (worker)", p2d)):
            if v:
                print("%s: n %d, median %.1f ms, p90 %.1f ms, max %.1f ms"
                      % (name, len(v), statistics.median(v), pct(v, 0.9), max(v)))
        if os.environ.get("KEEP"):
            import shutil
            shutil.copytree(c.tmp, os.environ["KEEP"], dirs_exist_ok=True)
            print("logs in", os.environ["KEEP"])


if __name__ == "__main__":
    main()
