"""MTP2 through a real cluster: greedy output identical with MTP depth 0, 1 and 2 (worker
--mtp-depth and the request's "mtp_depth"), single and batched, disaggregated (the module KV
and the hand-off state cross the KV transfer) and on a mixed worker; EOS and max_tokens
that fall inside an accepted run; workers whose modules do not match; the spec-decode
counters of the heartbeats; seeded sampling with one-hot drafts identical to depth 0.

The workers pin their depth (--mtp-adaptive false) unless a test says otherwise: on
stories260K the controller would rightly turn drafting off for batches (a verify of three
tokens costs ~2-5 plain steps on a model this small), and these tests are about the
draft-and-verify path itself."""

import os
import re
import shutil
import struct
import sys
import tempfile
import threading
import time
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cluster import BIN, MODEL, Cluster  # noqa: E402

REF = {
    "Once upon a time": ", there was a little girl named Lily. She loved to play outside in "
                        "the park. One day, she saw a big, red ball. She wanted to play with it,",
    "Tom and Sue went to the": " park. They saw a big box with a big box. They wanted to play "
                               "with it. They wanted to play with the box. They wanted to play "
                               "with the box.",
}
PINNED = ["--mtp-adaptive", "false"]


class RoleCluster(Cluster):
    """A cluster whose workers get extra flags per role (role_args[role])."""

    def __init__(self, roles, role_args=None, **kw):
        super().__init__(roles=roles, **kw)
        self.role_args = role_args or {}

    def start_worker(self, name, role):
        saved = self.worker_args
        self.worker_args = saved + list(self.role_args.get(role, []))
        try:
            return super().start_worker(name, role)
        finally:
            self.worker_args = saved


def spec_counters(c, timeout=3.0, want_drafts=None):
    """Sum of the spec-decode counters over the workers (/metrics), after the heartbeats
    have caught up (waits until num_drafts reaches want_drafts when given, or for two
    equal readings)."""
    deadline = time.time() + timeout
    last = None
    while True:
        status, text = c.request("GET", "/metrics")
        assert status == 200
        tot = {"drafts": 0, "draft_tokens": 0, "accepted": 0, "pos0": 0, "pos1": 0}
        for line in text.split("\n"):
            m = re.match(r"tidepool_spec_decode_num_(\w+)_total\{([^}]*)\} (\d+)", line)
            if not m:
                continue
            name, labels, v = m.group(1), m.group(2), int(m.group(3))
            if name == "drafts":
                tot["drafts"] += v
            elif name == "draft_tokens":
                tot["draft_tokens"] += v
            elif name == "accepted_tokens":
                tot["accepted"] += v
            elif name == "accepted_tokens_per_pos":
                tot["pos0" if 'position="0"' in labels else "pos1"] += v
        done = (want_drafts is not None and tot["drafts"] >= want_drafts) or \
               (want_drafts is None and tot == last)
        if done or time.time() > deadline:
            return tot
        last = tot
        time.sleep(0.3)


def run_all(c, jobs, concurrent):
    """jobs: list of (prompt, kwargs); returns the (status, body) of each."""
    out = [None] * len(jobs)

    def one(i):
        p, kw = jobs[i]
        kw = dict(kw)
        out[i] = c.complete(p, max_tokens=kw.pop("max_tokens", 48), **kw)

    if not concurrent:
        for i in range(len(jobs)):
            one(i)
        return out
    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    return out


