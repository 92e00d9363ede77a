#!/usr/bin/env python3
"""Cache-aware routing A/B (docs/prefix-cache.md "Cache-aware routing"): the same
tidepool-bench workload against a fresh local cluster of 2 prefill workers and 1 decode
worker per run, the gateway started with --routing cache-aware and --routing least-loaded
alternately (cache-aware, least-loaded, cache-aware, ...); prints per run the prefix cache
hit rate (prefix_cache_hits / prefix_cache_queries over both prefill workers), TTFT p50 /
p99 and the prompt tokens computed, then the medians and the cache-aware / least-loaded
ratios.

  tools/bench/routing-ab.py [--reps 3] [--prefill-arg=--kv-blocks=96 ...]
      -- [tidepool-bench flags]   (default: the shared-prefix workload below)

The default workload: 16 groups of prompts, each group sharing a prefix of 60 words
(about 140 tokens: SGLang's generated-shared-prefix), 10 words of their own, 160 prompts,
4 at a time; the prefill workers' KV caches hold 96 blocks (1536 tokens) each: about
two thirds of the groups' prefixes, so where a prompt goes decides whether its prefix is
still cached (the regime cache-aware routing is for: a working set larger than one
worker's cache, not larger than all of theirs). Multi-turn, caches at their default size:

  tools/bench/routing-ab.py --prefill-arg=--kv-blocks=0 -- --workload multi-turn \\
      --endpoint /v1/chat/completions --conversations 8 --turns 5 --system-len 60 \\
      --input-len 8 --output-len 20 --seed 1

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

DEFAULT_BENCH = ["--workload", "shared-prefix", "--prefix-groups", "16", "--prefix-len", "60",
                 "--input-len", "10", "--output-len", "16", "--num-prompts", "160",
                 "--concurrency", "4", "--seed", "1"]
DEFAULT_PREFILL = ["--kv-blocks", "96"]
MODES = ("cache-aware", "least-loaded")


def metric_sum(text, family, worker_prefix=None):
    total = 0.0
    for line in text.splitlines():
        m = re.match(r"^tidepool[:_]%s(\{[^}]*\})? ([0-9.e+-]+)$" % re.escape(family), line)
        if m and (worker_prefix is None or 'worker="%s' % worker_prefix in (m.group(1) or "")):
            total += float(m.group(2))
    return total


class RoleCluster(Cluster):
    """A Cluster whose prefill workers get flags of their own."""

    def __init__(self, prefill_args, **kw):
        self.prefill_args = list(prefill_args)
        super().__init__(**kw)

    def start_worker(self, name, role, extra=()):
        return super().start_worker(name, role, list(extra) +
                                    (self.prefill_args if role == "prefill" else []))


def wait_registered(c, n, timeout=30):
    deadline = time.time() + timeout
    while time.time() < deadline:
        status, body = c.request("GET", "/workers")
        if status == 200 and len(body["workers"]) == n:
            return
        time.sleep(0.1)
    sys.exit("workers did not register:\n" + c.all_logs())


def one_run(mode, prefill_args, worker_args, bench_args):
    args = ["--heartbeat-ms", "100"] + list(worker_args)
    with RoleCluster(prefill_args, roles=("prefill", "prefill", "decode"), worker_args=args,
                     gateway_args=["--routing", mode]) as c:
        wait_registered(c, 3)
        _, before = c.request("GET", "/metrics")
        out = os.path.join(tempfile.mkdtemp(prefix="routing-ab-"), "run.json")
        p = subprocess.run([os.path.join(BIN, "tidepool-bench"), "--url",
                            "http://127.0.0.1:%d" % c.port, "--no-progress", "--result-json",
                            out] + bench_args, capture_output=True, text=True, timeout=1800)
        if p.returncode != 0:
            sys.exit("tidepool-bench failed:\n" + p.stdout + p.stderr)
        with open(out) as f:
            res = json.load(f)
        # the heartbeats carry the counters: wait until the queries add up and two reads agree
        want = res["total_input_tokens"]
        keys = ("prefix_cache_queries_total", "prefix_cache_hits_total",
                "worker_prompt_tokens_total")
        after = None
        for _ in range(100):
            time.sleep(0.3)
            _, now = c.request("GET", "/metrics")
            if after and all(metric_sum(now, k) == metric_sum(after, k) for k in keys) and \
                    metric_sum(now, keys[0]) - metric_sum(before, keys[0]) == want:
                break
            after = now

        def delta(fam, w=None):
            return metric_sum(after, fam, w) - metric_sum(before, fam, w)

        return {"ttft_p50": res["median_ttft_ms"], "ttft_p99": res["p99_ttft_ms"],
                "queries": delta(keys[0]), "hits": delta(keys[1]),
                "computed": delta(keys[2]),
                "split": tuple(int(delta(keys[0], "prefill-%d" % i)) for i in (0, 1)),
                "completed": res["completed"], "failed": res["failed"]}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--prefill-arg", action="append", default=None,
                    help="one more prefill worker flag (repeat; default --kv-blocks=96)")
    ap.add_argument("--worker-arg", action="append", default=[],
                    help="one more flag for every worker (repeat)")
    ap.add_argument("bench", nargs="*", help="tidepool-bench flags (after --)")
    a = ap.parse_args()
    bench_args = a.bench or DEFAULT_BENCH
    prefill_args = DEFAULT_PREFILL if a.prefill_arg is None else a.prefill_arg
    runs = {m: [] for m in MODES}
    for rep in range(a.reps):
        for mode in MODES:
            r = one_run(mode, prefill_args, a.worker_arg, bench_args)
            runs[mode].append(r)
            print("rep %d %-12s hit rate %.3f (%6d / %6d tokens, split %6d / %6d)  ttft p50 "
                  "%8.2f ms p99 %8.2f ms  computed %6d tok  (%d ok, %d failed)" %
                  (rep, mode, r["hits"] / r["queries"] if r["queries"] else 0, r["hits"],
                   r["queries"], r["split"][0], r["split"][1], r["ttft_p50"], r["ttft_p99"],
                   r["computed"], r["completed"], r["failed"]), flush=True)
    for r in runs.values():
        for x in r:
            x["rate"] = x["hits"] / x["queries"] if x["queries"] else 0.0
    med = {m: {k: statistics.median(x[k] for x in runs[m])
               for k in ("rate", "ttft_p50", "ttft_p99", "computed")} for m in MODES}
    for m in MODES:
        print("median %-12s: hit rate %.3f, ttft p50 %.2f ms, p99 %.2f ms, computed %d tokens" %
              (m, med[m]["rate"], med[m]["ttft_p50"], med[m]["ttft_p99"], med[m]["computed"]))
    ca, ll = med["cache-aware"], med["least-loaded"]
    pairs = list(zip(runs["cache-aware"], runs["least-loaded"]))
    print("cache-aware / least-loaded: hit rate %.3f (per pair %s), ttft p99 %.3f (per pair "
          "%s), ttft p50 %.3f, prompt tokens computed %.3f" %
          (ca["rate"] / ll["rate"] if ll["rate"] else float("inf"),
           " ".join("%.2f" % (x["rate"] / y["rate"]) if y["rate"] else "inf" for x, y in pairs),
           ca["ttft_p99"] / ll["ttft_p99"],
           " ".join("%.2f" % (x["ttft_p99"] / y["ttft_p99"]) for x, y in pairs),
           ca["ttft_p50"] / ll["ttft_p50"], ca["computed"] / ll["computed"]))


if __name__ == "__main__":
    main()
