"""Chunked prefill: a prompt of a few hundred tokens computed in chunks of 7 tokens (KV
blocks of 16: chunk boundaries never line up with blocks, so every block is completed by a
later chunk than the one that began it, and the KV hand-off sends each layer in many
block ranges) gives the same greedy text through the gateway as the default (one chunk),
disaggregated and on a mixed worker. On the mixed worker, short requests decode while the
long prompt is still being computed chunk by chunk; every KV block comes back."""

import os
import re
import signal
import sys
import threading
import time
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cluster import Cluster  # noqa: E402
from test_e2e import REF, wait_kv_free, worker_figures  # noqa: E402

# About 300 tokens of the stories260K tokenizer (checked below), well inside its 512-token
# context together with MAX_TOKENS.
LONG = ("Once upon a time, there was a little girl named Lily. She loved to play outside in "
        "the park with her friends. One day, she saw a big red ball under a tree. She ran to "
        "the ball and picked it up. Her mom said, \"Lily, be careful!\" Lily smiled and threw "
        "the ball to her friend Tom. Tom was happy and they played all day. When the sun went "
        "down, they sat on the grass and looked at the sky. The sky was pink and orange. Lily "
        "said, \"I love the park.\" Tom said, \"Me too.\" Then they went home to eat dinner "
        "with their moms and dads. After dinner, Lily took a bath and put on her pajamas. "
        "She got into bed with her teddy bear and her mom read her a story about a dog")
MAX_TOKENS = 40
# The prompt is sent several times: the prefix cache is off so that every run computes it
# whole in chunks (test_prefix_cache.py runs chunked prefill with the cache on).
CHUNK = ["--prefill-chunk-tokens", "7", "--block-size", "16", "--prefix-cache", "false"]


def greedy(c, prompt=LONG, max_tokens=MAX_TOKENS):
    status, body = c.complete(prompt, max_tokens=max_tokens)
    assert status == 200, body
    return body["choices"][0]["text"], body["usage"]["prompt_tokens"]


def rid_lines(log, pattern):
    """(line number, request id, match) of the worker log lines matching pattern."""
    out = []
    for i, line in enumerate(log.splitlines()):
        m = re.search(r"req=(\d+) " + pattern, line)
        if m:
            out.append((i, int(m.group(1)), m))
    return out


