"""KV blocks on demand with preemption (issue 14 item 1, docs/kvtransfer.md "Reservations").

A decode worker takes KV blocks as its sequences generate instead of reserving the worst
case (prompt + max_tokens - 1, the whole context when max_tokens is unset), so a cache sized
for 16 worst-case sequences runs many more at once; when blocks run out it preempts (offline
first, then the newest online) and the gateway re-runs the sequence by recomputation from
prompt + tokens so far. Every greedy text must equal the one of a cluster that never
preempts, seeded sampling must go on unchanged, the preemptions are counted (/workers,
/metrics) and no block is leaked."""

import json
import os
import re
import sys
import threading
import time
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cluster import Cluster  # noqa: E402
from test_e2e import wait_kv_free, worker_figures  # noqa: E402

# stories260K (n_ctx 512) never ends a story with EOS here: with max_tokens unset every
# request generates to the context's end, its worst case
PROMPTS = ["Once upon a time", "Tom and Sue went to the", "The cat", "A little dog",
           "Lily wanted", "One day, Ben", "The sun was", "Mom said"]
N_CTX = 512
BS = 16
WORST_BLOCKS = N_CTX // BS     # one sequence's worst case with max_tokens unset
SMALL_CACHE = 16 * WORST_BLOCKS  # room for 16 worst-case sequences
# heartbeats every 50 ms (the peak running count is read from them); a worker busy in a long
# recomputing prefill (a sanitizer build on a loaded machine) must not be declared dead
GW = ["--heartbeat-ms", "50", "--dead-after-ms", "10000"]
QUICK_GW = ["--heartbeat-ms", "50", "--dead-after-ms", "3000"]  # killed workers found


def run_concurrent(c, bodies, poll_worker=None):
    """POST every body at once; returns ([(status, body)], peak running of poll_worker as
    its heartbeats reported it while they ran)."""
    out = [None] * len(bodies)

    def one(i):
        try:
            out[i] = c.request("POST", "/v1/completions", bodies[i], timeout=300)
        except Exception as e:  # noqa: BLE001
            out[i] = ("exception", repr(e))

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(bodies))]
    for t in threads:
        t.start()
    peak = 0
    while any(t.is_alive() for t in threads):
        if poll_worker:
            w = worker_figures(c).get(poll_worker)
            if w:
                peak = max(peak, w["running"])
        time.sleep(0.03)
    for t in threads:
        t.join()
    return out, peak


def body(prompt, **kw):
    b = {"model": "stories260K", "prompt": prompt, "temperature": 0}
    b.update(kw)
    return b


def texts(results):
    got = []
    for status, b in results:
        assert status == 200, (status, b)
        got.append((b["choices"][0]["text"], b["choices"][0]["finish_reason"],
                    b["usage"]["completion_tokens"]))
    return got


def metric_value(text, name, worker):
    for line in text.splitlines():
        m = re.match(r'^([\w:]+)\{([^}]*)\} (\S+)$', line)
        if m and m.group(1).endswith(name) and ('worker="%s"' % worker) in m.group(2):
            return float(m.group(3))
    return None


def reference(bodies_by_key, worker_args=()):
    """The texts of a cluster with room for everything (the default cache: 64 worst-case
    sequences), one request per distinct body."""
    keys = list(bodies_by_key)
    with Cluster(roles=("prefill", "decode"), worker_args=list(worker_args)) as c:
        res, _ = run_concurrent(c, [bodies_by_key[k] for k in keys])
        return dict(zip(keys, texts(res)))


