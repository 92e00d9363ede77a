"""The gateway's answers to bad requests, with no workers at all: every bad input gets a 4xx
with an OpenAI error body (streaming or not) and the gateway keeps serving; /health is 503
with a reason; a request no worker can take ends with an error instead of hanging; a full
queue answers 429 with Retry-After; a client that leaves is forgotten.

Starts only build/bin/gateway on free loopback ports. Standard library only.
    python3 -m unittest -v tests/integration/test_http_errors.py
"""

import http.client
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import unittest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BUILD = os.environ.get("TIDEPOOL_BUILD", "build")
GATEWAY = os.path.join(ROOT, BUILD, "bin", "gateway")
MODEL = os.path.join(ROOT, os.environ.get("TIDEPOOL_TEST_MODEL", "build/models/stories260K.gguf"))
SANITIZER_MARKERS = ("ERROR: AddressSanitizer", "ERROR: LeakSanitizer", "runtime error:",
                     "WARNING: ThreadSanitizer")
MAX_BODY = 16384
N_CTX = 512  # stories260K

# (name, path, body, status, param, code); body: dict/list/str (sent as JSON) or bytes (raw)
CHAT = "/v1/chat/completions"
CMPL = "/v1/completions"
MSG = [{"role": "user", "content": "hi"}]
BAD = [
    ("not json", CMPL, b'{"prompt": "hi"', 400, None, "invalid_json"),
    ("empty body", CMPL, b"", 400, None, "invalid_json"),
    ("array body", CMPL, [{"prompt": "hi"}], 400, None, "invalid_type"),
    ("invalid utf-8", CMPL, b'{"prompt": "caf\xc3"}', 400, None, "invalid_encoding"),
    ("prompt int", CMPL, {"prompt": 5}, 400, "prompt", "invalid_type"),
    ("prompt missing", CMPL, {"max_tokens": 5}, 400, "prompt", "missing_required_parameter"),
    ("prompt empty", CMPL, {"prompt": ""}, 400, "prompt", "invalid_value"),
    ("prompt batch with an int", CMPL, {"prompt": ["a", 5]}, 400, "prompt", "invalid_type"),
    ("messages string", CHAT, {"messages": "hi"}, 400, "messages", "invalid_type"),
    ("messages missing", CHAT, {"prompt": "hi"}, 400, "messages", "missing_required_parameter"),
    ("messages empty", CHAT, {"messages": []}, 400, "messages", "invalid_value"),
    ("chat image part", CHAT, {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "what is this?"},
        {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}]}]},
     400, "messages", "unsupported_value"),
    ("chat unknown part", CHAT, {"messages": [{"role": "user", "content": [{"type": "x"}]}]},
     400, "messages", "invalid_value"),
    ("temperature string", CMPL, {"prompt": "hi", "temperature": "hot"}, 400, "temperature",
     "invalid_type"),
    ("temperature high", CMPL, {"prompt": "hi", "temperature": 5}, 400, "temperature",
     "invalid_value"),
    ("top_p zero", CMPL, {"prompt": "hi", "top_p": 0}, 400, "top_p", "invalid_value"),
    ("top_p high", CMPL, {"prompt": "hi", "top_p": 1.01}, 400, "top_p", "invalid_value"),
    ("stop int", CMPL, {"prompt": "hi", "stop": 5}, 400, "stop", "invalid_type"),
    ("stop five", CMPL, {"prompt": "hi", "stop": ["a", "b", "c", "d", "e"]}, 400, "stop",
     "invalid_value"),
    ("stream string", CMPL, {"prompt": "hi", "stream": "yes"}, 400, "stream", "invalid_type"),
    ("max_tokens -1", CMPL, {"prompt": "hi", "max_tokens": -1}, 400, "max_tokens",
     "invalid_value"),
    ("max_tokens 0", CMPL, {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens",
     "invalid_value"),
    ("max_tokens 1.5", CMPL, {"prompt": "hi", "max_tokens": 1.5}, 400, "max_tokens",
     "invalid_type"),
    ("max_tokens string", CMPL, {"prompt": "hi", "max_tokens": "10"}, 400, "max_tokens",
     "invalid_type"),
    ("max_tokens over context", CMPL, {"prompt": "hi", "max_tokens": N_CTX}, 400, "max_tokens",
     "context_length_exceeded"),
    ("chat max_completion_tokens over context", CHAT,
     {"messages": MSG, "max_completion_tokens": 100000}, 400, "max_completion_tokens",
     "context_length_exceeded"),
    ("prompt over context", CMPL, {"prompt": "Once upon a time " * 200}, 400, "prompt",
     "context_length_exceeded"),
    ("prompt far over context", CMPL, {"prompt": "Once upon a time " * 800}, 400, "prompt",
     "context_length_exceeded"),
    ("chat over context", CHAT, {"messages": [{"role": "user", "content": "a b c " * 400}]},
     400, "messages", "context_length_exceeded"),
    ("n 129", CMPL, {"prompt": "hi", "n": 129}, 400, "n", "invalid_value"),
    ("unknown model", CMPL, {"prompt": "hi", "model": "gpt-4"}, 404, "model", "model_not_found"),
    ("chat unknown model", CHAT, {"messages": MSG, "model": "gpt-4"}, 404, "model",
     "model_not_found"),
    ("logprobs 6", CMPL, {"prompt": "hi", "logprobs": 6}, 400, "logprobs", "invalid_value"),
    ("chat top_logprobs 21", CHAT, {"messages": MSG, "logprobs": True, "top_logprobs": 21}, 400,
     "top_logprobs", "invalid_value"),
    ("best_of 129", CMPL, {"prompt": "hi", "best_of": 129}, 400, "best_of", "invalid_value"),
    ("body over limit", CMPL, {"prompt": "x" * (MAX_BODY + 10)}, 413, None, "request_too_large"),
    # sampling controls (docs/api.md "Sampling controls"): vLLM's ranges
    ("frequency_penalty low", CMPL, {"prompt": "hi", "frequency_penalty": -2.5}, 400,
     "frequency_penalty", "invalid_value"),
    ("repetition_penalty 0", CMPL, {"prompt": "hi", "repetition_penalty": 0}, 400,
     "repetition_penalty", "invalid_value"),
    ("repetition_penalty high", CHAT, {"messages": MSG, "repetition_penalty": 2.5}, 400,
     "repetition_penalty", "invalid_value"),
    ("logit_bias list", CMPL, {"prompt": "hi", "logit_bias": [1, 2]}, 400, "logit_bias",
     "invalid_type"),
    ("logit_bias key", CMPL, {"prompt": "hi", "logit_bias": {"dog": 5}}, 400, "logit_bias",
     "invalid_value"),
    ("logit_bias key negative", CMPL, {"prompt": "hi", "logit_bias": {"-3": 5}}, 400,
     "logit_bias", "invalid_value"),
    ("logit_bias value", CMPL, {"prompt": "hi", "logit_bias": {"5": 101}}, 400, "logit_bias",
     "invalid_value"),
    ("logit_bias string value", CMPL, {"prompt": "hi", "logit_bias": {"5": "1"}}, 400,
     "logit_bias", "invalid_value"),
    ("logit_bias key 01", CMPL, {"prompt": "hi", "logit_bias": {"01": 5}}, 400, "logit_bias",
     "invalid_value"),
    ("logit_bias key +1", CHAT, {"messages": MSG, "logit_bias": {"+1": 5}}, 400, "logit_bias",
     "invalid_value"),
    # chat asking for output this server cannot give: refused, not ignored
    ("response_format json_object", CHAT,
     {"messages": MSG, "response_format": {"type": "json_object"}}, 400, "response_format",
     "unsupported_parameter"),
    ("response_format json_schema", CHAT,
     {"messages": MSG, "response_format": {"type": "json_schema",
                                           "json_schema": {"name": "x", "schema": {}}}},
     400, "response_format", "unsupported_parameter"),
    ("tool_choice required", CHAT, {"messages": MSG, "tool_choice": "required"}, 400,
     "tool_choice", "unsupported_parameter"),
    ("tool_choice named", CHAT,
     {"messages": MSG, "tool_choice": {"type": "function", "function": {"name": "f"}}}, 400,
     "tool_choice", "unsupported_parameter"),
    ("modalities audio", CHAT, {"messages": MSG, "modalities": ["audio"]}, 400, "modalities",
     "unsupported_parameter"),
    ("logit_bias out of vocabulary", CHAT, {"messages": MSG, "logit_bias": {"512": 1}}, 400,
     "logit_bias", "invalid_value"),
    ("min_tokens negative", CMPL, {"prompt": "hi", "min_tokens": -1}, 400, "min_tokens",
     "invalid_value"),
    ("min_tokens over max_tokens", CMPL, {"prompt": "hi", "min_tokens": 9, "max_tokens": 8},
     400, "min_tokens", "invalid_value"),
    ("min_tokens float", CMPL, {"prompt": "hi", "min_tokens": 1.5}, 400, "min_tokens",
     "invalid_type"),
    ("stop_token_ids int", CMPL, {"prompt": "hi", "stop_token_ids": 2}, 400, "stop_token_ids",
     "invalid_type"),
    ("stop_token_ids negative", CMPL, {"prompt": "hi", "stop_token_ids": [2, -1]}, 400,
     "stop_token_ids", "invalid_value"),
    ("stop_token_ids out of vocabulary", CMPL, {"prompt": "hi", "stop_token_ids": [512]}, 400,
     "stop_token_ids", "invalid_value"),
]


sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cluster import free_port  # noqa: E402  (random ports below the ephemeral range)


