"""Emulated workers send the emulated model's KV size (docs/scheduler.md "Emulated
workers", docs/kvtransfer.md "Padding"): with --emulate a100-llama3-8b every KV transfer of
n prompt tokens puts exactly n x 131072 payload bytes on the wire (the small model's KV plus
zero padding), counted by both workers and by the gateway's per-request figure, and the
tokens stay the real model's.

A real 1P1D cluster; one prompt in one pass, one in chunks of 7 tokens (the padding then
comes in many KV_LAYER ranges), and the workers' counters read from GET /metrics."""

import os
import sys
import time
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cluster import Cluster  # noqa: E402
from test_chunked import LONG  # noqa: E402
from test_e2e import REF  # noqa: E402
from test_stats import metric, parse_metrics  # noqa: E402

KV_BYTES_PER_TOKEN = 131072  # a100-llama3-8b: 2 (K, V) x 32 layers x 8 kv heads x 128 x 2


def metrics(c):
    """GET /metrics, parsed: {(name, labels): value}."""
    conn = c.conn()
    conn.request("GET", "/metrics")
    r = conn.getresponse()
    text = r.read().decode()
    conn.close()
    assert r.status == 200, r.status
    return parse_metrics(text)[0]


class EmulatedKvBytes(unittest.TestCase):
    def test_transfer_bytes_are_the_emulated_models(self):
        with Cluster(roles=("prefill", "decode"),
                     worker_args=["--emulate", "a100-llama3-8b", "--prefill-chunk-tokens", "7"]
                     ) as c:
            for name in ("prefill-0", "decode-1"):
                self.assertIn("padded with zeros to the emulated model's %d bytes per token"
                              % KV_BYTES_PER_TOKEN, c.log(name))
            prompt_tokens = 0
            for prompt, max_tokens in (("Once upon a time", 48), (LONG, 8)):
                status, body = c.complete(prompt, max_tokens=max_tokens)
                self.assertEqual(status, 200, body)
                if prompt in REF and max_tokens == 48:
                    self.assertEqual(body["choices"][0]["text"], REF[prompt])
                prompt_tokens += body["usage"]["prompt_tokens"]
            want = prompt_tokens * KV_BYTES_PER_TOKEN
            # per request (decode worker's TOKENS xfer_bytes): exact at once
            s = metrics(c)
            self.assertEqual(metric(s, "tidepool_kv_transfer_bytes_count"), 2)
            self.assertEqual(metric(s, "tidepool_kv_transfer_bytes_sum"), want)
            # per worker (heartbeat counters, which lag): both sides, exactly
            deadline = time.time() + 10
            while True:
                s = metrics(c)
                tx = metric(s, "tidepool_worker_kv_transfer_bytes_total", worker="prefill-0",
                            side="send")
                rx = metric(s, "tidepool_worker_kv_transfer_bytes_total", worker="decode-1",
                            side="recv")
                if (tx, rx) == (want, want) or time.time() > deadline:
                    break
                time.sleep(0.2)
            self.assertEqual((tx, rx), (want, want))
            self.assertEqual(metric(s, "tidepool_kv_transfers_total", worker="decode-1",
                                    side="recv", result="aborted"), 0)


if __name__ == "__main__":
    unittest.main()
