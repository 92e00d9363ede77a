"""Several choices in one request, end to end (real gateway + workers over HTTP):

- batched prompts on /v1/completions ("prompt": [str, ...] or [[ids], ...]): one choice
  per prompt in order, each equal to that prompt's answer alone, streamed (every chunk names
  its choice) and not, usage summed; a batch with one prompt too long is refused as a whole
  (400) before any of it is admitted;
- "n" for completions and chat: greedy choices identical, seeded choices seed + i (equal to
  the one-choice answers with seeds seed, seed + 1, ...), distinct and reproducible; index
  n x prompt + i with batched prompts; best_of > n: the n of best_of seeded sequences with
  the highest cumulative log-probability, best first (not streamed);
- Batch API lines with batched prompts and n go through the same path."""

import json
import os
import re
import sys
import time
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cluster import Cluster  # noqa: E402
from test_batch import create, file_lines, upload, wait_batch  # noqa: E402

PROMPTS = ["Once upon a time", "Tom and Sue went to the", "The cat"]
IDS = [1, 403, 407, 261, 378]  # BOS + "Once upon a time"


def received(c):
    """The gateway's count of completion requests received (a refusal counts once)."""
    status, text = c.request("GET", "/metrics")
    m = re.search(r"^tidepool[:_]requests_received_total(?:\{[^}]*\})? (\S+)$", text, re.M)
    return float(m.group(1))


class ChoicesTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.c = Cluster(roles=("prefill", "decode"))
        cls.c.start()

    @classmethod
    def tearDownClass(cls):
        cls.c.stop()
        assert not cls.c.sanitizer_reports(), cls.c.sanitizer_reports()

    def alone(self, prompt, **kw):
        status, body = self.c.complete(prompt, max_tokens=kw.pop("max_tokens", 24), **kw)
        self.assertEqual(status, 200, body)
        return body

    def test_batched_text_prompts(self):
        singles = [self.alone(p) for p in PROMPTS]
        status, body = self.c.complete(PROMPTS, max_tokens=24)
        self.assertEqual(status, 200, body)
        self.assertEqual([ch["index"] for ch in body["choices"]], [0, 1, 2])
        self.assertEqual([ch["text"] for ch in body["choices"]],
                         [s["choices"][0]["text"] for s in singles])
        self.assertEqual([ch["finish_reason"] for ch in body["choices"]],
                         [s["choices"][0]["finish_reason"] for s in singles])
        for k in ("prompt_tokens", "completion_tokens", "total_tokens"):
            self.assertEqual(body["usage"][k], sum(s["usage"][k] for s in singles), k)
        # streamed: every chunk carries its index; the texts per index are the same
        status, events, done = self.c.stream(
            "/v1/completions", {"prompt": PROMPTS, "max_tokens": 24, "temperature": 0,
                                "stream_options": {"include_usage": True}})
        self.assertEqual((status, done), (200, True))
        texts, finish = ["", "", ""], [None, None, None]
        for e in events:
            for ch in e["choices"]:
                texts[ch["index"]] += ch["text"]
                if ch["finish_reason"]:
                    self.assertIsNone(finish[ch["index"]])
                    finish[ch["index"]] = ch["finish_reason"]
        self.assertEqual(texts, [ch["text"] for ch in body["choices"]])
        self.assertEqual(finish, [ch["finish_reason"] for ch in body["choices"]])
        self.assertEqual(events[-1]["choices"], [])
        self.assertEqual(events[-1]["usage"], body["usage"])

    def test_batched_token_id_prompts(self):
        one = self.alone(IDS)
        two = self.alone([1, 403, 407])
        status, body = self.c.complete([IDS, [1, 403, 407], IDS], max_tokens=24)
        self.assertEqual(status, 200, body)
        self.assertEqual([ch["text"] for ch in body["choices"]],
                         [one["choices"][0]["text"], two["choices"][0]["text"],
                          one["choices"][0]["text"]])
        self.assertEqual(body["usage"]["prompt_tokens"], 5 + 3 + 5)
        # the text prompt and its ids give the same answer, in one batch too
        status, body = self.c.complete(["Once upon a time", IDS], max_tokens=24)
        self.assertEqual(status, 200, body)
        self.assertEqual(body["choices"][0]["text"], body["choices"][1]["text"])

    def test_batch_with_a_prompt_too_long_is_refused_whole(self):
        before = received(self.c)
        status, body = self.c.complete(["Once upon a time", [5] * 600], max_tokens=4)
        self.assertEqual(status, 400, body)
        self.assertEqual(body["error"]["code"], "context_length_exceeded")
        self.assertIn("(prompt 1 of the batch)", body["error"]["message"])
        self.assertEqual(received(self.c), before + 1)  # one refusal, nothing admitted
        status, body = self.c.complete(["Once upon a time", [1, 600]], max_tokens=4)
        self.assertEqual(status, 400, body)
        self.assertEqual(body["error"]["message"],
                         "token id 600 (element 1 of 'prompt') is not in the model's "
                         "vocabulary of 512 tokens. (prompt 1 of the batch)")

    def test_n_greedy_identical(self):
        one = self.alone("Once upon a time")["choices"][0]["text"]
        status, body = self.c.complete("Once upon a time", max_tokens=24, n=3)
        self.assertEqual(status, 200, body)
        self.assertEqual([ch["index"] for ch in body["choices"]], [0, 1, 2])
        self.assertEqual([ch["text"] for ch in body["choices"]], [one] * 3)
        self.assertEqual(body["usage"]["completion_tokens"], 3 * self.alone(
            "Once upon a time")["usage"]["completion_tokens"])
        self.assertEqual(body["usage"]["prompt_tokens"], 5)  # the prompt counts once

    def test_n_seeded_distinct_reproducible(self):
        # a pinned depth: seeded sampling is then exact whatever runs beside it (docs/api.md
        # "Speculative decoding (MTP)"); n choices run side by side
        kw = {"max_tokens": 32, "temperature": 1.0, "mtp_depth": 0}
        singles = [self.alone("Once upon a time", seed=s, **kw)["choices"][0]["text"]
                   for s in (41, 42, 43)]
        self.assertEqual(len(set(singles)), 3)
        status, body = self.c.complete("Once upon a time", n=3, seed=41, **kw)
        self.assertEqual(status, 200, body)
        self.assertEqual([ch["text"] for ch in body["choices"]], singles)  # seed + i
        status, again = self.c.complete("Once upon a time", n=3, seed=41, **kw)
        self.assertEqual([ch["text"] for ch in again["choices"]], singles)
        # chat, streamed: the same seeds give the same texts as chat one at a time
        msgs = [{"role": "user", "content": "Tell me a story."}]
        chat_singles = []
        for s in (41, 42):
            status, b = self.c.request("POST", "/v1/chat/completions",
                                       {"messages": msgs, "seed": s, **kw})
            self.assertEqual(status, 200, b)
            chat_singles.append(b["choices"][0]["message"]["content"])
        status, events, done = self.c.stream("/v1/chat/completions",
                                             {"messages": msgs, "seed": 41, "n": 2, **kw})
        self.assertEqual((status, done), (200, True))
        texts, roles = ["", ""], [0, 0]
        for e in events:
            for ch in e["choices"]:
                roles[ch["index"]] += ch["delta"].get("role") == "assistant"
                texts[ch["index"]] += ch["delta"].get("content") or ""
        self.assertEqual(roles, [1, 1])
        self.assertEqual(texts, chat_singles)
        # without a seed, n choices are distinct (random seeds of their own)
        status, body = self.c.complete("Once upon a time", n=3, **kw)
        self.assertEqual(len({ch["text"] for ch in body["choices"]}), 3)

    def test_batched_prompts_with_n(self):
        kw = {"max_tokens": 20, "temperature": 1.0, "mtp_depth": 0}
        want = [self.alone(p, seed=7 + i, **kw)["choices"][0]["text"]
                for p in PROMPTS[:2] for i in range(2)]
        status, body = self.c.complete(PROMPTS[:2], n=2, seed=7, **kw)
        self.assertEqual(status, 200, body)
        self.assertEqual([ch["index"] for ch in body["choices"]], [0, 1, 2, 3])
        self.assertEqual([ch["text"] for ch in body["choices"]], want)

    def test_best_of(self):
        status, body = self.c.complete("Once upon a time", max_tokens=8, n=2, best_of=2)
        self.assertEqual(status, 200, body)
        self.assertEqual(len(body["choices"]), 2)
        # best_of > n: the sequences are those of n = best_of (seeds seed + i); the answer
        # is the n of them with the highest sum of token logprobs, best first, every
        # sequence counted in usage
        kw = {"max_tokens": 12, "temperature": 1.0, "mtp_depth": 0, "seed": 3}
        for prompts in ("Once upon a time", PROMPTS[:2]):
            np = 1 if isinstance(prompts, str) else len(prompts)
            status, every = self.c.complete(prompts, n=4, logprobs=0, **kw)
            self.assertEqual(status, 200, every)
            chs = every["choices"]
            want = []
            for p in range(np):
                sums = [sum(chs[4 * p + i]["logprobs"]["token_logprobs"]) for i in range(4)]
                self.assertEqual(len(set(sums)), 4)  # distinct: the ranking is the test
                order = sorted(range(4), key=lambda i: (-sums[i], i))
                want += [chs[4 * p + i] for i in order[:2]]
            status, body = self.c.complete(prompts, n=2, best_of=4, **kw)
            self.assertEqual(status, 200, body)
            self.assertEqual([ch["text"] for ch in body["choices"]], [w["text"] for w in want])
            self.assertEqual([ch["index"] for ch in body["choices"]], list(range(2 * np)))
            self.assertEqual([ch["logprobs"] for ch in body["choices"]], [None] * 2 * np)
            self.assertEqual(body["usage"], every["usage"])
            # with logprobs shown: the chosen sequences' own entries
            status, body = self.c.complete(prompts, n=2, best_of=4, logprobs=0, **kw)
            self.assertEqual([ch["logprobs"] for ch in body["choices"]],
                             [w["logprobs"] for w in want])
        status, body = self.c.complete("Once upon a time", n=1, best_of=3, stream=True, **kw)
        self.assertEqual(status, 400, body)
        self.assertEqual((body["error"]["param"], body["error"]["code"]),
                         ("best_of", "invalid_value"))

    def test_batch_api_lines(self):
        c = self.c
        bodies = [{"prompt": PROMPTS[:2], "max_tokens": 16, "temperature": 0},
                  {"prompt": "Once upon a time", "max_tokens": 16, "temperature": 1.0,
                   "n": 2, "seed": 5, "mtp_depth": 0}]
        want = [[self.alone(p, max_tokens=16)["choices"][0]["text"] for p in PROMPTS[:2]],
                [self.alone("Once upon a time", max_tokens=16, temperature=1.0, mtp_depth=0,
                            seed=5 + i)["choices"][0]["text"] for i in range(2)]]
        text = "".join(json.dumps({"custom_id": "l%d" % i, "method": "POST",
                                   "url": "/v1/completions", "body": b}) + "\n"
                       for i, b in enumerate(bodies))
        status, f = upload(c, text)
        self.assertEqual(status, 200, f)
        status, b = create(c, f["id"])
        self.assertEqual(status, 200, b)
        b = wait_batch(c, b["id"], timeout=120)
        self.assertEqual(b["status"], "completed", b)
        out = {l["custom_id"]: l for l in file_lines(c, b["output_file_id"])}
        for i in range(2):
            body = out["l%d" % i]["response"]["body"]
            self.assertEqual([ch["text"] for ch in body["choices"]], want[i])


if __name__ == "__main__":
    unittest.main()
