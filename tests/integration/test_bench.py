"""tidepool-bench against a fake OpenAI-compatible server written here (standard library
only): the fake streams SSE with known timings (TTFT, gap between chunks) and a known
`usage`, and can misbehave on purpose (HTTP errors, connections closed mid-stream, error
events, hangs, oversized events). Counts and token totals are checked exactly, timings
within a tolerance. Run: python3 -m unittest -v tests/integration/test_bench.py
(TIDEPOOL_BUILD picks the build directory, default build/)."""

import http.server
import json
import math
import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
import unittest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BUILD = os.environ.get("TIDEPOOL_BUILD", "build")
BENCH = os.path.join(ROOT, BUILD, "bin", "tidepool-bench")
SANITIZER_MARKERS = ("ERROR: AddressSanitizer", "ERROR: LeakSanitizer", "runtime error:",
                     "WARNING: ThreadSanitizer")
WORDS = set("the a little girl boy cat dog sun tree ball red big happy sad day park ran saw "
            "played jumped and with to in was she he they friend mom home bird fish water sky "
            "blue green small went said looked found toy box car house garden flower apple "
            "cake rain night star moon bear rabbit duck hat shoe book door window road "
            "hill".split())

TTFT_S = 0.100   # fake server: request received -> first content chunk
ITL_S = 0.020    # fake server: gap between content chunks
SLACK_MS = 150   # timing tolerance above the ideal (loaded machines, sanitizers)


def free_port():
    import sys
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from cluster import free_port as fp  # below the ephemeral range (cluster.py)
    return fp()


def prompt_words(body):
    if "prompt" in body:
        return len(body["prompt"].split())
    return sum(len(m["content"].split()) for m in body["messages"])


class FakeHandler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True

    def log_message(self, *args):
        pass

    def do_GET(self):
        if self.path == "/v1/models":
            self._json(200, {"object": "list",
                             "data": [{"id": self.server.fake.model, "object": "model"}]})
        else:
            self._json(404, {"error": {"message": "not found"}})

    def _json(self, status, obj):
        data = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _chunk(self, data):
        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
        self.wfile.flush()

    def _event(self, obj, chunked=True):
        data = ("data: " + (obj if isinstance(obj, str) else json.dumps(obj)) + "\n\n").encode()
        if chunked:
            self._chunk(data)
        else:
            self.wfile.write(data)
            self.wfile.flush()

    def _start_stream(self, chunked=True):
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        if chunked:
            self.send_header("Transfer-Encoding", "chunked")
        else:
            self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.flush()

    def _content(self, chat, text, finish=None):
        if chat:
            choice = {"index": 0, "delta": {"content": text}, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": text, "finish_reason": finish}
        return {"id": "cmpl-1", "object": "chunk", "model": self.server.fake.model,
                "choices": [choice], "usage": None}

    def do_POST(self):
        fake = self.server.fake
        n = int(self.headers.get("Content-Length", "0"))
        body = json.loads(self.rfile.read(n))
        with fake.lock:
            idx = len(fake.requests)
            fake.requests.append(body)
            fake.paths.append(self.path)
            fake.times.append(time.monotonic())
            fake.active += 1
            fake.max_active = max(fake.max_active, fake.active)
        mode = fake.modes[idx] if idx < len(fake.modes) else "ok"
        try:
            self._serve(body, mode)
        except (BrokenPipeError, ConnectionResetError):
            pass
        finally:
            fake.release(idx)

    def _serve(self, body, mode):
        fake = self.server.fake
        chat = "messages" in body
        if mode == "http503":
            fake.release_once()
            self._json(503, {"error": {"message": "overloaded, try later", "type": "server_error"}})
            return
        if mode == "not_sse":   # ignores "stream": one JSON body
            fake.release_once()
            self._json(200, {"id": "x", "choices": [{"text": "hi", "finish_reason": "stop"}]})
            return
        if mode in ("close_mid", "close_delimited_mid"):
            chunked = mode == "close_mid"
            self._start_stream(chunked)
            self._event(self._content(chat, " once"), chunked)
            self._event(self._content(chat, " upon"), chunked)
            self.close_connection = True
            return
        self._start_stream()
        if mode == "huge":
            self._chunk(b"data: " + b"x" * (2 << 20))
            self.close_connection = True
            return
        if mode == "hang":
            self._event(self._content(chat, " start"))
            fake.stop.wait(30)
            self.close_connection = True
            return
        if mode == "dribble":
            # every event in 3-byte writes, CRLF line ends, a comment, an "event:" line and
            # a two-line data field: the client must reassemble across reads
            time.sleep(fake.ttft_s)
            n_tok = body["max_tokens"]
            events = [json.dumps(self._content(chat, " tok")) for _ in range(n_tok)]
            events.append(json.dumps(self._content(chat, "", "length")))
            usage = {"prompt_tokens": prompt_words(body) + 1, "completion_tokens": n_tok}
            events.append('{"choices": [],\r\ndata: "usage": %s}' % json.dumps(usage))
            events.append("[DONE]")
            for k, ev in enumerate(events):
                raw = (": keep-alive\r\nevent: message\r\ndata: " + ev + "\r\n\r\n").encode()
                for i in range(0, len(raw), 3):
                    self._chunk(raw[i:i + 3])
                if k == n_tok - 1:
                    fake.release_once()
            self._chunk(b"")
            return
        if mode == "error_event":
            self._event(self._content(chat, " hello"))
            self._event({"error": {"message": "worker died", "type": "server_error"}})
            self._event("[DONE]")
            self._chunk(b"")
            return
        if chat:
            self._event({"id": "c", "choices": [{"index": 0, "delta": {"role": "assistant",
                                                                       "content": ""}}]})
        time.sleep(fake.ttft_s)
        n_tok = body["max_tokens"]
        if mode == "no_content":
            n_tok = 0
        tpc = fake.tokens_per_chunk
        n_chunks = math.ceil(n_tok / tpc)
        for k in range(n_chunks):
            if k > 0:
                time.sleep(fake.itl_s)
            self._event(self._content(chat, " tok" * min(tpc, n_tok - k * tpc)))
        self._event(self._content(chat, "", "length"))
        if fake.usage:
            self._event({"id": "cmpl-1", "choices": [],
                         "usage": {"prompt_tokens": prompt_words(body) + 1,
                                   "completion_tokens": n_tok,
                                   "total_tokens": prompt_words(body) + 1 + n_tok}})
        fake.release_once()  # before the end: the client may send its next request now
        self._event("[DONE]")
        self._chunk(b"")


class FakeServer:
    def __init__(self, modes=(), ttft_s=TTFT_S, itl_s=ITL_S, usage=True, tokens_per_chunk=1,
                 model="fake-model"):
        self.modes = list(modes)
        self.ttft_s, self.itl_s, self.usage = ttft_s, itl_s, usage
        self.tokens_per_chunk, self.model = tokens_per_chunk, model
        self.lock = threading.Lock()
        self.requests, self.paths, self.times = [], [], []
        self.active = self.max_active = 0
        self._released = threading.local()
        self.stop = threading.Event()
        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), FakeHandler)
        self.httpd.daemon_threads = True
        self.httpd.fake = self
        self.port = self.httpd.server_address[1]
        self.url = "http://127.0.0.1:%d" % self.port
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def release_once(self):
        if not getattr(self._released, "done", False):
            self._released.done = True
            with self.lock:
                self.active -= 1

    def release(self, idx):
        self.release_once()
        self._released.done = False

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.httpd.shutdown()
        self.httpd.server_close()