class MtpGreedy(unittest.TestCase):
    def check_identity(self, roles, worker_args):
        """Reference prompts at request depth absent/0/1/2, one at a time and 16 at once:
        always the plain greedy text."""
        with Cluster(roles=roles, worker_args=worker_args) as c:
            depths = [None, 0, 1, 2]
            jobs = []
            for d in depths:
                for p in REF:
                    kw = {} if d is None else {"mtp_depth": d}
                    jobs.append((p, kw))
            for concurrent in (False, True):
                batch = jobs if not concurrent else jobs * 2
                for (p, kw), (status, body) in zip(batch, run_all(c, batch, concurrent)):
                    self.assertEqual(status, 200, body)
                    self.assertEqual(body["choices"][0]["text"], REF[p], (p, kw, concurrent))
                    self.assertEqual(body["usage"]["completion_tokens"], 48)
            tot = spec_counters(c)
            return tot

    def test_disaggregated_pinned_depth2(self):
        tot = self.check_identity(("prefill", "decode"), PINNED)
        self.assertGreater(tot["drafts"], 0)
        self.assertGreater(tot["accepted"], 0)
        self.assertEqual(tot["accepted"], tot["pos0"] + tot["pos1"])
        self.assertLessEqual(tot["accepted"], tot["draft_tokens"])
        mal = 1 + tot["accepted"] / tot["drafts"]
        self.assertGreater(mal, 1.8, tot)  # greedy on these prompts: ~2.5 at depth 2

    def test_mixed_pinned_depth2(self):
        tot = self.check_identity(("mixed",), PINNED)
        self.assertGreater(tot["accepted"], 0)

    def test_worker_depth1(self):
        tot = self.check_identity(("prefill", "decode"), PINNED + ["--mtp-depth", "1"])
        self.assertGreater(tot["drafts"], 0)
        self.assertEqual(tot["pos1"], 0)  # never a second draft
        self.assertEqual(tot["draft_tokens"], tot["drafts"])

    def test_worker_depth0(self):
        tot = self.check_identity(("prefill", "decode"), ["--mtp-depth", "0"])
        self.assertEqual(tot["drafts"], 0)

    def test_adaptive_default(self):
        """The shipped defaults (adaptive depth): same text."""
        self.check_identity(("prefill", "decode"), [])

    def test_adaptive_batch1_follows_measured_cost(self):
        """Adaptive default, one request at a time (batch 1) on a mixed worker: the
        controller drafts at depth 2 when the worker's measured step costs (its start-up
        log) and the file's acceptance say depth 2 pays clearly, and mostly not (probes
        only) when it clearly does not. Same text either way."""
        with Cluster(roles=("mixed",), worker_args=[]) as c:
            name = c.worker_names()[0]
            log = c.log(name)
            m = re.search(r"MTP cost at batch 1: plain step [0-9.]+ ms; depth 1 x([0-9.]+), "
                          r"depth 2 x([0-9.]+)", log)
            a = re.search(r"sequences start from acceptance ([0-9.]+), ([0-9.]+)", log)
            self.assertIsNotNone(m, log[-2000:])
            self.assertIsNotNone(a, log[-2000:])
            c1, c2 = float(m.group(1)), float(m.group(2))
            a1, a2 = float(a.group(1)), float(a.group(2))
            score = [1.0, (1 + a1) / c1, (1 + a1 + a1 * a2) / c2]
            for _ in range(2):
                for p in REF:
                    status, body = c.complete(p, max_tokens=48)
                    self.assertEqual(status, 200, body)
                    self.assertEqual(body["choices"][0]["text"], REF[p])
            tot = spec_counters(c)
            print("measured cost d1 x%.2f d2 x%.2f, score %s, counters %s" % (c1, c2, score, tot))
            if score[2] > 1.3 and score[2] >= score[1]:
                self.assertGreater(tot["pos1"], 0, tot)   # second drafts made and accepted
                self.assertGreater(tot["drafts"], 40, tot)  # ~4 * 47 / 2.4 steps at depth 2
            elif score[1] < 0.8 and score[2] < 0.8:
                self.assertLess(tot["drafts"], 30, tot)  # probes: 1 step in 16

    def test_request_depth0_drafts_nothing(self):
        with Cluster(roles=("prefill", "decode"), worker_args=PINNED) as c:
            for p in REF:
                status, body = c.complete(p, max_tokens=48, mtp_depth=0)
                self.assertEqual(body["choices"][0]["text"], REF[p])
            self.assertEqual(spec_counters(c)["drafts"], 0)
            status, body = c.complete("Once upon a time", max_tokens=48, mtp_depth=1)
            self.assertEqual(body["choices"][0]["text"], REF["Once upon a time"])
            tot = spec_counters(c, want_drafts=1)
            self.assertGreater(tot["drafts"], 0)
            self.assertEqual(tot["pos1"], 0)
            status, body = c.complete("Once upon a time", max_tokens=4, mtp_depth=3)
            self.assertEqual(status, 400)
            self.assertEqual(body["error"]["param"], "mtp_depth")

    def test_max_tokens_exact(self):
        """max_tokens 1..12 at depth 2: exactly the first N tokens of the plain output (a
        sequence never drafts past its max_tokens, so no run overshoots it)."""
        with Cluster(roles=("prefill", "decode"), worker_args=PINNED) as c:
            ref = {}
            for n in range(1, 13):
                status, b0 = c.complete("Once upon a time", max_tokens=n, mtp_depth=0)
                status, b2 = c.complete("Once upon a time", max_tokens=n, mtp_depth=2)
                self.assertEqual(status, 200, b2)
                self.assertEqual(b2["choices"][0]["text"], b0["choices"][0]["text"], n)
                self.assertEqual(b2["usage"]["completion_tokens"], n)
                self.assertEqual(b2["choices"][0]["finish_reason"], "length")
                ref[n] = b2["choices"][0]["text"]
            self.assertTrue(REF["Once upon a time"].startswith(ref[12]))