class Gateway:
    def __init__(self, *args):
        self.port = free_port()
        self.tmp = tempfile.mkdtemp(prefix="tidepool-gw-")
        self.log = os.path.join(self.tmp, "gateway.log")
        argv = [GATEWAY, "--host", "127.0.0.1", "--port", str(self.port),
                "--ctl-bind", "tcp://127.0.0.1:%d" % free_port(), "--model", MODEL,
                "--max-body-bytes", str(MAX_BODY)] + list(args)
        if "--state-db" not in args:  # its own: another gateway may hold the default one
            argv += ["--state-db", os.path.join(self.tmp, "gateway.db")]
        if "--stats-bind" not in args:  # a free port: the default 5558 is a user's cluster's
            argv += ["--stats-bind", "tcp://127.0.0.1:%d" % free_port()]
        if "--sse-keepalive-s" not in args:  # these tests split events on exact bytes
            argv += ["--sse-keepalive-s", "3600"]
        with open(self.log, "ab") as f:
            self.proc = subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT)
        deadline = time.time() + 20
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError("gateway exited: " + self.read_log())
            if "listening on http://" in self.read_log():
                return
            time.sleep(0.05)
        raise RuntimeError("gateway did not start: " + self.read_log())

    def read_log(self):
        with open(self.log, errors="replace") as f:
            return f.read()

    def fingerprint(self):
        """The model fingerprint the gateway computed (a worker must REGISTER with it)."""
        return int(re.search(r"fingerprint ([0-9a-f]{16})", self.read_log()).group(1), 16)

    def request(self, method, path, body=None, headers=None, timeout=20):
        c = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        if body is not None and not isinstance(body, bytes):
            body = json.dumps(body).encode()
        h = {"Content-Type": "application/json"}
        h.update(headers or {})
        c.request(method, path, body=body, headers=h)
        r = c.getresponse()
        data = r.read()
        c.close()
        return r.status, dict(r.getheaders()), data

    def stop(self):
        """SIGTERM; returns the exit code. Fails on sanitizer reports in the log."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        log = self.read_log()
        for m in SANITIZER_MARKERS:
            if m in log:
                raise AssertionError("sanitizer report in the gateway log:\n" + log[-4000:])
        return self.proc.returncode


@unittest.skipUnless(os.path.exists(GATEWAY) and os.path.exists(MODEL),
                     "needs %s and %s (make all)" % (GATEWAY, MODEL))
class HttpErrorsTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.gw = Gateway("--request-timeout-ms", "800")

    @classmethod
    def tearDownClass(cls):
        rc = cls.gw.stop()
        assert rc == 0, "gateway exit code %s" % rc

    def check_error(self, status, headers, data, want_status, param, code, name):
        self.assertEqual(status, want_status, "%s: %r" % (name, data[:300]))
        self.assertTrue(headers.get("Content-Type", "").startswith("application/json"), name)
        err = json.loads(data)["error"]
        self.assertIsInstance(err["message"], str, name)
        self.assertTrue(err["message"], name)
        self.assertIn("type", err, name)
        self.assertEqual(err.get("param"), param, "%s: %r" % (name, err))
        self.assertEqual(err.get("code"), code, "%s: %r" % (name, err))
        return err

    def test_bad_requests(self):
        for name, path, body, want, param, code in BAD:
            with self.subTest(name):
                st, h, data = self.gw.request("POST", path, body)
                self.check_error(st, h, data, want, param, code, name)

    def test_bad_requests_streaming(self):
        """Validation comes before the stream starts: same 4xx JSON answers."""
        for name, path, body, want, param, code in BAD:
            if not isinstance(body, dict) or "stream" in body:
                continue
            with self.subTest(name):
                b = dict(body, stream=True)
                st, h, data = self.gw.request("POST", path, b)
                self.check_error(st, h, data, want, param, code, name + " (stream)")

    def test_context_message_names_numbers(self):
        st, h, data = self.gw.request("POST", CMPL, {"prompt": "hi", "max_tokens": 600})
        err = self.check_error(st, h, data, 400, "max_tokens", "context_length_exceeded", "ctx")
        self.assertIn(str(N_CTX), err["message"])
        self.assertIn("600", err["message"])
        for n in (200, 800):  # tokenized, and refused on its byte length alone
            st, h, data = self.gw.request("POST", CMPL, {"prompt": "Once upon a time " * n})
            err = self.check_error(st, h, data, 400, "prompt", "context_length_exceeded", "p")
            self.assertIn(str(N_CTX), err["message"])
            numbers = [int(w) for w in err["message"].replace(",", " ").split() if w.isdigit()]
            self.assertTrue(any(x > N_CTX for x in numbers), err["message"])

    def test_huge_body(self):
        st, _, _ = self.gw.request("POST", CMPL, b"x" * (4 * MAX_BODY + 100000))
        self.assertEqual(st, 413)

    def test_paths_and_methods(self):
        st, h, data = self.gw.request("GET", "/v1/nope")
        self.check_error(st, h, data, 404, None, "unknown_url", "unknown path")
        st, h, data = self.gw.request("POST", "/v2/completions", {"prompt": "hi"})
        self.check_error(st, h, data, 404, None, "unknown_url", "unknown path")
        for method, path in [("GET", CMPL), ("GET", CHAT), ("PUT", CMPL), ("POST", "/health"),
                             ("DELETE", "/v1/models"), ("POST", "/v1/models")]:
            with self.subTest(method + " " + path):
                st, h, data = self.gw.request(method, path, b"{}" if method != "GET" else None)
                self.check_error(st, h, data, 405, None, "method_not_allowed", method + path)
                want = {CMPL: "POST", CHAT: "POST", "/health": "GET, HEAD",
                        "/v1/models": "GET, HEAD"}[path]
                self.assertEqual(h.get("Allow"), want)  # HEAD wherever GET (RFC 9110 9.3.2)

    def test_no_default_endpoint(self):
        """The test gateway binds nothing a cluster on the default ports uses: until 3 Dec 2026
        it bound the default stats socket, tcp://127.0.0.1:5558, so a `deploy/local/start` or
        compose cluster started while these tests ran served without its stats socket
        ("cannot bind the stats socket ... Address already in use"), and tidepool-top showed
        a test gateway's snapshots instead."""
        log = self.gw.read_log()
        defaults = {"port": "8000", "ctl-bind": "tcp://127.0.0.1:5557",
                    "stats-bind": "tcp://127.0.0.1:5558", "state-db": "build/state/gateway.db"}
        for name, default in defaults.items():
            with self.subTest(name):
                m = re.search(r"config %s = (.*)" % re.escape(name), log)
                self.assertIsNotNone(m, name)
                self.assertNotEqual(m.group(1).strip(), default, name)

    def test_health_without_workers(self):
        st, h, data = self.gw.request("GET", "/health")
        self.assertEqual(st, 503)
        j = json.loads(data)
        self.assertNotEqual(j["status"], "ok")
        self.assertTrue(j["reason"])

    def test_models(self):
        st, _, data = self.gw.request("GET", "/v1/models")
        self.assertEqual(st, 200)
        j = json.loads(data)
        self.assertEqual(j["object"], "list")
        name = j["data"][0]["id"]
        self.assertEqual(j["data"][0]["object"], "model")
        st, _, data = self.gw.request("GET", "/v1/models/" + name)
        self.assertEqual(st, 200)
        st, h, data = self.gw.request("GET", "/v1/models/nope")
        self.check_error(st, h, data, 404, "model", "model_not_found", "model")
        # the served name is accepted as "model"
        st, _, data = self.gw.request("POST", CMPL, {"prompt": "hi", "model": name,
                                                     "max_tokens": 1})
        self.assertEqual(st, 503)  # valid, but no worker within --request-timeout-ms

    def test_content_length_must_be_digits(self):
        """Content-Length is 1*DIGIT (RFC 9110 8.6): libevent's strtoll took "+7" and "-0",
        which a proxy in front may read otherwise (request smuggling): 400 bad_framing, the
        connection closed, nothing after the body answered."""
        smuggled = b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n"
        for cl, body in ((b"+7", b'{"a":1}'), (b"-0", b""), (b"+0", b""), (b"0 7", b'{"a":1}')):
            with self.subTest(cl):
                req = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: " + cl +
                       b"\r\n\r\n" + body + smuggled)
                out, closed = raw_exchange(self.gw.port, req)
                self.assertTrue(closed, out[:300])
                self.assertEqual(out.count(b"HTTP/1.1 "), 1, out[:600])
                st, _, headers, payload = parse_response(out)
                self.assertEqual(st, 400, out[:300])
                self.assertEqual(headers.get("connection"), "close")
                code = json.loads(payload)["error"]["code"]
                self.assertIn(code, ("bad_framing", "bad_request"), payload)  # libevent: "0 7"
        # digits, also with leading zeros or padding, are a length
        body = b'{"prompt": ""}'
        for cl in (b"%d" % len(body), b"00%d" % len(body), b" %d " % len(body)):
            with self.subTest(cl):
                req = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
                       b"Content-Length: " + cl + b"\r\n\r\n" + body)
                out, _ = raw_exchange(self.gw.port, req)
                st, _, _, payload = parse_response(out)
                self.assertEqual((st, json.loads(payload)["error"]["param"]), (400, "prompt"))

    def test_http10_keepalive_stream_ends_with_the_connection(self):
        """An HTTP/1.0 stream is delimited by the connection's end: libevent answered a 1.0
        client that sent "Connection: keep-alive" with "Connection: keep-alive" and
        "Content-Length: 0", then the events, and kept the connection open."""
        body = json.dumps({"prompt": "Once", "max_tokens": 2, "stream": True}).encode()
        for extra in (b"Connection: keep-alive\r\n", b"Connection: Keep-Alive, foo\r\n", b""):
            with self.subTest(extra):
                data = (b"POST /v1/completions HTTP/1.0\r\n" + extra +
                        b"Content-Length: %d\r\n\r\n" % len(body) + body)
                t0 = time.time()
                out, closed = raw_exchange(self.gw.port, data, timeout=8)
                self.assertTrue(closed, out[:400])  # ends after the error event, ~0.8 s
                self.assertLess(time.time() - t0, 6)
                head, events = out.split(b"\r\n\r\n", 1)
                lines = head.decode("latin-1").split("\r\n")
                self.assertEqual(lines[0], "HTTP/1.0 200 OK")
                headers = {k.strip().lower(): v.strip() for k, v in
                           (line.split(":", 1) for line in lines[1:])}
                self.assertNotIn("content-length", headers, head)
                self.assertEqual(headers.get("connection", "close").lower(), "close", head)
                self.assertTrue(events.startswith(b"data: {"), out[:400])
                self.assertTrue(events.endswith(b"data: [DONE]\n\n"), out[-200:])
                self.assertIn(b'"code":"no_worker_available"', events)

    def test_double_slash_target_is_its_own_path(self):
        """A request target starting with "//" is an origin-form path (RFC 9112 3.2.1), not
        a host: libevent read "//x/metrics" as host x, path /metrics, and the gateway served
        /metrics (and "//x/v1/completions" as a completion), past a proxy's path rules."""
        for target, method in [("//x/metrics", "GET"), ("//v1/models", "GET"),
                               ("//x/v1/completions?a=1", "POST"), ("//x/health", "HEAD")]:
            with self.subTest(target):
                body = b'{"prompt":"a","max_tokens":1}' if method == "POST" else b""
                data = (b"%s %s HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
                        b"Content-Length: %d\r\n\r\n" % (method.encode(), target.encode(),
                                                         len(body)) + body)
                out, closed = raw_exchange(self.gw.port, data)
                st, _, headers, got = parse_response(out)
                self.assertEqual(st, 404, out[:300])
                if method != "HEAD":
                    self.assertEqual(json.loads(got), {"error": {
                        "message": "Invalid URL (%s %s)" % (method, target.split("?")[0]),
                        "type": "invalid_request_error", "param": None,
                        "code": "unknown_url"}})
        # the absolute form still names the host and the path (RFC 9112 3.2.2)
        out, _ = raw_exchange(self.gw.port, b"GET http://x/v1/models HTTP/1.1\r\nHost: x\r\n"
                                            b"Connection: close\r\n\r\n")
        self.assertTrue(out.startswith(b"HTTP/1.1 200 OK\r\n"), out[:300])

    def test_absolute_form_keeps_the_connection(self):
        """A request in absolute form (RFC 9112 3.2.2: a server MUST accept it) is served on
        a kept-alive connection as any other: libevent took it for a proxy request, and
        closed the connection after the reply (which said nothing of it), so the request
        pipelined behind it was lost without an answer."""
        body = b'{"prompt": "Once"}'
        for first in (b"GET http://x/v1/models HTTP/1.1\r\nHost: x\r\n\r\n",
                      b"POST http://127.0.0.1:%d/tokenize HTTP/1.1\r\nHost: x\r\n"
                      b"Content-Length: %d\r\n\r\n%s" % (self.gw.port, len(body), body)):
            with self.subTest(first[:30]):
                second = b"GET /v1/models HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
                out, closed = raw_exchange(self.gw.port, first + second)
                self.assertEqual(out.count(b"HTTP/1.1 200 OK\r\n"), 2, out[:600])
                self.assertTrue(closed)

    def test_head_has_headers_only(self):
        """HEAD gets GET's status and headers with the Content-Length of GET's body, and no
        body (RFC 9110 9.3.2): libevent 2.1 sent the body after a HEAD reply's headers, with
        no Content-Length, so a kept-alive client read those bytes as the start of its next
        response (`curl -I URL URL`: "Excess found")."""
        paths = ["/v1/models", "/v1/models/stories260K", "/v1/models/nope", "/health",
                 "/v1/batches", "/v1/files/file-nope", "/metrics", "/workers",
                 "/v1/completions", "/v1/nope"]
        stable = {"/v1/models", "/v1/models/stories260K", "/v1/models/nope", "/health",
                  "/v1/batches", "/v1/files/file-nope"}  # (404, 405 name the method)
        for path in paths:
            with self.subTest(path):
                get_status, _, get_body = self.gw.request("GET", path)
                two = (b"HEAD %s HTTP/1.1\r\nHost: x\r\n\r\n" % path.encode() +
                       b"GET /v1/models HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
                out, closed = raw_exchange(self.gw.port, two)
                self.assertTrue(closed, out[:300])
                head, rest = out.split(b"\r\n\r\n", 1)
                # the next response follows the HEAD reply's blank line at once
                self.assertTrue(rest.startswith(b"HTTP/1.1 200 OK\r\n"), out[:600])
                st, _, headers, _ = parse_response(head + b"\r\n\r\n")
                want_status = 405 if path == "/v1/completions" else get_status
                self.assertEqual(st, want_status, out[:300])
                self.assertIn("content-length", headers, out[:300])
                if path in stable:
                    self.assertEqual(int(headers["content-length"]), len(get_body), path)
                if path == "/v1/completions":  # the 405 of a HEAD: its error body's length
                    self.assertEqual(headers.get("allow"), "POST")
                    body = ('{"error":{"message":"Method HEAD is not allowed for '
                            '/v1/completions (use POST).","type":"invalid_request_error",'
                            '"param":null,"code":"method_not_allowed"}}')
                    self.assertEqual(int(headers["content-length"]), len(body))

    def test_no_worker_does_not_hang(self):
        t0 = time.time()
        st, h, data = self.gw.request("POST", CMPL, {"prompt": "hi", "max_tokens": 4})
        err = self.check_error(st, h, data, 503, None, "no_worker_available", "no worker")
        self.assertLess(time.time() - t0, 10)
        st, h, data = self.gw.request("POST", CHAT, {"messages": MSG, "stream": True})
        self.assertEqual(st, 200)
        self.assertTrue(h["Content-Type"].startswith("text/event-stream"))
        events = [e for e in data.decode().split("\n\n") if e]
        self.assertEqual(events[-1], "data: [DONE]")
        self.assertIn("error", json.loads(events[-2][len("data: "):]))
        first = json.loads(events[0][len("data: "):])
        self.assertEqual(first["choices"][0]["delta"]["role"], "assistant")

    def test_keeps_serving(self):
        for name, path, body, *_ in BAD:
            self.gw.request("POST", path, body)
        st, _, _ = self.gw.request("GET", "/health")
        self.assertEqual(st, 503)
        self.assertIsNone(self.gw.proc.poll())


def raw_exchange(port, data, timeout=10):
    """Send raw bytes on a new connection; return (everything received, closed): closed is
    True when the server closed the connection (EOF) before the timeout."""
    s = socket.create_connection(("127.0.0.1", port), timeout=timeout)
    s.sendall(data)
    out, closed = b"", False
    try:
        while True:
            chunk = s.recv(65536)
            if not chunk:
                closed = True
                break
            out += chunk
    except socket.timeout:
        pass
    except ConnectionResetError:
        closed = True
    s.close()
    return out, closed


def parse_response(data):
    """(status, reason, {header: value}, body) of the one HTTP/1.1 response in data."""
    head, body = data.split(b"\r\n\r\n", 1)
    lines = head.decode("latin-1").split("\r\n")
    version, status, reason = lines[0].split(" ", 2)
    assert version == "HTTP/1.1", lines[0]
    headers = {}
    for line in lines[1:]:
        k, v = line.split(":", 1)
        headers[k.strip().lower()] = v.strip()
    return int(status), reason, headers, body


MSG_400 = ("The request could not be parsed: a malformed request line or header, or a request "
           "line or header block over the server's limit (64 KiB).")
MSG_413 = "The request line, its headers or its body exceed this server's limits."
MSG_417 = "The Expect header is not supported (only 100-continue is)."
MSG_501 = "This HTTP method is not supported."
MSG_505 = ("The request's HTTP version is not supported (RFC 9110 15.6.6): this server "
           "speaks HTTP/1.0 and HTTP/1.1.")
# Requests libevent answers by itself, before any gateway handler: (name, bytes, status,
# reason phrase, code, message). Issue 12: these came back as libevent's HTML page.
RAW_ERRORS = [
    ("garbage request line", b"\x01\x02 garbage\r\n\r\n", 400, "Bad Request", "bad_request",
     MSG_400),
    ("request line without a version", b"GET /health\r\nHost: x\r\n\r\n", 400, "Bad Request",
     "bad_request", MSG_400),
    ("unknown HTTP version", b"GET /health HTTP/9.9\r\nHost: x\r\n\r\n", 505,
     "HTTP Version Not Supported", "http_version_not_supported", MSG_505),
    ("header line without a colon", b"GET /health HTTP/1.1\r\nHost x\r\n\r\n", 400,
     "Bad Request", "bad_request", MSG_400),
    ("header block over 64 KiB", b"GET /health HTTP/1.1\r\nHost: x\r\n" +
     b"".join(b"X-Pad-%d: %s\r\n" % (i, b"a" * 1000) for i in range(70)) + b"\r\n", 400,
     "Bad Request", "bad_request", MSG_400),
    ("over-long URI", b"GET /" + b"a" * 70000 + b" HTTP/1.1\r\nHost: x\r\n\r\n", 400,
     "Bad Request", "bad_request", MSG_400),
    ("unknown method", b"FOO /health HTTP/1.1\r\nHost: x\r\n\r\n", 501, "Not Implemented",
     "method_not_implemented", MSG_501),
    ("method outside the allowed ones", b"TRACE /health HTTP/1.1\r\nHost: x\r\n\r\n", 501,
     "Not Implemented", "method_not_implemented", MSG_501),
    ("Expect other than 100-continue", b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
     b"Expect: something\r\nContent-Length: 2\r\n\r\n{}", 417, "Expectation Failed",
     "expectation_failed", MSG_417),
    # libevent's own body limit: past 2 x --max-body-bytes + 64 KiB (Batch API off), before
    # the body is read (below that the gateway reads it and answers its own JSON 413)
    ("body over libevent's limit", b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
     b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % (2 * MAX_BODY + 65537),
     413, "Content Too Large", "request_too_large", MSG_413),
]


@unittest.skipUnless(os.path.exists(GATEWAY) and os.path.exists(MODEL),
                     "needs %s and %s (make all)" % (GATEWAY, MODEL))
class RawErrorsTest(unittest.TestCase):
    """Every HTTP error is the OpenAI JSON error shape, including those libevent 2.1 sends
    itself (it has no error callback: the gateway defines evhttp_send_error, http.c)."""

    @classmethod
    def setUpClass(cls):
        cls.gw = Gateway("--state-db", "", "--stats-bind", "")

    @classmethod
    def tearDownClass(cls):
        rc = cls.gw.stop()
        assert rc == 0, "gateway exit code %s" % rc

    def test_override_is_exported(self):
        """The executable exports evhttp_send_error, so libevent's PLT call binds to it."""
        out = subprocess.run(["nm", "-D", "--defined-only", GATEWAY], capture_output=True,
                             text=True, check=True).stdout
        self.assertRegex(out, r"(?m)^[0-9a-f]+ T evhttp_send_error$")
        # and evutil_strtoll, libevent's chunk-size parser (gateway/http_wire.c)
        self.assertRegex(out, r"(?m)^[0-9a-f]+ T evutil_strtoll$")

    def test_libevent_errors_are_json(self):
        for name, data, status, reason, code, message in RAW_ERRORS:
            with self.subTest(name):
                out, closed = raw_exchange(self.gw.port, data)
                self.assertTrue(out, name)
                st, rs, headers, body = parse_response(out)
                self.assertEqual((st, rs), (status, reason), out[:300])
                self.assertEqual(headers["content-type"], "application/json")
                self.assertEqual(headers["connection"], "close")
                self.assertEqual(int(headers["content-length"]), len(body))
                self.assertEqual(json.loads(body), {"error": {
                    "message": message, "type": "invalid_request_error", "param": None,
                    "code": code}})
                # after a request it could not take, the server closes the connection (what
                # follows on it cannot be trusted) and sends nothing else
                self.assertTrue(closed, name)
                self.assertEqual(out.count(b"HTTP/1.1 "), 1, name)
        self.assertIsNone(self.gw.proc.poll())
        st, _, _ = self.gw.request("GET", "/v1/models")
        self.assertEqual(st, 200)
        # counted like every reply
        _, _, metrics = self.gw.request("GET", "/metrics")
        got = {int(m.group(1)): int(float(m.group(2))) for m in re.finditer(
            r'(?m)^tidepool_http_responses_total\{[^}]*code="(\d+)"\} (\S+)$',
            metrics.decode())}
        for status in (400, 413, 417, 501, 505):
            want = sum(1 for case in RAW_ERRORS if case[2] == status)
            self.assertEqual(got.get(status), want, (status, got))

    def test_gateway_errors_keep_the_connection(self):
        """The gateway's own JSON errors (404 here) leave a keep-alive connection usable."""
        two = (b"GET /v1/nope HTTP/1.1\r\nHost: x\r\n\r\n"
               b"GET /v1/models HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        out, closed = raw_exchange(self.gw.port, two)
        self.assertTrue(closed)
        first, second = out.split(b"HTTP/1.1 ")[1:]
        self.assertTrue(first.startswith(b"404 "), out[:300])
        self.assertTrue(second.startswith(b"200 "), out[:600])
        st, _, headers, body = parse_response(b"HTTP/1.1 " + first)
        self.assertEqual(headers["content-type"], "application/json")
        self.assertEqual(json.loads(body)["error"]["code"], "unknown_url")


@unittest.skipUnless(os.path.exists(GATEWAY) and os.path.exists(MODEL),
                     "needs %s and %s (make all)" % (GATEWAY, MODEL))
class RequestSyntaxTest(unittest.TestCase):
    """What libevent's parser let through or refused wrongly (the break-it trial of session
    11): chunk extensions, the request target's bytes, the HTTP version, {id} escapes."""

    @classmethod
    def setUpClass(cls):
        cls.gw = Gateway("--stats-bind", "")  # with the Batch API (its own state db)

    @classmethod
    def tearDownClass(cls):
        rc = cls.gw.stop()
        assert rc == 0, "gateway exit code %s" % rc

    def chunked(self, chunks, path=b"/tokenize"):
        """POST path with a chunked body of the given raw chunk lines; (out, closed)."""
        head = (b"POST " + path + b" HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b"Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n")
        return raw_exchange(self.gw.port, head + b"".join(chunks))

    def check_refusal(self, out, closed, status, code, name):
        self.assertTrue(out, name)
        st, _, headers, body = parse_response(out)
        self.assertEqual(st, status, (name, out[:300]))
        self.assertEqual(headers["content-type"], "application/json", name)
        self.assertEqual(headers["connection"], "close", name)
        self.assertEqual(json.loads(body)["error"]["code"], code, (name, body))
        self.assertTrue(closed, name)
        self.assertEqual(out.count(b"HTTP/1.1 "), 1, name)
        return json.loads(body)["error"]["message"]

    def test_chunk_extensions_are_ignored(self):
        """RFC 9112 7.1.1: a recipient MUST ignore unrecognized chunk extensions (libevent
        refused "5;name=value" with 413)."""
        body = b'{"prompt": "Once upon a time"}'
        st, _, data = self.gw.request("POST", "/tokenize", body)
        self.assertEqual(st, 200, data)
        want = json.loads(data)["tokens"]
        a, b = body[:10], body[10:]
        for name, lines in (
                ("name=value", [b"%x;name=value\r\n%s\r\n" % (len(a), a),
                                b"%X;n2\r\n%s\r\n" % (len(b), b), b"0;last=1\r\n\r\n"]),
                ("several, quoted, BWS", [b"%x ; a = b ;c=\"x \\\" ;y\" \r\n%s\r\n" % (len(a), a),
                                          b"%x;q=\"\"\r\n%s\r\n" % (len(b), b), b"0\r\n\r\n"]),
                ("near the limit", [b"%x;k=%s\r\n%s\r\n" % (len(body), b"v" * 4000, body),
                                    b"0\r\n\r\n"])):
            with self.subTest(name):
                out, _ = self.chunked(lines)
                st, _, _, payload = parse_response(out)
                self.assertEqual(st, 200, out[:300])
                self.assertEqual(json.loads(payload)["tokens"], want)

    def test_bad_chunk_lines_are_refused(self):
        body = b'{"prompt": "Once"}'
        for name, line, status, code in (
                ("not hex", b"zz\r\n", 400, "bad_framing"),
                ("0x prefix", b"0x%x\r\n" % len(body), 400, "bad_framing"),
                ("plus sign", b"+%x\r\n" % len(body), 400, "bad_framing"),
                ("leading space", b" %x\r\n" % len(body), 400, "bad_framing"),
                ("extension without a name", b"%x;=v\r\n" % len(body), 400, "bad_framing"),
                ("unterminated quote", b"%x;a=\"v\r\n" % len(body), 400, "bad_framing"),
                ("huge extension", b"%x;k=%s\r\n" % (len(body), b"v" * 9000), 413,
                 "request_too_large")):
            with self.subTest(name):
                out, closed = self.chunked([line, body, b"\r\n0\r\n\r\n"])
                msg = self.check_refusal(out, closed, status, code, name)
                self.assertIn("chunk-size line", msg)
        self.assertIsNone(self.gw.proc.poll())

    def test_invalid_request_target_is_400(self):
        """RFC 9112 3: a request line whose target holds a space (or another byte a URI may
        not hold) is invalid: 400, never routed (it was: "/v1/mo dels" got 404)."""
        for name, target, what in (
                ("space", b"/v1/mo dels", "0x20 at byte 6"),
                ("two spaces after the method", b" /v1/models", "0x20 at byte 0"),
                ("DEL", b"/v1/models\x7f", "0x7f at byte 10"),
                ("non-ASCII", b"/v1/models?x=\xc3\xa9", "0xc3 at byte 13"),
                ("quote", b'/v1/models?x="a"', "0x22 at byte 13"),
                ("fragment", b"/v1/models#top", "0x23 at byte 10"),
                ("backslash", b"/v1\\models", "0x5c at byte 3"),
                ("bad escape", b"/v1/models?x=%zz", "not followed by two hex digits, at "
                                                   "byte 13"),
                ("short escape", b"/v1/models%4", "at byte 10")):
            with self.subTest(name):
                out, closed = raw_exchange(self.gw.port, b"GET " + target + b" HTTP/1.1\r\n"
                                           b"Host: x\r\n\r\nGET /v1/models HTTP/1.1\r\n"
                                           b"Host: x\r\n\r\n")
                msg = self.check_refusal(out, closed, 400, "bad_request", name)
                self.assertIn(what, msg)
        # what a URI may hold is still served (escapes, sub-delims, an IP literal)
        for target in (b"/v1/models?a=%20b&c=d~e;f=(g)*!$'+,:@/?",
                       b"http://[::1]:8000/v1/models"):
            out, _ = raw_exchange(self.gw.port, b"GET " + target + b" HTTP/1.1\r\nHost: x\r\n"
                                  b"Connection: close\r\n\r\n")
            self.assertTrue(out.startswith(b"HTTP/1.1 200 "), (target, out[:300]))

    def test_http_version_other_than_1x_is_505(self):
        """RFC 9110 15.6.6: a version the server does not speak gets 505, in HTTP/1.1 (6.2).
        libevent took "HTTP/1.2" (and any major 0 or 1) and echoed it in its status line."""
        for version in (b"HTTP/1.2", b"HTTP/1.9", b"HTTP/0.9", b"HTTP/2.0", b"HTTP/3"):
            with self.subTest(version):
                out, closed = raw_exchange(self.gw.port, b"GET /v1/models " + version +
                                           b"\r\nHost: x\r\n\r\nGET /v1/models HTTP/1.1\r\n"
                                           b"Host: x\r\n\r\n")
                self.assertTrue(out.startswith(b"HTTP/1.1 505 HTTP Version Not Supported\r\n"),
                                out[:300])
                self.assertEqual(self.check_refusal(out, closed, 505,
                                                    "http_version_not_supported", version),
                                 MSG_505)
        for version in (b"HTTP/01.1", b"HTTP/1.01", b"HTTP/1.1.1", b"http/1.1", b"HTTP/-1.1"):
            with self.subTest(version):
                out, closed = raw_exchange(self.gw.port, b"GET /v1/models " + version +
                                           b"\r\nHost: x\r\n\r\n")
                self.check_refusal(out, closed, 400, "bad_request", version)
        out, _ = raw_exchange(self.gw.port, b"GET /v1/models HTTP/1.0\r\n\r\n")
        self.assertTrue(out.startswith(b"HTTP/1.0 200 "), out[:300])

    def test_path_ids_are_percent_decoded(self):
        """Every {id} of a path is percent-decoded (files, batches, responses, models,
        workers): "/v1/files/%66ile-..." is that file; one that decodes to "/" or NUL is
        400 (only a model id may hold "/": "org%2Fname")."""
        data = b'{"custom_id": "a"}\n{"custom_id": "b"}\n'
        st, _, body = self.gw.request("POST", "/v1/files?purpose=batch", data,
                                      {"Content-Type": "application/jsonl"})
        self.assertEqual(st, 200, body)
        fid = json.loads(body)["id"]
        enc = "".join("%%%02X" % ord(ch) for ch in fid)  # every byte escaped
        st, _, body = self.gw.request("GET", "/v1/files/%s/content" % enc)
        self.assertEqual((st, body), (200, data))
        st, _, body = self.gw.request("GET", "/v1/files/" + enc)
        self.assertEqual((st, json.loads(body)["id"]), (200, fid))
        st, _, body = self.gw.request("GET", "/v1/responses/%72esp_nope")
        self.assertEqual(st, 404)
        self.assertEqual(json.loads(body)["error"]["message"],
                         "Response with id 'resp_nope' not found.")
        model = json.loads(self.gw.request("GET", "/v1/models")[2])["data"][0]["id"]
        st, _, body = self.gw.request("GET", "/v1/models/%%%02X%s" % (ord(model[0]), model[1:]))
        self.assertEqual((st, json.loads(body)["id"]), (200, model))
        st, _, body = self.gw.request("GET", "/v1/models/org%2Fname")
        self.assertEqual((st, json.loads(body)["error"]["code"]), (404, "model_not_found"))
        for method, path, what in (("GET", "/v1/files/file%2Fx/content", "file"),
                                   ("GET", "/v1/files/file%00", "file"),
                                   ("DELETE", "/v1/files/%2f", "file"),
                                   ("GET", "/v1/batches/batch%2F1", "batch"),
                                   ("POST", "/v1/batches/b%00/cancel", "batch"),
                                   ("GET", "/v1/responses/resp%2F1", "response"),
                                   ("POST", "/workers/decode%00/role", "worker"),
                                   ("GET", "/v1/models/a%00b", "model")):
            with self.subTest(path):
                st, h, body = self.gw.request(method, path, b"{}" if method == "POST" else None)
                err = self.check_error_body(st, body, 400, "invalid_value")
                self.assertIn("The %s id in the path decodes to a " % what, err["message"])
        st, _, body = self.gw.request("GET", "/v1/files/file%zz")
        self.check_error_body(st, body, 400, "bad_request")

    def check_error_body(self, st, body, status, code):
        self.assertEqual(st, status, body[:300])
        err = json.loads(body)["error"]
        self.assertEqual(err["code"], code, err)
        return err


@unittest.skipUnless(os.path.exists(GATEWAY) and os.path.exists(MODEL),
                     "needs %s and %s (make all)" % (GATEWAY, MODEL))
class StreamWaitTest(unittest.TestCase):
    """A stream waiting for a worker is not idle: --http-timeout-s (1 s here) used to cut it
    at 1 s with no error event and no [DONE] (found by a fresh-user trial). It now waits for
    --request-timeout-ms (3.5 s), gets an SSE comment every --sse-keepalive-s (1 s), then
    the error event and [DONE]; and the connection's idle timeout is back afterwards."""

    def test_waiting_stream_gets_keepalives_then_the_error(self):
        gw = Gateway("--http-timeout-s", "1", "--request-timeout-ms", "3500",
                     "--sse-keepalive-s", "1")
        try:
            s = socket.create_connection(("127.0.0.1", gw.port), timeout=10)
            body = json.dumps({"prompt": "Once upon", "max_tokens": 4, "stream": True}).encode()
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                      b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                      % (len(body), body))
            t0, out = time.time(), b""
            while not out.endswith(b"0\r\n\r\n"):
                chunk = s.recv(65536)
                self.assertTrue(chunk, "closed after %.1f s: %r" % (time.time() - t0, out))
                out += chunk
            waited = time.time() - t0
            self.assertTrue(out.startswith(b"HTTP/1.1 200"), out[:200])
            self.assertGreater(waited, 3.0)
            text = out.decode()
            self.assertGreaterEqual(text.count(": keep-alive\n\n"), 2, text)
            err = re.search(r"data: (\{\"error\".*?)\n\n", text)
            self.assertIsNotNone(err, text)
            self.assertEqual(json.loads(err.group(1))["error"]["code"], "no_worker_available")
            self.assertIn("data: [DONE]\n\n", text)
            # the connection idles again: closed by the server after about 1 s
            s.settimeout(5)
            t1 = time.time()
            self.assertEqual(s.recv(100), b"")
            self.assertLess(time.time() - t1, 4.0)
            s.close()
        finally:
            self.assertEqual(gw.stop(), 0)


@unittest.skipUnless(os.path.exists(GATEWAY) and os.path.exists(MODEL),
                     "needs %s and %s (make all)" % (GATEWAY, MODEL))
class QueueTest(unittest.TestCase):
    def test_full_queue_429_and_disconnect(self):
        gw = Gateway("--max-queue", "1", "--request-timeout-ms", "60000")
        try:
            # one request waits in the queue (no workers) on a raw socket...
            body = json.dumps({"prompt": "hi", "max_tokens": 2}).encode()
            s = socket.create_connection(("127.0.0.1", gw.port))
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                      b"application/json\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
            deadline = time.time() + 10
            while json.loads(gw.request("GET", "/health")[2])["queued"] != 1:
                self.assertLess(time.time(), deadline)
                time.sleep(0.02)
            # ...so the next one is refused
            st, h, data = gw.request("POST", CMPL, {"prompt": "hi", "max_tokens": 2})
            self.assertEqual(st, 429)
            self.assertIn("Retry-After", h)
            self.assertGreaterEqual(int(h["Retry-After"]), 1)
            err = json.loads(data)["error"]
            self.assertEqual(err["code"], "rate_limit_exceeded")
            # the waiting client leaves: its request is forgotten
            s.close()
            while json.loads(gw.request("GET", "/health")[2])["queued"] != 0:
                self.assertLess(time.time(), deadline)
                time.sleep(0.02)
            self.assertIn("client disconnected", gw.read_log())
        finally:
            self.assertEqual(gw.stop(), 0)


if __name__ == "__main__":
    unittest.main()


# --- fake workers: the gateway's side of the ctl protocol, driven step by step

try:
    import zmq  # python3-zmq; the tests below are skipped without it
except ImportError:  # pragma: no cover
    zmq = None

REGISTER, REGISTER_ACK, HEARTBEAT, PREFILL, CANCEL, TOKENS, FINISH, ERROR, BYE = range(1, 10)
BUNDLE = 12
BYTE0 = 3  # llama2.c vocabularies: <0x00>..<0xFF> are ids 3..258


def mp_pack(o):
    """A minimal msgpack encoder (maps with str keys, ints, floats, str, lists)."""
    import struct
    if isinstance(o, bool):
        return b"\xc3" if o else b"\xc2"
    if isinstance(o, int):
        if 0 <= o < 128:
            return bytes([o])
        if o >= 0:
            return b"\xcf" + struct.pack(">Q", o)
        return b"\xd3" + struct.pack(">q", o)
    if isinstance(o, float):
        return b"\xcb" + struct.pack(">d", o)
    if isinstance(o, str):
        b = o.encode()
        return (bytes([0xa0 | len(b)]) if len(b) < 32 else b"\xdb" + struct.pack(">I", len(b))) + b
    if isinstance(o, (list, tuple)):
        return b"\xdd" + struct.pack(">I", len(o)) + b"".join(mp_pack(x) for x in o)
    if isinstance(o, dict):
        return b"\xdf" + struct.pack(">I", len(o)) + b"".join(
            mp_pack(k) + mp_pack(v) for k, v in o.items())
    raise TypeError(type(o))


def mp_unpack(b):
    """A minimal msgpack decoder for the gateway's headers."""
    import struct

    def one(i):
        c = b[i]
        if c < 0x80:
            return c, i + 1
        if c >= 0xe0:
            return c - 256, i + 1
        if 0x80 <= c <= 0x8f:
            return seq(i + 1, c & 15, True)
        if 0x90 <= c <= 0x9f:
            return seq(i + 1, c & 15, False)
        if 0xa0 <= c <= 0xbf:
            n = c & 31
            return b[i + 1:i + 1 + n].decode(), i + 1 + n
        fixed = {0xcc: ">B", 0xcd: ">H", 0xce: ">I", 0xcf: ">Q", 0xd0: ">b", 0xd1: ">h",
                 0xd2: ">i", 0xd3: ">q", 0xca: ">f", 0xcb: ">d"}
        if c in fixed:
            fmt = fixed[c]
            n = struct.calcsize(fmt)
            return struct.unpack(fmt, b[i + 1:i + 1 + n])[0], i + 1 + n
        if c in (0xc0, 0xc2, 0xc3):
            return {0xc0: None, 0xc2: False, 0xc3: True}[c], i + 1
        if c in (0xd9, 0xda, 0xdb):
            w = {0xd9: 1, 0xda: 2, 0xdb: 4}[c]
            n = int.from_bytes(b[i + 1:i + 1 + w], "big")
            return b[i + 1 + w:i + 1 + w + n].decode(), i + 1 + w + n
        if c in (0xdc, 0xdd, 0xde, 0xdf):
            w = 2 if c in (0xdc, 0xde) else 4
            n = int.from_bytes(b[i + 1:i + 1 + w], "big")
            return seq(i + 1 + w, n, c in (0xde, 0xdf))
        raise ValueError("msgpack byte 0x%02x" % c)

    def seq(i, n, is_map):
        out = {} if is_map else []
        for _ in range(n):
            if is_map:
                k, i = one(i)
                v, i = one(i)
                out[k] = v
            else:
                v, i = one(i)
                out.append(v)
        return out, i

    return one(0)[0]


class FakeWorker:
    """A mixed worker speaking the ctl protocol from the test's thread."""

    def __init__(self, ctx, endpoint, wid, fp):
        self.wid = wid
        self.fp = fp  # the gateway's model fingerprint
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.ROUTING_ID, wid.encode())
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)
        self.alive = True

    def send(self, t, **fields):
        fields.update(t=t, v=1)
        self.sock.send(mp_pack(fields))

    def register(self, role=3, kvep=""):
        self.send(REGISTER, wid=self.wid, role=role, kvep=kvep, fp=self.fp, pid=os.getpid(),
                  n_ctx=N_CTX,
                  bs=16, max_seqs=8, kv_total=1000, kv_free=1000)

    def send_bundle(self, frames):
        """A BUNDLE: its own header, then each message (a dict, or raw bytes) as a frame."""
        self.sock.send_multipart([mp_pack({"t": BUNDLE, "v": 1})] +
                                 [f if isinstance(f, bytes) else mp_pack(dict(f, v=1))
                                  for f in frames])

    def heartbeat(self):
        self.send(HEARTBEAT, wid=self.wid, role=3, state=1, running=0, queued=0, qtok=0,
                  kv_total=1000, kv_free=1000, tok_in=0, tok_out=0)

    def recv(self, timeout=5.0, want=None):
        """The next message (skipping REGISTER_ACK unless wanted), as a dict, or None."""
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.sock.poll(int(max(1, (deadline - time.time()) * 1000))):
                m = mp_unpack(self.sock.recv())
                if want is None or m["t"] in want:
                    return m
        return None

    def close(self):
        self.sock.close()