def parse_summary(text):
    """The 'Key: value' lines of the summary block."""
    out = {}
    for line in text.splitlines():
        m = re.match(r"^([A-Za-z].*?):\s+(-?[0-9.]+)\s*$", line)
        if m:
            out[m.group(1)] = float(m.group(2))
    return out


class BenchTest(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.mkdtemp(prefix="tidepool-bench-test-")

    def tearDown(self):
        shutil.rmtree(self.tmp, ignore_errors=True)

    def run_bench(self, *args, timeout=60, env=None):
        """Run the bench; returns (rc, stdout, stderr, summary dict, result JSON or None)."""
        out = os.path.join(self.tmp, "result.json")
        if os.path.exists(out):
            os.unlink(out)
        argv = [BENCH, "--no-progress", "--result-json", out] + [str(a) for a in args]
        p = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=env)
        for marker in SANITIZER_MARKERS:
            self.assertNotIn(marker, p.stderr, p.stderr)
        res = None
        if os.path.exists(out):
            with open(out) as f:
                res = json.load(f)
        return p.returncode, p.stdout, p.stderr, parse_summary(p.stdout), res

    def assert_close_ms(self, value, ideal_ms, what):
        self.assertGreaterEqual(value, ideal_ms - 5, what)
        self.assertLessEqual(value, ideal_ms + SLACK_MS, what)

    # ---------------------------------------------------------------- command line

    def test_help_lists_every_flag(self):
        p = subprocess.run([BENCH, "--help"], capture_output=True, text=True, timeout=10)
        self.assertEqual(p.returncode, 0)
        for flag in ("--url", "--endpoint", "--model", "--num-prompts", "--concurrency",
                     "--request-rate", "--seed", "--input-len", "--output-len",
                     "--input-len-range", "--output-len-range", "--dataset", "--workload",
                     "--phase-seconds", "--temperature", "--ignore-eos", "--goodput",
                     "--result-json", "--plot", "--timeout-s", "--no-progress",
                     "--decode-rate", "--duration-s", "--trace-out"):
            self.assertIn(flag, p.stdout)

    def test_bad_flags_exit_2(self):
        for args in (["--bogus"], ["--request-rate", "0"], ["--input-len-range", "5:3"],
                     ["--goodput", "foo:3"], ["--num-prompts", "0"], ["--url", "https://x"],
                     ["--workload", "nope"], ["--input-len", "3", "--input-len-range", "1:2"],
                     ["--concurrency"]):
            p = subprocess.run([BENCH] + args, capture_output=True, text=True, timeout=10)
            self.assertEqual(p.returncode, 2, args)
            self.assertIn("tidepool-bench", p.stderr)

    # ---------------------------------------------------------------- figures

    def test_completions_counts_and_timings(self):
        n, words, out_len = 6, 20, 10
        with FakeServer() as srv:
            rc, out, err, s, res = self.run_bench(
                "--url", srv.url, "--num-prompts", n, "--concurrency", 2,
                "--input-len", words, "--output-len", out_len, "--seed", 3)
        self.assertEqual(rc, 0, err)
        # the model came from GET /v1/models; every request streamed with usage
        self.assertEqual(len(srv.requests), n)
        self.assertEqual(srv.max_active, 2)
        for body, path in zip(srv.requests, srv.paths):
            self.assertEqual(path, "/v1/completions")
            self.assertEqual(body["model"], "fake-model")
            self.assertIs(body["stream"], True)
            self.assertEqual(body["stream_options"], {"include_usage": True})
            self.assertEqual(body["temperature"], 0)
            self.assertEqual(body["max_tokens"], out_len)
            self.assertNotIn("ignore_eos", body)
            self.assertEqual(len(body["prompt"].split()), words)
            self.assertTrue(set(body["prompt"].split()) <= WORDS)
        # exact figures
        self.assertIn("Serving Benchmark Result", out)
        self.assertEqual(s["Successful requests"], n)
        self.assertEqual(s["Failed requests"], 0)
        self.assertEqual(s["Maximum request concurrency"], 2)
        self.assertEqual(s["Total input tokens"], n * (words + 1))
        self.assertEqual(s["Total generated tokens"], n * out_len)
        self.assertEqual(res["completed"], n)
        self.assertEqual(res["failed"], 0)
        self.assertEqual(res["total_input_tokens"], n * (words + 1))
        self.assertEqual(res["total_output_tokens"], n * out_len)
        self.assertEqual(res["model_id"], "fake-model")
        self.assertLessEqual(res["peak_concurrency"], 2)
        self.assertIsNone(res["request_goodput"])
        self.assertNotIn("Request goodput", out)
        for r in res["requests"]:
            self.assertTrue(r["success"])
            self.assertEqual(r["prompt_tokens"], words + 1)
            self.assertEqual(r["output_tokens"], out_len)
            self.assertEqual(r["prompt_tokens_source"], "usage")
            self.assertEqual(r["output_tokens_source"], "usage")
            self.assertEqual(len(r["itl_ms"]), out_len - 1)
            self.assertIsNone(r["error"])
            self.assert_close_ms(r["ttft_ms"], TTFT_S * 1e3, "ttft")
            self.assertAlmostEqual(r["tpot_ms"], (r["e2el_ms"] - r["ttft_ms"]) / (out_len - 1),
                                   delta=0.002)   # JSON times are rounded to 1 µs
        # timings: the fake's schedule plus a tolerance
        ideal_e2el = (TTFT_S + (out_len - 1) * ITL_S) * 1e3
        self.assert_close_ms(s["Mean TTFT (ms)"], TTFT_S * 1e3, "mean ttft")
        self.assert_close_ms(s["Median TTFT (ms)"], TTFT_S * 1e3, "median ttft")
        self.assert_close_ms(s["Mean ITL (ms)"], ITL_S * 1e3, "mean itl")
        self.assert_close_ms(s["Mean TPOT (ms)"], ITL_S * 1e3, "mean tpot")
        self.assert_close_ms(s["Mean E2EL (ms)"], ideal_e2el, "mean e2el")
        # three rounds of two requests each
        self.assertGreaterEqual(s["Benchmark duration (s)"], 3 * ideal_e2el / 1e3 - 0.01)
        self.assertLess(s["Benchmark duration (s)"], 3 * ideal_e2el / 1e3 + 1.0)
        # the printout and the JSON agree, and the throughputs follow from the duration
        dur = res["duration"]
        self.assertAlmostEqual(s["Benchmark duration (s)"], dur, delta=0.006)
        self.assertAlmostEqual(res["request_throughput"], n / dur, places=6)
        self.assertAlmostEqual(res["output_throughput"], n * out_len / dur, places=6)
        self.assertAlmostEqual(res["total_token_throughput"], n * (words + 1 + out_len) / dur,
                               places=6)
        self.assertAlmostEqual(s["Request throughput (req/s)"], res["request_throughput"],
                               delta=0.006)
        self.assertAlmostEqual(s["P99 E2EL (ms)"], res["p99_e2el_ms"], delta=0.006)
        e2els = sorted(r["e2el_ms"] for r in res["requests"])
        self.assertAlmostEqual(res["median_e2el_ms"], (e2els[2] + e2els[3]) / 2, delta=0.001)
        self.assertAlmostEqual(res["mean_ttft_ms"],
                               sum(r["ttft_ms"] for r in res["requests"]) / n, delta=0.001)
        itls = [x for r in res["requests"] for x in r["itl_ms"]]
        self.assertAlmostEqual(res["mean_itl_ms"], sum(itls) / len(itls), delta=0.001)

    def test_chat_ignore_eos_temperature(self):
        with FakeServer(model="other") as srv:
            rc, out, err, s, res = self.run_bench(
                "--url", srv.url + "/", "--endpoint", "/v1/chat/completions", "--model", "m1",
                "--num-prompts", 3, "--input-len", 7, "--output-len", 4, "--ignore-eos",
                "--temperature", 0.5)
        self.assertEqual(rc, 0, err)
        self.assertEqual(s["Successful requests"], 3)
        self.assertEqual(s["Total input tokens"], 3 * 8)
        self.assertEqual(s["Total generated tokens"], 3 * 4)
        self.assertEqual(res["backend"], "openai-chat")
        for body, path in zip(srv.requests, srv.paths):
            self.assertEqual(path, "/v1/chat/completions")
            self.assertEqual(body["model"], "m1")
            self.assertIs(body["ignore_eos"], True)
            self.assertEqual(body["temperature"], 0.5)
            self.assertEqual(body["messages"][0]["role"], "user")
            self.assertEqual(len(body["messages"][0]["content"].split()), 7)
        for r in res["requests"]:
            # the role-only first delta is not content: TTFT waits for real text
            self.assert_close_ms(r["ttft_ms"], TTFT_S * 1e3, "chat ttft")
            self.assertEqual(len(r["itl_ms"]), 3)

    def test_usage_counts_tokens_not_chunks(self):
        # 3 tokens per chunk (as MTP may emit): output tokens come from usage, ITLs are per
        # chunk, TPOT divides by tokens
        with FakeServer(tokens_per_chunk=3) as srv:
            rc, out, err, s, res = self.run_bench(
                "--url", srv.url, "--model", "x", "--num-prompts", 2, "--input-len", 5,
                "--output-len", 9)
        self.assertEqual(rc, 0, err)
        self.assertEqual(s["Total generated tokens"], 18)
        for r in res["requests"]:
            self.assertEqual(r["output_tokens"], 9)
            self.assertEqual(len(r["itl_ms"]), 2)
            self.assert_close_ms(r["tpot_ms"], 2 * ITL_S * 1e3 / 8, "tpot")

    def test_no_usage_falls_back_to_chunks_and_words(self):
        with FakeServer(usage=False, tokens_per_chunk=2) as srv:
            rc, out, err, s, res = self.run_bench(
                "--url", srv.url, "--model", "x", "--num-prompts", 2, "--input-len", 6,
                "--output-len", 7)
        self.assertEqual(rc, 0, err)
        self.assertEqual(s["Total input tokens"], 2 * 6)       # words
        self.assertEqual(s["Total generated tokens"], 2 * 4)   # ceil(7 / 2) chunks
        self.assertIn("no usage.prompt_tokens", out)
        self.assertIn("no usage.completion_tokens", out)
        self.assertEqual(res["requests"][0]["output_tokens_source"], "chunks")

    def test_sse_split_across_reads(self):
        with FakeServer(modes=["dribble"] * 3) as srv:
            rc, out, err, s, res = self.run_bench(
                "--url", srv.url, "--model", "x", "--num-prompts", 3, "--input-len", 4,
                "--output-len", 5, "--concurrency", 1)
        self.assertEqual(rc, 0, err)
        self.assertEqual(s["Successful requests"], 3)
        self.assertEqual(s["Total input tokens"], 3 * 5)
        self.assertEqual(s["Total generated tokens"], 3 * 5)
        for r in res["requests"]:
            self.assertEqual(r["output_tokens_source"], "usage")
            self.assertEqual(len(r["itl_ms"]), 4)

    def test_goodput(self):
        with FakeServer() as srv:
            args = ["--url", srv.url, "--model", "x", "--num-prompts", 4, "--input-len", 3,
                    "--output-len", 3]
            rc, out, err, s, res = self.run_bench(*args, "--goodput", "ttft:50",
                                                  "--goodput", "e2el:60000,tpot:1e6")
            self.assertEqual(rc, 0, err)
            self.assertEqual(s["Request goodput (req/s)"], 0)
            self.assertEqual(res["request_goodput"], 0)
            self.assertEqual(res["goodput_slo_ms"],
                             {"ttft_ms": 50, "tpot_ms": 1e6, "e2el_ms": 60000})
            rc, out, err, s, res = self.run_bench(*args, "--goodput", "ttft:5000",
                                                  "tpot:1000")   # vLLM's form
            self.assertEqual(rc, 0, err)
            self.assertEqual(res["goodput_slo_ms"], {"ttft_ms": 5000, "tpot_ms": 1000})
            self.assertAlmostEqual(res["request_goodput"], res["request_throughput"], places=9)
            self.assertAlmostEqual(s["Request goodput (req/s)"],
                                   s["Request throughput (req/s)"], places=2)

    # ---------------------------------------------------------------- failures

    def test_failures_are_counted_not_fatal(self):
        modes = ["ok", "http503", "close_mid", "error_event", "hang", "close_delimited_mid",
                 "huge", "no_content", "not_sse", "ok"]
        t0 = time.monotonic()
        with FakeServer(modes=modes) as srv:
            rc, out, err, s, res = self.run_bench(
                "--url", srv.url, "--model", "x", "--num-prompts", len(modes),
                "--concurrency", 1, "--input-len", 4, "--output-len", 3, "--timeout-s", 1.5)
        self.assertLess(time.monotonic() - t0, 30)
        self.assertEqual(rc, 0, err)
        self.assertEqual(s["Successful requests"], 2)
        self.assertEqual(s["Failed requests"], 8)
        self.assertEqual(res["failed"], 8)
        recs = res["requests"]
        kinds = [r["error_kind"] for r in recs]
        self.assertEqual(kinds, [None, "http", "closed", "stream_error", "timeout", "closed",
                                 "protocol", "no_content", "protocol", None])
        self.assertEqual(recs[1]["http_status"], 503)
        self.assertIn("HTTP 503: overloaded, try later", recs[1]["error"])
        self.assertIn("mid-stream", recs[2]["error"])
        self.assertIn("worker died", recs[3]["error"])
        self.assertIn("1.5 s", recs[4]["error"])
        # libevent's timers run off a cached clock: they may fire a few ms "early"
        self.assertGreaterEqual(recs[4]["e2el_ms"], 1500 - 10)
        self.assertLess(recs[4]["e2el_ms"], 1500 + 1000)
        self.assertIn("[DONE]", recs[5]["error"])
        self.assertIn("larger than", recs[6]["error"])
        self.assertIn("no content", recs[7]["error"])
        self.assertIn("no SSE event", recs[8]["error"])
        # the first message of each kind is printed, and the first failure is logged
        self.assertIn("Errors (count, first message of each kind):", out)
        self.assertIn("HTTP 503: overloaded, try later", out)
        self.assertIn("worker died", out)
        self.assertIn("request 1 failed: HTTP 503", err)
        self.assertEqual(s["Total generated tokens"], 6)

    def test_connection_refused(self):
        port = free_port()
        rc, out, err, s, res = self.run_bench(
            "--url", "http://127.0.0.1:%d" % port, "--model", "x", "--num-prompts", 3)
        self.assertEqual(rc, 1)   # nothing succeeded
        self.assertEqual(s["Successful requests"], 0)
        self.assertEqual(s["Failed requests"], 3)
        self.assertEqual({r["error_kind"] for r in res["requests"]}, {"connect"})
        self.assertIn("cannot connect to 127.0.0.1 port %d" % port, res["requests"][0]["error"])
        self.assertIn("cannot connect", out)

    def test_no_model_list(self):
        rc, out, err, s, res = self.run_bench("--url", "http://127.0.0.1:%d" % free_port(),
                                              "--num-prompts", 1)
        self.assertEqual(rc, 1)
        self.assertIn("--model", err)

    def test_sigint_stops_cleanly(self):
        with FakeServer(modes=["hang"] * 50) as srv:
            out_json = os.path.join(self.tmp, "r.json")
            p = subprocess.Popen([BENCH, "--no-progress", "--url", srv.url, "--model", "x",
                                  "--num-prompts", "50", "--concurrency", "4", "--result-json",
                                  out_json], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                 text=True)
            deadline = time.monotonic() + 10
            while len(srv.requests) < 4 and time.monotonic() < deadline:
                time.sleep(0.05)
            p.send_signal(signal.SIGINT)
            out, err = p.communicate(timeout=20)
        for marker in SANITIZER_MARKERS:
            self.assertNotIn(marker, err)
        self.assertEqual(p.returncode, 1)
        s = parse_summary(out)
        self.assertEqual(s["Failed requests"], 4)
        self.assertIn("46 requests were not sent", out)
        with open(out_json) as f:
            res = json.load(f)
        self.assertEqual(res["not_sent"], 46)
        self.assertEqual(sum(r["error_kind"] == "interrupted" for r in res["requests"]), 4)

    # ---------------------------------------------------------------- workloads

    def test_seed_reproducible_ranges_and_poisson(self):
        def run(seed):
            with FakeServer(ttft_s=0.01, itl_s=0.002) as srv:
                rc, out, err, s, res = self.run_bench(
                    "--url", srv.url, "--model", "x", "--num-prompts", 20, "--seed", seed,
                    "--request-rate", 40, "--input-len-range", "5:15",
                    "--output-len-range", "2:6")
                self.assertEqual(rc, 0, err)
                return srv.requests, res
        a_reqs, a = run(7)
        b_reqs, b = run(7)
        c_reqs, c = run(8)
        key = lambda res: [(r["prompt_words"], r["max_tokens"], r["arrival_s"])
                           for r in res["requests"]]
        self.assertEqual(key(a), key(b))
        self.assertNotEqual(key(a), key(c))
        prompts = lambda reqs: sorted((x["prompt"], x["max_tokens"]) for x in reqs)
        self.assertEqual(prompts(a_reqs), prompts(b_reqs))
        self.assertNotEqual(prompts(a_reqs), prompts(c_reqs))
        for body in a_reqs:
            self.assertTrue(5 <= len(body["prompt"].split()) <= 15)
            self.assertTrue(2 <= body["max_tokens"] <= 6)
        self.assertGreater(len({r["prompt_words"] for r in a["requests"]}), 3)
        # Poisson arrivals: first at 0, increasing, mean gap near 1/rate; sent on schedule
        arr = [r["arrival_s"] for r in a["requests"]]
        self.assertEqual(arr[0], 0)
        self.assertEqual(arr, sorted(arr))
        self.assertTrue(0.25 * 19 / 40 < arr[-1] < 4 * 19 / 40, arr[-1])
        for r in a["requests"]:
            self.assertGreaterEqual(r["start_s"], r["arrival_s"] - 1e-3)
            self.assertLess(r["start_s"], r["arrival_s"] + 0.1)
        self.assertEqual(a["request_rate"], 40)

    def test_dataset(self):
        path = os.path.join(self.tmp, "prompts.jsonl")
        with open(path, "w") as f:
            f.write(json.dumps({"prompt": "one two three", "max_tokens": 2}) + "\n\n")
            f.write(json.dumps({"prompt": "four five"}) + "\n")
            f.write(json.dumps({"messages": [{"role": "system", "content": "be brief"},
                                             {"role": "user", "content": "six seven"}],
                                "max_tokens": 3, "stop": ["x"]}) + "\n")
        with FakeServer() as srv:
            rc, out, err, s, res = self.run_bench(
                "--url", srv.url, "--model", "x", "--endpoint", "/v1/chat/completions",
                "--dataset", path, "--num-prompts", 5, "--output-len", 4, "--concurrency", 1)
        self.assertEqual(rc, 0, err)
        got = [(b["messages"], b["max_tokens"]) for b in srv.requests]
        user = lambda t: [{"role": "user", "content": t}]
        self.assertEqual(got[0], (user("one two three"), 2))
        self.assertEqual(got[1], (user("four five"), 4))
        self.assertEqual(got[2][1], 3)
        self.assertEqual(len(got[2][0]), 2)
        self.assertEqual(srv.requests[2]["stop"], ["x"])
        self.assertEqual(got[3], got[0])   # cycles through the file
        self.assertEqual(s["Total generated tokens"], 2 + 4 + 3 + 2 + 4)
        self.assertEqual(s["Total input tokens"], 4 + 3 + 5 + 4 + 3)
        self.assertEqual(res["workload"], "dataset")
        # a messages line needs the chat endpoint; the error names the file and line
        p = subprocess.run([BENCH, "--model", "x", "--dataset", path, "--num-prompts", "3"],
                           capture_output=True, text=True, timeout=10)
        self.assertEqual(p.returncode, 1)
        self.assertIn("prompts.jsonl:4", p.stderr)

    def test_phase_shift(self):
        with FakeServer(ttft_s=0.01, itl_s=0.002) as srv:
            rc, out, err, s, res = self.run_bench(
                "--url", srv.url, "--model", "x", "--workload", "phase-shift",
                "--phase-seconds", 0.4, "--request-rate", 30, "--num-prompts", 40,
                "--input-len", 50, "--output-len", 12, "--phase-short-len", 3, "--seed", 1)
        self.assertEqual(rc, 0, err)
        shapes = {(len(b["prompt"].split()), b["max_tokens"]) for b in srv.requests}
        self.assertEqual(shapes, {(50, 3), (3, 12)})
        for r in res["requests"]:
            want = ["prefill-heavy", "decode-heavy"][int(r["arrival_s"] / 0.4) % 2]
            self.assertEqual(r["phase"], want)
            self.assertEqual((r["prompt_words"], r["max_tokens"]),
                             (50, 3) if want == "prefill-heavy" else (3, 12))
        ph = res["phases"]
        self.assertEqual(ph["prefill-heavy"]["completed"] + ph["decode-heavy"]["completed"], 40)
        self.assertGreater(ph["prefill-heavy"]["completed"], 0)
        self.assertGreater(ph["decode-heavy"]["completed"], 0)
        self.assertIn("Prefill-heavy successful requests:", out)
        self.assertEqual(s["Prefill-heavy successful requests"], ph["prefill-heavy"]["completed"])

    def test_phase_rates_duration_and_trace(self):
        trace = os.path.join(self.tmp, "trace.csv")
        with FakeServer(ttft_s=0.01, itl_s=0.002) as srv:
            rc, out, err, s, res = self.run_bench(
                "--url", srv.url, "--model", "x", "--workload", "phase-shift",
                "--phase-seconds", 0.5, "--request-rate", 10, "--decode-rate", 80,
                "--duration-s", 2, "--num-prompts", 1000, "--input-len", 20, "--output-len", 6,
                "--phase-short-len", 2, "--seed", 3, "--trace-out", trace)
        self.assertEqual(rc, 0, err)
        reqs = res["requests"]
        self.assertEqual(len(reqs), len(srv.requests))
        self.assertTrue(all(r["arrival_s"] < 2 for r in reqs))
        self.assertGreater(reqs[-1]["arrival_s"], 1.5)     # up to the end of the 4th phase
        n_dec = sum(r["phase"] == "decode-heavy" for r in reqs)
        n_pre = len(reqs) - n_dec
        # expected 10 prefill-heavy (10/s x 1 s) and 80 decode-heavy (80/s x 1 s)
        self.assertGreater(n_dec, 3 * max(n_pre, 1), (n_pre, n_dec))
        self.assertGreater(n_pre, 0)
        for r in reqs:
            want = ["prefill-heavy", "decode-heavy"][int(r["arrival_s"] / 0.5) % 2]
            self.assertEqual(r["phase"], want)
        self.assertEqual(res["decode_rate"], 80)
        self.assertEqual(res["duration_s"], 2)
        with open(trace) as f:
            lines = f.read().splitlines()
        self.assertTrue(lines[0].startswith("# tidepool-bench trace"))
        self.assertEqual(lines[1], "arrival_s,prompt_tokens,output_tokens,class")
        self.assertEqual(len(lines), 2 + len(reqs))
        for r, line in zip(reqs, lines[2:]):
            arrival, prompt, output, cls = line.split(",")
            self.assertAlmostEqual(float(arrival), r["arrival_s"], places=5)
            self.assertEqual(int(prompt), r["prompt_tokens"])   # the server's usage
            self.assertEqual(int(output), r["max_tokens"])
            self.assertEqual(cls, "online")
        # the same seed and flags give the same schedule
        with FakeServer(ttft_s=0.01, itl_s=0.002) as srv:
            rc, out, err, s, res2 = self.run_bench(
                "--url", srv.url, "--model", "x", "--workload", "phase-shift",
                "--phase-seconds", 0.5, "--request-rate", 10, "--decode-rate", 80,
                "--duration-s", 2, "--num-prompts", 1000, "--input-len", 20, "--output-len", 6,
                "--phase-short-len", 2, "--seed", 3)
        self.assertEqual([r["arrival_s"] for r in res2["requests"]],
                         [r["arrival_s"] for r in reqs])
        # the flags need a finite rate (and --decode-rate the phase-shift workload)
        for args in (["--decode-rate", "5"], ["--workload", "phase-shift", "--decode-rate", "5"],
                     ["--duration-s", "3"]):
            p = subprocess.run([BENCH, "--model", "x"] + args, capture_output=True, text=True,
                               timeout=10)
            self.assertEqual(p.returncode, 2, args)
            self.assertIn("finite --request-rate", p.stderr)

    def test_plot(self):
        png = os.path.join(self.tmp, "lat.png")
        with FakeServer(ttft_s=0.01, itl_s=0.002) as srv:
            args = ("--url", srv.url, "--model", "x", "--num-prompts", 4, "--output-len", 3,
                    "--plot", png)
            if shutil.which("gnuplot"):
                rc, out, err, s, res = self.run_bench(*args)
                self.assertEqual(rc, 0, err)
                with open(png, "rb") as f:
                    self.assertEqual(f.read(8), b"\x89PNG\r\n\x1a\n")
                os.unlink(png)
            env = dict(os.environ, PATH="/nonexistent")
            rc, out, err, s, res = self.run_bench(*args, env=env)
        self.assertEqual(rc, 0, err)
        self.assertIn("gnuplot not found", err)
        self.assertFalse(os.path.exists(png))