def model_with_eos(tmpdir, eos_id):
    """A copy of the test model whose EOS is token eos_id (a word the greedy text holds), so
    that EOS falls inside accepted runs. The fingerprint does not cover the EOS id."""
    path = os.path.join(tmpdir, "stories260K.gguf")
    shutil.copy(MODEL, path)
    with open(path, "r+b") as f:
        data = f.read()
        key = b"tokenizer.ggml.eos_token_id"
        i = data.find(key)
        assert i > 0
        vtype = struct.unpack_from("<I", data, i + len(key))[0]
        assert vtype in (4, 5)  # u32 / i32
        f.seek(i + len(key) + 4)
        f.write(struct.pack("<I", eos_id))
    return path


class MtpEos(unittest.TestCase):
    def test_eos_inside_accepted_runs(self):
        # greedy ids after BOS "Once upon a time": 432 383 286 261 376 298 315 421 395 317
        # (", there was a little girl named Lily. She"): EOS = " Lily" (421) ends the answer
        # after 7 tokens, EOS = "." (395) after 8. (The gateway's detokenizer treats the
        # EOS id as a control token, so the text is compared between depths, not to a
        # fixed string.)
        tmp = tempfile.mkdtemp(prefix="tidepool-mtp-eos-")
        try:
            for eos, n_tok in ((421, 7), (395, 8)):
                model = model_with_eos(tmp, eos)
                for roles in (("prefill", "decode"), ("mixed",)):
                    with Cluster(roles=roles, worker_args=PINNED, model=model) as c:
                        want = None
                        for d in (0, 1, 2):
                            status, body = c.complete("Once upon a time", max_tokens=40,
                                                      mtp_depth=d)
                            self.assertEqual(status, 200, body)
                            ch = body["choices"][0]
                            self.assertEqual(ch["finish_reason"], "stop", (eos, roles, d))
                            self.assertEqual(body["usage"]["completion_tokens"], n_tok)
                            want = ch["text"] if want is None else want
                            self.assertEqual(ch["text"], want, (eos, roles, d))
                        # streamed: nothing after the EOS either
                        status, text, events, done = c.stream_text(
                            "Once upon a time", max_tokens=40, mtp_depth=2)
                        self.assertEqual(text, want)
                        self.assertTrue(done)
                        self.assertGreater(spec_counters(c)["accepted"], 0)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)


