"""HTTP-level hardening of the gateway: ambiguous framing (request smuggling), slow
clients (slowloris) and the idle timeout, which must not cut requests that are merely
waiting for tokens."""

import json
import os
import re
import resource
import signal
import subprocess
import socket
import sys
import time
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cluster import Cluster  # noqa: E402
from test_e2e import REF  # noqa: E402


def raw(port, data, timeout=5):
    """Send raw bytes; return everything the server sends until it closes or times out."""
    s = socket.create_connection(("127.0.0.1", port), timeout=timeout)
    s.sendall(data)
    out = b""
    try:
        while True:
            chunk = s.recv(65536)
            if not chunk:
                break
            out += chunk
    except socket.timeout:
        pass
    s.close()
    return out


class Hardening(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.c = Cluster(roles=("prefill", "decode"), gateway_args=["--http-timeout-s", "1"],
                        worker_args=["--debug-step-delay-ms", "100"])
        cls.c.start()

    @classmethod
    def tearDownClass(cls):
        cls.c.stop()
        reports = cls.c.sanitizer_reports()
        if reports:
            raise AssertionError("sanitizer reports:\n" + "\n".join(reports))

    def test_duplicate_content_length_is_refused_and_nothing_smuggled(self):
        body = b'{"a":1}'
        smuggled = b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n"
        req = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
               b"Content-Length: 7\r\nContent-Length: %d\r\n\r\n" % (len(body) + len(smuggled)))
        out = raw(self.c.port, req + body + smuggled)
        self.assertTrue(out.startswith(b"HTTP/1.1 400"), out[:200])
        self.assertEqual(out.count(b"HTTP/1.1 "), 1, "a second (smuggled) response came back")
        payload = out.split(b"\r\n\r\n", 1)[1]
        self.assertEqual(json.loads(payload)["error"]["code"], "bad_framing")

    def test_unknown_transfer_encoding_is_refused_and_nothing_smuggled(self):
        """libevent ignores a Transfer-Encoding other than chunked and reads the body as the
        next request (the trial's smuggled GET /workers came back): 501, closed."""
        smuggled = b"GET /workers HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
        # "chunked, gzip" libevent itself reads as chunked and fails to parse: its 400
        for te, status, code in ((b"gzip", 501, "unsupported_transfer_encoding"),
                                 (b"identity", 501, "unsupported_transfer_encoding"),
                                 (b"chunked, gzip", 400, "bad_request")):
            req = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                   b"Transfer-Encoding: " + te + b"\r\n\r\n")
            out = raw(self.c.port, req + smuggled)
            self.assertTrue(out.startswith(b"HTTP/1.1 %d" % status), (te, out[:200]))
            self.assertEqual(out.count(b"HTTP/1.1 "), 1, (te, "a smuggled response came back"))
            head, payload = out.split(b"\r\n\r\n", 1)
            self.assertIn(b"Connection: close", head)
            self.assertEqual(json.loads(payload)["error"]["code"], code)
        # "chunked" itself (any case, padded) is still taken
        body = b'{"prompt": "Once", "max_tokens": 2}'
        req = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
               b"Transfer-Encoding:  Chunked \r\nConnection: close\r\n\r\n"
               b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body))
        out = raw(self.c.port, req)
        self.assertTrue(out.startswith(b"HTTP/1.1 200"), out[:300])

    def test_field_name_with_whitespace_is_refused_and_nothing_smuggled(self):
        """"Content-Length : N" is no Content-Length to libevent: it read no body and took
        the body, a smuggled GET /workers, for the next request (answered 200), where a
        proxy that trims field names forwards it as a body. RFC 9112 5.1: 400, closed."""
        smuggled = b"GET /workers HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
        body = b'{"prompt": "Once"}'
        for name in (b"Content-Length ", b"Transfer-Encoding\t", b"X-Pad "):
            value = b"chunked" if name.startswith(b"Transfer") else b"%d" % (len(body) +
                                                                              len(smuggled))
            req = (b"POST /tokenize HTTP/1.1\r\nHost: x\r\n" + name + b": " + value +
                   b"\r\n\r\n" + body + smuggled)
            out = raw(self.c.port, req)
            self.assertTrue(out.startswith(b"HTTP/1.1 400"), (name, out[:200]))
            self.assertEqual(out.count(b"HTTP/1.1 "), 1, (name, "a smuggled response came back"))
            head, payload = out.split(b"\r\n\r\n", 1)
            self.assertIn(b"Connection: close", head)
            self.assertEqual(json.loads(payload), {"error": {
                "message": "The request has a header field name that is not a token "
                           "(whitespace before the colon?): \"%s\"." % name.decode(),
                "type": "invalid_request_error", "param": None, "code": "bad_header"}})

    def test_nul_in_a_header_is_refused(self):
        """libevent keeps a field value up to its first NUL ("Content-Length: 18\\0 99" was
        18; "Bearer KEY\\0junk" would be "Bearer KEY"): RFC 9110 5.5, 400, closed."""
        smuggled = b"GET /workers HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
        body = b'{"prompt": "Once"}'
        for head in (b"Content-Length: %d\x00 %d\r\n" % (len(body), len(body) + len(smuggled)),
                     b"Content-Length: %d\r\nX-Note: a\x00b\r\n" % len(body)):
            req = b"POST /tokenize HTTP/1.1\r\nHost: x\r\n" + head + b"\r\n" + body + smuggled
            out = raw(self.c.port, req)
            self.assertTrue(out.startswith(b"HTTP/1.1 400"), (head, out[:200]))
            self.assertEqual(out.count(b"HTTP/1.1 "), 1, (head, "a smuggled response came back"))
            hdrs, payload = out.split(b"\r\n\r\n", 1)
            self.assertIn(b"Connection: close", hdrs)
            self.assertEqual(json.loads(payload), {"error": {
                "message": "The request's header block holds a NUL byte (RFC 9110 5.5).",
                "type": "invalid_request_error", "param": None, "code": "bad_header"}})
        # the same request without the NUL is served (and the connection stays usable)
        req = (b"POST /tokenize HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n"
               b"Connection: close\r\n\r\n%s" % (len(body), body))
        self.assertTrue(raw(self.c.port, req).startswith(b"HTTP/1.1 200"))

    def test_host_header_missing_or_repeated_is_refused(self):
        """RFC 9112 3.2: a server MUST answer 400 to an HTTP/1.1 request without a Host
        header and to any request with more than one (a proxy that routes on the first and
        a server that reads the last disagree on where it goes). libevent took both."""
        smuggled = b"GET /workers HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
        for head, msg in ((b"GET /v1/models HTTP/1.1\r\n",
                           "An HTTP/1.1 request must have a Host header (RFC 9112 3.2)."),
                          (b"GET /v1/models HTTP/1.1\r\nHost: a\r\nHost: b\r\n",
                           "The request has more than one Host header (RFC 9112 3.2)."),
                          (b"GET /v1/models HTTP/1.0\r\nHost: a\r\nhost: a\r\n",
                           "The request has more than one Host header (RFC 9112 3.2).")):
            out = raw(self.c.port, head + b"\r\n" + smuggled)
            self.assertTrue(re.match(rb"HTTP/1\.[01] 400 ", out), (head, out[:200]))
            # (the status lines: the first message itself says "HTTP/1.1 request")
            self.assertEqual(len(re.findall(rb"(?:^|\n)HTTP/1\.[01] \d{3} ", out)), 1,
                             (head, "a second response came back"))
            hdrs, payload = out.split(b"\r\n\r\n", 1)
            self.assertIn(b"Connection: close", hdrs)
            self.assertEqual(json.loads(payload), {"error": {
                "message": msg, "type": "invalid_request_error", "param": None,
                "code": "bad_header"}})
        # one Host, or none in HTTP/1.0, is served
        for req in (b"GET /v1/models HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
                    b"GET /v1/models HTTP/1.0\r\n\r\n"):
            self.assertIn(b" 200 OK", raw(self.c.port, req).split(b"\r\n")[0], req)

    def test_slowloris_connection_is_closed(self):
        s = socket.create_connection(("127.0.0.1", self.c.port), timeout=10)
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nContent-Length: 100\r\n")  # never finished
        t0 = time.time()
        try:
            data = s.recv(65536)
        except (ConnectionResetError, socket.timeout):
            data = b""
        waited = time.time() - t0
        s.close()
        self.assertLess(waited, 8, "a half-sent request held its connection open")
        self.assertNotIn(b"200 OK", data)

    def test_request_longer_than_idle_timeout_completes(self):
        # 48 tokens at >= 100 ms a step (MTP emits at most 3 per step): over the 1 s idle
        # timeout, non-streaming, so the client reads
        # nothing until the end
        t0 = time.time()
        status, body = self.c.complete("Once upon a time", max_tokens=48)
        self.assertGreater(time.time() - t0, 1.5)
        self.assertEqual(status, 200, body)
        self.assertEqual(body["choices"][0]["text"], REF["Once upon a time"])
        status, text, events, done = self.c.stream_text("Once upon a time", max_tokens=48)
        self.assertTrue(done)
        self.assertEqual(text, REF["Once upon a time"])