ENGINE = os.path.join(ROOT, BUILD, "tests", "bench_engine")  # built by make test and bench
TINY = os.path.join(ROOT, os.environ.get("TIDEPOOL_TEST_MODEL", "build/models/stories260K.gguf"))


@unittest.skipUnless(os.path.exists(TINY), "needs %s (make model)" % TINY)
class BenchEngineArgs(unittest.TestCase):
    """bench_engine refuses what it cannot run with its usage (exit 2) instead of running
    something else or nothing: no model, a bad --threads, --kernel, --isa or --pp-tokens
    value, a flag taken as a value, two modes, models with --kern."""

    def test_bad_arguments(self):
        for args in ([], ["--pp"], ["--batched"], ["--tg", "--threads", "2"],
                     ["--threads", "abc", "--pp", TINY], ["--threads", "-3", "--pp", TINY],
                     ["--threads", "2x", "--pp", TINY], ["--threads", "100000", "--pp", TINY],
                     ["--threads", "--pp", TINY], ["--threads"],
                     ["--kernel", "bogus", "--pp", TINY], ["--isa", "avx9", "--pp", TINY],
                     ["--pp", "--tg", TINY], ["--kern", TINY],
                     ["--pp-tokens", "0", "--pp", TINY], ["--pp-tokens", "513", "--pp", TINY],
                     ["--pp-tokens", "8x", "--pp", TINY], ["--pp", "--pp-tokens"]):
            p = subprocess.run([ENGINE] + args, capture_output=True, text=True, timeout=60)
            self.assertEqual(p.returncode, 2, (args, p.stdout, p.stderr))
            self.assertEqual(p.stdout, "", args)
            self.assertIn("usage: bench_engine", p.stderr, args)

    def test_good_arguments(self):
        for args in (["--threads", "1", "--kernel", "exact", "--isa", "avx512", "--pp", TINY],
                     ["--threads", "0", "--isa", "scalar", "--kernel", "auto", "--pp", TINY],
                     ["--threads", "2", "--kernel", "fast", "--pp-tokens", "100", "--pp", TINY]):
            p = subprocess.run([ENGINE] + args, capture_output=True, text=True, timeout=120)
            self.assertEqual(p.returncode, 0, (args, p.stderr))
            self.assertRegex(p.stdout, r"^pp \S+ [0-9.]+ cores [0-9.]+\n$")


