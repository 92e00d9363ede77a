"""Automatic prefix caching (docs/prefix-cache.md): a multi-turn chat, each turn resending
the conversation so far, gives the same greedy texts with the prefix cache on and off
(--prefix-cache false), disaggregated and on a mixed worker, with MTP (the default, depth 2)
and without, in one chunk and chunked; later turns compute only what is new. The counters
(HEARTBEAT pc_q / pc_hit -> GET /workers, /metrics) are exact: the same prompt twice hits
its full blocks but the last one or two tokens' block (the last token is always computed;
with MTP the one before too).

The decode side keeps a prefix cache too (docs/prefix-cache.md "The decode side"): the
prompt's full-block hashes travel in KV_BEGIN and only the blocks the decode worker lacks
are sent, so the KV bytes P->D fall with the cache on (at most half here); without MTP
the generated tokens' blocks are cached as well (a mixed worker's next turn finds the
reply). Killed workers, cancelled streams and evictions in a small decode cache lose no
text and leak no block."""

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
from test_stats import parse_metrics  # noqa: E402

SYSTEM = ("You are a kind storyteller. You tell short stories about a little girl named Lily, "
          "her dog Max and her friend Tom, who live in a small town near a big green park.")
TURNS = ["Tell me a story about Lily.", "What did Max do next?",
         "And then what happened to Tom?", "How did the day end?"]
MAX_TOKENS = 24
BS = 16
FAST_HB = ["--heartbeat-ms", "50"]


def chat(c, msgs):
    status, body = c.request("POST", "/v1/chat/completions",
                             {"model": "stories260K", "messages": msgs,
                              "max_tokens": MAX_TOKENS, "temperature": 0})
    assert status == 200, body
    return body["choices"][0]["message"]["content"], body["usage"]["prompt_tokens"]


def conversation(c):
    """The replies and prompt sizes of one conversation of len(TURNS) turns."""
    msgs = [{"role": "system", "content": SYSTEM}]
    replies, sizes = [], []
    for t in TURNS:
        msgs.append({"role": "user", "content": t})
        text, n = chat(c, msgs)
        replies.append(text)
        sizes.append(n)
        msgs.append({"role": "assistant", "content": text})
    return replies, sizes


def prefill_names(c):
    return [n for n in c.worker_names() if not n.startswith("decode")]


def counters(c, want_queries, timeout=10):
    """(queries, hits) summed over the workers once the heartbeats report want_queries."""
    deadline = time.time() + timeout
    while True:
        ws = worker_figures(c).values()
        q = sum(w["prefix_cache_queries"] for w in ws)
        h = sum(w["prefix_cache_hits"] for w in ws)
        if q == want_queries or time.time() > deadline:
            return q, h
        time.sleep(0.05)


def prompt_tokens_computed(c, want=None, timeout=10):
    """Sum of the workers' worker_prompt_tokens_total (the tokens prefilled), once it is
    want (heartbeats lag), or whatever it is after timeout."""
    deadline = time.time() + timeout
    while True:
        status, text = c.request("GET", "/metrics")
        assert status == 200
        samples, _, _ = parse_metrics(text)
        v = sum(v for (n, _), v in samples.items()
                if re.fullmatch(r"tidepool[:_]worker_prompt_tokens_total", n))
        if want is None or v == want or time.time() > deadline:
            return v
        time.sleep(0.05)


def spec_counters(c, timeout=10):
    """(drafts, draft tokens, accepted tokens) summed over the workers, once two reads a
    heartbeat apart agree."""
    names = ("spec_decode_num_drafts_total", "spec_decode_num_draft_tokens_total",
             "spec_decode_num_accepted_tokens_total")
    last, deadline = None, time.time() + timeout
    while True:
        time.sleep(0.15)
        status, text = c.request("GET", "/metrics")
        assert status == 200
        samples, _, _ = parse_metrics(text)
        now = tuple(sum(v for (n, _), v in samples.items()
                        if re.fullmatch(r"tidepool[:_]" + f, n)) for f in names)
        if now == last or time.time() > deadline:
            return now
        last = now