class MtpMismatch(unittest.TestCase):
    def test_decode_without_modules(self):
        """The prefill worker sends module layers; the decode worker has none: it takes the
        main layers and decodes plainly."""
        with RoleCluster(("prefill", "decode"), {"decode": ["--mtp", "none"]},
                         worker_args=PINNED) as c:
            for p in REF:
                status, body = c.complete(p, max_tokens=48)
                self.assertEqual(body["choices"][0]["text"], REF[p])
            self.assertEqual(spec_counters(c)["drafts"], 0)

    def test_prefill_without_modules(self):
        """The decode worker has modules but the transfer carries none: plain decoding."""
        with RoleCluster(("prefill", "decode"), {"prefill": ["--mtp", "none"]},
                         worker_args=PINNED) as c:
            for p in REF:
                status, body = c.complete(p, max_tokens=48)
                self.assertEqual(body["choices"][0]["text"], REF[p])
            self.assertEqual(spec_counters(c)["drafts"], 0)

    def test_bad_side_file(self):
        """A bad --mtp file stops the worker at start-up with a message naming it."""
        tmp = tempfile.mkdtemp(prefix="tidepool-mtp-bad-")
        try:
            bad = os.path.join(tmp, "bad-mtp.gguf")
            with open(bad, "wb") as f:
                f.write(b"GGUF\x03\x00\x00\x00garbage")
            c = Cluster(roles=())
            try:
                p = c._spawn("decode-x", [os.path.join(BIN, "decode_worker"), "--model", MODEL,
                                          "--mtp", bad, "--gateway", c.ctl,
                                          "--kv-bind", "tcp://127.0.0.1:*"])
                rc = p.wait(timeout=30)
                self.assertNotEqual(rc, 0)
                self.assertIn(bad, c.log("decode-x"))
                self.assertIn("MTP", c.log("decode-x"))
            finally:
                c.stop()
        finally:
            shutil.rmtree(tmp, ignore_errors=True)


class MtpSampling(unittest.TestCase):
    def test_onehot_seeded_identical_to_depth0(self):
        """With one-hot drafts, a seeded sampled request gives the depth-0 tokens at any
        depth, batched or not (the rejection-sampling distribution test is the C unit test
        test_mtp/test_specdec_sampling_distribution)."""
        with Cluster(roles=("prefill", "decode"),
                     worker_args=PINNED + ["--mtp-sampling", "onehot"]) as c:
            jobs = []
            for seed in range(1, 9):
                for d in (0, 2):
                    jobs.append(("Once upon a time", {"temperature": 1.0, "seed": seed,
                                                      "mtp_depth": d, "max_tokens": 40}))
            for concurrent in (False, True):
                res = run_all(c, jobs, concurrent)
                for k in range(0, len(jobs), 2):
                    t0 = res[k][1]["choices"][0]["text"]
                    t2 = res[k + 1][1]["choices"][0]["text"]
                    self.assertEqual(t0, t2, jobs[k])
            self.assertGreater(spec_counters(c)["accepted"], 0)

    def test_seeded_explicit_depth_same_on_every_worker(self):
        """A sampled request that gives "mtp_depth" decodes at that depth on an adaptive
        worker too, so its seed gives the tokens a worker with a fixed depth gives: the
        controller's costs are each worker's own start-up timings, and with it the same
        seed gave other tokens on another worker (or after a restart)."""
        jobs = [{"temperature": 1.0, "seed": s, "mtp_depth": d, "max_tokens": 300}
                for s in (1, 2, 3) for d in (1, 2)]
        outs = []
        for args in ([], PINNED):
            with Cluster(roles=("mixed",), worker_args=args) as c:
                got = []
                for kw in jobs:
                    st, b = c.complete("Once upon a time", **kw)
                    self.assertEqual(st, 200, b)
                    got.append(b["choices"][0]["text"])
                outs.append(got)
        self.assertEqual(outs[0], outs[1])

    def test_rejection_seeded_reproducible(self):
        """Rejection sampling (the default): the same seed alone gives the same tokens."""
        with Cluster(roles=("prefill", "decode")) as c:
            outs = [c.complete("Once upon a time", max_tokens=40, temperature=1.0, seed=s)[1]
                    for s in (7, 7, 8)]
            texts = [o["choices"][0]["text"] for o in outs]
            self.assertEqual(texts[0], texts[1])
            self.assertNotEqual(texts[0], texts[2])


if __name__ == "__main__":
    unittest.main()