SERVE_PEER = os.path.join(ROOT, "tools", "bench", "serve-peer.sh")


@unittest.skipUnless(os.path.exists(os.path.join(ROOT, BUILD, "bin", "gateway")) and
                     os.path.exists(TINY), "needs the gateway and %s" % TINY)
class ServePeerFailure(unittest.TestCase):
    """serve-peer.sh with a setting tidepool refuses (SERVE_THREADS=x) stops at once with
    the worker's message (not after its 30 s start-up wait) and leaves no process behind
    (here a stub llama-server that records its pid)."""

    def test_bad_setting_fails_fast_and_cleans_up(self):
        tmp = tempfile.mkdtemp()
        try:
            os.makedirs(os.path.join(tmp, "llama", "bin"))
            stub = os.path.join(tmp, "llama", "bin", "llama-server")
            with open(stub, "w") as f:
                f.write("#!/bin/sh\necho $$ >> %s/pids\nexec sleep 60\n" % tmp)
            os.chmod(stub, 0o755)
            env = dict(os.environ, LLAMA_CPP_DIR=os.path.join(tmp, "llama"), BUILD=BUILD,
                       SERVE_THREADS="x", SERVE_LOG_DIR=os.path.join(tmp, "logs"))
            t0 = time.monotonic()
            p = subprocess.run([SERVE_PEER], env=env, capture_output=True, text=True,
                               timeout=60)
            took = time.monotonic() - t0
            self.assertEqual(p.returncode, 1, p.stdout + p.stderr)
            self.assertIn("serving peer: tidepool did not start", p.stdout)
            self.assertIn("invalid value 'x' for threads", p.stdout + p.stderr)
            self.assertLess(took, 15)
            with open(os.path.join(tmp, "pids")) as f:
                pids = [int(x) for x in f.read().split()]
            self.assertEqual(len(pids), 2)
            for pid in pids:
                with self.assertRaises(ProcessLookupError):
                    os.kill(pid, 0)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)


