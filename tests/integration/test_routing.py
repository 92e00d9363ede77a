"""Cache-aware routing (docs/prefix-cache.md "Cache-aware routing"), with 2 prefill workers
and 1 decode worker: prompts sharing a prefix land on the prefill worker whose prefix
cache holds it (exact hit counts per worker: the HEARTBEAT "pfx" summaries and the
gateway's belief), with greedy texts identical to least-loaded routing, which sends
them all to one worker; a prefill worker restarted (its cache lost) costs a miss, never a
wrong answer.

Placement is made deterministic by stopping both prefill workers (SIGSTOP) while the two
seed prompts are routed: the first goes to one worker, and the second, with the first
still pending there, to the other; then both resume. The prompts are token ids (no BOS
added), so the hits are known exactly: with MTP depth 2 a block's key holds the 2 tokens
after it, so a 50-token prompt caches blocks 0..2 (48 tokens) and a 53-token prompt that
extends it finds those 48."""

import os
import random
import signal
import subprocess
import sys
import threading
import time
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cluster import BIN, Cluster  # noqa: E402
from test_e2e import worker_figures  # noqa: E402

BS = 16
MAX_TOKENS = 12
GW = ["--dead-after-ms", "20000"]  # heartbeats stop while the prefill workers are stopped
rng = random.Random(14)
A = [rng.randrange(3, 500) for _ in range(50)]
B = [rng.randrange(3, 500) for _ in range(50)]
FOLLOW = [(A + [rng.randrange(3, 500) for _ in range(3)],
           B + [rng.randrange(3, 500) for _ in range(3)]) for _ in range(3)]
AFTER = [B + [rng.randrange(3, 500) for _ in range(3)] for _ in range(2)]
HIT = 48  # a follow-up's cached tokens: blocks 0..2 of its 50-token seed


def complete(c, prompt):
    status, body = c.request("POST", "/v1/completions",
                             {"model": "stories260K", "prompt": prompt,
                              "max_tokens": MAX_TOKENS, "temperature": 0})
    assert status == 200, body
    assert body["usage"]["prompt_tokens"] == len(prompt), body
    return body["choices"][0]["text"]


def prefill_counters(c, want_queries, timeout=10):
    """{worker: (queries, hits)} of the prefill workers once their queries sum to
    want_queries (heartbeats lag)."""
    deadline = time.time() + timeout
    while True:
        f = {k: (w["prefix_cache_queries"], w["prefix_cache_hits"])
             for k, w in worker_figures(c).items() if k.startswith("prefill")}
        if sum(q for q, _ in f.values()) == want_queries or time.time() > deadline:
            return f
        time.sleep(0.05)