class ChunkedPrefill(unittest.TestCase):
    def run_pair(self, roles, extra_args=(), then=None):
        with Cluster(roles=roles) as c:
            want, n_prompt = greedy(c)
        self.assertGreaterEqual(n_prompt, 200, "the prompt must span many chunks and blocks")
        self.assertLessEqual(n_prompt + MAX_TOKENS, 512)
        args = CHUNK + ["--log-level", "debug"] + list(extra_args)
        with Cluster(roles=roles, worker_args=args) as c:
            base = {k: w["kv_blocks_free"] for k, w in worker_figures(c).items()}
            got, _ = greedy(c)
            self.assertEqual(got, want)
            # streamed too, and a short prompt (one chunk) is unaffected
            status, text, events, done = c.stream_text(LONG, max_tokens=MAX_TOKENS)
            self.assertEqual((status, done, text), (200, True, want))
            prompt = next(iter(REF))
            self.assertEqual(greedy(c, prompt, 48)[0], REF[prompt])
            # the prompt really ran in chunks of 7 (debug log of the prefilling worker)
            name = [n for n in c.worker_names() if not n.startswith("decode")][0]
            chunks = [(int(m.group(1)), int(m.group(2))) for _, _, m in
                      rid_lines(c.log(name), r"prefill chunk \[(\d+), (\d+)\) of %d," % n_prompt)]
            self.assertEqual(len(chunks), 2 * ((n_prompt + 6) // 7), chunks[:5])
            self.assertTrue(all(b - a <= 7 for a, b in chunks), chunks[:5])
            if then:
                then(c, name, want, n_prompt)
            wait_kv_free(c, base)

    def test_disaggregated(self):
        # a short lease and slow steps for transfer_fails_while_chunking
        self.run_pair(("prefill", "decode"), ["--lease-ms", "300", "--debug-step-delay-ms", "10"],
                      self.transfer_fails_while_chunking)

    def transfer_fails_while_chunking(self, c, name, want, n_prompt):
        """A transfer that fails while its prompt is still being computed (no KV_BEGIN_ACK
        within the 300 ms lease: the decode worker is frozen; the prompt takes ~40 steps of
        10 ms) ends the attempt on the prefill worker at once, with a retryable ERROR before
        its last chunk; once the decode worker is back, the gateway's re-run completes."""
        result = {}
        mark = len(c.log(name).splitlines())
        dec = c.procs["decode-1"]
        dec.send_signal(signal.SIGSTOP)
        try:
            t = threading.Thread(target=lambda: result.update(r=c.complete(LONG, MAX_TOKENS)))
            t.start()
            for _ in range(1000):
                if "error reported: timeout" in c.log(name):
                    break
                time.sleep(0.01)
        finally:
            dec.send_signal(signal.SIGCONT)
        t.join(60)
        status, body = result["r"]
        self.assertEqual(status, 200, body)
        self.assertEqual(body["choices"][0]["text"], want)
        log = "\n".join(c.log(name).splitlines()[mark:])
        errors = rid_lines(log, r"error reported: timeout")
        self.assertTrue(errors, "no transfer timeout reported while chunking")
        rid = errors[0][1]
        last = [i for i, r, _ in rid_lines(log, r"prefill chunk \[\d+, %d\)" % n_prompt)
                if r == rid]
        # each attempt has its own wire rid: the failed one must never reach its last chunk
        # (or only after the error), and the re-run (next wire rid) computes it
        self.assertTrue(not last or errors[0][0] < last[0],
                        "the attempt must end before its last chunk, not after")
        rerun = [i for i, r, _ in rid_lines(log, r"prefill chunk \[\d+, %d\)" % n_prompt)
                 if int(r) == int(rid) + 1]
        self.assertTrue(rerun, "the re-run attempt did not compute the whole prompt")

    def test_mixed(self):
        self.run_pair(("mixed",), ["--debug-step-delay-ms", "5"], self.decode_interleaves)

    def decode_interleaves(self, c, name, want, n_prompt):
        """Short requests sent once the long prompt's first chunk ran decode to the end
        before its last chunk (the worker's log orders the events); every text is right."""
        results = {}

        def run(key, prompt, n):
            results[key] = c.stream_text(prompt, max_tokens=n)

        short = next(iter(REF))
        mark = len(c.log(name).splitlines())
        long_t = threading.Thread(target=run, args=("long", LONG, MAX_TOKENS))
        long_t.start()
        first = r"prefill chunk \[0, 7\) of %d," % n_prompt
        for _ in range(500):
            if rid_lines("\n".join(c.log(name).splitlines()[mark:]), first):
                break
            time.sleep(0.01)
        threads = [threading.Thread(target=run, args=(i, short, 8)) for i in range(3)]
        for t in threads + [long_t]:
            if t is not long_t:
                t.start()
        for t in threads + [long_t]:
            t.join(60)
        self.assertEqual(results["long"][:2], (200, want))
        for i in range(3):
            self.assertEqual(results[i][:2], (200, REF[short][:len(results[i][1])]))
        log = "\n".join(c.log(name).splitlines()[mark:])
        long_rid = rid_lines(log, first)[0][1]
        last = [i for i, rid, _ in rid_lines(log, r"prefill chunk \[\d+, %d\)" % n_prompt)
                if rid == long_rid]
        short_rids = {rid for _, rid, _ in rid_lines(log, r"prefill chunk \[0, \d+\) of 5,")}
        finished = [i for i, rid, _ in rid_lines(log, r"finished") if rid in short_rids]
        self.assertEqual(len(short_rids), 3)
        self.assertEqual(len(finished), 3)
        self.assertLess(max(finished), last[0], "short requests must finish between chunks")


if __name__ == "__main__":
    unittest.main()
