"""Load: many concurrent streams on one decode worker, and KV-block exhaustion (requests
wait or fail cleanly, none is lost, and the block count returns to its start)."""

import os
import sys
import threading
import time
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cluster import Cluster  # noqa: E402
from test_e2e import REF, wait_kv_free, worker_figures  # noqa: E402


def run_streams(c, prompts, max_tokens=48):
    results = [None] * len(prompts)

    def run(i):
        try:
            results[i] = c.stream_text(prompts[i], max_tokens=max_tokens)
        except Exception as e:  # noqa: BLE001
            results[i] = ("exception", repr(e), [], False)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    return results


class Load(unittest.TestCase):
    def test_32_concurrent_streams_one_decode_worker(self):
        with Cluster(roles=("prefill", "decode")) as c:
            prompts = list(REF) * 16
            for i, (status, text, events, done) in enumerate(run_streams(c, prompts)):
                self.assertEqual(status, 200, "request %d: %r" % (i, text))
                self.assertTrue(done)
                self.assertEqual(text, REF[prompts[i]], "request %d" % i)

    def test_kv_exhaustion_requests_wait(self):
        # 16 blocks of 16 tokens: each request grows to ceil((5 + 48 - 1) / 16) = 4 blocks, so
        # at most 4 can finish side by side on the decode worker (more start, blocks taken on
        # demand; the rest are preempted and recomputed); 24 requests must all complete.
        with Cluster(roles=("prefill", "decode"),
                     worker_args=["--kv-blocks", "16", "--debug-step-delay-ms", "2"]) as c:
            time.sleep(0.5)
            base = {k: w["kv_blocks_free"] for k, w in worker_figures(c).items()}
            prompts = list(REF) * 12
            results = run_streams(c, prompts)
            for i, (status, text, events, done) in enumerate(results):
                self.assertEqual(status, 200, "request %d: %r" % (i, text))
                self.assertTrue(done, "request %d" % i)
                self.assertEqual(text, REF[prompts[i]], "request %d" % i)
            wait_kv_free(c, base)

    def test_request_that_can_never_fit(self):
        # 4 blocks * 16 tokens = 64 slots; a 90-token prompt can never fit: clean error (a
        # 200-token max_tokens alone is admitted: test_preempt.py)
        with Cluster(roles=("prefill", "decode"), worker_args=["--kv-blocks", "4"]) as c:
            status, body = c.complete("Once upon a time " * 18, max_tokens=8)
            self.assertEqual(status, 400, body)
            self.assertEqual(body["error"]["code"], "kv_cache_capacity_exceeded")
            status, body = c.complete("Once upon a time", max_tokens=48)
            self.assertEqual(status, 200, body)
            self.assertEqual(body["choices"][0]["text"], REF["Once upon a time"])


if __name__ == "__main__":
    unittest.main()