class OnDemand(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.ref = reference({p: body(p) for p in PROMPTS})

    def check_run(self, roles, n_requests, kv_blocks, decode_name, min_peak):
        prompts = (PROMPTS * (n_requests // len(PROMPTS) + 1))[:n_requests]
        with Cluster(roles=roles, gateway_args=GW,
                     worker_args=["--kv-blocks", str(kv_blocks)]) as c:
            time.sleep(0.3)
            base = {k: w["kv_blocks_free"] for k, w in worker_figures(c).items()}
            self.assertEqual(base[decode_name], kv_blocks)
            res, peak = run_concurrent(c, [body(p) for p in prompts], poll_worker=decode_name)
            got = texts(res)
            for i, p in enumerate(prompts):
                self.assertEqual(got[i], self.ref[p], "request %d (%r)" % (i, p))
                self.assertEqual(got[i][1], "length")
            # no block leaked: every worker back to all its blocks free
            figs = wait_kv_free(c, base)
            n_pre = figs[decode_name]["num_preemptions"]
            self.assertGreater(n_pre, 0)
            self.assertGreaterEqual(peak, min_peak)
            status, text = c.request("GET", "/metrics")
            self.assertEqual(status, 200)
            self.assertEqual(metric_value(text, "num_preemptions_total", decode_name), n_pre)
            # a preemption is load, not a failure: nothing failed or was retried as one
            self.assertNotIn("request failed", c.log("gateway"))
            log = c.log(decode_name)
            self.assertEqual(len(re.findall(r"preempted \((?:online|offline)", log)), n_pre)
            return peak, n_pre

    def test_16_worst_case_cache_runs_3x_as_many(self):
        # worst-case reservations admitted SMALL_CACHE / WORST_BLOCKS = 16 at once; on demand,
        # 64 start at once (max-seqs 64) and preempt as they grow to the whole context
        peak, n_pre = self.check_run(("prefill", "decode"), 64, SMALL_CACHE, "decode-1",
                                     min_peak=3 * 16)
        print("disaggregated: peak running %d (worst case allowed 16), %d preemptions"
              % (peak, n_pre), file=sys.stderr)

    def test_mixed_worker_preempts_its_local_sequences(self):
        # a mixed worker's own prefill hands its sequences over locally: the same rule
        peak, n_pre = self.check_run(("mixed",), 24, 8 * WORST_BLOCKS, "mixed-0",
                                     min_peak=3 * 8)
        print("mixed: peak running %d (worst case allowed 8), %d preemptions" % (peak, n_pre),
              file=sys.stderr)


class Tiers(unittest.TestCase):
    def test_offline_sequences_are_preempted_first(self):
        # offline (service_tier flex) requests start first and fill the cache; online ones
        # come in and grow: the decode worker frees offline sequences before any online one,
        # and every text of both tiers is exact
        ref = reference({p: body(p, max_tokens=300) for p in PROMPTS})
        with Cluster(roles=("prefill", "decode"), gateway_args=GW,
                     worker_args=["--kv-blocks", "96", "--debug-step-delay-ms", "2"]) as c:
            time.sleep(0.3)
            base = {k: w["kv_blocks_free"] for k, w in worker_figures(c).items()}
            bodies = [body(p, max_tokens=300, service_tier="flex") for p in PROMPTS]
            out = [None] * 16

            def one(i, b):
                out[i] = c.request("POST", "/v1/completions", b, timeout=300)

            threads = [threading.Thread(target=one, args=(i, b)) for i, b in enumerate(bodies)]
            for t in threads:
                t.start()
            time.sleep(0.3)
            online = [threading.Thread(target=one, args=(8 + i, body(p, max_tokens=300)))
                      for i, p in enumerate(PROMPTS)]
            for t in online:
                t.start()
            for t in threads + online:
                t.join(300)
            got = texts(out)
            for i in range(16):
                self.assertEqual(got[i], ref[PROMPTS[i % 8]], "request %d" % i)
            wait_kv_free(c, base)
            log = c.log("decode-1")
            pre = re.findall(r"preempted \((online|offline), .*?; (\d+) offline running\)", log)
            tiers = [tier for tier, n in pre]
            print("preempted: %d offline, %d online" % (tiers.count("offline"),
                                                        tiers.count("online")), file=sys.stderr)
            self.assertIn("offline", tiers)
            for tier, n_off in pre:  # an online one only when no offline one was left
                if tier == "online":
                    self.assertEqual(n_off, "0")


class Seeded(unittest.TestCase):
    def test_seeded_sampling_goes_on_across_preemption(self):
        # plain decoding (MTP off): a seeded request's text depends on its seed alone, so a
        # preempted and recomputed one reads as if it had never been interrupted
        args = ["--mtp-depth", "0"]
        bodies = {(p, s): body(p, temperature=0.9, seed=s, max_tokens=300)
                  for p in PROMPTS[:4] for s in (1, 2, 3, 4)}
        ref = reference(bodies, args)
        with Cluster(roles=("prefill", "decode"), gateway_args=GW,
                     worker_args=args + ["--kv-blocks", "160"]) as c:
            time.sleep(0.3)
            base = {k: w["kv_blocks_free"] for k, w in worker_figures(c).items()}
            keys = list(bodies)
            res, _ = run_concurrent(c, [bodies[k] for k in keys])
            got = texts(res)
            for k, g in zip(keys, got):
                self.assertEqual(g, ref[k], repr(k))
            figs = wait_kv_free(c, base)
            self.assertGreater(figs["decode-1"]["num_preemptions"], 0)


class Limits(unittest.TestCase):
    def test_worst_case_beyond_the_cache_is_admitted(self):
        # 4 blocks * 16 = 64 slots. max_tokens 200 used to be refused (400); it now runs
        # until its sequence fills the whole cache, then ends as at the context's end
        # ("length") with exactly the tokens a cache of 64 slots holds
        with Cluster(roles=("prefill", "decode"), gateway_args=GW,
                     worker_args=["--kv-blocks", "4"]) as c:
            time.sleep(0.3)
            base = {k: w["kv_blocks_free"] for k, w in worker_figures(c).items()}
            status, b = c.complete("Once upon a time", max_tokens=200)
            self.assertEqual(status, 200, b)
            n_prompt = b["usage"]["prompt_tokens"]
            n_gen = b["usage"]["completion_tokens"]
            # the last token needs no KV slot: prompt + generated = slots + 1
            self.assertEqual(n_prompt + n_gen, 4 * BS + 1)
            self.assertEqual(b["choices"][0]["finish_reason"], "length")
            text = b["choices"][0]["text"]
            # a prompt that alone cannot fit is still refused, at once, with a clear error
            status, e = c.complete("Once upon a time " * 20, max_tokens=1)
            self.assertEqual(status, 400, e)
            self.assertEqual(e["error"]["code"], "kv_cache_capacity_exceeded")
            self.assertEqual(e["error"]["type"], "invalid_request_error")
            self.assertIn("largest decode worker holds 64 tokens", e["error"]["message"])
            wait_kv_free(c, base)
            deadline = time.time() + 5  # (heartbeats lag)
            while worker_figures(c)["decode-1"]["num_preemptions"] != 1 and time.time() < deadline:
                time.sleep(0.05)
            self.assertEqual(worker_figures(c)["decode-1"]["num_preemptions"], 1)
        with Cluster(roles=("prefill", "decode")) as c:  # the same tokens, room to spare
            status, b = c.complete("Once upon a time", max_tokens=n_gen)
            self.assertEqual(status, 200, b)
            self.assertEqual(b["choices"][0]["text"], text)


class Faults(unittest.TestCase):
    def test_cancels_and_killed_workers_under_preemption(self):
        # streams cancelled by their clients mid-way, a prefill worker killed (transfers in
        # flight) and then a decode worker killed while sequences are preempted and
        # recomputed: every other request finishes exactly, no block leaks on the survivors
        ref = reference({p: body(p, max_tokens=200) for p in PROMPTS})
        with Cluster(roles=("prefill", "prefill", "decode", "decode"),
                     gateway_args=QUICK_GW,
                     worker_args=["--kv-blocks", "48", "--debug-step-delay-ms", "1"]) as c:
            time.sleep(0.3)
            base = {k: w["kv_blocks_free"] for k, w in worker_figures(c).items()
                    if k not in ("prefill-0", "decode-2")}
            prompts = PROMPTS * 3
            results = [None] * len(prompts)

            def one(i):
                if i % 4 == 3:  # read a few events, then hang up
                    conn = c.conn(60)
                    conn.request("POST", "/v1/completions",
                                 json.dumps(dict(body(prompts[i], max_tokens=200),
                                                 stream=True)).encode(),
                                 {"Content-Type": "application/json"})
                    r = conn.getresponse()
                    r.read1(200)
                    conn.close()
                    results[i] = "cancelled"
                    return
                results[i] = c.request("POST", "/v1/completions",
                                       body(prompts[i], max_tokens=200), timeout=300)

            threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
            for t in threads:
                t.start()
            time.sleep(0.4)
            c.kill("prefill-0")
            time.sleep(0.4)
            c.kill("decode-2")
            for t in threads:
                t.join(300)
            for i, r in enumerate(results):
                if r == "cancelled":
                    continue
                self.assertEqual(texts([r])[0], ref[prompts[i]], "request %d" % i)
            figs = wait_kv_free(c, base, timeout=10)
            self.assertGreater(figs["decode-3"]["num_preemptions"], 0)
            self.assertIn("retrying", c.log("gateway"))  # the killed workers' requests


if __name__ == "__main__":
    unittest.main()