def kv_bytes(c, timeout=10):
    """KV payload bytes the decode workers received (the sum of every worker's
    worker_kv_transfer_bytes_total counts both ends), once two reads a heartbeat apart
    agree."""
    last, deadline = None, time.time() + timeout
    while True:
        time.sleep(0.15)
        status, text = c.request("GET", "/metrics")
        assert status == 200
        samples, _, _ = parse_metrics(text)
        now = sum(v for (n, _), v in samples.items()
                  if re.fullmatch(r"tidepool[:_]worker_kv_transfer_bytes_total", n)) / 2
        if now == last or time.time() > deadline:
            return now
        last = now


def metric_values(c, family):
    status, text = c.request("GET", "/metrics")
    assert status == 200
    samples, types, _ = parse_metrics(text)
    names = [n for n in types if re.fullmatch(r"tidepool[:_]" + family, n)]
    assert len(names) == 1, (family, names)
    assert types[names[0]] == "counter"
    return sum(v for (n, _), v in samples.items() if n == names[0])


class PrefixCache(unittest.TestCase):
    def run_both(self, roles, extra=(), spec=False):
        """The conversation with the cache off, then on: identical texts; returns the
        sizes, the on-cluster's (queries, hits) and the tokens each side computed. A
        disaggregated cluster's KV bytes P->D at least halve with the cache on."""
        args = FAST_HB + list(extra)
        with Cluster(roles=roles, worker_args=args + ["--prefix-cache", "false"]) as c:
            want, sizes = conversation(c)
            q_off, h_off = counters(c, 0)
            self.assertEqual((q_off, h_off), (0, 0))
            computed_off = prompt_tokens_computed(c, sum(sizes))
            spec_off = spec_counters(c)
            kv_off = kv_bytes(c)
        self.assertEqual(computed_off, sum(sizes))
        self.assertEqual(len(set(want)), len(want), "the turns must differ")
        with Cluster(roles=roles, worker_args=args) as c:
            base = {k: w["kv_blocks_free"] for k, w in worker_figures(c).items()}
            got, sizes_on = conversation(c)
            self.assertEqual(sizes_on, sizes)
            self.assertEqual(got, want)
            q, h = counters(c, sum(sizes))
            self.assertEqual(q, sum(sizes))
            computed_on = prompt_tokens_computed(c, q - h)
            self.assertEqual(computed_on, q - h)
            if spec:  # the MTP modules' K/V of cached blocks is right: the same drafts pass
                self.assertEqual(spec_counters(c), spec_off)
                self.assertGreater(spec_off[0], 0)
            self.assertEqual(metric_values(c, "prefix_cache_queries_total"), q)
            self.assertEqual(metric_values(c, "prefix_cache_hits_total"), h)
            kv_on = kv_bytes(c)
            # cached blocks are free blocks: the cache holds them, nothing is leaked
            wait_kv_free(c, base)
            for n in c.worker_names():
                self.assertNotIn("ERROR", c.log(n))
        # each turn resends the previous one: all but its tail is cached
        self.assertGreater(h, 0)
        self.assertLessEqual(computed_on * 2, computed_off,
                             "caching must at least halve the prompt tokens computed")
        if "decode" in roles:  # only the blocks the decode worker lacked were sent
            self.assertGreater(kv_on, 0)
            self.assertLessEqual(kv_on * 2, kv_off, "KV bytes P->D on %d, off %d" %
                                 (kv_on, kv_off))
        else:
            self.assertEqual((kv_on, kv_off), (0, 0))
        return sizes, (q, h)

    def test_disaggregated_mtp(self):
        # a fixed depth (no adaptive lowering, which depends on timing): drafts and
        # acceptances must be the same with the cache on and off
        self.run_both(("prefill", "decode"), ["--mtp-adaptive", "false"], spec=True)

    def test_disaggregated_no_mtp_chunked(self):
        self.run_both(("prefill", "decode"),
                      ["--mtp-depth", "0", "--prefill-chunk-tokens", "7"])

    def test_mixed(self):
        self.run_both(("mixed",), ["--mtp-adaptive", "false"], spec=True)

    def test_mixed_adaptive(self):
        self.run_both(("mixed",))

    def test_mixed_chunked_no_mtp(self):
        self.run_both(("mixed",), ["--mtp", "none", "--prefill-chunk-tokens", "5"])

    def test_exact_counters(self):
        """The same prompt twice: the second computes only its last block's worth. With
        MTP (depth 2) a block's key holds the 2 tokens after it and 2 tokens are computed
        at least; without, 1. A third request with another prompt shares nothing."""
        prompt = SYSTEM + " Once upon a time"
        for extra, la in (([], 2), (["--mtp-depth", "0"], 1)):
            with Cluster(roles=("prefill", "decode"), worker_args=FAST_HB + extra) as c:
                st, first = c.complete(prompt, max_tokens=8)
                self.assertEqual(st, 200, first)
                n = first["usage"]["prompt_tokens"]
                self.assertEqual(counters(c, n), (n, 0))
                st, second = c.complete(prompt, max_tokens=8)
                self.assertEqual(st, 200, second)
                self.assertEqual(second["choices"][0]["text"], first["choices"][0]["text"])
                hit = (n - la) // BS * BS
                self.assertGreater(hit, 0)
                self.assertEqual(counters(c, 2 * n), (2 * n, hit))
                self.assertEqual(prompt_tokens_computed(c, 2 * n - hit), 2 * n - hit)
                # a prompt that differs in its first token shares no block
                st, third = c.complete("Tom " + prompt, max_tokens=8)
                self.assertEqual(st, 200, third)
                m = third["usage"]["prompt_tokens"]
                self.assertEqual(counters(c, 2 * n + m), (2 * n + m, hit))

    def test_mtp_lookahead(self):
        """Token-id prompts: A (33 tokens), then B = A's first 32 tokens and 8 others. With
        MTP (depth 2) a block's key holds the 2 tokens after it, so A registers only its
        first block (32 + 2 > 33: the modules' K/V at positions 30 and 31 is not A's to
        write) and B hits 16 tokens; without MTP A registers both full blocks and B hits 32
        (at most 39). Texts match a cache-off cluster either way."""
        a = [1] + [(37 * i) % 480 + 20 for i in range(1, 33)]
        b = a[:32] + [(53 * i) % 470 + 30 for i in range(8)]
        self.assertNotEqual(b[32], a[32])
        for extra, want_hit in ((["--mtp-adaptive", "false"], 16), (["--mtp-depth", "0"], 32)):
            texts = {}
            for cache in ("true", "false"):
                args = FAST_HB + extra + ["--prefix-cache", cache]
                with Cluster(roles=("prefill", "decode"), worker_args=args) as c:
                    out = []
                    for prompt in (a, b):
                        st, body = c.complete(prompt, max_tokens=12)
                        self.assertEqual(st, 200, body)
                        out.append(body["choices"][0]["text"])
                    self.assertEqual(body["usage"]["prompt_tokens"], 40)
                    texts[cache] = out
                    if cache == "true":
                        self.assertEqual(counters(c, 73), (73, want_hit))
            self.assertEqual(texts["true"], texts["false"])


