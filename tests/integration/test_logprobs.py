"""Log-probabilities (docs/api.md "Log-probabilities") on stories260K with exact
expectations: completions "logprobs" and chat "logprobs" + "top_logprobs", streamed and not,
in OpenAI's shapes; the values equal a reference log-softmax of the engine's plain forward
pass (tidepool-generate --logprobs, computed in double there) within 1e-4; greedy: the
emitted token is the most likely one; the same values disaggregated or mixed, at MTP depth
0 or 2 (each position's from its own verify logits), and after a decode worker is killed
mid-stream (the entries already sent travelled with their tokens).
    python3 -m unittest -v tests/integration/test_logprobs.py
"""

import os
import subprocess
import sys
import threading
import time
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cluster import BIN, MODEL, Cluster  # noqa: E402
from test_e2e import worker_figures  # noqa: E402

ONCE = "Once upon a time"
LILY = "Lily liked to"
TOL = 1e-4
PINNED = ["--mtp-adaptive", "false"]


def reference(prompt, n, k):
    """[(token id, logprob, [(id, logprob)] * k)] of n greedy tokens after BOS + prompt,
    from tidepool-generate --logprobs k (one token per forward pass, no batching, no MTP)."""
    r = subprocess.run([os.path.join(BIN, "tidepool-generate"), "--model", MODEL, "--prompt",
                        prompt, "--max-tokens", str(n), "--logprobs", str(k)],
                       capture_output=True, text=True, timeout=60, check=True)
    out = []
    for line in r.stderr.splitlines():
        if not line.startswith("logprob "):
            continue
        f = line.split()
        top = [(int(a), float(b)) for a, b in (x.split(":") for x in f[3:])]
        out.append((int(f[1]), float(f[2]), top))
    return out


