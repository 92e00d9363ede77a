"""tidepool-bench --trace against the fake OpenAI server of test_bench.py, given a /tokenize
(vLLM's form, or llama-server's): every request of the trace is sent at its arrival time
times --time-scale, its prompt exactly prompt_tokens token ids (BOS, then ids the server's
tokenizer produced), max_tokens = min_tokens = output_tokens with ignore_eos, offline lines
as service_tier flex; the summary reports the simulator's figures (SLO attainment, goodput
over the arrival span, offline tokens). Bad traces and flag mixes exit 2 with a message.
Run: python3 -m unittest -v tests/integration/test_bench_trace.py"""

import json
import os
import subprocess
import sys
import tempfile
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import test_bench  # noqa: E402
from test_bench import FakeHandler, FakeServer  # noqa: E402


BOS = 1
WORD_IDS = {w: 100 + i for i, w in enumerate(sorted(test_bench.WORDS))}


def _prompt_words(body):
    """The fake's usage.prompt_tokens is this + 1: for an id prompt, its length."""
    if isinstance(body.get("prompt"), list):
        return len(body["prompt"]) - 1
    return _orig_prompt_words(body)


_orig_prompt_words = test_bench.prompt_words
test_bench.prompt_words = _prompt_words


class TokenizeHandler(FakeHandler):
    """/tokenize: each word two ids (100 + its rank, 200 + its length), BOS = 1 first with
    special tokens. form "vllm" takes {"prompt", "add_special_tokens"} and reports
    max_model_len; form "llama" takes only {"content", "add_special"} (400 otherwise) and
    has no BOS."""

    def do_POST(self):
        if self.path != "/tokenize":
            return FakeHandler.do_POST(self)
        fake = self.server.fake
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", "0"))))
        with fake.lock:
            fake.tokenize_calls.append(body)
        if fake.form == "vllm" and "prompt" in body:
            text, special = body["prompt"], body.get("add_special_tokens", True)
        elif fake.form == "llama" and "content" in body:
            text, special = body["content"], False  # a model without BOS
        else:
            self._json(400, {"error": {"message": "bad body"}})
            return
        ids = [BOS] if special else []
        for w in text.split():
            ids += [WORD_IDS[w], 200 + len(w)]
        reply = {"tokens": ids, "count": len(ids)}
        if fake.form == "vllm":
            reply["max_model_len"] = fake.max_model_len
        self._json(200, reply)


class TraceServer(FakeServer):
    def __init__(self, form="vllm", max_model_len=4096, **kw):
        super().__init__(**kw)
        self.form, self.max_model_len = form, max_model_len
        self.tokenize_calls = []
        self.httpd.RequestHandlerClass = TokenizeHandler


# unsorted on purpose, a header, a comment, a blank line, every class spelling
TRACE = """arrival_s,prompt_tokens,output_tokens,class
# a comment
0.40,30,5,offline
0.00,12,3
0.20,7,4,online

0.20,50,2,flex
0.60,1,6,interactive
0.80,21,3,batch
"""
# sorted (stable): (arrival, prompt, output, offline)
EXPECT = [(0.0, 12, 3, 0), (0.2, 7, 4, 0), (0.2, 50, 2, 1), (0.4, 30, 5, 1), (0.6, 1, 6, 0),
          (0.8, 21, 3, 1)]