PROMPTS = [SYSTEM + " " + t for t in ("Once upon a time", "One day Lily saw", "Max the dog ran",
                                      "Tom and Lily went to", "In the big green park",
                                      "The sun was warm and")]
QUICK_GW = ["--heartbeat-ms", "50", "--dead-after-ms", "3000"]  # killed workers found


class DecodeSide(unittest.TestCase):
    def test_generated_blocks_cached_mixed(self):
        """Without MTP a sequence's generated tokens' blocks are cached when it ends: a
        prompt that resends prompt + reply on a mixed worker hits past the first prompt."""
        prompt = SYSTEM + " Once upon a time"
        with Cluster(roles=("mixed",), worker_args=FAST_HB + ["--mtp", "none"]) as c:
            st, first = c.complete(prompt, max_tokens=40)
            self.assertEqual(st, 200, first)
            n = first["usage"]["prompt_tokens"]
            self.assertEqual(first["usage"]["completion_tokens"], 40)
            st, second = c.complete(prompt + first["choices"][0]["text"], max_tokens=4)
            self.assertEqual(st, 200, second)
            m = second["usage"]["prompt_tokens"]
            q, h = counters(c, n + m)
            self.assertEqual(q, n + m)
            # more than the first prompt's full blocks: its reply's blocks were cached
            self.assertGreater(h, n // BS * BS)
            self.assertLessEqual(h, (m - 1) // BS * BS)

    def test_generated_blocks_cached_disaggregated(self):
        """Without MTP the decode worker caches the prompt's and the reply's blocks: a
        prompt that resends prompt + reply (40 generated tokens, so 83 + 39 tokens of KV:
        7 full blocks) has only its last block sent, though the prefill worker held just
        the first prompt's 5 full blocks."""
        prompt = SYSTEM + " Once upon a time"
        with Cluster(roles=("prefill", "decode"),
                     worker_args=FAST_HB + ["--mtp-depth", "0"]) as c:
            st, first = c.complete(prompt, max_tokens=40)
            self.assertEqual(st, 200, first)
            n = first["usage"]["prompt_tokens"]
            self.assertEqual(first["usage"]["completion_tokens"], 40)
            sent1 = kv_bytes(c)
            block = sent1 / -(-n // BS)  # the first transfer sent every block
            st, second = c.complete(prompt + first["choices"][0]["text"], max_tokens=4)
            self.assertEqual(st, 200, second)
            m = second["usage"]["prompt_tokens"]
            self.assertEqual(m, n + 40)  # the reply's text gives its ids back
            held = (n + 40 - 1) // BS  # the decode worker's full blocks
            self.assertGreater(held, n // BS)
            self.assertEqual(kv_bytes(c) - sent1, (-(-m // BS) - held) * block)

    def test_faults_small_decode_cache(self):
        """Cache on everywhere, two prefill and two decode workers with small caches (the
        LRU evicts), streams cancelled by their clients, a prefill worker killed with
        transfers in flight (the decode side's shared blocks were pinned by them), then a
        decode worker killed: every other request's greedy text equals a cache-off
        cluster's, and the survivors' KV blocks all come back free."""
        ref = {}
        with Cluster(roles=("prefill", "decode"),
                     worker_args=FAST_HB + ["--prefix-cache", "false"]) as c:
            for p in PROMPTS:
                st, b = c.complete(p, max_tokens=60)
                self.assertEqual(st, 200, b)
                ref[p] = b["choices"][0]["text"]
        with Cluster(roles=("prefill", "prefill", "decode", "decode"), gateway_args=QUICK_GW,
                     worker_args=FAST_HB + ["--kv-blocks", "40", "--debug-step-delay-ms", "1",
                                            "--lease-ms", "1000"]) as c:
            time.sleep(0.3)
            base = {k: w["kv_blocks_free"] for k, w in worker_figures(c).items()
                    if k not in ("prefill-0", "decode-2")}
            prompts = PROMPTS * 4
            results = [None] * len(prompts)

            def one(i):
                if i % 5 == 4:  # read a little of the stream, then hang up
                    conn = c.conn(60)
                    conn.request("POST", "/v1/completions",
                                 json.dumps({"model": "stories260K", "prompt": prompts[i],
                                             "max_tokens": 60, "temperature": 0,
                                             "stream": True}).encode(),
                                 {"Content-Type": "application/json"})
                    conn.getresponse().read1(100)
                    conn.close()
                    results[i] = "cancelled"
                    return
                results[i] = c.request("POST", "/v1/completions",
                                       {"model": "stories260K", "prompt": prompts[i],
                                        "max_tokens": 60, "temperature": 0}, timeout=300)

            threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
            for t in threads:
                t.start()
            time.sleep(0.3)
            c.kill("prefill-0")
            time.sleep(0.3)
            c.kill("decode-2")
            for t in threads:
                t.join(300)
            for i, r in enumerate(results):
                self.assertIsNotNone(r, "request %d did not end" % i)
                if r == "cancelled":
                    continue
                st, b = r
                self.assertEqual(st, 200, b)
                self.assertEqual(b["choices"][0]["text"], ref[prompts[i]], "request %d" % i)
            # the survivors still serve from their caches, exactly
            for p in PROMPTS[:2]:
                st, b = c.complete(p, max_tokens=60)
                self.assertEqual(st, 200, b)
                self.assertEqual(b["choices"][0]["text"], ref[p])
            wait_kv_free(c, base, timeout=10)
            self.assertIn("retrying", c.log("gateway"))  # the killed workers' requests


if __name__ == "__main__":
    unittest.main()
