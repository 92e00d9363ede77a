"""Emulated workers send the emulated model's KV size (docs/scheduler.md "Emulated
workers", docs/kvtransfer.md "Padding"): with --emulate a100-llama3-8b every KV transfer of
n prompt tokens puts exactly n x 131072 payload bytes on the wire (the small model's KV plus
zero padding), counted by both workers and by the gateway's per-request figure, and the
tokens stay the real model's; with --emulate-kv-pad false only the real KV goes.

Their KV cache holds the emulated accelerator's capacity (costmodel_kv_capacity_tokens,
scaled by PRESET:token-scale=S): its blocks are reported exactly (REGISTER, HEARTBEAT,
GET /workers), and a cache that small fills up: sequences are preempted and recomputed, and
the greedy texts stay those of an unemulated cluster with room for everything.

A real 1P1D cluster; one prompt in one pass, one in chunks of 7 tokens (the padding then
comes in many KV_LAYER ranges), and the workers' counters read from GET /metrics."""

import os
import sys
import time
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cluster import Cluster  # noqa: E402
from test_chunked import LONG  # noqa: E402
from test_e2e import REF, wait_kv_free, worker_figures  # noqa: E402
from test_preempt import PROMPTS, body, reference, run_concurrent, texts  # noqa: E402
from test_stats import metric, parse_metrics  # noqa: E402

KV_BYTES_PER_TOKEN = 131072  # a100-llama3-8b: 2 (K, V) x 32 layers x 8 kv heads x 128 x 2
# a100-llama3-8b's KV capacity: (0.9 x 80e9 - 16.06e9 weights - 2e9) / 131072 = 411529.5
# tokens, floor(411529.5 x S) at token-scale S, in blocks of 16 tokens
BLOCKS_A100 = 411529 // 16                    # 25720
BLOCKS_A100_S001 = int(411529.54 * 0.01) // 16  # 4115 tokens: 257 blocks


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
            # the KV cache is the emulated A100's (411529 tokens), not 64 x 512 of the
            # small model's
            figs = worker_figures(c)
            for name in ("prefill-0", "decode-1"):
                self.assertEqual(figs[name]["kv_blocks_total"], BLOCKS_A100)
                self.assertIn("KV cache sized to the emulated accelerator's capacity: 411529 "
                              "tokens, %d blocks of 16 tokens" % BLOCKS_A100, c.log(name))

    def test_no_padding(self):
        with Cluster(roles=("prefill", "decode"),
                     worker_args=["--emulate", "a100-llama3-8b", "--emulate-kv-pad", "false"]
                     ) as c:
            self.assertIn("carry the real model's KV only (--emulate-kv-pad false)",
                          c.log("prefill-0"))
            status, body_ = c.complete("Once upon a time", max_tokens=48)
            self.assertEqual(status, 200, body_)
            self.assertEqual(body_["choices"][0]["text"], REF["Once upon a time"])
            n = body_["usage"]["prompt_tokens"]
            s = metrics(c)
            # the real model's KV only: stories260K's 1280 bytes per token (plus framing:
            # far below the padded n x 131072)
            got = metric(s, "tidepool_kv_transfer_bytes_sum")
            self.assertGreaterEqual(got, n * 1280)
            self.assertLess(got, n * KV_BYTES_PER_TOKEN // 10)


class EmulatedKvCapacity(unittest.TestCase):
    def test_capacity_is_reported_and_fills(self):
        # a100-llama3-8b at token-scale 0.01: 4115 tokens, 257 blocks, room for 8 of the
        # 32-block worst-case sequences; 24 run to the context's end at once
        n = 24
        prompts = (PROMPTS * (n // len(PROMPTS) + 1))[:n]
        ref = reference({p: body(p) for p in PROMPTS})
        with Cluster(roles=("prefill", "decode"),
                     gateway_args=["--heartbeat-ms", "50", "--dead-after-ms", "10000"],
                     worker_args=["--emulate", "a100-llama3-8b:token-scale=0.01"]) as c:
            # the registration's figures, then a heartbeat's: the same exact capacity
            figs = worker_figures(c)
            for name in ("prefill-0", "decode-1"):
                self.assertEqual(figs[name]["kv_blocks_total"], BLOCKS_A100_S001)
                self.assertTrue(figs[name]["emulated"])
                self.assertIn("the KV cache holds the emulated accelerator's 4115 tokens "
                              "(token scale 0.01)", c.log(name))
            time.sleep(0.3)
            figs = worker_figures(c)
            base = {}
            for name in ("prefill-0", "decode-1"):
                self.assertEqual(figs[name]["kv_blocks_total"], BLOCKS_A100_S001)
                self.assertEqual(figs[name]["kv_blocks_free"], BLOCKS_A100_S001)
                base[name] = BLOCKS_A100_S001
            res, peak = run_concurrent(c, [body(p) for p in prompts], poll_worker="decode-1")
            got = texts(res)
            for i, p in enumerate(prompts):
                self.assertEqual(got[i], ref[p], "request %d (%r)" % (i, p))
            figs = wait_kv_free(c, base)
            # it filled: sequences were preempted (the small model's own cache, 64 x 32
            # blocks, would have held all 24)
            self.assertGreater(figs["decode-1"]["num_preemptions"], 0)
            self.assertGreater(peak, 8)


if __name__ == "__main__":
    unittest.main()