class OutOfDescriptors(unittest.TestCase):
    def test_accept_failures_pause_instead_of_spinning(self):
        """With 64 descriptors and 120 clients, accept() fails: the gateway must not spin
        (nor flood its log), and must serve again once the clients are gone."""
        from cluster import BIN, MODEL, free_port  # noqa: E402
        import tempfile
        port = free_port()
        tmp = tempfile.mkdtemp(prefix="tidepool-emfile-")
        log = open(os.path.join(tmp, "gateway.log"), "wb")

        def limit():
            resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))

        p = subprocess.Popen([os.path.join(BIN, "gateway"), "--port", str(port), "--ctl-bind",
                              "tcp://127.0.0.1:%d" % free_port(), "--stats-bind",
                              "tcp://127.0.0.1:%d" % free_port(), "--model", MODEL,
                              "--state-db", os.path.join(tmp, "state.db")],
                             stdout=log, stderr=subprocess.STDOUT, preexec_fn=limit)
        try:
            deadline = time.time() + 10
            while time.time() < deadline:
                try:
                    socket.create_connection(("127.0.0.1", port), timeout=1).close()
                    break
                except OSError:
                    time.sleep(0.1)
            socks = []
            for _ in range(120):
                try:
                    s = socket.create_connection(("127.0.0.1", port), timeout=1)
                    s.sendall(b"POST /v1/completions HTTP/1.1\r\n")
                    socks.append(s)
                except OSError:
                    pass
            t0 = time.time()
            cpu0 = _proc_cpu(p.pid)
            time.sleep(2)
            cpu = (_proc_cpu(p.pid) - cpu0) / (time.time() - t0)
            for s in socks:
                s.close()
            self.assertLess(cpu, 0.5, "gateway spun at %.0f%% CPU while out of descriptors"
                            % (cpu * 100))
            time.sleep(0.5)
            status = None
            for _ in range(50):
                try:
                    c = socket.create_connection(("127.0.0.1", port), timeout=2)
                    c.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
                    status = c.recv(100)[:12]
                    c.close()
                    break
                except OSError:
                    time.sleep(0.1)
            self.assertEqual(status, b"HTTP/1.1 503")  # serving again (no workers: 503)
            self.assertIsNone(p.poll(), "gateway died")
        finally:
            p.terminate()
            p.wait(10)
            log.close()
        with open(os.path.join(tmp, "gateway.log")) as f:
            lines = f.read().count("cannot accept connections")
        self.assertLessEqual(lines, 10)