STREAMING_LLAMA_SERVER = """#!/usr/bin/env python3
# a llama-server stand-in that answers: /health ok, /v1/models one model, a completion
# streamed as max_tokens one-character chunks, then the usage (prompt tokens: the ids
# sent) and [DONE]
import http.server, json, sys
port = int(sys.argv[sys.argv.index("--port") + 1])
class H(http.server.BaseHTTPRequestHandler):
    def log_message(self, *a):
        pass
    def do_GET(self):
        b = b'{"data":[{"id":"stub"}]}' if self.path == "/v1/models" else b'{"status":"ok"}'
        self.send_response(200)
        self.send_header("Content-Length", str(len(b)))
        self.end_headers()
        self.wfile.write(b)
    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        p, n = body["prompt"], body["max_tokens"]
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Connection", "close")
        self.end_headers()
        out = []
        for i in range(n):
            out.append('data: {"choices":[{"index":0,"text":"a","finish_reason":%s}]}\\n\\n'
                       % ('"length"' if i == n - 1 else "null"))
        out.append('data: {"choices":[],"usage":{"prompt_tokens":%d,"completion_tokens":%d}}'
                   '\\n\\ndata: [DONE]\\n\\n' % (len(p) if isinstance(p, list) else 1, n))
        self.wfile.write("".join(out).encode())
http.server.ThreadingHTTPServer(("127.0.0.1", port), H).serve_forever()
"""