class Logprobs(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.dis = Cluster(roles=("prefill", "decode"), worker_args=PINNED)
        cls.mix = Cluster(roles=("mixed",), worker_args=PINNED)
        cls.dis.__enter__()
        cls.mix.__enter__()

    @classmethod
    def tearDownClass(cls):
        cls.dis.__exit__(None, None, None)
        cls.mix.__exit__(None, None, None)

    def piece(self, i):
        """The text of token i after a token that is not BOS."""
        st, t = self.dis.request("POST", "/detokenize", {"tokens": [13, i]})
        st2, t0 = self.dis.request("POST", "/detokenize", {"tokens": [13]})
        return t["prompt"][len(t0["prompt"]):]

    def check_completions(self, lp, text, ref, k):
        self.assertEqual(sorted(lp), ["text_offset", "token_logprobs", "tokens", "top_logprobs"])
        self.assertEqual(len(lp["tokens"]), len(ref))
        self.assertEqual("".join(lp["tokens"]), text)
        off = 0
        for i, (tid, want, top) in enumerate(ref):
            got = lp["token_logprobs"][i]
            self.assertAlmostEqual(got, want, delta=TOL, msg=i)
            alts = lp["top_logprobs"][i]
            self.assertEqual(len(alts), k)
            # greedy: the emitted token is the most likely one, listed first
            self.assertEqual(next(iter(alts)), lp["tokens"][i])
            self.assertEqual(alts[lp["tokens"][i]], got)
            self.assertEqual(max(alts.values()), got)
            for (aid, av), (ak, gv) in zip(top, alts.items()):
                self.assertAlmostEqual(gv, av, delta=TOL, msg=(i, ak))
            self.assertEqual(lp["text_offset"][i], off)
            off += len(lp["tokens"][i])
        self.assertEqual(ref[0][0], ref[0][2][0][0])

    def test_completions_equal_reference(self):
        ref = reference(ONCE, 24, 5)
        self.assertEqual(len(ref), 24)
        for c in (self.dis, self.mix):
            for d in (0, 2):
                st, b = c.complete(ONCE, max_tokens=24, logprobs=5, mtp_depth=d)
                self.assertEqual(st, 200, b)
                ch = b["choices"][0]
                self.check_completions(ch["logprobs"], ch["text"], ref, 5)
                self.assertEqual(self.piece(ref[1][0]), ch["logprobs"]["tokens"][1])

    def test_same_values_everywhere(self):
        """Disaggregated or mixed, MTP depth 0 or 2: identical values (the forward pass is
        batch invariant and each position's logprobs come from its own verify logits)."""
        got = []
        for c in (self.dis, self.mix):
            for d in (0, 2):
                st, b = c.complete(LILY, max_tokens=40, logprobs=3, mtp_depth=d)
                self.assertEqual(st, 200, b)
                got.append(b["choices"][0]["logprobs"])
        for g in got[1:]:
            self.assertEqual(g["tokens"], got[0]["tokens"])
            for a, w in zip(g["token_logprobs"], got[0]["token_logprobs"]):
                self.assertAlmostEqual(a, w, delta=1e-5)

    def test_logprobs_zero_and_absent(self):
        st, b = self.dis.complete(ONCE, max_tokens=3, logprobs=0)
        lp = b["choices"][0]["logprobs"]
        self.assertEqual(lp["top_logprobs"], [{}, {}, {}])
        self.assertEqual(len(lp["token_logprobs"]), 3)
        st, b = self.dis.complete(ONCE, max_tokens=3)
        self.assertIsNone(b["choices"][0]["logprobs"])

    def test_completions_stream(self):
        st, b = self.dis.complete(ONCE, max_tokens=16, logprobs=2)
        want = b["choices"][0]["logprobs"]
        for c in (self.dis, self.mix):
            st, events, done = c.stream("/v1/completions", {
                "prompt": ONCE, "max_tokens": 16, "temperature": 0, "logprobs": 2})
            self.assertEqual((st, done), (200, True))
            got = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
            text = ""
            for e in events:
                for ch in e.get("choices", []):
                    text += ch["text"]
                    if ch["logprobs"] is not None:
                        for key in got:
                            got[key] += ch["logprobs"][key]
            self.assertEqual(got, want)
            self.assertEqual(text, b["choices"][0]["text"])

    def test_chat(self):
        body = {"messages": [{"role": "user", "content": "Tell me a story."}],
                "max_tokens": 12, "temperature": 0, "logprobs": True, "top_logprobs": 20}
        st, b = self.dis.request("POST", "/v1/chat/completions", body)
        self.assertEqual(st, 200, b)
        ch = b["choices"][0]
        lp = ch["logprobs"]
        self.assertIsNone(lp["refusal"])
        content = lp["content"]
        self.assertEqual(len(content), b["usage"]["completion_tokens"])
        self.assertEqual("".join(x["token"] for x in content), ch["message"]["content"])
        for x in content:
            self.assertEqual(sorted(x), ["bytes", "logprob", "token", "top_logprobs"])
            self.assertEqual(x["bytes"], list(x["token"].encode()))
            self.assertEqual(len(x["top_logprobs"]), 20)
            self.assertEqual(x["top_logprobs"][0]["token"], x["token"])
            self.assertEqual(x["top_logprobs"][0]["logprob"], x["logprob"])
            vals = [t["logprob"] for t in x["top_logprobs"]]
            self.assertEqual(vals, sorted(vals, reverse=True))
            self.assertLessEqual(x["logprob"], 0)
        # without "logprobs": null
        st, r = self.dis.request("POST", "/v1/chat/completions", dict(body, logprobs=False,
                                                                      top_logprobs=None))
        self.assertIsNone(r["choices"][0]["logprobs"])
        # streamed: the chunks carry the same entries, in order
        for c in (self.dis, self.mix):
            st, events, done = c.stream("/v1/chat/completions", body)
            self.assertEqual((st, done), (200, True))
            got = [x for e in events for chn in e.get("choices", [])
                   if chn.get("logprobs") for x in chn["logprobs"]["content"]]
            self.assertEqual(got, content)

    def test_stop_string_and_n(self):
        """A stop string: entries up to the token that completed it (usage counts them);
        n = 2 greedy choices carry the same entries."""
        st, b = self.dis.complete(ONCE, max_tokens=30, logprobs=1, stop=["little"], n=2)
        self.assertEqual(st, 200, b)
        a, c = b["choices"]
        self.assertEqual(a["finish_reason"], "stop")
        self.assertEqual(a["logprobs"], c["logprobs"])
        self.assertEqual(len(a["logprobs"]["tokens"]), b["usage"]["completion_tokens"] // 2)
        self.assertTrue("".join(a["logprobs"]["tokens"]).startswith(a["text"]))
        self.assertIn("little", "".join(a["logprobs"]["tokens"]))

    def test_echo_known_prompt(self):
        """echo: a prompt of BOS + "Once upon a time" + its first 140 greedy tokens (ids:
        three echo chunks of 64): the prompt's entries are those of the reference at the
        same positions (1e-4, the same top ids), the first one null; then the completion."""
        n_ref = 140
        ref = reference(ONCE, n_ref + 1, 5)
        head = [1, 403, 407, 261, 378]  # BOS + "Once upon a time"
        ids = head + [t for t, _, _ in ref[:n_ref]]
        for c in (self.dis, self.mix):
            st, b = c.complete(ids, max_tokens=1, logprobs=5, echo=True)
            self.assertEqual(st, 200, b)
            ch = b["choices"][0]
            lp = ch["logprobs"]
            self.assertEqual(len(lp["tokens"]), len(ids) + 1)
            self.assertEqual(lp["token_logprobs"][0], None)
            self.assertEqual(lp["top_logprobs"][0], None)
            self.assertEqual(lp["tokens"][0], "")  # BOS
            self.assertEqual("".join(lp["tokens"]), ch["text"])
            for i, (tid, want, top) in enumerate(ref):
                pos = len(head) + i  # the reference's token i is at this position
                self.assertAlmostEqual(lp["token_logprobs"][pos], want, delta=TOL, msg=pos)
                vals = list(lp["top_logprobs"][pos].values())
                self.assertEqual(len(vals), 5)
                for (aid, av), gv in zip(top, vals):
                    self.assertAlmostEqual(gv, av, delta=TOL, msg=pos)
            for i in range(1, len(ids) + 1):
                self.assertLessEqual(lp["token_logprobs"][i], 0)
            self.assertEqual(lp["text_offset"][1:4], [0, 4, 9])  # "Once", " upon", " a"
        # text prompt: its text as given, then the completion; without logprobs only text
        st, b = self.dis.complete(ONCE, max_tokens=4, echo=True)
        st2, b2 = self.dis.complete(ONCE, max_tokens=4)
        self.assertEqual(b["choices"][0]["text"], ONCE + b2["choices"][0]["text"])
        self.assertIsNone(b["choices"][0]["logprobs"])
        st, b = self.dis.complete(ONCE, max_tokens=4, echo=True, logprobs=1)
        st3, b3 = self.dis.complete(ONCE, max_tokens=4, logprobs=1)
        lp, gen = b["choices"][0]["logprobs"], b3["choices"][0]["logprobs"]
        self.assertEqual(lp["tokens"], ["", "Once", " upon", " a", " time"] + gen["tokens"])
        self.assertEqual(lp["token_logprobs"][5:], gen["token_logprobs"])
        self.assertEqual(lp["text_offset"][5:], [len(ONCE) + o for o in gen["text_offset"]])
        self.assertEqual(b["usage"], b2["usage"])

    def test_echo_streamed(self):
        """echo streamed: the prompt's text (and entries) as each choice's first chunk, then
        the answer; joined, exactly the non-streamed reply (text, tokens, values, offsets)."""
        for body in ({"prompt": ONCE, "max_tokens": 6, "temperature": 0, "echo": True},
                     {"prompt": ONCE, "max_tokens": 6, "temperature": 0, "echo": True,
                      "logprobs": 2},
                     {"prompt": ONCE, "max_tokens": 5, "temperature": 0, "echo": True,
                      "logprobs": 1, "n": 2}):
            st, b = self.dis.request("POST", "/v1/completions", body)
            self.assertEqual(st, 200, b)
            st, events, done = self.dis.stream("/v1/completions", body)
            self.assertEqual((st, done), (200, True))
            n = body.get("n", 1)
            text = [""] * n
            got = [{"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
                   for _ in range(n)]
            first = [None] * n
            for e in events:
                for ch in e.get("choices", []):
                    i = ch["index"]
                    if first[i] is None and ch["text"]:
                        first[i] = ch["text"]
                    text[i] += ch["text"]
                    if ch.get("logprobs") is not None:
                        for key in got[i]:
                            got[i][key] += ch["logprobs"][key]
            for i in range(n):
                want = b["choices"][i]
                self.assertEqual(first[i], ONCE)  # the echo comes first, whole
                self.assertEqual(text[i], want["text"])
                if "logprobs" in body:
                    self.assertEqual(got[i], want["logprobs"])
                    self.assertIsNone(got[i]["token_logprobs"][0])  # BOS: no value

    def test_bad_values(self):
        chat = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2}
        for path, body, param in [
                ("/v1/completions", {"prompt": "x", "logprobs": 6}, "logprobs"),
                ("/v1/completions", {"prompt": "x", "logprobs": -1}, "logprobs"),
                ("/v1/completions", {"prompt": "x", "logprobs": "2"}, "logprobs"),
                ("/v1/completions", {"prompt": "x", "top_logprobs": 2}, "top_logprobs"),
                ("/v1/chat/completions", dict(chat, logprobs=True, top_logprobs=21),
                 "top_logprobs"),
                ("/v1/chat/completions", dict(chat, top_logprobs=2), "top_logprobs"),
                ("/v1/chat/completions", dict(chat, logprobs=1), "logprobs"),
                ("/v1/responses", {"input": "x", "logprobs": True}, "logprobs"),
                ("/v1/completions", {"prompt": "x", "echo": 1}, "echo"),
                ("/v1/chat/completions", dict(chat, echo=True), "echo")]:
            st, b = self.dis.request("POST", path, body)
            self.assertEqual(st, 400, (path, body, b))
            self.assertEqual(b["error"]["param"], param, b)
            self.assertEqual(b["error"]["type"], "invalid_request_error", b)


class LogprobsRetry(unittest.TestCase):
    def test_killed_decode_worker_keeps_logprobs(self):
        """A decode worker SIGKILLed mid-stream: the re-run continues from the tokens so far
        and the answer's log-probabilities equal an undisturbed run's."""
        with Cluster(roles=("prefill", "decode", "decode"),
                     worker_args=["--debug-step-delay-ms", "25"]) as c:
            body = {"prompt": ONCE, "max_tokens": 100, "temperature": 0, "logprobs": 2}
            st, b = c.request("POST", "/v1/completions", body)
            want = b["choices"][0]["logprobs"]
            deadline = time.time() + 5  # the heartbeats show that run ended
            while time.time() < deadline and any(
                    worker_figures(c).get(k, {}).get("running", 1) for k in ("decode-1",
                                                                             "decode-2")):
                time.sleep(0.05)
            result = []
            t = threading.Thread(target=lambda: result.append(c.stream("/v1/completions",
                                                                       body)))
            t.start()
            victim, deadline = None, time.time() + 5
            while victim is None and time.time() < deadline:
                figs = worker_figures(c)
                victim = next((k for k in ("decode-1", "decode-2")
                               if figs.get(k, {}).get("running", 0) >= 1), None)
                time.sleep(0.05)
            self.assertIsNotNone(victim)
            time.sleep(0.5)
            c.kill(victim)
            t.join(60)
            st, events, done = result[0]
            self.assertEqual((st, done), (200, True))
            got = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
            for e in events:
                for ch in e.get("choices", []):
                    if ch["logprobs"] is not None:
                        for key in got:
                            got[key] += ch["logprobs"][key]
            self.assertEqual(got["tokens"], want["tokens"])
            self.assertEqual(got["text_offset"], want["text_offset"])
            for a, w in zip(got["token_logprobs"], want["token_logprobs"]):
                self.assertAlmostEqual(a, w, delta=1e-5)
            self.assertIn("retrying", c.log("gateway"))


if __name__ == "__main__":
    unittest.main()
