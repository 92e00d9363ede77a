"""The sampling controls really applied (docs/api.md "Sampling controls"): logit_bias,
stop_token_ids, min_tokens, presence/frequency/repetition penalties, on stories260K with
exact expectations, and the same tokens whatever runs them: disaggregated or mixed, MTP
depth 0 or 2 asked (a penalised sequence decodes at depth 0), seeded sampling reproducible.
(A retry after a killed decode worker and a live migration: test_tidal.py.)
    python3 -m unittest -v tests/integration/test_sampling.py
"""

import os
import sys
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cluster import Cluster  # noqa: E402

ONCE = "Once upon a time"
# greedy after BOS + "Once upon a time" (fake_gateway.py's REF_IDS): ", there was a little g"
GREEDY_IDS = [432, 383, 286, 261, 376, 298]
LOOP = "Lily liked to"  # its greedy text repeats "They had a lot of fun." three times
FUN = "They had a lot of fun."


class Sampling(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.dis = Cluster(roles=("prefill", "decode"), worker_args=["--mtp-adaptive", "false"])
        cls.mix = Cluster(roles=("mixed",), worker_args=["--mtp-adaptive", "false"])
        cls.dis.__enter__()
        cls.mix.__enter__()

    @classmethod
    def tearDownClass(cls):
        cls.dis.__exit__(None, None, None)
        cls.mix.__exit__(None, None, None)

    def run_both(self, prompt, **kw):
        """The choice and usage of one request, checked identical on both clusters and at
        MTP depth 0 and 2."""
        got = []
        for c in (self.dis, self.mix):
            for d in (0, 2):
                st, b = c.complete(prompt, mtp_depth=d, **kw)
                self.assertEqual(st, 200, b)
                got.append((b["choices"][0]["text"], b["choices"][0]["finish_reason"],
                            b["usage"]["completion_tokens"]))
        for g in got[1:]:
            self.assertEqual(g, got[0], kw)
        return got[0]

    def ids(self, text):
        st, t = self.dis.request("POST", "/tokenize", {"prompt": text,
                                                       "add_special_tokens": False})
        return t["tokens"]

    def detok(self, ids):
        return self.dis.request("POST", "/detokenize", {"tokens": ids})[1]["prompt"]

    def test_greedy_reference(self):
        text, fin, n = self.run_both(ONCE, max_tokens=6, temperature=0)
        self.assertEqual((text, fin, n), (self.detok(GREEDY_IDS), "length", 6))
        self.assertEqual(text, ", there was a little g")

    def test_logit_bias_ban_gives_runner_up(self):
        # the two most likely first tokens: what top-k 2 ever samples
        seen = set()
        for seed in range(40):
            st, b = self.dis.complete(ONCE, max_tokens=1, temperature=2, top_k=2, seed=seed)
            seen.add(b["choices"][0]["text"])
        self.assertEqual(seen, {",", " there"})
        text, fin, n = self.run_both(ONCE, max_tokens=1, temperature=0,
                                     logit_bias={str(GREEDY_IDS[0]): -100})
        self.assertEqual((text, n), (" there", 1))
        # a bias that makes a token the only choice: every step picks it
        little = str(GREEDY_IDS[4])
        text, fin, n = self.run_both(ONCE, max_tokens=3, temperature=0,
                                     logit_bias={little: 100})
        self.assertEqual((text, fin, n), (" little little little", "length", 3))
        # and with sampling: a +100 bias dominates any temperature
        text, fin, n = self.run_both(ONCE, max_tokens=2, temperature=1.5, seed=3,
                                     logit_bias={little: 100})
        self.assertEqual(text, " little little")

    def test_stop_token_ids(self):
        # ends at the given id (" little", the 5th token) with finish_reason stop; the stop
        # token is part of the output, as vLLM returns a non-special stop token
        text, fin, n = self.run_both(ONCE, max_tokens=40, temperature=0,
                                     stop_token_ids=[GREEDY_IDS[4], 511])
        self.assertEqual((text, fin, n), (", there was a little", "stop", 5))
        # the first token: ends at once (the prefill worker's token)
        text, fin, n = self.run_both(ONCE, max_tokens=40, temperature=0,
                                     stop_token_ids=[GREEDY_IDS[0]])
        self.assertEqual((text, fin, n), (",", "stop", 1))
        # chat takes them too: the biased token, which is a stop id, ends it at once
        for c in (self.dis, self.mix):
            st, b = c.request("POST", "/v1/chat/completions",
                              {"messages": [{"role": "user", "content": "Tell a story."}],
                               "max_tokens": 30, "temperature": 0,
                               "logit_bias": {str(GREEDY_IDS[4]): 100},
                               "stop_token_ids": [GREEDY_IDS[4]]})
            self.assertEqual(st, 200, b)
            self.assertEqual((b["choices"][0]["message"]["content"],
                              b["choices"][0]["finish_reason"], b["usage"]["completion_tokens"]),
                             (" little", "stop", 1))

    def test_ignore_eos(self):
        # vLLM's ignore_eos: EOS (id 2) never ends the answer. A +100 bias makes EOS the
        # greedy first token (an empty answer); with ignore_eos the plain greedy text comes,
        # to max_tokens; stop_token_ids still stop; and a non-boolean is a 400
        eos = {"2": 100}
        self.assertEqual(self.run_both(ONCE, max_tokens=6, temperature=0, logit_bias=eos),
                         ("", "stop", 0))
        self.assertEqual(self.run_both(ONCE, max_tokens=6, temperature=0, logit_bias=eos,
                                       ignore_eos=True),
                         (self.detok(GREEDY_IDS), "length", 6))
        self.assertEqual(self.run_both(ONCE, max_tokens=40, temperature=0, ignore_eos=True,
                                       stop_token_ids=[GREEDY_IDS[4]]),
                         (", there was a little", "stop", 5))
        self.assertEqual(self.run_both(ONCE, max_tokens=6, temperature=0, ignore_eos=False),
                         (self.detok(GREEDY_IDS), "length", 6))
        st, b = self.dis.complete(ONCE, max_tokens=6, ignore_eos="yes")
        self.assertEqual((st, b["error"]["param"]), (400, "ignore_eos"), b)

    def test_min_tokens_masks_stop_ids(self):
        # " little" (index 4) is a stop id, but min_tokens 8 masks it there: the first four
        # tokens are greedy's, the fifth is another one, and no stop comes before 8 tokens
        text, fin, n = self.run_both(ONCE, max_tokens=12, temperature=0,
                                     stop_token_ids=[GREEDY_IDS[4]], min_tokens=8)
        self.assertTrue(text.startswith(", there was a"), text)
        self.assertFalse(text.startswith(", there was a little"), text)
        self.assertGreaterEqual(n, 8)
        plain, _, _ = self.run_both(ONCE, max_tokens=4, temperature=0)
        self.assertEqual(plain, ", there was a")

    def test_min_tokens_passes_over_stop_strings(self):
        # vLLM checks stop strings only after min_tokens: " there" (token 2) is passed over
        # with min_tokens 3, and " little" (token 5) then ends the text
        stops = [" there", " little"]
        text, fin, n = self.run_both(ONCE, max_tokens=12, temperature=0, stop=stops)
        self.assertEqual((text, fin, n), (",", "stop", 2))
        text, fin, n = self.run_both(ONCE, max_tokens=12, temperature=0, stop=stops,
                                     min_tokens=3)
        self.assertEqual((text, fin, n), (", there was a", "stop", 5))
        for c in (self.dis, self.mix):
            status, streamed, events, done = c.stream_text(ONCE, 12, temperature=0, stop=stops,
                                                           min_tokens=3)
            self.assertEqual((status, streamed, done), (200, ", there was a", True))

    def test_min_tokens_beyond_the_context(self):
        # without max_tokens the answer may take the rest of the context, which min_tokens
        # must not exceed (vLLM's 400 min_tokens > max_tokens); with it, max_tokens decides
        st, tok = self.dis.request("POST", "/tokenize", {"prompt": ONCE})
        room = 512 - tok["count"]
        for c in (self.dis, self.mix):
            st, b = c.request("POST", "/v1/completions",
                              {"prompt": ONCE, "min_tokens": room + 1, "temperature": 0})
            self.assertEqual(st, 400, b)
            self.assertEqual((b["error"]["param"], b["error"]["code"]),
                             ("min_tokens", "invalid_value"))
            st, b = c.request("POST", "/v1/completions",
                              {"prompt": [ONCE, ONCE + " there"], "min_tokens": room,
                               "temperature": 0, "logit_bias": {"2": 100}})
            self.assertEqual(st, 400, b)  # the second prompt leaves one token fewer
            self.assertIn("(prompt 1 of the batch)", b["error"]["message"])
            st, b = c.request("POST", "/v1/chat/completions",
                              {"messages": [{"role": "user", "content": "hi"}],
                               "min_tokens": 600})
            self.assertEqual((st, b["error"]["param"]), (400, "min_tokens"), b)
        st, b = self.dis.request("POST", "/v1/completions",
                                 {"prompt": ONCE, "min_tokens": 3, "temperature": 0,
                                  "logit_bias": {"2": 100}})
        self.assertEqual((st, b["usage"]["completion_tokens"]), (200, 3), b)

    def test_frequency_penalty_breaks_the_loop(self):
        greedy, fin, n = self.run_both(LOOP, max_tokens=300, temperature=0)
        self.assertGreaterEqual(greedy.count(FUN), 3)
        text, fin, n = self.run_both(LOOP, max_tokens=300, temperature=0, frequency_penalty=1.0)
        self.assertLessEqual(text.count(FUN), 1, text)
        self.assertNotEqual(text, greedy)
        # nothing generated yet at the first token: the same as greedy's
        self.assertEqual(self.ids(text)[:2], self.ids(greedy)[:2])
        pres, _, _ = self.run_both(LOOP, max_tokens=300, temperature=0, presence_penalty=1.5)
        self.assertLessEqual(pres.count(FUN), 1, pres)
        self.assertNotEqual(pres, text)
        rep, _, _ = self.run_both(LOOP, max_tokens=300, temperature=0, repetition_penalty=1.3)
        self.assertLessEqual(rep.count(FUN), 1, rep)
        # a negative frequency penalty (it favours repeats) changes the text too
        neg, _, _ = self.run_both(LOOP, max_tokens=100, temperature=0, frequency_penalty=-0.5)
        self.assertNotEqual(neg, greedy[:len(neg)])

    def test_seeded_sampling_with_penalties_reproducible(self):
        kw = dict(max_tokens=64, temperature=0.9, seed=1234, frequency_penalty=0.7,
                  presence_penalty=0.3, repetition_penalty=1.1, logit_bias={"432": -5})
        a = self.run_both(ONCE, **kw)
        b = self.run_both(ONCE, **kw)
        self.assertEqual(a, b)
        c = self.run_both(ONCE, **dict(kw, seed=1235))
        self.assertNotEqual(a[0], c[0])

    def test_streamed_equals_whole(self):
        kw = dict(max_tokens=40, temperature=0, frequency_penalty=1.2,
                  stop_token_ids=[GREEDY_IDS[4]], min_tokens=6)
        want = self.run_both(ONCE, **kw)
        for c in (self.dis, self.mix):
            kw2 = dict(kw)
            max_tokens = kw2.pop("max_tokens")
            status, text, events, done = c.stream_text(ONCE, max_tokens, **kw2)
            self.assertEqual((status, done), (200, True))
            self.assertEqual(text, want[0])
            self.assertEqual(events[-1]["choices"][0]["finish_reason"], want[1])


if __name__ == "__main__":
    unittest.main()