class TraceTest(unittest.TestCase):
    setUp = test_bench.BenchTest.setUp
    tearDown = test_bench.BenchTest.tearDown
    run_bench = test_bench.BenchTest.run_bench

    def write(self, name, text):
        path = os.path.join(self.tmp, name)
        with open(path, "w") as f:
            f.write(text)
        return path

    def pool(self, srv):
        """The ids the bench tokenized as its pool (the longest /tokenize text)."""
        texts = [c.get("prompt", c.get("content")) for c in srv.tokenize_calls]
        text = max(texts, key=len)
        ids = []
        for w in text.split():
            ids += [WORD_IDS[w], 200 + len(w)]
        return ids

    def check_prompt(self, prompt, n, pool, bos):
        self.assertEqual(len(prompt), n)
        body = prompt[1:] if bos else prompt
        if bos:
            self.assertEqual(prompt[0], BOS)
        if not body:
            return
        # a run of the pool (wrapping around), starting anywhere
        starts = [i for i in range(len(pool)) if pool[i] == body[0]]
        self.assertTrue(any(all(pool[(s + k) % len(pool)] == body[k] for k in range(len(body)))
                            for s in starts), prompt)

    def test_replay_shapes_times_and_classes(self):
        trace = self.write("t.csv", TRACE)
        with TraceServer(ttft_s=0.01, itl_s=0.002) as srv:
            rc, out, err, summ, res = self.run_bench(
                "--url", srv.url, "--trace", trace, "--time-scale", "2", "--seed", "5",
                "--goodput", "ttft:5000", "tpot:1000", "--trace-out",
                os.path.join(self.tmp, "back.csv"))
            self.assertEqual(rc, 0, out + err)
            pool = self.pool(srv)
            bodies = [b for b, p in zip(srv.requests, srv.paths) if p == "/v1/completions"]
            times = [t for t, p in zip(srv.times, srv.paths) if p == "/v1/completions"]
        self.assertEqual(len(bodies), len(EXPECT))
        self.assertGreaterEqual(len(pool), 2048)
        by_len = sorted(bodies, key=lambda b: len(b["prompt"]))
        self.assertEqual([len(b["prompt"]) for b in by_len], sorted(e[1] for e in EXPECT))
        for b in bodies:
            n = len(b["prompt"])
            e = next(x for x in EXPECT if x[1] == n)
            self.check_prompt(b["prompt"], n, pool, bos=True)
            self.assertEqual((b["max_tokens"], b["min_tokens"], b["ignore_eos"]), (e[2], e[2], True))
            self.assertEqual(b.get("service_tier"), "flex" if e[3] else None)
            self.assertEqual((b["stream"], b["temperature"], b["model"]), (True, 0, "fake-model"))
        # prompts share no prefix (distinct offsets into the pool)
        heads = [tuple(b["prompt"][1:4]) for b in bodies if len(b["prompt"]) >= 4]
        self.assertEqual(len(heads), len(set(heads)))
        # open loop at 2 x the trace's times (the first at 0)
        t0 = min(times)
        for b, t in zip(bodies, times):
            e = next(x for x in EXPECT if x[1] == len(b["prompt"]))
            self.assertGreaterEqual(t - t0, 2 * e[0] - 0.01)
            self.assertLessEqual(t - t0, 2 * e[0] + 0.15)
        # the report: per record class, and the simulator's figures
        self.assertEqual(res["workload"], "trace")
        self.assertEqual([r["class"] for r in res["requests"]],
                         ["offline" if e[3] else "online" for e in EXPECT])
        self.assertEqual([r["prompt_tokens"] for r in res["requests"]], [e[1] for e in EXPECT])
        self.assertEqual([r["output_tokens"] for r in res["requests"]], [e[2] for e in EXPECT])
        tr = res["trace"]
        self.assertEqual((tr["online"], tr["online_good"], tr["offline"], tr["offline_completed"],
                          tr["offline_output_tokens"]), (3, 3, 3, 3, 2 + 5 + 3))
        self.assertEqual(tr["slo_attainment_pct"], 100.0)
        self.assertEqual(tr["span_s"], 1.6)
        self.assertAlmostEqual(tr["goodput"], 3 / 1.6, places=9)
        self.assertEqual(summ["Online requests"], 3)
        self.assertEqual(summ["Online SLO attainment (%)"], 100.0)
        self.assertEqual(summ["Offline generated tokens"], 10)
        self.assertEqual(summ["Arrival span (s)"], 1.6)
        # --trace-out writes the trace back: scaled, sorted, the same shapes and classes
        with open(os.path.join(self.tmp, "back.csv")) as f:
            rows = [l.strip().split(",") for l in f if l[0].isdigit()]
        self.assertEqual([(round(float(r[0]), 6), int(r[1]), int(r[2]), r[3]) for r in rows],
                         [(round(2 * e[0], 6), e[1], e[2], "offline" if e[3] else "online")
                          for e in EXPECT])

    def test_slo_missed_counts_from_arrival(self):
        """TTFT 150 ms at the fake > a 100 ms SLO: no online request is good; --num-prompts
        keeps the first lines; JSONL traces work too."""
        trace = self.write("t.jsonl", "".join(json.dumps(x) + "\n" for x in [
            {"arrival_s": 0, "prompt_tokens": 9, "output_tokens": 2},
            {"arrival_s": 0.1, "prompt_tokens": 8, "output_tokens": 2, "service_tier": "flex"},
            {"arrival_s": 0.2, "prompt_tokens": 7, "output_tokens": 2, "offline": False},
            {"arrival_s": 0.3, "prompt_tokens": 6, "output_tokens": 2}]))
        with TraceServer(ttft_s=0.15, itl_s=0.002) as srv:
            rc, out, err, summ, res = self.run_bench(
                "--url", srv.url, "--trace", trace, "--num-prompts", "3", "--goodput",
                "ttft:100")
        self.assertEqual(rc, 0, out + err)
        self.assertEqual(res["completed"], 3)
        tr = res["trace"]
        self.assertEqual((tr["online"], tr["online_good"], tr["offline"]), (2, 0, 1))
        self.assertEqual(tr["slo_attainment_pct"], 0.0)
        self.assertEqual(tr["span_s"], 1)  # last arrival 0.2 s: at least 1 s
        self.assertEqual(summ["Online goodput (req/s of arrival span)"], 0)

    def test_offline_timeout(self):
        """--offline-timeout-s: queued offline work may take longer than an online request
        may; online ones still fail at --timeout-s."""
        trace = self.write("t.csv", "0,5,2,online\n0,6,2,offline\n")
        with TraceServer(ttft_s=0.6, itl_s=0.002) as srv:
            rc, out, err, _, res = self.run_bench("--url", srv.url, "--trace", trace,
                                                  "--timeout-s", "0.3", "--offline-timeout-s",
                                                  "10")
        self.assertEqual(rc, 0, out + err)
        recs = res["requests"]
        self.assertEqual([(r["class"], r["state"]) for r in recs],
                         [("online", "failed"), ("offline", "ok")])
        self.assertEqual(recs[0]["error"], "no complete response within 0.3 s (--timeout-s)")
        self.assertEqual(res["trace"]["offline_output_tokens"], 2)

    def test_llama_server_tokenize_form_without_bos(self):
        trace = self.write("t.csv", "0,5,2\n0.05,40,3\n")
        with TraceServer(form="llama", ttft_s=0.01, itl_s=0.002) as srv:
            rc, out, err, _, res = self.run_bench("--url", srv.url, "--trace", trace)
            pool = self.pool(srv)
            bodies = [b for b, p in zip(srv.requests, srv.paths) if p == "/v1/completions"]
        self.assertEqual(rc, 0, out + err)
        self.assertIn("context window unknown", err)
        self.assertEqual(sorted(len(b["prompt"]) for b in bodies), [5, 40])
        for b in bodies:
            self.check_prompt(b["prompt"], len(b["prompt"]), pool, bos=False)
        self.assertEqual([r["prompt_tokens"] for r in res["requests"]], [5, 40])

    def test_context_window_checked(self):
        trace = self.write("t.csv", "0,10,5\n0.1,50,15\n0.2,60,4\n")
        with TraceServer(max_model_len=64) as srv:
            rc, out, err, _, res = self.run_bench("--url", srv.url, "--trace", trace)
            sent = [p for p in srv.paths if p == "/v1/completions"]
        self.assertEqual(rc, 1)
        self.assertIn("t.csv:2: prompt + output = 65 tokens exceeds the server's context "
                      "window (max_model_len 64)", err)
        self.assertEqual(sent, [])
        self.assertIsNone(res)

    def test_no_tokenize_endpoint(self):
        trace = self.write("t.csv", "0,10,5\n")
        with TraceServer(form="none") as srv:
            rc, out, err, _, _ = self.run_bench("--url", srv.url, "--trace", trace)
        self.assertEqual(rc, 1)
        self.assertIn("cannot tokenize the prompts' text with http://127.0.0.1:%d/tokenize "
                      "(vLLM form: HTTP 400; llama-server form: HTTP 400)" % srv.port, err)
        self.assertIn("--prompt-tokenizer", err)

    def test_bad_traces_and_flags(self):
        cases = [
            ("0,10\n", "t.csv:1: want arrival_s,prompt_tokens,output_tokens[,class]"),
            ("0,10,5\n1,10,5,weird\n", "t.csv:2: class must be online or offline"),
            ("0,10,0\n", "t.csv:1: prompt_tokens and output_tokens must be whole numbers"),
            ("0,2.5,3\n", "t.csv:1: prompt_tokens and output_tokens must be whole numbers"),
            ("-1,10,5\n", "t.csv:1: arrival_s must be a finite number >= 0"),
            ("arrival_s,p,o\nx,1,1\n", "t.csv:2: arrival_s is not a number"),
            ("# nothing\n", "t.csv: no requests"),
            ('{"arrival_s": 0, "prompt_tokens": 3}\n', "t.csv:1: want numbers arrival_s"),
        ]
        for text, msg in cases:
            trace = self.write("t.csv", text)
            rc, out, err, _, _ = self.run_bench("--url", "http://127.0.0.1:9", "--trace", trace)
            self.assertEqual(rc, 2, text)
            self.assertIn(msg, err, text)
        trace = self.write("t.csv", "0,10,5\n")
        for extra, msg in [
                (["--request-rate", "4"], "--trace gives the arrival times"),
                (["--input-len", "8"], "--trace gives every request's arrival and lengths"),
                (["--workload", "phase-shift"], "--trace gives every request's"),
                (["--endpoint", "/v1/chat/completions"], "--trace needs the completions"),
        ]:
            rc, out, err, _, _ = self.run_bench("--url", "http://127.0.0.1:9", "--trace", trace,
                                                *extra)
            self.assertEqual(rc, 2, extra)
            self.assertIn(msg, err, extra)
        rc, _, err, _, _ = self.run_bench("--url", "http://127.0.0.1:9", "--time-scale", "2")
        self.assertEqual(rc, 2)
        self.assertIn("--time-scale goes with --trace", err)
        rc, _, err, _, _ = self.run_bench("--trace", os.path.join(self.tmp, "missing.csv"))
        self.assertEqual(rc, 2)
        self.assertIn("missing.csv: No such file or directory", err)


