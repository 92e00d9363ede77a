"""Test harness: starts a real tidepool cluster (gateway + workers) on free loopback ports,
waits for /health, and stops it. Uses only the Python standard library.

Every process logs to a file in a temporary directory; on stop the logs are scanned for
sanitizer reports, which fail the test."""

import http.client
import json
import os
import random
import signal
import socket
import subprocess
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BUILD = os.environ.get("TIDEPOOL_BUILD", "build")
BIN = os.path.join(ROOT, BUILD, "bin")
MODEL = os.path.join(ROOT, os.environ.get("TIDEPOOL_TEST_MODEL", "build/models/stories260K.gguf"))
SANITIZER_MARKERS = ("ERROR: AddressSanitizer", "ERROR: LeakSanitizer", "runtime error:",
                     "WARNING: ThreadSanitizer")


def free_port():
    """A TCP port on 127.0.0.1 that is free now, drawn at random below the kernel's ephemeral
    range (/proc/sys/net/ipv4/ip_local_port_range): a port the kernel hands out with bind(0)
    can be taken by any outgoing connection (a client, a ZeroMQ connect) between this check
    and the server's own bind, which made tests fail with "Address already in use" on a busy
    machine; random draws also keep test processes running side by side apart."""
    lo = 32768
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            lo = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        pass
    rng = random.SystemRandom()
    for _ in range(100):
        port = rng.randrange(10000, lo) if lo > 11000 else 0
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return s.getsockname()[1]
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Cluster:
    """A gateway plus workers. roles: list of "prefill" / "decode" / "mixed". api_key: sent
    as Authorization: Bearer on every request of request() and stream() (a gateway started
    with API keys; /health needs none), unless the call's headers give their own.
    curve=True: CURVE on the ctl and kv sockets (docs/security.md), with keys made by
    tidepool-keygen in <tmp>/keys: gateway.key/.pub, and workers/<name>.key/.pub for every
    worker, the directory being every process's authorized-keys list."""

    def __init__(self, roles=("prefill", "decode"), gateway_args=(), worker_args=(),
                 model=MODEL, env=None, api_key=None, curve=False):
        self.tmp = tempfile.mkdtemp(prefix="tidepool-test-")
        self.curve = curve
        self.keys = os.path.join(self.tmp, "keys")
        self.port = free_port()
        self.ctl = "tcp://127.0.0.1:%d" % free_port()
        self.stats = "tcp://127.0.0.1:%d" % free_port()  # the gateway's stats PUB socket
        # the Batch API's SQLite state: private to this cluster, kept across gateway restarts
        self.state_db = os.path.join(self.tmp, "state", "gateway.db")
        self.model = model
        # API keys only when a test asks for them: a developer's own TIDEPOOL_API_KEY (a
        # client setting as much as the gateway's) must not close every test's gateway
        self.env = {k: v for k, v in os.environ.items()
                    if k not in ("TIDEPOOL_API_KEY", "TIDEPOOL_ADMIN_API_KEY",
                                 "TIDEPOOL_API_KEY_FILE")}
        self.env.update(env or {})
        self.gateway_args = list(gateway_args)
        self.worker_args = list(worker_args)
        self.roles = list(roles)
        self.api_key = api_key
        self.procs = {}   # name -> Popen
        self.logs = {}    # name -> path
        self.stopped = False

    # -- processes
    def _spawn(self, name, argv):
        path = os.path.join(self.tmp, name + ".log")
        f = open(path, "ab")
        p = subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, env=self.env,
                             cwd=ROOT, start_new_session=True)
        f.close()
        self.procs[name] = p
        self.logs[name] = path
        return p

    # -- CURVE keys
    def keygen(self, name, subdir="workers"):
        """<keys>/<subdir>/<name>.key and .pub (made once); returns the path without suffix."""
        d = os.path.join(self.keys, subdir)
        os.makedirs(d, exist_ok=True)
        base = os.path.join(d, name)
        if not os.path.exists(base + ".key"):
            subprocess.run([os.path.join(BIN, "tidepool-keygen"), base], check=True,
                           stdout=subprocess.DEVNULL)
        return base

    def public_key(self, base):
        """The Z85 public key of the key file base + ".pub"."""
        with open(base + ".pub") as f:
            for line in f:
                if line.strip().startswith("public-key"):
                    return line.split("=", 1)[1].strip().strip('"')
        raise ValueError("no public key in " + base)

    def curve_worker_args(self, name, subdir="workers"):
        base = self.keygen(name, subdir)
        return ["--curve-secret-key", base + ".key",
                "--curve-gateway-key", self.keygen("gateway", ".") + ".pub",
                "--curve-authorized-keys", os.path.join(self.keys, "workers")]

    def start_gateway(self):
        curve = []
        if self.curve:
            curve = ["--curve-secret-key", self.keygen("gateway", ".") + ".key",
                     "--curve-authorized-keys", os.path.join(self.keys, "workers")]
        return self._spawn("gateway", [os.path.join(BIN, "gateway"), "--host", "127.0.0.1",
                                       "--port", str(self.port), "--ctl-bind", self.ctl,
                                       "--model", self.model, "--heartbeat-ms", "200",
                                       "--dead-after-ms", "800", "--stats-bind", self.stats,
                                       "--state-db", self.state_db]
                           + curve + self.gateway_args)

    def start_worker(self, name, role, extra=()):
        """extra: more flags for this worker (with curve=True and no --curve-secret-key
        among them, the worker gets its own key pair from keygen)."""
        prog = "decode_worker" if role == "decode" else "prefill_worker"
        argv = [os.path.join(BIN, prog), "--role", role, "--gateway", self.ctl,
                "--model", self.model, "--worker-id", name, "--heartbeat-ms", "200"]
        # every worker gets a kv port: a prefill worker binds it if it changes to decode
        argv += ["--kv-bind", "tcp://127.0.0.1:%d" % free_port()]
        if self.curve and "--curve-secret-key" not in extra:
            argv += self.curve_worker_args(name)
        return self._spawn(name, argv + self.worker_args + list(extra))

    def worker_names(self, role=None):
        return [n for n in self.procs if n != "gateway" and (role is None or n.startswith(role))]

    def start(self, timeout=30):
        if self.curve:  # the gateway reads the authorized keys at start: make them first
            for i, role in enumerate(self.roles):
                self.keygen("%s-%d" % (role, i))
        self.start_gateway()
        for i, role in enumerate(self.roles):
            self.start_worker("%s-%d" % (role, i), role)
        self.wait_healthy(timeout)
        return self

    def wait_healthy(self, timeout=30):
        deadline = time.time() + timeout
        last = None
        while time.time() < deadline:
            for name, p in self.procs.items():
                if p.poll() is not None and name == "gateway":
                    raise RuntimeError("gateway exited (%s):\n%s" % (p.returncode, self.log("gateway")))
            try:
                status, body = self.request("GET", "/health", timeout=2)
                last = (status, body)
                if status == 200:
                    return
            except OSError as e:
                last = e
            time.sleep(0.1)
        raise RuntimeError("cluster not healthy after %ss: %r\n%s" % (timeout, last, self.all_logs()))

    def kill(self, name, sig=signal.SIGKILL):
        p = self.procs[name]
        p.send_signal(sig)
        p.wait(timeout=30)

    def stop(self):
        if self.stopped:
            return
        self.stopped = True
        for name, p in self.procs.items():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        deadline = time.time() + 15
        for name, p in self.procs.items():
            try:
                p.wait(timeout=max(0.1, deadline - time.time()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()

    def sanitizer_reports(self):
        bad = []
        for name, path in self.logs.items():
            text = self.log(name)
            if any(m in text for m in SANITIZER_MARKERS):
                bad.append("%s:\n%s" % (name, text[-4000:]))
        return bad

    def log(self, name):
        with open(self.logs[name], "r", errors="replace") as f:
            return f.read()

    def all_logs(self):
        return "\n".join("== %s ==\n%s" % (n, self.log(n)[-3000:]) for n in self.logs)

    def __enter__(self):
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc):
        self.stop()
        reports = self.sanitizer_reports()
        if reports and exc[0] is None:
            raise AssertionError("sanitizer reports:\n" + "\n".join(reports))
        return False

    # -- HTTP
    def conn(self, timeout=60):
        return http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)

    def request(self, method, path, body=None, timeout=60, headers=None, raw=None):
        """One request; returns (status, parsed JSON or text)."""
        c = self.conn(timeout)
        h = self.auth_headers({"Content-Type": "application/json"})
        h.update(headers or {})
        data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
        c.request(method, path, body=data, headers=h)
        r = c.getresponse()
        text = r.read().decode("utf-8", errors="replace")
        c.close()
        try:
            return r.status, json.loads(text)
        except ValueError:
            return r.status, text

    def auth_headers(self, h):
        """h plus the Authorization header of api_key (when set)."""
        if self.api_key:
            h["Authorization"] = "Bearer " + self.api_key
        return h

    def complete(self, prompt, max_tokens=48, **kw):
        body = {"model": kw.pop("model", "stories260K"), "prompt": prompt,
                "max_tokens": max_tokens, "temperature": kw.pop("temperature", 0)}
        body.update(kw)
        return self.request("POST", "/v1/completions", body)

    def stream(self, path, body, timeout=60):
        """A streaming request; returns (status, [parsed events], saw_done)."""
        body = dict(body, stream=True)
        c = self.conn(timeout)
        c.request("POST", path, body=json.dumps(body).encode(),
                  headers=self.auth_headers({"Content-Type": "application/json"}))
        r = c.getresponse()
        if r.status != 200:
            text = r.read().decode()
            c.close()
            return r.status, [json.loads(text)], False
        events, done = [], False
        buf = b""
        while True:
            chunk = r.read1(65536) if hasattr(r, "read1") else r.read(1)
            if not chunk:
                break
            buf += chunk
            while b"\n\n" in buf:
                ev, buf = buf.split(b"\n\n", 1)
                for line in ev.split(b"\n"):
                    if not line.startswith(b"data: "):
                        continue
                    data = line[6:]
                    if data == b"[DONE]":
                        done = True
                    else:
                        events.append(json.loads(data))
        c.close()
        return r.status, events, done

    def stream_text(self, prompt, max_tokens=48, **kw):
        body = {"model": "stories260K", "prompt": prompt, "max_tokens": max_tokens,
                "temperature": kw.pop("temperature", 0)}
        body.update(kw)
        status, events, done = self.stream("/v1/completions", body)
        text = "".join(c["text"] for e in events for c in e.get("choices", []))
        return status, text, events, done
