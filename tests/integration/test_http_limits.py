"""The gateway's connection limits against hostile or broken clients (gateway/httpconn.h):
request deadlines (a request trickled a byte at a time gets 408 once its headers or its body
are late, where --http-timeout-s alone, restarting with every byte, never cut it), the
--max-connections cap (503 too_many_connections, the connection closed without a reset),
and a streaming client that stops reading (dropped once --stream-max-unsent-bytes wait,
its request cancelled on the worker).

Starts build/bin/gateway (and, for the slow reader, a mixed worker) on free loopback ports.
    python3 -m unittest -v tests/integration/test_http_limits.py
"""

import json
import os
import re
import select
import socket
import sys
import time
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cluster import Cluster, free_port  # noqa: E402
from test_http_errors import GATEWAY, MODEL, Gateway  # noqa: E402

HEADER_S = 2
BODY_S = 2
MIN_RATE = 100  # bytes/s: each 100 bytes of a body buy it 1 s more
IDLE_S = 4      # --http-timeout-s

MSG_HEADER = ("The request's headers were not received within 2 s of its first byte "
              "(--http-header-timeout-s).")
MSG_BODY = ("The request's body was not received in time: it must arrive within 2 s of the "
            "headers, plus 1 s per 100 bytes received (--http-body-timeout-s, "
            "--http-body-min-rate).")


def read_all(s, timeout):
    """Everything s receives until the peer closes (b"" more) or timeout; (data, closed)."""
    out = b""
    deadline = time.time() + timeout
    while time.time() < deadline:
        r, _, _ = select.select([s], [], [], max(0.0, deadline - time.time()))
        if not r:
            break
        try:
            chunk = s.recv(65536)
        except ConnectionResetError:
            return out, "reset"
        if not chunk:
            return out, "closed"
        out += chunk
    return out, None


def trickle(s, data, every_s, limit_s):
    """Send data a byte every every_s seconds until it is all sent, the server answers, or
    limit_s passed; returns the time the server's first byte came (None: it did not)."""
    t0 = time.time()
    for b in data:
        r, _, _ = select.select([s], [], [], every_s)
        if r:
            return time.time() - t0
        if time.time() - t0 > limit_s:
            return None
        try:
            s.sendall(bytes([b]))
        except OSError:
            break
    r, _, _ = select.select([s], [], [], max(0.0, limit_s - (time.time() - t0)))
    return time.time() - t0 if r else None


def split_reply(data):
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    headers = {}
    for line in lines[1:]:
        k, _, v = line.partition(":")
        headers[k.strip().lower()] = v.strip()
    return lines[0], headers, body


def metric(gw, name, labels=""):
    st, _, data = gw.request("GET", "/metrics")
    assert st == 200, data[:200]
    m = re.search(r'^tidepool_%s\{model_name="[^"]*"%s\} (\S+)$' % (name, labels), data.decode(),
                  re.M)
    return float(m.group(1)) if m else None


@unittest.skipUnless(os.path.exists(GATEWAY) and os.path.exists(MODEL),
                     "needs %s and %s (make all)" % (GATEWAY, MODEL))