@unittest.skipUnless(os.path.exists(os.path.join(ROOT, BUILD, "bin", "gateway")) and
                     os.path.exists(TINY), "needs the gateway and %s" % TINY)
class ServePeerRounds(unittest.TestCase):
    """serve-peer.sh draws new prompts for every round, the same for every side of a round
    (repeated prompts timed the servers' prompt caches, not their prefill: llama-server's
    TTFT p50 of session 11); SERVE_SAME_PROMPTS=1 repeats one set as before. Against
    tidepool and two stub llama-servers that stream."""

    def rounds(self, same):
        tmp = tempfile.mkdtemp()
        try:
            os.makedirs(os.path.join(tmp, "llama", "bin"))
            stub = os.path.join(tmp, "llama", "bin", "llama-server")
            with open(stub, "w") as f:
                f.write(STREAMING_LLAMA_SERVER)
            os.chmod(stub, 0o755)
            logs = os.path.join(tmp, "logs")
            env = dict(os.environ, LLAMA_CPP_DIR=os.path.join(tmp, "llama"), BUILD=BUILD,
                       SERVE_LOG_DIR=logs, SERVE_STREAMS="1", SERVE_REPS="2", SERVE_OUTPUT="4",
                       SERVE_MODEL=TINY, SERVE_SAME_PROMPTS="1" if same else "0")
            p = subprocess.run([SERVE_PEER], env=env, capture_output=True, text=True,
                               timeout=240)
            self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
            self.assertNotIn("MISMATCH", p.stdout)
            prompt = {}  # (side, round) -> the prompt tokens the side counted
            with open(os.path.join(logs, "runs.txt")) as f:
                for line in f:
                    x = line.split()
                    prompt[(x[0], int(x[2]))] = float(x[7])
            self.assertEqual(len(prompt), 6, prompt)
            for r in (1, 2):
                self.assertEqual(len({prompt[(s, r)] for s in
                                      ("tidepool", "llama-1slot", "llama-16slot")}), 1, prompt)
            return prompt[("tidepool", 1)], prompt[("tidepool", 2)]
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    def test_fresh_prompts_each_round(self):
        a, b = self.rounds(False)
        self.assertNotEqual(a, b)  # 32 prompts of 32 random words: other lengths in tokens

    def test_same_prompts_when_asked(self):
        a, b = self.rounds(True)
        self.assertEqual(a, b)


