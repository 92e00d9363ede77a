#!/usr/bin/env python3
"""Prefix caching A/B (docs/prefix-cache.md): the same tidepool-bench workload against a
fresh local cluster with the prefix cache on and off (--prefix-cache false), alternating
on, off, on, off, ...; prints per run TTFT p50/p99 and E2EL p50 (ms), the prompt tokens the
workers computed (worker_prompt_tokens_total), the KV bytes sent P->D (with the cache on,
only the blocks the decode worker lacked), and the prefix cache hit rate, then the medians
and the on/off ratios.

  tools/bench/prefix-ab.py [--reps 3] [--roles prefill,decode] [--worker-arg=--emulate ...]
      -- [tidepool-bench flags]   (default: the multi-turn chat workload below)

Runs from the repository root with the build in build/ (TIDEPOOL_BUILD for another)."""

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "tests", "integration"))
from cluster import BIN, Cluster  # noqa: E402

DEFAULT_BENCH = ["--workload", "multi-turn", "--endpoint", "/v1/chat/completions",
                 "--conversations", "4", "--turns", "5", "--system-len", "60",
                 "--input-len", "8", "--output-len", "20", "--seed", "1"]


def metric_sum(text, family):
    total = 0.0
    for line in text.splitlines():
        m = re.match(r"^tidepool[:_]%s(\{[^}]*\})? ([0-9.e+-]+)$" % re.escape(family), line)
        if m:
            total += float(m.group(2))
    return total


def one_run(on, roles, worker_args, bench_args):
    args = ["--heartbeat-ms", "100"] + list(worker_args) + (
        [] if on else ["--prefix-cache", "false"])
    with Cluster(roles=roles, worker_args=args) as c:
        _, before = c.request("GET", "/metrics")
        out = os.path.join(tempfile.mkdtemp(prefix="prefix-ab-"), "run.json")
        p = subprocess.run([os.path.join(BIN, "tidepool-bench"), "--url",
                            "http://127.0.0.1:%d" % c.port, "--no-progress", "--result-json",
                            out] + bench_args, capture_output=True, text=True, timeout=1800)
        if p.returncode != 0:
            sys.exit("tidepool-bench failed:\n" + p.stdout + p.stderr)
        with open(out) as f:
            res = json.load(f)
        # the heartbeats (every 100 ms) carry the workers' counters: wait until the prompt
        # tokens looked up (on) or computed (off) add up and two reads agree
        want, family = res["total_input_tokens"], (
            "prefix_cache_queries_total" if on else "worker_prompt_tokens_total")
        after = None
        for _ in range(100):
            time.sleep(0.3)
            _, now = c.request("GET", "/metrics")
            keys = ("worker_prompt_tokens_total", "worker_kv_transfer_bytes_total",
                    "prefix_cache_hits_total", "prefix_cache_queries_total")
            if after and all(metric_sum(now, k) == metric_sum(after, k) for k in keys) and \
                    metric_sum(now, family) - metric_sum(before, family) == want:
                break
            after = now

        def delta(fam):
            return metric_sum(after, fam) - metric_sum(before, fam)

        return {"ttft_p50": res["median_ttft_ms"], "ttft_p99": res["p99_ttft_ms"],
                "e2el_p50": res["median_e2el_ms"],
                "computed": delta("worker_prompt_tokens_total"),
                "kv_bytes": delta("worker_kv_transfer_bytes_total") / 2,  # sent + received
                "queries": delta("prefix_cache_queries_total"),
                "hits": delta("prefix_cache_hits_total"),
                "completed": res["completed"], "failed": res["failed"],
                "input_tokens": res["total_input_tokens"]}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--roles", default="prefill,decode")
    ap.add_argument("--worker-arg", action="append", default=[],
                    help="one more worker flag (repeat; --worker-arg=--emulate=...)")
    ap.add_argument("bench", nargs="*", help="tidepool-bench flags (after --)")
    a = ap.parse_args()
    bench_args = a.bench or DEFAULT_BENCH
    roles = tuple(a.roles.split(","))
    runs = {True: [], False: []}
    for rep in range(a.reps):
        for on in (True, False):
            r = one_run(on, roles, a.worker_arg, bench_args)
            runs[on].append(r)
            print("rep %d cache %-3s ttft p50 %8.2f ms p99 %8.2f ms  e2el p50 %8.2f ms  "
                  "computed %6d tok  kv %9d B  hits %6d / %6d  (%d ok, %d failed)" %
                  (rep, "on" if on else "off", r["ttft_p50"], r["ttft_p99"], r["e2el_p50"],
                   r["computed"],
                   r["kv_bytes"], r["hits"], r["queries"], r["completed"], r["failed"]),
                  flush=True)
    med = {on: {k: statistics.median(x[k] for x in runs[on]) for k in runs[on][0]}
           for on in runs}
    print("median on : ttft p50 %.2f ms, computed %d tokens" %
          (med[True]["ttft_p50"], med[True]["computed"]))
    print("median off: ttft p50 %.2f ms, computed %d tokens" %
          (med[False]["ttft_p50"], med[False]["computed"]))
    ratios = [x["ttft_p50"] / y["ttft_p50"] for x, y in zip(runs[True], runs[False])]
    e2el = [x["e2el_p50"] / y["e2el_p50"] for x, y in zip(runs[True], runs[False])]
    print("on/off ratios: ttft p50 %.3f (per pair %s), e2el p50 %.3f (per pair %s), prompt "
          "tokens computed %.3f, KV bytes P->D %.3f; hit rate %.3f" %
          (med[True]["ttft_p50"] / med[False]["ttft_p50"],
           " ".join("%.3f" % r for r in ratios),
           statistics.median(e2el), " ".join("%.3f" % r for r in e2el),
           med[True]["computed"] / med[False]["computed"],
           med[True]["kv_bytes"] / med[False]["kv_bytes"] if med[False]["kv_bytes"] else 0,
           med[True]["hits"] / med[True]["queries"] if med[True]["queries"] else 0))


if __name__ == "__main__":
    main()
