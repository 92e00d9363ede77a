"""The cost of log-probabilities, A/B alternating (docs/api.md "Log-probabilities"): a
400-token greedy completion of "Once upon a time" with logprobs=5 vs without on one mixed
worker (--mtp-adaptive false), at mtp_depth 0 and 2; the median of 41 pairs of end-to-end
times (the order alternates, the first pair warms up). Not part of make bench (Python):
    python3 tests/bench/logprobs_cost.py
"""
import os
import statistics
import sys
import time
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "integration"))
from cluster import Cluster
REPS = 41
with Cluster(roles=("mixed",), worker_args=["--mtp-adaptive", "false"]) as c:
    for d in (0, 2):
        ratios = []
        for i in range(REPS + 1):
            t = {}
            for side in ("A", "B") if i % 2 == 0 else ("B", "A"):
                kw = {"logprobs": 5} if side == "B" else {}
                t0 = time.perf_counter()
                st, b = c.complete("Once upon a time", max_tokens=400, mtp_depth=d, **kw)
                t[side] = time.perf_counter() - t0
                assert st == 200
            if i:  # the first pair warms up
                ratios.append(t["B"] / t["A"])
        print("mtp_depth %d: logprobs=5 / none = x%.3f (median of %d alternating pairs)"
              % (d, statistics.median(ratios), REPS))