def wait_assigned(c, n_busy, timeout=10):
    """The prefill workers with a request assigned, once n_busy of them have one."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        busy = [k for k, w in worker_figures(c).items()
                if k.startswith("prefill") and w["assigned"] > 0]
        if len(busy) == n_busy:
            return busy
        time.sleep(0.02)
    raise AssertionError("not %d prefill workers busy: %r" % (n_busy, worker_figures(c)))


class Routing(unittest.TestCase):
    def seed(self, c):
        """Route A, then B, with both prefill workers stopped; returns (A's worker, B's)
        and their texts."""
        names = [n for n in c.worker_names() if n.startswith("prefill")]
        deadline = time.time() + 30
        while len([k for k, w in worker_figures(c).items() if w["last_seen_ms_ago"] < 1000]) < 3:
            self.assertLess(time.time(), deadline, "workers not registered")
            time.sleep(0.05)
        for n in names:
            os.kill(c.procs[n].pid, signal.SIGSTOP)
        out = {}
        try:
            ta = threading.Thread(target=lambda: out.__setitem__("A", complete(c, A)))
            ta.start()
            wa = wait_assigned(c, 1)[0]
            tb = threading.Thread(target=lambda: out.__setitem__("B", complete(c, B)))
            tb.start()
            busy = wait_assigned(c, 2)
        finally:
            for n in names:
                os.kill(c.procs[n].pid, signal.SIGCONT)
        ta.join(60)
        tb.join(60)
        wb = [n for n in busy if n != wa][0]
        self.assertEqual(prefill_counters(c, 100), {wa: (50, 0), wb: (50, 0)})
        return wa, wb, out["A"], out["B"]

    def run_mode(self, mode):
        with Cluster(roles=["prefill", "prefill", "decode"],
                     gateway_args=GW + ["--routing", mode]) as c:
            status, models = c.request("GET", "/v1/models")
            self.assertEqual(models["data"][0]["mtp_depth"], 2)  # the hits assume depth 2
            wa, wb, ta, tb = self.seed(c)
            texts = [ta, tb]
            before = prefill_counters(c, 100)
            q = 100
            per = []
            for fa, fb in FOLLOW:
                for p in (fa, fb):
                    texts.append(complete(c, p))
                    q += len(p)
                    now = prefill_counters(c, q)
                    per.append({k: (now[k][0] - before[k][0], now[k][1] - before[k][1])
                                for k in now})
                    before = now
            return c, wa, wb, texts, per

    def test_cache_aware_places_by_prefix(self):
        """Every follow-up goes where its seed was computed and hits its 48 tokens; texts
        identical to least-loaded routing, which sends them all to one worker (a B
        follow-up misses there once)."""
        c, wa, wb, texts, per = self.run_mode("cache-aware")
        for i, d in enumerate(per):
            want = wa if i % 2 == 0 else wb
            other = wb if want == wa else wa
            self.assertEqual(d[want], (53, HIT), (i, per))
            self.assertEqual(d[other], (0, 0), (i, per))
        c2, la, lb, texts_ll, per_ll = self.run_mode("least-loaded")
        self.assertEqual(texts_ll, texts)
        # least-loaded: both workers idle, every follow-up goes to one of them
        hits_ll = sum(h for d in per_ll for _, h in d.values())
        self.assertLess(hits_ll, 6 * HIT)
        self.assertEqual(len({k for d in per_ll for k, (q, _) in d.items() if q}), 1, per_ll)

    def test_restart_costs_a_miss(self):
        """B's worker restarted: its cache (and the gateway's belief of it) are gone, so
        the next B follow-up computes everything (0 hits on either worker) and its text
        is the reference's; the one after hits where it went."""
        with Cluster(roles=["prefill", "decode"], worker_args=["--prefix-cache", "false"]) as ref:
            want = [complete(ref, p) for p in AFTER]
        with Cluster(roles=["prefill", "prefill", "decode"], gateway_args=GW) as c:
            wa, wb, _, _ = self.seed(c)
            self.assertEqual(complete(c, FOLLOW[0][1]), complete(c, FOLLOW[0][1]))
            q = 100 + 2 * 53
            before = prefill_counters(c, q)
            self.assertEqual(before[wb], (50 + 2 * 53, 2 * HIT))
            c.kill(wb)
            c.start_worker(wb, "prefill")
            deadline = time.time() + 30
            while worker_figures(c).get(wb, {}).get("pid") != c.procs[wb].pid:
                self.assertLess(time.time(), deadline, "restarted worker not registered")
                time.sleep(0.05)
            got = complete(c, AFTER[0])
            now = prefill_counters(c, q - before[wb][0] + 53)
            self.assertEqual(got, want[0])
            self.assertEqual(sum(h for _, h in now.values()) - before[wa][1], 0, now)
            q = sum(x for x, _ in now.values())
            self.assertEqual(complete(c, AFTER[1]), want[1])
            after = prefill_counters(c, q + 53)
            self.assertEqual(sum(h for _, h in after.values()) - before[wa][1], HIT, after)
            # routed back where the miss was computed: the other worker saw nothing more
            moved = [k for k in after if after[k][0] != now[k][0]]
            self.assertEqual(len(moved), 1, (now, after))

    def test_bad_routing_flag(self):
        """--routing takes cache-aware or least-loaded; anything else exits 2, naming it."""
        for argv, needle in ((["--routing", "round-robin"], "invalid value 'round-robin' for "
                              "routing: want cache-aware or least-loaded"),
                             (["--routing-load-weight", "-1"], "routing-load-weight")):
            p = subprocess.run([os.path.join(BIN, "gateway")] + argv, capture_output=True,
                               text=True, timeout=30)
            self.assertEqual(p.returncode, 2, p.stderr)
            self.assertIn(needle, p.stderr)


if __name__ == "__main__":
    unittest.main()