def text_of(ids):
    return bytes(i - BYTE0 for i in ids).decode()


def ids_of(text):
    return [BYTE0 + b for b in text.encode()]


@unittest.skipUnless(zmq and os.path.exists(GATEWAY) and os.path.exists(MODEL),
                     "needs python3-zmq, %s and %s" % (GATEWAY, MODEL))
class FakeWorkerTest(unittest.TestCase):
    """Retries, duplicates, dead workers, cancels: the gateway against scripted workers."""

    def setUp(self):
        self.ctl_port = free_port()
        self.gw = Gateway("--ctl-bind", "tcp://127.0.0.1:%d" % self.ctl_port,
                          "--heartbeat-ms", "100", "--dead-after-ms", "600",
                          "--max-retries", "2", "--request-timeout-ms", "20000")
        self.ctx = zmq.Context()
        self.workers = []

    def tearDown(self):
        for w in self.workers:
            w.close()
        self.ctx.term()
        self.assertEqual(self.gw.stop(), 0)

    def worker(self, wid, role=3, kvep=""):
        w = FakeWorker(self.ctx, "tcp://127.0.0.1:%d" % self.ctl_port, wid, self.gw.fingerprint())
        w.register(role, kvep)
        self.assertEqual(w.recv(want=(REGISTER_ACK,))["hb_ms"], 100)
        self.workers.append(w)
        return w

    def start(self, body, path=CMPL):
        """Send a request from a thread; returns a function giving (status, headers, data)."""
        import threading
        box = {}

        def run():
            box["r"] = self.gw.request("POST", path, body, timeout=30)
        t = threading.Thread(target=run)
        t.start()

        def result():
            t.join(30)
            return box["r"]
        return result

    def prefill(self, w, timeout=5.0):
        m = w.recv(timeout, want=(PREFILL,))
        self.assertIsNotNone(m, "no PREFILL for " + w.wid)
        self.assertEqual(m["dep"], "")
        self.assertEqual(m["dw"], w.wid)
        return m

    def test_wrong_fingerprint_is_refused(self):
        """A REGISTER with another model's fingerprint gets REGISTER_ACK with code 2
        (layout_mismatch) and the reason, and the worker is never routed to."""
        w = FakeWorker(self.ctx, "tcp://127.0.0.1:%d" % self.ctl_port, "w-x", 1)
        self.workers.append(w)
        w.register()
        m = w.recv(want=(REGISTER_ACK,))
        self.assertEqual(m["code"], 2)
        self.assertEqual(m["msg"], "model fingerprint 0000000000000001, the gateway's model has "
                         "%016x (another model, or another conversion of it)"
                         % self.gw.fingerprint())
        self.assertEqual(m["hb_ms"], 100)
        st, _, data = self.gw.request("GET", "/health")
        self.assertEqual(st, 503)
        self.assertEqual(json.loads(data)["workers"],
                         {"prefill": 0, "decode": 0, "mixed": 0, "draining": 0})
        st, _, data = self.gw.request("GET", "/workers")
        body = json.loads(data)
        self.assertEqual(body["workers"], [])
        self.assertEqual([(r["id"], r["state"], r["role"]) for r in body["refused"]],
                         [("w-x", "refused", "mixed")])
        # an older worker that ignores the refusal and heartbeats is told to register
        # again (BYE) and refused again, never routed to
        w.heartbeat()
        self.assertIsNotNone(w.recv(want=(BYE,)))
        w.register()
        self.assertEqual(w.recv(want=(REGISTER_ACK,))["code"], 2)
        self.assertIsNone(w.recv(0.5, want=(PREFILL,)))
        self.assertEqual(len(re.findall("worker w-x .* refused", self.gw.read_log())), 1)

    def test_duplicates_and_retry_give_one_answer(self):
        a = self.worker("w-a")
        res = self.start({"prompt": "hi", "max_tokens": 6, "temperature": 0})
        m = self.prefill(a)
        n_prompt = len(m["tokens"])
        self.assertEqual(m["max_tokens"], 6)
        rid = m["rid"]
        want = ids_of("Hello!")
        # the first token twice (prefill and decode both report it), then a repeat
        a.send(TOKENS, rid=rid, index=0, tokens=want[:1])
        a.send(TOKENS, rid=rid, index=0, tokens=want[:2])
        a.send(TOKENS, rid=rid, index=1, tokens=want[1:3])
        b = self.worker("w-b")
        a.send(ERROR, rid=rid, code=7, msg="injected", retry=1)
        m2 = self.prefill(b)
        # each attempt has its own wire rid: same request id (high bits), next attempt
        self.assertEqual(m2["rid"] >> 8, rid >> 8)
        self.assertEqual(m2["rid"], rid + 1)
        self.assertEqual(m2["tokens"][n_prompt:], want[:3])  # prompt + tokens so far
        self.assertEqual(m2["max_tokens"], 3)
        # a stale message of the first attempt, even from the new attempt's worker, is ignored
        b.send(TOKENS, rid=rid, index=0, tokens=ids_of("zz"))
        b.send(TOKENS, rid=m2["rid"], index=0, tokens=want[3:6])
        b.send(FINISH, rid=m2["rid"], reason=2)
        st, _, data = res()
        self.assertEqual(st, 200, data)
        j = json.loads(data)
        self.assertEqual(j["choices"][0]["text"], "Hello!")
        self.assertEqual(j["choices"][0]["finish_reason"], "length")
        self.assertEqual(j["usage"]["completion_tokens"], 6)
        # late messages of the failed attempt are ignored
        a.send(TOKENS, rid=rid, index=3, tokens=ids_of("zz"))
        a.send(FINISH, rid=rid, reason=1)
        self.assertEqual(self.gw.request("GET", "/health")[0], 200)

    def test_out_of_vocabulary_ids_rerun_elsewhere(self):
        """TOKENS holding an id outside the model's vocabulary (512 for stories260K) are never
        turned into text: dropped, logged, and the attempt re-run from what is known."""
        a = self.worker("w-a")
        res = self.start({"prompt": "hi", "max_tokens": 5, "temperature": 0})
        m = self.prefill(a)
        rid, n_prompt = m["rid"], len(m["tokens"])
        want = ids_of("Hello")
        a.send(TOKENS, rid=rid, index=0, tokens=want[:2])
        a.send(TOKENS, rid=rid, index=2, tokens=[want[2], 512])
        m2 = self.prefill(a)  # the only worker: the re-run comes back to it
        b = a
        self.assertEqual(m2["rid"], rid + 1)
        self.assertEqual(m2["tokens"][n_prompt:], want[:2])  # the bad message added nothing
        b.send(TOKENS, rid=m2["rid"], index=0, tokens=want[2:5])
        b.send(FINISH, rid=m2["rid"], reason=2)
        st, _, data = res()
        self.assertEqual(st, 200, data)
        self.assertEqual(json.loads(data)["choices"][0]["text"], "Hello")
        self.assertIn("hold id 512 at 1, outside the vocabulary of 512", self.gw.read_log())

    def test_out_of_vocabulary_worker_is_avoided_by_the_rerun(self):
        """With another worker free, the re-run after a worker's out-of-vocabulary or
        undecodable TOKENS goes there, not back to the worker that produced them (every
        re-run went to the same idle worker: 503 after --max-retries with a healthy one
        idle)."""
        ws = {x: self.worker(x) for x in ("w-a", "w-b")}

        def next_prefill():
            deadline = time.time() + 3
            while time.time() < deadline:
                for w in ws.values():
                    m = w.recv(0.02, want=(PREFILL,))
                    if m:
                        return w, m
            self.fail("no PREFILL")
        for bad_ids in ([600], [-1]):
            res = self.start({"prompt": "hi", "max_tokens": 2, "temperature": 0})
            bad, m = next_prefill()
            bad.send(TOKENS, rid=m["rid"], index=0, tokens=bad_ids)
            good, m2 = next_prefill()
            self.assertNotEqual(good.wid, bad.wid)
            good.send(TOKENS, rid=m2["rid"], index=0, tokens=ids_of("ok"))
            st, _, data = res()
            self.assertEqual(st, 200, data)
            self.assertEqual(json.loads(data)["choices"][0]["text"], "ok")

    def test_malformed_tokens_rerun_at_once(self):
        """TOKENS the protocol cannot even decode (an id below 0 or past 2^31, alone or in a
        BUNDLE) are lost like the out-of-vocabulary ones: the attempt is re-run from what is
        known at once, not after --request-timeout-ms (20 s here) of silence."""
        a = self.worker("w-a")
        res = self.start({"prompt": "hi", "max_tokens": 4, "temperature": 0})
        m = self.prefill(a)
        rid, n_prompt = m["rid"], len(m["tokens"])
        a.send(TOKENS, rid=rid, index=0, tokens=ids_of("He"))
        a.send(TOKENS, rid=rid, index=2, tokens=[-1])
        m2 = self.prefill(a, timeout=3)
        self.assertEqual(m2["rid"], rid + 1)
        self.assertEqual(m2["tokens"][n_prompt:], ids_of("He"))
        a.send_bundle([{"t": TOKENS, "rid": m2["rid"], "index": 0, "tokens": [2 ** 32]}])
        m3 = self.prefill(a, timeout=3)
        self.assertEqual(m3["rid"], rid + 2)
        self.assertEqual(m3["tokens"][n_prompt:], ids_of("He"))
        a.send(TOKENS, rid=m3["rid"], index=0, tokens=ids_of("ll"))
        a.send(FINISH, rid=m3["rid"], reason=2)
        st, _, data = res()
        self.assertEqual(st, 200, data)
        self.assertEqual(json.loads(data)["choices"][0]["text"], "Hell")
        log = self.gw.read_log()
        self.assertIn("malformed TOKENS from w-a", log)
        # a malformed message naming no current attempt changes nothing
        a.send(TOKENS, rid=rid, index=0, tokens=[-1])
        self.assertEqual(self.gw.request("GET", "/health")[0], 200)

    def test_tokens_gap_without_progress_is_a_counted_retry(self):
        """TOKENS that start past what is known (lost messages) re-run the attempt; one that
        brought no token at all counts as a failed attempt, so a worker that always skips
        ahead ends the request with 503 after --max-retries (2) instead of re-running it
        for ever."""
        a = self.worker("w-a")
        res = self.start({"prompt": "hi", "max_tokens": 4})
        for _ in range(3):
            m = self.prefill(a)
            a.send(TOKENS, rid=m["rid"], index=5, tokens=ids_of("x"))
        st, _, data = res()
        self.assertEqual(st, 503, data)
        self.assertEqual(json.loads(data)["error"]["code"], "worker_failure")
        self.assertIsNone(a.recv(0.1, want=(PREFILL,)))
        # a gap after progress re-runs without costing a retry: the answer completes
        a.heartbeat()
        res = self.start({"prompt": "hi", "max_tokens": 4})
        for k in range(3):
            m = self.prefill(a)
            a.send(TOKENS, rid=m["rid"], index=0, tokens=ids_of("abc"[k]))
            a.send(TOKENS, rid=m["rid"], index=3, tokens=ids_of("x"))
        m = self.prefill(a)
        a.send(TOKENS, rid=m["rid"], index=0, tokens=ids_of("d"))
        st, _, data = res()
        self.assertEqual(st, 200, data)
        self.assertEqual(json.loads(data)["choices"][0]["text"], "abcd")

    def test_failed_kv_link_is_avoided(self):
        """A prefill worker whose KV hand-off to a decode worker failed (the link is down
        while both reach the gateway): the re-run and the next requests go to another
        decode worker while the pair is avoided; with no other pair the failed one is
        tried again rather than waiting."""
        p = self.worker("w-p", role=1)
        d = {x: self.worker(x, role=2, kvep="tcp://127.0.0.1:1") for x in ("w-d1", "w-d2")}
        res = self.start({"prompt": "hi", "max_tokens": 3, "temperature": 0})
        m = p.recv(want=(PREFILL,))
        bad = m["dw"]
        good = ({"w-d1", "w-d2"} - {bad}).pop()
        p.send(ERROR, rid=m["rid"], code=4, retry=1,
               msg="KV transfer to tcp://127.0.0.1:1 failed: lease expired")
        m2 = p.recv(want=(PREFILL,))
        self.assertIsNotNone(m2)
        self.assertEqual(m2["dw"], good)
        d[good].send(TOKENS, rid=m2["rid"], index=0, tokens=ids_of("Hey"))
        d[good].send(FINISH, rid=m2["rid"], reason=2)
        st, _, data = res()
        self.assertEqual(st, 200, data)
        self.assertEqual(json.loads(data)["choices"][0]["text"], "Hey")
        self.assertIn("KV hand-off w-p -> %s failed (1 in a row)" % bad, self.gw.read_log())
        # the next request, within the penalty (1 s), avoids the pair too
        res = self.start({"prompt": "hi", "max_tokens": 1, "temperature": 0})
        m3 = p.recv(want=(PREFILL,))
        self.assertEqual(m3["dw"], good)
        p.send(TOKENS, rid=m3["rid"], index=0, tokens=ids_of("H"))
        p.send(FINISH, rid=m3["rid"], reason=2)
        self.assertEqual(res()[0], 200)
        # only the failed pair left: it is used again (and fails again: 2 in a row)
        d[good].send(BYE, wid=good)
        time.sleep(0.2)
        res = self.start({"prompt": "hi", "max_tokens": 2, "temperature": 0})
        m4 = p.recv(want=(PREFILL,))
        self.assertEqual(m4["dw"], bad)
        p.send(ERROR, rid=m4["rid"], code=4, retry=1, msg="KV transfer failed: lease expired")
        m5 = p.recv(want=(PREFILL,))
        self.assertEqual(m5["dw"], bad)
        d[bad].send(TOKENS, rid=m5["rid"], index=0, tokens=ids_of("Ho"))
        d[bad].send(FINISH, rid=m5["rid"], reason=2)
        st, _, data = res()
        self.assertEqual(st, 200, data)
        self.assertEqual(json.loads(data)["choices"][0]["text"], "Ho")
        self.assertIn("KV hand-off w-p -> %s failed (2 in a row)" % bad, self.gw.read_log())

    def test_decode_tokens_overtaking_the_prefill_end_it_cleanly(self):
        """The decode worker's first TOKENS repeat the first token, so (on a loaded machine)
        they can reach the gateway, and end a short request at max_tokens, before the
        prefill worker's own TOKENS. That late message is expected: no CANCEL (it would turn
        the prefill's finished transfer into a cancelled one in its counters), and the
        prefill's durations come with the decode worker's TOKENS (KV_END carries them), so
        the request's prefill-time sample is not lost (the CI run that found it: 11 of 12)."""
        p = self.worker("w-p", role=1)
        d = self.worker("w-d", role=2, kvep="tcp://127.0.0.1:1")
        res = self.start({"prompt": "hi", "max_tokens": 2, "temperature": 0})
        m = p.recv(want=(PREFILL,))
        self.assertEqual(m["dw"], "w-d")
        d.send(TOKENS, rid=m["rid"], index=0, tokens=ids_of("ok"), queue_us=1000,
               prefill_us=250000, xfer_us=3000, xfer_bytes=4096, step_us=2000)
        st, _, data = res()
        self.assertEqual(st, 200, data)
        self.assertEqual(json.loads(data)["choices"][0]["text"], "ok")
        p.send(TOKENS, rid=m["rid"], index=0, tokens=ids_of("o"), queue_us=1000,
               prefill_us=250000)
        d.send(FINISH, rid=m["rid"], reason=2)
        p.send(FINISH, rid=m["rid"], reason=2)
        self.assertIsNone(p.recv(0.5, want=(CANCEL,)), "CANCEL sent for a finished request")
        self.assertIsNone(d.recv(0.1, want=(CANCEL,)), "CANCEL sent for a finished request")
        _, _, metrics = self.gw.request("GET", "/metrics")
        got = dict(re.findall(r"^tidepool_request_prefill_time_seconds_(sum|count)\{[^}]*\} (\S+)$",
                              metrics.decode(), re.M))
        self.assertEqual(got, {"count": "1", "sum": "0.25"})
        # a message of an attempt the gateway never knew still gets its CANCEL
        p.send(TOKENS, rid=m["rid"] + 5, index=0, tokens=ids_of("o"))
        c = p.recv(2, want=(CANCEL,))
        self.assertIsNotNone(c)
        self.assertEqual(c["rid"], m["rid"] + 5)

    def pd_pair(self):
        """A prefill and a decode worker, and a function that heartbeats both (the test's
        pauses are longer than --dead-after-ms)."""
        p = self.worker("w-p", role=1)
        d = self.worker("w-d", role=2, kvep="tcp://127.0.0.1:1")

        def hb():
            for w, role in ((p, 1), (d, 2)):
                w.send(HEARTBEAT, wid=w.wid, role=role, state=1, running=0, queued=0, qtok=0,
                       kv_total=1000, kv_free=1000, tok_in=0, tok_out=0)
        return p, d, hb

    def test_decode_tokens_with_logprobs_overtaking_the_prefill_are_held(self):
        """With logprobs the decode worker does not repeat the first token (it has not its
        logprobs), so its first TOKENS start at 1; when they (and its FINISH) reach the
        gateway before the prefill worker's TOKENS of token 0 (another connection; a
        prefill batch's tokens go out at the end of the batch), they are held until that
        token comes, not taken for lost tokens: before, each attempt was re-run and the
        request failed with 503 after the retries (test_choices' best_of on a fast host)."""
        p, d, hb = self.pd_pair()
        res = self.start({"prompt": "hi", "max_tokens": 4, "temperature": 0, "logprobs": 0})
        m = p.recv(want=(PREFILL,))
        self.assertEqual(m["dw"], "w-d")
        self.assertEqual(m["lpk"], 1)
        d.send(TOKENS, rid=m["rid"], index=1, tokens=ids_of("bc"),
               lp=[[-0.5, [], []], [-0.25, [], []]])
        d.send(TOKENS, rid=m["rid"], index=3, tokens=ids_of("d"), lp=[[-0.125, [], []]])
        d.send(FINISH, rid=m["rid"], reason=2)
        hb()
        self.assertIsNone(p.recv(0.3, want=(PREFILL, CANCEL)), "the attempt was re-run")
        hb()
        p.send(TOKENS, rid=m["rid"], index=0, tokens=ids_of("a"), lp=[[-1.0, [], []]])
        p.send(FINISH, rid=m["rid"], reason=2)
        st, _, data = res()
        self.assertEqual(st, 200, data)
        ch = json.loads(data)["choices"][0]
        self.assertEqual(ch["text"], "abcd")
        self.assertEqual(ch["logprobs"]["token_logprobs"], [-1.0, -0.5, -0.25, -0.125])
        self.assertEqual(ch["finish_reason"], "length")
        self.assertIsNone(p.recv(0.2, want=(PREFILL, CANCEL)))
        self.assertIsNone(d.recv(0.05, want=(PREFILL, CANCEL)))

    def test_decode_tokens_gap_the_prefill_cannot_fill_is_rerun(self):
        """Held TOKENS that the prefill worker's first token does not reach (index 2 with
        1 known) are a real loss: the attempt is re-run from what is known."""
        p, d, hb = self.pd_pair()
        res = self.start({"prompt": "hi", "max_tokens": 4, "temperature": 0, "logprobs": 0})
        m = p.recv(want=(PREFILL,))
        d.send(TOKENS, rid=m["rid"], index=2, tokens=ids_of("c"), lp=[[-0.5, [], []]])
        p.send(TOKENS, rid=m["rid"], index=0, tokens=ids_of("a"), lp=[[-1.0, [], []]])
        m2 = p.recv(want=(PREFILL,))
        self.assertIsNotNone(m2, "a real gap was not re-run")
        hb()
        d.send(TOKENS, rid=m2["rid"], index=0, tokens=ids_of("xyz"),
               lp=[[-1.0, [], []], [-1.0, [], []], [-1.0, [], []]])
        d.send(FINISH, rid=m2["rid"], reason=2)
        st, _, data = res()
        self.assertEqual(st, 200, data)
        self.assertEqual(json.loads(data)["choices"][0]["text"], "axyz")

    def test_avoided_pair_not_used_while_another_is_busy(self):
        """While a failed pair is avoided, a request that the other pair can take once its
        decode worker has room again waits for it rather than going over the failed link
        (where it would likely fail again after a lease and lose a retry)."""
        p = self.worker("w-p", role=1)
        d = {x: self.worker(x, role=2, kvep="tcp://127.0.0.1:1") for x in ("w-d1", "w-d2")}

        def beat(free_good):
            p.send(HEARTBEAT, wid="w-p", role=1, state=1, running=0, queued=0, qtok=0,
                   kv_total=1000, kv_free=1000, tok_in=0, tok_out=0)
            for x, w in d.items():
                w.send(HEARTBEAT, wid=x, role=2, state=1, running=0, queued=0, qtok=0,
                       kv_total=1000, kv_free=free_good if x == good else 1000, tok_in=0,
                       tok_out=0)
        res = self.start({"prompt": "hi", "max_tokens": 2, "temperature": 0})
        m = p.recv(want=(PREFILL,))
        bad = m["dw"]
        good = ({"w-d1", "w-d2"} - {bad}).pop()
        p.send(ERROR, rid=m["rid"], code=4, retry=1, msg="KV transfer failed: lease expired")
        t_fail = time.time()
        m2 = p.recv(want=(PREFILL,))
        self.assertEqual(m2["dw"], good)
        beat(0)  # the good decode worker is full for now
        res2 = self.start({"prompt": "yo", "max_tokens": 2, "temperature": 0})
        t_end = t_fail + 0.7  # (well within the pair's 1 s penalty)
        if time.time() > t_end - 0.2:
            self.skipTest("the machine is too slow for the 1 s penalty window")
        while time.time() < t_end:
            self.assertIsNone(p.recv(0.05, want=(PREFILL,)),
                              "sent over the avoided pair while the other one was busy")
            beat(0)
        beat(1000)
        m3 = p.recv(2, want=(PREFILL,))
        self.assertIsNotNone(m3)
        self.assertEqual(m3["dw"], good)
        for mm in (m2, m3):
            d[good].send(TOKENS, rid=mm["rid"], index=0, tokens=ids_of("ok"))
            d[good].send(FINISH, rid=mm["rid"], reason=2)
        self.assertEqual(res()[0], 200)
        self.assertEqual(res2()[0], 200)

    def test_bundle_frames_are_validated_one_by_one(self):
        """A BUNDLE's frames are handled in order, each decoded like a message: a malformed
        one and a type that may not be bundled are logged and dropped, the others count."""
        a = self.worker("w-a")
        res = self.start({"prompt": "hi", "max_tokens": 5, "stream": True})
        rid = self.prefill(a)["rid"]
        a.send_bundle([{"t": TOKENS, "rid": rid, "index": 0, "tokens": ids_of("He")},
                       b"\x81\xa1t",  # truncated msgpack
                       {"t": HEARTBEAT, "wid": "w-a", "role": 3, "state": 1, "running": 0,
                        "queued": 0, "qtok": 0, "kv_total": 1000, "kv_free": 1000,
                        "tok_in": 0, "tok_out": 0},
                       {"t": TOKENS, "rid": rid, "index": 2, "tokens": ids_of("llo")},
                       {"t": FINISH, "rid": rid, "reason": 2}])
        st, _, data = res()
        self.assertEqual(st, 200)
        events = [e[6:] for e in data.decode().split("\n\n") if e]
        self.assertEqual(events[-1], "[DONE]")
        self.assertEqual("".join(json.loads(e)["choices"][0]["text"] for e in events[:-1]),
                         "Hello")
        self.assertEqual(json.loads(events[-2])["choices"][0]["finish_reason"], "length")
        log = self.gw.read_log()
        self.assertIn("dropped message 1 of a BUNDLE from 'w-a'", log)
        self.assertIn("dropped HEARTBEAT in a BUNDLE from 'w-a'", log)

    def test_malformed_bundles_are_logged_and_dropped(self):
        """An empty BUNDLE, a BUNDLE inside a BUNDLE, an empty frame and frames beyond
        PROTO_BUNDLE_MAX (256) are logged and dropped; the request they interleave with
        gets exactly its own tokens."""
        a = self.worker("w-a")
        res = self.start({"prompt": "hi", "max_tokens": 5, "temperature": 0})
        rid = self.prefill(a)["rid"]
        a.send_bundle([])
        a.send_bundle([{"t": TOKENS, "rid": rid, "index": 0, "tokens": ids_of("He")},
                       {"t": BUNDLE},
                       b""])
        # 256 frames are handled; the 257th and later (here a repeat, then the rest of
        # the answer) are dropped
        over = [{"t": TOKENS, "rid": rid, "index": 0, "tokens": ids_of("He")}] * 256
        a.send_bundle(over + [{"t": TOKENS, "rid": rid, "index": 2, "tokens": ids_of("zzz")},
                              {"t": FINISH, "rid": rid, "reason": 2}])
        a.send_bundle([{"t": TOKENS, "rid": rid, "index": 2, "tokens": ids_of("llo")},
                       {"t": FINISH, "rid": rid, "reason": 2}])
        st, _, data = res()
        self.assertEqual(st, 200, data)
        self.assertEqual(json.loads(data)["choices"][0]["text"], "Hello")
        log = self.gw.read_log()
        self.assertIn("empty BUNDLE from 'w-a': dropped", log)
        self.assertIn("dropped BUNDLE in a BUNDLE from 'w-a'", log)
        self.assertIn("dropped message 2 of a BUNDLE from 'w-a'", log)
        self.assertIn("BUNDLE from 'w-a' holds 258 messages (at most 256): the last 2 dropped",
                      log)
        self.assertEqual(self.gw.request("GET", "/health")[0], 200)

    def test_stream_text_every_byte_class(self):
        """Byte-fallback tokens of every class (controls, quotes, backslashes, U+2028, DEL,
        invalid and truncated UTF-8, a character split over two TOKENS messages): every
        data: line is strict JSON and the streamed text is the non-streamed text."""
        a = self.worker("w-a")
        cases = [[b'a"b\\c', b"\x01\x1f\x7f\t\n"], [b"\xe2\x80\xa8\xe2\x80\xa9"],
                 [b"\xff", b"ok"], [b"x\xc3"], [b"\xc3(", b"\xc0\xaf"], [b"\xed\xa0\x80"],
                 [b"\xf4\x90\x80\x80z"], [b"\xe2\x82", b"\xac!"], [b"\xf0\x9f", b"\x98", b"\x80"],
                 [b"\x00a"], [b"</script>\r\n\r\ndata: [DONE]\n\n"]]
        for parts in cases:
            texts = []
            for stream in (False, True):
                n = sum(len(p) for p in parts)
                res = self.start({"prompt": "hi", "max_tokens": n, "temperature": 0,
                                  "stream": stream})
                rid = self.prefill(a)["rid"]
                index = 0
                for p in parts:
                    ids = [BYTE0 + b for b in p]
                    a.send(TOKENS, rid=rid, index=index, tokens=ids)
                    index += len(ids)
                a.send(FINISH, rid=rid, reason=2)
                st, _, data = res()
                self.assertEqual(st, 200, (parts, data))
                if not stream:
                    texts.append(json.loads(data)["choices"][0]["text"])
                    continue
                text = ""
                events = data.decode().split("\n\n")
                self.assertEqual(events[-1], "", (parts, data))
                for e in events[:-1]:
                    self.assertTrue(e.startswith("data: ") and "\n" not in e, (parts, e))
                    if e != "data: [DONE]":
                        text += json.loads(e[6:])["choices"][0]["text"]
                self.assertEqual(events[-2], "data: [DONE]")
                texts.append(text)
            self.assertEqual(texts[0], texts[1], parts)

    def test_dead_worker_requests_rerun(self):
        a = self.worker("w-a")
        res = self.start({"prompt": "hi", "max_tokens": 4, "stream": True})
        rid = self.prefill(a)["rid"]
        a.send(TOKENS, rid=rid, index=0, tokens=ids_of("ab"))
        b = self.worker("w-b")
        # a goes silent; b keeps heartbeating until the request comes over
        deadline = time.time() + 5
        m2 = None
        while m2 is None and time.time() < deadline:
            b.heartbeat()
            m2 = b.recv(0.1, want=(PREFILL,))
        self.assertIsNotNone(m2, "the request was not re-run")
        self.assertEqual(m2["max_tokens"], 2)
        b.send(TOKENS, rid=m2["rid"], index=0, tokens=ids_of("cd"))
        b.send(FINISH, rid=m2["rid"], reason=2)
        st, _, data = res()
        self.assertEqual(st, 200)
        events = [e[6:] for e in data.decode().split("\n\n") if e]
        self.assertEqual(events[-1], "[DONE]")
        text = "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1])
        self.assertEqual(text, "abcd")
        self.assertIn("silent", self.gw.read_log())
        # the dead worker's heartbeat is answered with BYE (it must register again)
        a.heartbeat()
        self.assertIsNotNone(a.recv(2, want=(BYE,)))

    def test_cut_off_worker_told_to_drop_rerun_attempts(self):
        """A worker cut off long enough to be declared dead still holds its attempt (a decode
        worker would decode it to max_tokens, holding its KV) while the gateway re-runs it
        elsewhere. When that process registers again, the gateway CANCELs the attempt there;
        a new process with that worker id (a restart) is sent nothing."""
        def rerun_on(w):
            deadline = time.time() + 5
            while time.time() < deadline:  # the other worker is silent: cut off
                w.heartbeat()
                m = w.recv(0.1, want=(PREFILL,))
                if m:
                    return m
            self.fail("the request was not re-run on " + w.wid)

        a = self.worker("w-a")
        res = self.start({"prompt": "hi", "max_tokens": 4, "stream": True})
        rid = self.prefill(a)["rid"]
        a.send(TOKENS, rid=rid, index=0, tokens=ids_of("ab"))
        b = self.worker("w-b")
        m2 = rerun_on(b)
        # the network heals: a's heartbeat gets BYE, it registers again (same process)
        a.heartbeat()
        self.assertIsNotNone(a.recv(2, want=(BYE,)))
        a.register()
        m = a.recv(2, want=(CANCEL,))
        self.assertIsNotNone(m, "no CANCEL for the attempt re-run elsewhere")
        self.assertEqual(m["rid"], rid)
        # b runs the re-run, then is cut off in turn; a takes the request again
        b.send(TOKENS, rid=m2["rid"], index=0, tokens=ids_of("c"))
        m3 = rerun_on(a)
        self.assertEqual(m3["max_tokens"], 1)
        # b comes back as another process (restarted): it never had the attempt
        b.send(REGISTER, wid="w-b", role=3, kvep="", fp=b.fp, pid=os.getpid() + 1, n_ctx=N_CTX,
               bs=16, max_seqs=8, kv_total=1000, kv_free=1000)
        for _ in range(5):  # a keeps its heartbeat meanwhile: it holds the last attempt
            a.heartbeat()
            self.assertIsNone(b.recv(0.1, want=(CANCEL,)), "CANCEL sent to another process")
        a.send(TOKENS, rid=m3["rid"], index=0, tokens=ids_of("d"))
        a.send(FINISH, rid=m3["rid"], reason=2)
        st, _, data = res()
        events = [e[6:] for e in data.decode().split("\n\n") if e]
        self.assertEqual(events[-1], "[DONE]")
        self.assertTrue(all("choices" in json.loads(e) for e in events[:-1]), events)
        self.assertEqual("".join(json.loads(e)["choices"][0]["text"] for e in events[:-1]),
                         "abcd")

    def test_tokens_of_no_current_attempt_are_cancelled(self):
        """A worker that generates for an attempt the gateway does not own (its CANCEL lost,
        e.g. in a partition) is told to stop at its next TOKENS."""
        a = self.worker("w-a")
        stray = (123456789 << 8) | 1
        a.send(TOKENS, rid=stray, index=5, tokens=ids_of("zz"))
        m = a.recv(2, want=(CANCEL,))
        self.assertIsNotNone(m, "no CANCEL for a stray attempt's tokens")
        self.assertEqual(m["rid"], stray)

    def test_partition_costs_one_retry(self):
        """Every worker is cut off at once (a partition of the gateway); the gateway finds them
        dead one sweep after another. A re-run must not go to a worker that is silent too
        (it would fail again a moment later): one partition costs the request one of its
        --max-retries (2 here), not one per worker, and it completes on the first worker
        heard from again."""
        def heartbeat(w, kv_free):
            w.send(HEARTBEAT, wid=w.wid, role=3, state=1, running=0, queued=0, qtok=0,
                   kv_total=1000, kv_free=kv_free, tok_in=0, tok_out=0)

        w1 = self.worker("w-1")
        res = self.start({"prompt": "hi", "max_tokens": 4, "stream": True})
        rid = self.prefill(w1)["rid"]
        w1.send(TOKENS, rid=rid, index=0, tokens=ids_of("ab"))
        t0 = time.time()  # w1 silent from here
        w2, w3 = self.worker("w-2"), self.worker("w-3")
        # w3 (the most free KV: a re-run's first choice) falls silent 100 ms after w1, w2
        # 200 ms after: each is found dead in a later sweep (every 100 ms) than the one before
        while time.time() < t0 + 0.2:
            heartbeat(w2, 900)
            if time.time() < t0 + 0.1:
                heartbeat(w3, 1000)
            time.sleep(0.02)
        time.sleep(1.0)  # all three declared dead (--dead-after-ms 600)
        for w in (w2, w3):
            m = w.recv(0.1, want=(PREFILL,))
            self.assertIsNone(m, "a re-run was sent to %s, silent for 400 ms and more" % w.wid)
        w4 = self.worker("w-4")  # the first worker back
        m = None
        deadline = time.time() + 5
        while m is None and time.time() < deadline:
            heartbeat(w4, 1000)
            m = w4.recv(0.1, want=(PREFILL,))
        self.assertIsNotNone(m, "the request was not re-run on w-4")
        self.assertEqual(m["rid"], rid + 1, "one re-run")
        w4.send(TOKENS, rid=m["rid"], index=0, tokens=ids_of("cd"))
        w4.send(FINISH, rid=m["rid"], reason=2)
        st, _, data = res()
        events = [e[6:] for e in data.decode().split("\n\n") if e]
        self.assertEqual(events[-1], "[DONE]")
        self.assertEqual("".join(json.loads(e)["choices"][0].get("text", "")
                                 for e in events[:-1] if "choices" in json.loads(e)), "abcd",
                         events)

    def test_retries_exhausted(self):
        a = self.worker("w-a")
        for stream in (False, True):
            res = self.start({"prompt": "hi", "max_tokens": 4, "stream": stream})
            for _ in range(3):  # --max-retries 2: three attempts
                m = self.prefill(a)
                a.send(ERROR, rid=m["rid"], code=9, msg="injected", retry=1)
            st, h, data = res()
            if not stream:
                self.assertEqual(st, 503, data)
                self.assertEqual(json.loads(data)["error"]["code"], "worker_failure")
            else:
                self.assertEqual(st, 200)
                events = [e[6:] for e in data.decode().split("\n\n") if e]
                self.assertEqual(events[-1], "[DONE]")
                self.assertEqual(json.loads(events[-2])["error"]["code"], "worker_failure")

    def test_non_retryable_bad_request(self):
        a = self.worker("w-a")
        res = self.start({"prompt": "hi", "max_tokens": 4})
        m = self.prefill(a)
        a.send(ERROR, rid=m["rid"], code=8, msg="bad token", retry=0)
        st, _, data = res()
        self.assertEqual(st, 400, data)

    def test_stop_string_cancels_worker(self):
        a = self.worker("w-a")
        res = self.start({"prompt": "hi", "max_tokens": 50, "stop": ["STOP"], "stream": True})
        rid = self.prefill(a)["rid"]
        toks = ids_of("one ST") + ids_of("OP two")
        a.send(TOKENS, rid=rid, index=0, tokens=toks[:5])
        a.send(TOKENS, rid=rid, index=5, tokens=toks[5:])
        self.assertEqual(a.recv(5, want=(CANCEL,))["rid"], rid)
        st, _, data = res()
        events = [e[6:] for e in data.decode().split("\n\n") if e]
        chunks = [json.loads(e) for e in events[:-1]]
        self.assertEqual("".join(c["choices"][0]["text"] for c in chunks), "one ")
        self.assertEqual(chunks[-1]["choices"][0]["finish_reason"], "stop")

    def test_client_disconnect_cancels(self):
        a = self.worker("w-a")
        body = json.dumps({"prompt": "hi", "max_tokens": 50}).encode()
        s = socket.create_connection(("127.0.0.1", self.gw.port))
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n"
                  % len(body) + body)
        rid = self.prefill(a)["rid"]
        a.send(TOKENS, rid=rid, index=0, tokens=ids_of("x"))
        s.close()
        self.assertEqual(a.recv(5, want=(CANCEL,))["rid"], rid)

    def read_to_close(self, s, what):
        """Everything s receives until the server closes it (then s is closed); a test
        failure if it stays open past the socket's timeout."""
        out = b""
        try:
            while True:
                chunk = s.recv(65536)
                if not chunk:
                    break
                out += chunk
        except socket.timeout:
            self.fail("no end of the %s: %r" % (what, out[:500]))
        finally:
            s.close()
        return out

    def test_half_closed_client_gets_its_reply(self):
        """A client that shuts its sending side after its request (shutdown(SHUT_WR)) still
        reads: its request was cancelled as a disconnect and the reply lost. The gateway now
        probes a FIN with an interim 100 Continue (a closed socket answers it with a reset,
        test_client_disconnect_cancels) and answers the half-closed client."""
        a = self.worker("w-a")
        body = json.dumps({"prompt": "hi", "max_tokens": 3}).encode()
        s = socket.create_connection(("127.0.0.1", self.gw.port), timeout=10)
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n"
                  % len(body) + body)
        s.shutdown(socket.SHUT_WR)
        rid = self.prefill(a)["rid"]
        self.assertIsNone(a.recv(0.3, want=(CANCEL,)), "the half-closed request was cancelled")
        a.send(TOKENS, rid=rid, index=0, tokens=ids_of("abc"))
        a.send(FINISH, rid=rid, reason=2)
        out = self.read_to_close(s, "reply")
        self.assertTrue(out.startswith(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\n"),
                        out[:300])
        self.assertEqual(json.loads(out.split(b"\r\n\r\n", 2)[2])["choices"][0]["text"], "abc")

    def test_half_closed_stream_gets_its_events(self):
        """The same for a stream: libevent read while it wrote the stream and freed the
        connection at the FIN; a closed stream client is still cancelled."""
        body = json.dumps({"prompt": "hi", "max_tokens": 3, "stream": True}).encode()
        req = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n"
               % len(body) + body)
        a = self.worker("w-a")
        s = socket.create_connection(("127.0.0.1", self.gw.port), timeout=10)
        s.sendall(req)
        s.shutdown(socket.SHUT_WR)
        rid = self.prefill(a)["rid"]
        self.assertIsNone(a.recv(0.3, want=(CANCEL,)), "the half-closed stream was cancelled")
        a.send(TOKENS, rid=rid, index=0, tokens=ids_of("abc"))
        a.send(FINISH, rid=rid, reason=2)
        out = self.read_to_close(s, "stream")
        self.assertTrue(out.startswith(b"HTTP/1.1 200 OK\r\n"), out[:300])
        events = re.findall(rb"data: (.*)\n\n", out)
        self.assertEqual(events[-1], b"[DONE]")
        self.assertEqual("".join(json.loads(e)["choices"][0]["text"] for e in events[:-1]),
                         "abc")
        # a stream whose client closes is cancelled
        s = socket.create_connection(("127.0.0.1", self.gw.port), timeout=10)
        s.sendall(req)
        rid = self.prefill(a)["rid"]
        a.send(TOKENS, rid=rid, index=0, tokens=ids_of("a"))
        s.close()
        self.assertEqual(a.recv(5, want=(CANCEL,))["rid"], rid)

    def test_batch_choice_retried(self):
        """A batch of two prompts: the first one's attempt fails (retryable) and is re-run;
        the client gets both choices in order, once."""
        a = self.worker("w-a")
        res = self.start({"prompt": ["hi", "yo"], "max_tokens": 2})
        m0, m1 = self.prefill(a), self.prefill(a)
        a.send(ERROR, rid=m0["rid"], code=7, msg="injected", retry=1)
        a.send(TOKENS, rid=m1["rid"], index=0, tokens=ids_of("cd"))
        m0b = self.prefill(a)  # the re-run (a new attempt id)
        self.assertNotIn(m0b["rid"], (m0["rid"], m1["rid"]))
        a.send(TOKENS, rid=m0b["rid"], index=0, tokens=ids_of("ab"))
        st, _, data = res()
        self.assertEqual(st, 200, data)
        body = json.loads(data)
        self.assertEqual([(c["index"], c["text"], c["finish_reason"]) for c in body["choices"]],
                         [(0, "ab", "length"), (1, "cd", "length")])
        self.assertEqual(body["usage"]["completion_tokens"], 4)

    def test_batch_choice_failure_fails_the_request(self):
        """n = 2: one choice fails for good (not retryable): the request is answered with
        its error, and the other choice is cancelled (see also
        test_failed_choice_cancels_the_others_at_once)."""
        a = self.worker("w-a")
        for stream in (False, True):
            res = self.start({"prompt": "hi", "max_tokens": 8, "n": 2, "stream": stream})
            m0, m1 = self.prefill(a), self.prefill(a)
            a.send(ERROR, rid=m0["rid"], code=8, msg="bad token", retry=0)
            st, _, data = res()
            if stream:
                self.assertEqual(st, 200)
                events = [e[6:] for e in data.decode().split("\n\n") if e]
                self.assertEqual(events[-1], "[DONE]")
                self.assertEqual(json.loads(events[-2])["error"]["code"], "bad_request")
            else:
                self.assertEqual(st, 400, data)
                self.assertEqual(json.loads(data)["error"]["code"], "bad_request")
            a.send(TOKENS, rid=m1["rid"], index=0, tokens=ids_of("x"))
            cancelled, deadline = set(), time.time() + 5  # (m0's attempt is cancelled too)
            while m1["rid"] not in cancelled and time.time() < deadline:
                m = a.recv(0.5, want=(CANCEL,))
                if m:
                    cancelled.add(m["rid"])
            self.assertIn(m1["rid"], cancelled)
        st, _, data = self.gw.request("GET", "/health")
        self.assertEqual(json.loads(data)["running"], 0)

    def test_failed_choice_cancels_the_others_at_once(self):
        """n = 3: one choice fails for good; the others are cancelled on their workers right
        away, even a stuck one that never sends another token (it must not wait for
        --request-timeout-ms, 20 s here, and then be re-run for nobody), and nothing is left
        running."""
        a = self.worker("w-a")
        res = self.start({"prompt": "hi", "max_tokens": 8, "n": 3})
        m0, m1, m2 = self.prefill(a), self.prefill(a), self.prefill(a)
        a.send(TOKENS, rid=m2["rid"], index=0, tokens=ids_of("x"))
        a.send(ERROR, rid=m0["rid"], code=8, msg="bad token", retry=0)
        st, _, data = res()
        self.assertEqual(st, 400, data)
        cancelled, deadline = set(), time.time() + 3
        while not {m1["rid"], m2["rid"]} <= cancelled and time.time() < deadline:
            m = a.recv(0.2, want=(CANCEL,))
            if m:
                cancelled.add(m["rid"])
        self.assertLessEqual({m1["rid"], m2["rid"]}, cancelled)
        st, _, data = self.gw.request("GET", "/health")
        self.assertEqual((json.loads(data)["running"], json.loads(data)["queued"]), (0, 0))
        # late messages of the cancelled choices change nothing
        a.send(TOKENS, rid=m1["rid"], index=0, tokens=ids_of("y"))
        a.send(FINISH, rid=m2["rid"], reason=2)
        self.assertIsNone(a.recv(0.5, want=(PREFILL,)))
        self.assertEqual(self.gw.request("GET", "/health")[0], 200)