class RequestDeadlines(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.gw = Gateway("--http-header-timeout-s", str(HEADER_S), "--http-body-timeout-s",
                         str(BODY_S), "--http-body-min-rate", str(MIN_RATE),
                         "--http-timeout-s", str(IDLE_S),
                         "--stats-bind", "tcp://127.0.0.1:%d" % free_port())

    @classmethod
    def tearDownClass(cls):
        assert cls.gw.stop() == 0

    def connect(self):
        return socket.create_connection(("127.0.0.1", self.gw.port), timeout=10)

    def check_408(self, data, message):
        status, headers, body = split_reply(data)
        self.assertEqual(status, "HTTP/1.1 408 Request Timeout")
        self.assertEqual(headers["content-type"], "application/json")
        self.assertEqual(headers["connection"], "close")
        self.assertEqual(int(headers["content-length"]), len(body))
        self.assertEqual(json.loads(body), {"error": {
            "message": message, "type": "invalid_request_error", "param": None,
            "code": "request_timeout"}})

    def test_trickled_headers_get_408(self):
        """A byte every 0.25 s: evhttp's timer (4 s) restarts with each one and never fires
        (it was cut at no time at all: 8 bytes in 320 s measured); the header deadline
        counts from the first byte."""
        before = metric(self.gw, "http_request_timeouts_total", ',phase="header"')
        s = self.connect()
        req = b"GET /health HTTP/1.1\r\nHost: x\r\n" + b"X-Pad: " + b"a" * 200 + b"\r\n\r\n"
        t = trickle(s, req, 0.25, HEADER_S + 3)
        self.assertIsNotNone(t, "no answer to a trickled request within %d s" % (HEADER_S + 3))
        self.assertGreaterEqual(t, HEADER_S - 0.3)
        data, how = read_all(s, 3)
        s.close()
        self.assertEqual(how, "closed")
        self.check_408(data, MSG_HEADER)
        self.assertEqual(metric(self.gw, "http_request_timeouts_total", ',phase="header"'),
                         before + 1)
        self.assertIn("408: request headers not received within 2 s", self.gw.read_log())

    def test_trickled_body_gets_408(self):
        """Headers at once, then a body at 20 bytes/s against a minimum of 100: late after
        2 s + 1 s per 100 bytes, i.e. at about 2.5 s."""
        before = metric(self.gw, "http_request_timeouts_total", ',phase="body"')
        s = self.connect()
        body = json.dumps({"prompt": "x" * 1000}).encode()
        s.sendall(b"POST /tokenize HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: %d\r\n\r\n" % len(body))
        t0 = time.time()
        for i in range(0, len(body), 10):
            r, _, _ = select.select([s], [], [], 0.5)
            if r or time.time() - t0 > 8:
                break
            s.sendall(body[i:i + 10])
        elapsed = time.time() - t0
        data, how = read_all(s, 3)
        s.close()
        self.assertEqual(how, "closed")
        self.check_408(data, MSG_BODY)
        self.assertGreater(elapsed, 2.0)
        self.assertLess(elapsed, 5.0)
        self.assertEqual(metric(self.gw, "http_request_timeouts_total", ',phase="body"'),
                         before + 1)

    def test_slow_body_above_the_rate_is_served(self):
        """A body at about 300 bytes/s for 4 s (longer than --http-body-timeout-s, but over
        the minimum rate) is read and answered."""
        text = "Once upon a time " * 70
        body = json.dumps({"prompt": text}).encode()
        s = self.connect()
        s.sendall(b"POST /tokenize HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Connection: close\r\nContent-Length: %d\r\n\r\n" % len(body))
        t0 = time.time()
        for i in range(0, len(body), 60):
            time.sleep(0.2)
            s.sendall(body[i:i + 60])
        self.assertGreater(time.time() - t0, BODY_S + 1)
        data, how = read_all(s, 5)
        s.close()
        status, _, payload = split_reply(data)
        self.assertEqual(status, "HTTP/1.1 200 OK", data[:300])
        self.assertEqual(json.loads(payload)["count"], len(json.loads(payload)["tokens"]))

    def test_idle_before_a_request_is_not_late(self):
        """The header clock starts at a request's first byte: a connection idle for longer
        than --http-header-timeout-s (but less than --http-timeout-s) is served, the first
        request and the next one on the same connection alike; an idle connection is
        closed after --http-timeout-s without a reply."""
        s = self.connect()
        for _ in range(2):
            time.sleep(HEADER_S + 1)
            s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            data = b""
            while b"\r\n\r\n" not in data:
                data += s.recv(65536)
            status, headers, body = split_reply(data)
            while len(body) < int(headers["content-length"]):
                body += s.recv(65536)
            self.assertEqual(status, "HTTP/1.1 503 Service Unavailable")  # no workers
        t0 = time.time()
        data, how = read_all(s, IDLE_S + 3)
        s.close()
        self.assertEqual((data, how), (b"", "closed"))
        self.assertGreater(time.time() - t0, IDLE_S - 1)

    def test_pipelined_requests_are_answered(self):
        """Two requests in one write: the second one waits in the input while the first is
        answered, and is not taken for a late request."""
        s = self.connect()
        body = b'{"prompt": "Once"}'
        one = (b"POST /tokenize HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % len(body)
               + body)
        s.sendall(one + one.replace(b"Host: x", b"Host: x\r\nConnection: close"))
        data, how = read_all(s, 5)
        s.close()
        self.assertEqual(how, "closed")
        self.assertEqual(data.count(b"HTTP/1.1 200 OK"), 2, data)


@unittest.skipUnless(os.path.exists(GATEWAY) and os.path.exists(MODEL),
                     "needs %s and %s (make all)" % (GATEWAY, MODEL))
class MaxConnections(unittest.TestCase):
    MAX = 4

    def test_connections_over_the_limit_get_503(self):
        gw = Gateway("--max-connections", str(self.MAX),
                     "--stats-bind", "tcp://127.0.0.1:%d" % free_port())
        try:
            def conn():
                return socket.create_connection(("127.0.0.1", gw.port), timeout=5)

            def is_open(s):
                r, _, _ = select.select([s], [], [], 0.2)
                return not r
            tok = b'{"prompt": "Once"}'
            tokenize = (b"POST /tokenize HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
                        b"Content-Length: %d\r\n\r\n" % len(tok) + tok)
            # MAX idle connections (nothing sent): a new one takes the place of the one
            # idle longest, which is closed (as a keep-alive connection may be), but only
            # once they are 1 s old: a client's new connection has that long to send
            idle = []
            for _ in range(self.MAX):
                idle.append(conn())
                time.sleep(0.05)
            s = conn()
            s.sendall(tokenize)
            data, how = read_all(s, 5)
            s.close()
            self.assertTrue(data.startswith(b"HTTP/1.1 503"), data[:200])
            self.assertEqual([is_open(x) for x in idle], [True] * self.MAX)
            time.sleep(1.0)
            s = conn()
            s.sendall(tokenize)
            data, how = read_all(s, 5)
            s.close()
            self.assertTrue(data.startswith(b"HTTP/1.1 200 OK"), data[:200])
            self.assertEqual(read_all(idle[0], 2), (b"", "closed"))
            self.assertEqual([is_open(x) for x in idle[1:]], [True] * (self.MAX - 1))
            # MAX connections each in the middle of a request: none can be closed, so the
            # next one is refused; a client that sends its request at once still reads the
            # 503 (the socket lingers: no reset for the bytes it sent)
            busy = idle[1:] + [conn()]
            for x in busy:
                x.sendall(b"GET /health HTTP/1.1\r\n")
            time.sleep(0.3)
            s = conn()
            s.sendall(tokenize)
            data, how = read_all(s, 5)
            s.close()
            self.assertEqual(how, "closed")
            status, headers, body = split_reply(data)
            self.assertEqual(status, "HTTP/1.1 503 Service Unavailable")
            self.assertEqual(headers["retry-after"], "1")
            self.assertEqual(headers["connection"], "close")
            self.assertEqual(json.loads(body), {"error": {
                "message": "The server has too many connections open (--max-connections 4). "
                           "Please try again in 1s.",
                "type": "server_error", "param": None, "code": "too_many_connections"}})
            self.assertEqual([is_open(x) for x in busy], [True] * self.MAX)
            # one closes: its place is free again
            busy.pop().close()
            time.sleep(0.3)
            st, _, data = gw.request("GET", "/metrics")
            self.assertEqual(st, 200)
            text = data.decode()
            self.assertRegex(text, r'(?m)^tidepool_http_connections_refused_total\{[^}]*\} 2$')
            # the 3 busy ones and this one
            self.assertRegex(text, r'(?m)^tidepool_http_connections\{[^}]*\} 4$')
            self.assertRegex(text, r'(?m)^tidepool_http_responses_total\{[^}]*code="503"\} 2$')
            for x in busy:
                x.close()
            time.sleep(0.3)
            self.assertEqual(metric(gw, "http_connections"), 1)
        finally:
            self.assertEqual(gw.stop(), 0)
        self.assertIn("503: a connection over --max-connections (4)", gw.read_log())


@unittest.skipUnless(os.path.exists(GATEWAY) and os.path.exists(MODEL),
                     "needs %s and %s (make all)" % (GATEWAY, MODEL))
class DeadlinesAndStreams(unittest.TestCase):
    """A request being answered has no deadline (a stream longer than the header timeout
    runs to its end); the bytes of a pipelined request sent with it count from the end of
    that answer: a whole one is served, a partial one gets its 408 a header timeout after
    the stream ended."""

    def test_stream_longer_than_the_deadlines_then_pipelined(self):
        c = Cluster(roles=("mixed",), gateway_args=["--http-header-timeout-s", "1",
                                                    "--http-body-timeout-s", "1",
                                                    "--http-body-min-rate", "0"],
                    # one token a step: with MTP (up to 3 a step, as the worker's start-up
                    # calibration decides) the stream took 0.85 s, under the deadlines
                    worker_args=["--debug-step-delay-ms", "60", "--mtp-depth", "0"])
        c.start()
        try:
            body = json.dumps({"prompt": "Once upon a time", "max_tokens": 40, "stream": True,
                               "temperature": 0}).encode()
            req = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                   b"application/json\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
            whole = b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
            s = socket.create_connection(("127.0.0.1", c.port), timeout=15)
            t0 = time.time()
            s.sendall(req + whole)
            data, how = read_all(s, 15)
            s.close()
            self.assertEqual(how, "closed")
            self.assertGreater(time.time() - t0, 1.5)  # 40 tokens at >= 60 ms a step
            self.assertEqual(data.count(b"HTTP/1.1 200 OK"), 2, data[-300:])
            self.assertIn(b"data: [DONE]", data)
            self.assertNotIn(b"408", data)
            # the same with the second request's headers never finished
            s = socket.create_connection(("127.0.0.1", c.port), timeout=15)
            s.sendall(req + b"GET /health HTTP/1.1\r\nHost: x\r\n")
            data = b""
            while b"0\r\n\r\n" not in data:  # the stream's last chunk
                chunk = s.recv(65536)
                self.assertTrue(chunk, data[-300:])
                data += chunk
            t_end = time.time()
            self.assertIn(b"data: [DONE]", data)
            rest, how = read_all(s, 5)
            s.close()
            self.assertEqual(how, "closed")
            self.assertTrue(rest.startswith(b"HTTP/1.1 408 Request Timeout"), rest[:200])
            self.assertGreater(time.time() - t_end, 0.7)
        finally:
            c.stop()
        self.assertEqual(c.sanitizer_reports(), [])


@unittest.skipUnless(os.path.exists(GATEWAY) and os.path.exists(MODEL),
                     "needs %s and %s (make all)" % (GATEWAY, MODEL))
class SlowReader(unittest.TestCase):
    """A streaming client that never reads: its answer piles up in the gateway until
    --stream-max-unsent-bytes, then the connection is closed at once (it used to stay open,
    holding the buffer, until --http-timeout-s of no progress) and the request cancelled on
    the worker, which frees its sequences."""

    def test_stalled_stream_is_dropped_and_cancelled(self):
        c = Cluster(roles=("mixed",), gateway_args=["--stream-max-unsent-bytes", "65536",
                                                    "--http-timeout-s", "60"],
                    worker_args=["--debug-step-delay-ms", "20"])
        c.start()
        try:
            s = socket.socket()
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            s.connect(("127.0.0.1", c.port))
            body = json.dumps({"prompt": "Once upon a time", "max_tokens": 400, "n": 16,
                               "logprobs": 5, "stream": True, "ignore_eos": True}).encode()
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                      b"application/json\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
            # 400 steps at >= 20 ms: 8 s or more if it ran to the end
            deadline = time.time() + 20
            while time.time() < deadline and "client too slow" not in c.log("gateway"):
                time.sleep(0.1)
            self.assertIn("connection closed, request cancelled", c.log("gateway"))
            t_drop = time.time()
            # the client now reads: what the kernel held, then the end, at once
            data, how = read_all(s, 5)
            s.close()
            self.assertIn(how, ("closed", "reset"))
            self.assertLess(time.time() - t_drop, 5)
            self.assertTrue(data.startswith(b"HTTP/1.1 200 OK"), data[:100])
            self.assertNotIn(b"[DONE]", data)
            # the worker let the 16 sequences go
            deadline = time.time() + 5
            running = None
            while time.time() < deadline:
                st, w = c.request("GET", "/workers")
                running = [x["running"] for x in w["workers"]]
                if running == [0]:
                    break
                time.sleep(0.1)
            self.assertEqual(running, [0])
            st, text = c.request("GET", "/metrics")
            self.assertRegex(text, r'(?m)^tidepool_http_slow_clients_total\{[^}]*\} 1$')
            self.assertRegex(text, r'(?m)^tidepool_request_success_total\{[^}]*'
                                   r'finished_reason="length"\} 0$')
        finally:
            c.stop()
        self.assertEqual(c.sanitizer_reports(), [])


def send_until_answered(s, head, chunks, limit):
    """Send head, then the chunks, until the server answers or limit bytes of body went
    out; (body bytes sent when the first reply byte was readable, or None)."""
    s.sendall(head)
    sent = 0
    for chunk in chunks:
        r, _, _ = select.select([s], [], [], 0)
        if r:
            return sent
        if sent >= limit:
            return None
        try:
            s.sendall(chunk)
        except OSError:  # the server closed: its answer is waiting
            return sent
        sent += len(chunk)
    r, _, _ = select.select([s], [], [], 5)
    return sent if r else None


@unittest.skipUnless(os.path.exists(GATEWAY) and os.path.exists(MODEL),
                     "needs %s and %s (make all)" % (GATEWAY, MODEL))
class BodyCaps(unittest.TestCase):
    """A body past its route's limit (plus 64 KiB of slack) is answered 413 while it
    arrives, so a client cannot make the gateway buffer more than the route takes: before,
    any body up to the HTTP layer's cut-off (that of uploads, 100 MiB by default) was read
    whole before the 413."""

    BIG = 64 << 20   # what the client offers
    SEEN = 32 << 20  # the reply must come before this much was sent (kernel buffers: a few MB)

    @classmethod
    def setUpClass(cls):
        cls.gw = Gateway()  # --max-body-bytes 16384, uploads up to 100 MiB (the default)

    @classmethod
    def tearDownClass(cls):
        assert cls.gw.stop() == 0

    def check_413(self, s, sent, code, limit, flag):
        self.assertIsNotNone(sent, "no answer before %d bytes of the body" % self.SEEN)
        self.assertLess(sent, self.SEEN)
        data, how = read_all(s, 5)
        s.close()
        self.assertIn(how, ("closed", "reset"))
        status, headers, body = split_reply(data)
        self.assertEqual(status, "HTTP/1.1 413 Content Too Large")
        self.assertEqual(headers["content-type"], "application/json")
        self.assertEqual(headers["connection"], "close")
        self.assertEqual(json.loads(body), {"error": {
            "message": "The request body is more than %d bytes; the limit is %d bytes (%s)."
                       % (limit + 65536, limit, flag),
            "type": "invalid_request_error", "param": None, "code": code}})

    def big_post(self, path, chunked):
        s = socket.create_connection(("127.0.0.1", self.gw.port), timeout=10)
        piece = b"x" * 65536
        if chunked:
            head = (b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                    b"Transfer-Encoding: chunked\r\n\r\n" % path)
            chunk = b"%x\r\n%s\r\n" % (len(piece), piece)
        else:
            head = (b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                    b"Content-Length: %d\r\n\r\n" % (path, self.BIG))
            chunk = piece
        sent = send_until_answered(s, head, (chunk for _ in range(self.BIG // len(piece))),
                                   self.SEEN)
        return s, sent

    def test_completion_body_cut_while_it_arrives(self):
        s, sent = self.big_post(b"/v1/completions", chunked=False)
        self.check_413(s, sent, "request_too_large", 16384, "--max-body-bytes")

    def test_chunked_body_cut_while_it_arrives(self):
        s, sent = self.big_post(b"/v1/chat/completions", chunked=True)
        self.check_413(s, sent, "request_too_large", 16384, "--max-body-bytes")

    def test_upload_not_cut_below_the_file_limit(self):
        s, sent = self.big_post(b"/v1/files?x=1", chunked=True)
        s.close()
        self.assertIsNone(sent)  # 64 MiB < 100 MiB: read on, no answer before 32 MiB

    def test_just_over_the_limit_gets_the_routes_own_413(self):
        """Within the slack the route reads the body and answers with its exact size."""
        st, _, data = self.gw.request("POST", "/v1/completions", b"x" * 20000)
        self.assertEqual(st, 413)
        self.assertEqual(json.loads(data)["error"]["message"],
                         "The request body is 20000 bytes; the limit is 16384 bytes.")
        # the same reason phrase as the HTTP layer's 413 (RFC 9110's), not libevent's own
        s = socket.create_connection(("127.0.0.1", self.gw.port), timeout=10)
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 20000\r\n"
                  b"Connection: close\r\n\r\n" + b"x" * 20000)
        data, _ = read_all(s, 5)
        s.close()
        self.assertEqual(split_reply(data)[0], "HTTP/1.1 413 Content Too Large")

    def test_the_gateway_still_serves(self):
        st, _, _ = self.gw.request("GET", "/v1/models")
        self.assertEqual(st, 200)


def rss_bytes(pid):
    with open("/proc/%d/status" % pid) as f:
        return int(re.search(r"^VmRSS:\s+(\d+) kB", f.read(), re.M).group(1)) * 1024


def read_reply(s, n_body, timeout=30):
    """Read one reply with a Content-Length body of n_body bytes from s: (head, body, closed)."""
    s.settimeout(timeout)
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = s.recv(65536)
        if not chunk:
            return data, b"", True
        data += chunk
    head, body = data.split(b"\r\n\r\n", 1)
    while len(body) < n_body:
        chunk = s.recv(1 << 20)
        if not chunk:
            return head, body, True
        body += chunk
    return head, body, False


@unittest.skipUnless(os.path.exists(GATEWAY) and os.path.exists(MODEL),
                     "needs %s and %s (make all)" % (GATEWAY, MODEL))
class FileDownloads(unittest.TestCase):
    """GET /v1/files/{id}/content is streamed from the store a piece at a time: N clients
    that do not read a big file do not make the gateway hold N copies of it (it read the
    whole file and queued it), and every byte still arrives."""

    N = 8

    @classmethod
    def setUpClass(cls):
        # AddressSanitizer keeps freed blocks in a quarantine (256 MB): every piece sent
        # would count in the RSS. Off for this gateway, so that the figure is its own.
        asan = os.environ.get("ASAN_OPTIONS")
        os.environ["ASAN_OPTIONS"] = ((asan + ":") if asan else "") + \
            "quarantine_size_mb=0:thread_local_quarantine_size_kb=0"
        try:
            cls.gw = Gateway("--stats-bind", "")
        finally:
            if asan is None:
                del os.environ["ASAN_OPTIONS"]
            else:
                os.environ["ASAN_OPTIONS"] = asan
        # about 8 MB of JSONL, each line distinct (a wrong offset shows)
        cls.data = b"".join(b'{"custom_id": "%07d", "pad": "%s"}\n' % (i, b"%07d" % i * 24)
                            for i in range(42000))
        st, _, body = cls.gw.request("POST", "/v1/files?purpose=batch", cls.data,
                                     {"Content-Type": "application/jsonl"}, timeout=60)
        assert st == 200, body[:300]
        cls.fid = json.loads(body)["id"]

    @classmethod
    def tearDownClass(cls):
        assert cls.gw.stop() == 0

    def get(self, method="GET", fid=None):
        s = socket.create_connection(("127.0.0.1", self.gw.port), timeout=30)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 65536)  # the kernel holds little
        s.sendall(b"%s /v1/files/%s/content HTTP/1.1\r\nHost: x\r\n\r\n"
                  % (method.encode(), (fid or self.fid).encode()))
        return s

    def test_slow_downloads_hold_a_piece_each_and_every_byte_arrives(self):
        self.assertGreater(len(self.data), 8 << 20)
        s = self.get()  # one first, read whole: the pages are warm, the baseline fair
        head, body, _ = read_reply(s, len(self.data))
        s.close()
        self.assertIn(b"Content-Length: %d\r\n" % len(self.data), head + b"\r\n")
        self.assertEqual(body, self.data)
        time.sleep(0.5)
        before = rss_bytes(self.gw.proc.pid)
        socks = [self.get() for _ in range(self.N)]
        time.sleep(1.5)  # they are answered; nobody reads
        grown = rss_bytes(self.gw.proc.pid) - before
        # held whole, the eight took about 8 x 8 MB (less what the kernel buffers);
        # streamed, a 256 KiB piece each
        self.assertLess(grown, 16 << 20, "the gateway grew by %d bytes" % grown)
        for s in socks:
            head, body, _ = read_reply(s, len(self.data))
            self.assertTrue(head.startswith(b"HTTP/1.1 200 OK\r\n"), head)
            self.assertEqual(len(body), len(self.data))
            self.assertTrue(body == self.data, "the bytes differ")
        # the connections stay usable (keep-alive) after a streamed reply
        socks[0].sendall(b"GET /v1/files/%s HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
                         b"\r\n" % self.fid.encode())
        out, _ = read_all(socks[0], 10)
        self.assertTrue(out.startswith(b"HTTP/1.1 200 OK\r\n"), out[:200])
        for s in socks:
            s.close()
        # a client that leaves in the middle: its download is freed (the sanitized run
        # reports a leak otherwise), and the gateway serves on
        s = self.get()
        s.recv(1 << 20)
        s.close()
        time.sleep(0.3)
        self.assertEqual(self.gw.request("GET", "/v1/files/" + self.fid)[0], 200)
        # HEAD: the headers, with the size, and no body
        s = self.get("HEAD")
        out, _ = read_all(s, 1)
        s.close()
        head, _, rest = out.partition(b"\r\n\r\n")
        self.assertIn(b"Content-Length: %d\r\n" % len(self.data), head + b"\r\n")
        self.assertEqual(rest, b"")

    def test_half_closed_client_gets_the_whole_file(self):
        """A client that shuts its sending side after the request still reads: libevent
        took its FIN for a close and cut the download after the first bytes."""
        s = self.get()
        s.shutdown(socket.SHUT_WR)
        head, body, _ = read_reply(s, len(self.data))
        s.close()
        self.assertTrue(head.startswith(b"HTTP/1.1 200 OK\r\n"), head)
        self.assertEqual(len(body), len(self.data))
        self.assertTrue(body == self.data, "the bytes differ")

    def test_deleting_the_file_cuts_its_download(self):
        small = self.data.replace(b'"pad": "0', b'"pad": "1')  # another file, as big: more
        # than the kernel's socket buffers take, so pieces are left to read after the delete
        st, _, body = self.gw.request("POST", "/v1/files?purpose=batch", small,
                                      {"Content-Type": "application/jsonl"}, timeout=60)
        self.assertEqual(st, 200, body[:300])
        fid = json.loads(body)["id"]
        s = self.get(fid=fid)
        time.sleep(0.5)  # the first pieces are queued; the client reads none
        st, _, body = self.gw.request("DELETE", "/v1/files/" + fid)
        self.assertEqual(st, 200, body)
        head, body, closed = read_reply(s, len(small))
        s.close()
        self.assertTrue(closed, "the download was not cut")
        self.assertLess(len(body), len(small))
        self.assertEqual(body, small[:len(body)])
        self.assertIn("download cut after", self.gw.read_log())
        self.assertIsNone(self.gw.proc.poll())


if __name__ == "__main__":
    unittest.main()