class RunBenchFilter(unittest.TestCase):
    """tests/run_bench.sh with a filter that matches no benchmark says so (exit 2) instead
    of printing nothing and exiting 0."""

    def test_unknown_filter(self):
        p = subprocess.run([os.path.join(ROOT, "tests", "run_bench.sh"), "no-such-bench"],
                           env=dict(os.environ, BUILD=BUILD), capture_output=True, text=True,
                           timeout=60)
        self.assertEqual(p.returncode, 2, p.stdout + p.stderr)
        self.assertIn("run_bench.sh: no benchmark matches 'no-such-bench'", p.stderr)


STUB_LLAMA_SERVER = """#!/usr/bin/env python3
# a llama-server stand-in: /health answers ok, a completion hangs
import http.server, os, sys, time
port = int(sys.argv[sys.argv.index("--port") + 1])
with open(os.path.join(%r, "pids"), "a") as f:
    f.write("%%d\\n" %% os.getpid())
class H(http.server.BaseHTTPRequestHandler):
    def log_message(self, *a):
        pass
    def do_GET(self):
        self.send_response(200)
        self.send_header("Content-Length", "15")
        self.end_headers()
        self.wfile.write(b'{"status":"ok"}')
    def do_POST(self):
        time.sleep(120)
http.server.ThreadingHTTPServer(("127.0.0.1", port), H).serve_forever()
"""