ROLE = 10


@unittest.skipUnless(zmq and os.path.exists(GATEWAY) and os.path.exists(MODEL),
                     "needs python3-zmq, %s and %s" % (GATEWAY, MODEL))
class TidalDemandTest(unittest.TestCase):
    """The tidal policy counts a request as decode demand from dispatch on: it holds a decode
    slot while its prompt waits at a prefill worker, so a burst of prompts on one decode
    worker of 8 slots moves a prefill worker to decode before any prefill starts."""

    def test_reserved_decode_slots_are_decode_demand(self):
        ctl = free_port()
        gw = Gateway("--ctl-bind", "tcp://127.0.0.1:%d" % ctl, "--heartbeat-ms", "100",
                     "--dead-after-ms", "5000", "--request-timeout-ms", "60000", "--tidal",
                     "--tidal-min-role-s", "0", "--smooth-s", "0", "--drain-timeout-ms", "200")
        ctx = zmq.Context()
        workers = []
        try:
            for wid, role in (("w-p1", 1), ("w-p2", 1), ("w-d", 2)):
                w = FakeWorker(ctx, "tcp://127.0.0.1:%d" % ctl, wid, gw.fingerprint())
                w.register(role, "tcp://127.0.0.1:1" if role == 2 else "")
                self.assertIsNotNone(w.recv(want=(REGISTER_ACK,)))
                workers.append(w)
            import threading
            for _ in range(8):  # the decode worker's 8 slots, all held by prompts
                threading.Thread(target=gw.request, daemon=True,
                                 args=("POST", CMPL, {"prompt": "hi", "max_tokens": 4}),
                                 kwargs={"timeout": 30}).start()
            got, deadline = None, time.time() + 10
            while got is None and time.time() < deadline:
                for w in workers:
                    w.send(HEARTBEAT, wid=w.wid, role=2 if w.wid == "w-d" else 1, state=1,
                           running=0, queued=0, qtok=0, kv_total=1000, kv_free=1000,
                           tok_in=0, tok_out=0)
                for w in workers[:2]:
                    m = w.recv(0.05, want=(ROLE,))
                    if m:
                        got = (w.wid, m)
            self.assertIsNotNone(got, "no prefill worker was moved: " + gw.read_log()[-2000:])
            self.assertEqual(got[1]["role"], 2)  # to decode
        finally:
            for w in workers:
                w.close()
            ctx.term()
            gw.stop()