GEN = os.path.join(test_bench.ROOT, "tools", "bench", "gen-trace.py")
TRACES = os.path.join(test_bench.ROOT, "tools", "bench", "traces")
SIM = os.path.join(test_bench.ROOT, test_bench.BUILD, "bin", "tidepool-sim")


def rows_of(text):
    """(arrival_s, prompt, output, class) of a trace's data lines."""
    out = []
    for line in text.splitlines():
        if line[:1].isdigit():
            f = line.split(",")
            out.append((float(f[0]), int(f[1]), int(f[2]), f[3]))
    return out


class GenTraceTest(unittest.TestCase):
    def gen(self, *args):
        p = subprocess.run([sys.executable, GEN] + [str(a) for a in args], capture_output=True,
                           text=True, timeout=60)
        self.assertEqual(p.returncode, 0, p.stderr)
        return p.stdout

    def test_shapes_deterministic_and_within_context(self):
        a = self.gen("--shape", "conversation", "--rate", "50", "--duration-s", "60",
                     "--scale", "0.1", "--max-context", "512", "--seed", "9")
        self.assertEqual(a, self.gen("--shape", "conversation", "--rate", "50", "--duration-s",
                                     "60", "--scale", "0.1", "--max-context", "512", "--seed",
                                     "9"))
        r = rows_of(a)
        self.assertGreater(len(r), 2700)
        self.assertLess(len(r), 3300)  # Poisson at 50/s for 60 s: 3000 +- 5 sigma
        self.assertTrue(all(p + o <= 512 and p >= 1 and o >= 1 and c == "online"
                            for _, p, o, c in r))
        self.assertEqual([x[0] for x in r], sorted(x[0] for x in r))
        med = lambda v: sorted(v)[len(v) // 2]
        # medians 1020 / 129 tokens times 0.1 (truncation at 512 pulls them down a little)
        self.assertTrue(85 <= med([x[1] for x in r]) <= 105, med([x[1] for x in r]))
        self.assertTrue(11 <= med([x[2] for x in r]) <= 14, med([x[2] for x in r]))
        c = rows_of(self.gen("--shape", "code", "--rate", "50", "--duration-s", "60",
                             "--scale", "0.1", "--max-context", "512"))
        self.assertTrue(1 <= med([x[2] for x in c]) <= 2)

    def test_tide_offline_and_bursts(self):
        r = rows_of(self.gen("--shape", "conversation", "--tide", "2:40", "--duration-s",
                             "100", "--offline", "50", "--scale", "0.1", "--max-context",
                             "512"))
        off = [x for x in r if x[3] == "offline"]
        on = [x for x in r if x[3] == "online"]
        self.assertEqual(len(off), 50)
        self.assertTrue(all(x[0] == 0 for x in off))
        # the trough at the ends of the day, the peak in the middle
        ends = sum(1 for x in on if x[0] < 20 or x[0] >= 80)
        mid = sum(1 for x in on if 40 <= x[0] < 60)
        self.assertGreater(mid, 3 * ends / 2)
        b = rows_of(self.gen("--rate", "5", "--bursts", "1:10:10", "--duration-s", "100",
                             "--scale", "0.1", "--max-context", "512"))
        per10 = [sum(1 for x in b if k * 10 <= x[0] < k * 10 + 10) for k in range(10)]
        self.assertGreater(max(per10), 4 * sorted(per10)[5], per10)

    def test_from_azure_and_retime(self):
        tmp = tempfile.mkdtemp(prefix="gen-trace-")
        az = os.path.join(tmp, "az.csv")
        with open(az, "w") as f:
            f.write("TIMESTAMP,ContextTokens,GeneratedTokens\n"
                    "2023-11-16 18:15:46.0000000,1000,100\n"
                    "2023-11-16 18:15:46.5000000,6000,20\n"
                    "2023-11-16 18:15:48.2500000,5,3\n"
                    "2023-11-16 18:15:50.0000000,30,40\n")
        out = self.gen("--from-azure", az, "--scale", "0.1", "--max-context", "512",
                       "--duration-s", "4")
        self.assertEqual(rows_of(out), [(0.0, 100, 10, "online"), (0.5, 510, 2, "online"),
                                        (2.25, 1, 1, "online")])
        self.assertIn("3 lines, 1 of them over --max-context 512 at --scale 0.1 (prompts "
                      "clipped to fit)", out)
        drop = self.gen("--from-azure", az, "--scale", "0.1", "--max-context", "512",
                        "--overflow", "drop", "--duration-s", "10", "--time-scale", "2")
        self.assertEqual(rows_of(drop), [(0.0, 100, 10, "online"), (4.5, 1, 1, "online"),
                                         (8.0, 3, 4, "online")])
        tr = os.path.join(tmp, "t.csv")
        with open(tr, "w") as f:
            f.write("arrival_s,prompt_tokens,output_tokens,class\n0,5,5,offline\n"
                    "1,10,2,online\n3,20,4\n")
        self.assertEqual(rows_of(self.gen("--from-trace", tr, "--time-scale", "0.5")),
                         [(0.0, 5, 5, "offline"), (0.5, 10, 2, "online"),
                          (1.5, 20, 4, "online")])

    def test_bundled_traces_replay_in_the_simulator(self):
        names = sorted(n for n in os.listdir(TRACES) if n.endswith(".csv"))
        self.assertEqual(names, ["azure-code.csv", "azure-conv.csv", "azure-mix.csv",
                                 "bursty-conv.csv", "day-mix.csv", "tide-offline.csv"])
        for n in names:
            path = os.path.join(TRACES, n)
            with open(path) as f:
                r = rows_of(f.read())
            self.assertTrue(all(p + o <= 512 for _, p, o, _ in r), n)
            p = subprocess.run([SIM, "--workers", "8", "--trace", path, "--policy", "static:4",
                                "--preset", "a100-llama3-8b:dilate=10"], capture_output=True,
                               text=True, timeout=120)
            self.assertEqual(p.returncode, 0, n + p.stderr)
            self.assertIn("workload: trace %s, %d requests" % (path, len(r)), p.stdout)


if __name__ == "__main__":
    unittest.main()