@unittest.skipUnless(os.path.exists(os.path.join(ROOT, BUILD, "bin", "gateway")) and
                     os.path.exists(TINY), "needs the gateway and %s" % TINY)
class RunBenchServeStops(unittest.TestCase):
    """A TERM to tests/run_bench.sh during the serving benchmark stops serve-peer.sh, its
    servers and its tidepool-bench at once (they ran on to the benchmark's end)."""

    def test_term_stops_everything(self):
        tmp = tempfile.mkdtemp()
        try:
            os.makedirs(os.path.join(tmp, "llama", "bin"))
            stub = os.path.join(tmp, "llama", "bin", "llama-server")
            with open(stub, "w") as f:
                f.write(STUB_LLAMA_SERVER % tmp)
            os.chmod(stub, 0o755)
            logs = os.path.join(tmp, "logs")
            env = dict(os.environ, LLAMA_CPP_DIR=os.path.join(tmp, "llama"), BUILD=BUILD,
                       SERVE_LOG_DIR=logs, SERVE_STREAMS="1", SERVE_REPS="1")
            p = subprocess.Popen([os.path.join(ROOT, "tests", "run_bench.sh"), "serve"],
                                 env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                 start_new_session=True)
            try:
                # the warm-up against tidepool, then a run against a stub that hangs; and
                # every process of the group up (the script, the peer, 4 servers: on a
                # loaded machine the pgrep below once came while only 3 were)
                def group():
                    return subprocess.run(["pgrep", "-g", str(p.pid)], capture_output=True,
                                          text=True).stdout.split()
                deadline = time.monotonic() + 90
                while (not os.path.exists(os.path.join(logs, "warmup.json.txt")) or
                       not subprocess.run(["pgrep", "-g", str(p.pid), "-f", "llama-1slot|"
                                           "tidepool-bench.*--url"], capture_output=True
                                          ).stdout or len(group()) < 6) and \
                        time.monotonic() < deadline:
                    time.sleep(0.1)
                time.sleep(1)
                self.assertGreaterEqual(len(group()), 6, group())  # script, peer, 4 servers
                p.send_signal(signal.SIGTERM)
                p.wait(timeout=20)
                time.sleep(0.5)
                left = subprocess.run(["ps", "-o", "pid,args", "-g", str(p.pid)],
                                      capture_output=True, text=True).stdout
                self.assertEqual(left.strip().count("\n"), 0, left)
            finally:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                p.communicate()
        finally:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    unittest.main()