def _proc_cpu(pid):
    with open("/proc/%d/stat" % pid) as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")



def http_get(sock, path):
    """One GET on a kept-alive connection; returns (status, body) or None when the server
    closed it or did not answer in time."""
    try:
        sock.sendall(b"GET %s HTTP/1.1\r\nHost: x\r\n\r\n" % path.encode())
        buf = b""
        while b"\r\n\r\n" not in buf:
            chunk = sock.recv(65536)
            if not chunk:
                return None
            buf += chunk
        head, body = buf.split(b"\r\n\r\n", 1)
        n = 0
        for line in head.split(b"\r\n")[1:]:
            k, _, v = line.partition(b":")
            if k.strip().lower() == b"content-length":
                n = int(v)
        while len(body) < n:
            chunk = sock.recv(65536)
            if not chunk:
                return None
            body += chunk
        return int(head.split(b" ")[1]), body[:n]
    except (OSError, ValueError):
        return None


class ShutdownFlush(unittest.TestCase):
    """After SIGTERM the gateway destroys the cluster, then keeps its loop running 200 ms so
    the last answers go out; a request on a kept-alive connection in that window must get a
    503 from a gateway that no longer has a cluster, not read the freed one (it did: found
    by review, a use-after-free that ASan reports)."""

    def test_requests_in_the_shutdown_flush_are_answered(self):
        c = Cluster(roles=("prefill", "decode"))
        c.start()
        try:
            socks = [socket.create_connection(("127.0.0.1", c.port), timeout=2)
                     for _ in range(4)]
            for s in socks:
                self.assertEqual(http_get(s, "/health")[0], 200)
            c.procs["gateway"].send_signal(signal.SIGTERM)
            statuses = []
            deadline = time.time() + 1.5
            while time.time() < deadline and socks:
                for s in list(socks):
                    for path in ("/health", "/workers", "/metrics"):
                        r = http_get(s, path)
                        if r is None:
                            socks.remove(s)
                            s.close()
                            break
                        statuses.append(r[0])
            for s in socks:
                s.close()
            self.assertEqual(c.procs["gateway"].wait(timeout=10), 0, c.log("gateway"))
            self.assertTrue(set(statuses) <= {200, 503}, statuses)
        finally:
            c.stop()
        self.assertEqual(c.sanitizer_reports(), [])

if __name__ == "__main__":
    unittest.main()
