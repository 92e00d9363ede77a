"""A multi-host tidepool cluster in network namespaces (issue 11 part 4).

Topology (names carry a per-run prefix tp<pid>-, so runs never collide):

    tp<pid>-br   bridge "br0", one veth port per host (gw, p0, p1, d0, d1)
    tp<pid>-gw   10.77.0.1   gateway (HTTP :8000, ctl :5557, stats :5558)
    tp<pid>-p0   10.77.0.11  prefill worker p0      tp<pid>-p1  10.77.0.12  prefill worker p1
    tp<pid>-d0   10.77.0.21  decode worker d0       tp<pid>-d1  10.77.0.22  decode worker d1

Each host's "eth0" is one end of a veth pair whose other end is a port of br0 in the bridge
namespace, so nothing touches the host's own network. Every socket between processes is TCP
between those addresses: workers bind their kv socket on their own address and advertise it,
and the test's HTTP client runs inside the gateway namespace (a helper process started with
`ip netns exec`, driven over its stdin/stdout).

The run: greedy references from a one-host cluster (every process in the gateway namespace,
on its loopback), checked against test_e2e's REF; then the multi-host cluster must give the
same texts, and again under streaming load through three faults:
  a. the link between prefill host p0 and the bridge goes down for 3 s while a long prompt's
     KV streams from it to a decode host (checked: a transfer ended there unfinished);
  b. decode host d1 dies (SIGKILL of the process running there), and is started again;
  c. the gateway host is partitioned from every worker for 5 s (its bridge port down), with
     streams that outlast the partition.
Each fault: every admitted request completes with exactly the reference text (nothing lost,
duplicated or altered), at most one re-run per request (each counts against --max-retries),
every live worker's KV blocks are all free again within 5 s after the load ends, and the
workers cut off are registered, ready and heard from again after the heal; after (c) the
decode workers run no attempt the gateway re-ran elsewhere (running <= assigned).

Needs root and `ip netns` (skipped with a message otherwise). Not part of `make test`:
    /usr/bin/python3 -m unittest -v tests/netns/test_multihost.py
TIDEPOOL_BUILD selects the build (e.g. build/san-address-undefined); the logs are checked for
sanitizer reports as tests/integration/cluster.py does. Every namespace, veth and bridge made
is deleted at the end, also on failure or SIGTERM; only the pids this test started are
signalled."""

import atexit
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "integration"))
from cluster import BIN, MODEL, ROOT, SANITIZER_MARKERS  # noqa: E402
from test_chunked import LONG as LONG_PROMPT  # noqa: E402  (~300 tokens)
from test_e2e import REF  # noqa: E402

PY = "/usr/bin/python3"
SUBNET = "10.77.0"
ADDR = {"gw": SUBNET + ".1", "p0": SUBNET + ".11", "p1": SUBNET + ".12",
        "d0": SUBNET + ".21", "d1": SUBNET + ".22"}
HTTP_PORT, CTL_PORT, STATS_PORT, KV_PORT = 8000, 5557, 5558, 5560
PREFILL, DECODE = ("p0", "p1"), ("d0", "d1")
HB_MS, DEAD_AFTER_MS = 200, 1000
STEP_DELAY_MS = 25   # decode steps last: a stream of MAX_TOKENS spans each fault
MAX_TOKENS = 150
# fault c: streams that outlast the partition, so the decode workers still run the attempts
# the gateway gave up on when the partition heals: plain decoding (one token a step; with MTP
# a step may emit three) and a longer max_tokens
OUTLAST = (400, 0)  # (max_tokens, mtp_depth)
SHORT = (MAX_TOKENS, None)  # None: the workers' default depth (MTP on: the model has modules)
# fault a: prompts computed over ~150 loop iterations of the prefill worker (chunks of 2
# tokens), their KV streaming to a decode host block by block meanwhile: one is mid-transfer
# on each prefill host when p0's link goes down
CHUNKED = (40, None)
N_STREAMS = 12       # concurrent streamed greedy completions per fault
STAGGER_S = 0.1      # between their starts, so prompts are in every stage when a fault hits
PROMPTS = list(REF) + ["The little dog", "Lily and Ben were"]
PREFILL_CUT_S = 3.0  # fault a: longer than --dead-after-ms, shorter than the 5 s KV lease
PARTITION_S = 5.0    # fault c
# workers: slow steps, and prompts computed in chunks of 2 tokens (one loop iteration and one
# step delay each), so that a transfer spans several iterations and a cut can land mid-way
WORKER_ARGS = ["--heartbeat-ms", str(HB_MS), "--debug-step-delay-ms", str(STEP_DELAY_MS),
               "--prefill-chunk-tokens", "2", "--threads", "1"]


def run(*argv, check=True):
    p = subprocess.run(list(argv), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if check and p.returncode != 0:
        raise RuntimeError("%s: exit %d: %s" % (" ".join(argv), p.returncode, p.stdout.strip()))
    return p


def netns_unavailable():
    """Why this test cannot run here, or None."""
    if os.geteuid() != 0:
        return "needs root (network namespaces, veth, bridge)"
    if not shutil.which("ip"):
        return "iproute2's ip is not installed"
    probe = "tp%d-probe" % os.getpid()
    p = run("ip", "netns", "add", probe, check=False)
    if p.returncode != 0:
        return "ip netns is unavailable: " + p.stdout.strip()
    run("ip", "netns", "del", probe, check=False)
    return None


# --- the topology


class Topology:
    """Namespaces joined by veth pairs to a bridge in a namespace of its own. Records what
    it made; destroy() removes all of it (and is safe to call twice or after a partial
    create)."""

    def __init__(self, prefix):
        self.prefix = prefix
        self.br = prefix + "br"
        self.made_ns = []      # namespaces created, in order
        self.made_links = []   # (ns, ifname) created: veth ports, the bridge

    def ns(self, host):
        return self.prefix + host

    def create(self):
        run("ip", "netns", "add", self.br)
        self.made_ns.append(self.br)
        run("ip", "-n", self.br, "link", "set", "lo", "up")
        run("ip", "-n", self.br, "link", "add", "br0", "type", "bridge")
        self.made_links.append((self.br, "br0"))
        run("ip", "-n", self.br, "link", "set", "br0", "up")
        for host, addr in ADDR.items():
            ns = self.ns(host)
            run("ip", "netns", "add", ns)
            self.made_ns.append(ns)
            run("ip", "-n", ns, "link", "set", "lo", "up")
            # the bridge port is named after the host; its peer moves into the host as eth0
            run("ip", "-n", self.br, "link", "add", host, "type", "veth", "peer", "name", "eth0",
                "netns", ns)
            self.made_links.append((self.br, host))
            run("ip", "-n", self.br, "link", "set", host, "master", "br0")
            run("ip", "-n", self.br, "link", "set", host, "up")
            run("ip", "-n", ns, "addr", "add", addr + "/24", "dev", "eth0")
            run("ip", "-n", ns, "link", "set", "eth0", "up")
        # every host reaches every other one (waits out address setup)
        for host in ADDR:
            if host != "gw":
                self.wait_ping("gw", ADDR[host])

    def wait_ping(self, host, addr, timeout=10):
        """A TCP connection from host to addr's closed port 9 is refused: addr answers."""
        probe = ("import socket, sys, time\n"
                 "deadline = time.time() + %r\n"
                 "while time.time() < deadline:\n"
                 "    s = socket.socket(); s.settimeout(1)\n"
                 "    try: s.connect((%r, 9))\n"
                 "    except ConnectionRefusedError: sys.exit(0)\n"
                 "    except OSError: time.sleep(0.1)\n"
                 "    finally: s.close()\n"
                 "sys.exit(1)\n" % (timeout, addr))
        if run("ip", "netns", "exec", self.ns(host), PY, "-c", probe, check=False).returncode:
            raise RuntimeError("%s cannot reach %s" % (host, addr))

    def link(self, host, up):
        """Set host's bridge port up or down: its eth0 loses carrier, the host is cut off."""
        run("ip", "-n", self.br, "link", "set", host, "up" if up else "down")

    def destroy(self):
        errors = []
        for ns, ifname in reversed(self.made_links):
            run("ip", "-n", ns, "link", "del", ifname, check=False)  # gone with its peer: fine
        self.made_links = []
        for ns in reversed(self.made_ns):
            p = run("ip", "netns", "del", ns, check=False)
            if p.returncode != 0:
                errors.append(p.stdout.strip())
        self.made_ns = []
        left = [n for n in run("ip", "netns", "list").stdout.split() if n.startswith(self.prefix)]
        if left:
            errors.append("namespaces left: %s" % left)
        return errors


# --- the HTTP client inside the gateway namespace


def client_main(host, port):
    """Runs inside the gateway's namespace (ip netns exec). Reads one JSON command a line on
    stdin, runs each in a thread, writes one JSON reply a line on stdout (same "id"):
    {"op": "get", "path"} -> {"status", "body"}; {"op": "stream", "body"} -> {"status",
    "text", "done", "finish", "errors", "n_chunks", "t_first", "t_end"}."""
    import http.client
    lock = threading.Lock()

    def reply(obj):
        with lock:
            sys.stdout.write(json.dumps(obj) + "\n")
            sys.stdout.flush()

    def get(cmd):
        c = http.client.HTTPConnection(host, port, timeout=10)
        c.request("GET", cmd["path"])
        r = c.getresponse()
        text = r.read().decode("utf-8", errors="replace")
        c.close()
        try:
            body = json.loads(text)
        except ValueError:
            body = text
        return {"status": r.status, "body": body}

    def stream(cmd):
        t0 = time.time()
        c = http.client.HTTPConnection(host, port, timeout=120)
        c.request("POST", "/v1/completions", body=json.dumps(dict(cmd["body"], stream=True)),
                  headers={"Content-Type": "application/json"})
        r = c.getresponse()
        out = {"status": r.status, "text": "", "done": False, "finish": None, "errors": [],
               "n_chunks": 0, "t_first": None}
        if r.status != 200:
            out["errors"].append(r.read().decode("utf-8", errors="replace"))
            c.close()
            return out
        buf = b""
        while True:
            chunk = r.read1(65536)
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
                        out["done"] = True
                        continue
                    e = json.loads(data)
                    if "error" in e:
                        out["errors"].append(e["error"])
                    for ch in e.get("choices", []):
                        if out["t_first"] is None:
                            out["t_first"] = time.time() - t0
                        out["text"] += ch.get("text", "")
                        out["n_chunks"] += 1
                        if ch.get("finish_reason"):
                            out["finish"] = ch["finish_reason"]
        c.close()
        out["t_end"] = time.time() - t0
        return out

    def serve(cmd):
        try:
            res = get(cmd) if cmd["op"] == "get" else stream(cmd)
        except Exception as e:  # noqa: BLE001 - reported to the test, which fails on it
            res = {"status": None, "exc": "%s: %s" % (type(e).__name__, e)}
        res["id"] = cmd["id"]
        reply(res)

    for line in sys.stdin:
        if line.strip():
            threading.Thread(target=serve, args=(json.loads(line),), daemon=True).start()


class NetClient:
    """The test's end of client_main: get() and stream() from any thread."""

    def __init__(self, ns, host, port, log_path):
        self.log = open(log_path, "ab")
        self.proc = subprocess.Popen(
            ["ip", "netns", "exec", ns, PY, os.path.abspath(__file__), "--client", host,
             str(port)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log,
            text=True, bufsize=1, start_new_session=True)
        self.lock = threading.Lock()
        self.cv = threading.Condition(self.lock)
        self.results = {}
        self.next_id = 1
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for line in self.proc.stdout:
            res = json.loads(line)
            with self.cv:
                self.results[res["id"]] = res
                self.cv.notify_all()
        with self.cv:
            self.results[None] = "client exited"
            self.cv.notify_all()

    def send(self, cmd):
        with self.lock:
            i = self.next_id
            self.next_id += 1
            self.proc.stdin.write(json.dumps(dict(cmd, id=i)) + "\n")
            self.proc.stdin.flush()
        return i

    def wait(self, i, timeout):
        deadline = time.time() + timeout
        with self.cv:
            while i not in self.results:
                left = deadline - time.time()
                if left <= 0 or None in self.results:
                    return None
                self.cv.wait(left)
            return self.results.pop(i)

    def get(self, path, timeout=15):
        res = self.wait(self.send({"op": "get", "path": path}), timeout)
        if res is None or res.get("status") is None:
            raise OSError("GET %s failed: %r" % (path, res))
        return res["status"], res["body"]

    def stream(self, prompt, max_tokens, mtp_depth=None):
        body = {"model": "stories260K", "prompt": prompt, "max_tokens": max_tokens,
                "temperature": 0}
        if mtp_depth is not None:
            body["mtp_depth"] = mtp_depth
        return self.send({"op": "stream", "body": body})

    def close(self):
        if self.proc.poll() is None:
            try:
                self.proc.stdin.close()
            except OSError:
                pass
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc.stdout.close()
        self.log.close()


# --- processes


class Procs:
    """The processes this test started: name -> (Popen, namespace, log path)."""

    def __init__(self, tmp):
        self.tmp = tmp
        self.procs = {}
        self.logs = {}
        self.env = dict(os.environ)

    def spawn(self, name, ns, argv):
        path = os.path.join(self.tmp, name + ".log")
        with open(path, "ab") as f:
            p = subprocess.Popen(["ip", "netns", "exec", ns] + argv, stdout=f,
                                 stderr=subprocess.STDOUT, env=self.env, cwd=ROOT,
                                 start_new_session=True)
        self.procs[name] = (p, ns)
        self.logs[name] = path
        return p

    def kill(self, name, sig=signal.SIGKILL):
        p = self.procs[name][0]
        if p.poll() is None:
            p.send_signal(sig)  # ip netns exec execs the program: this pid is the program's
        p.wait(15)

    def stop(self, names=None, timeout=20):
        names = [n for n in (names or list(self.procs)) if n in self.procs]
        for n in names:
            p = self.procs[n][0]
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        deadline = time.time() + timeout
        for n in names:
            p = self.procs[n][0]
            try:
                p.wait(max(0.1, deadline - time.time()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()

    def log(self, name):
        with open(self.logs[name], "r", errors="replace") as f:
            return f.read()

    def sanitizer_reports(self):
        bad = []
        for name in self.logs:
            text = self.log(name)
            if any(m in text for m in SANITIZER_MARKERS):
                bad.append("%s:\n%s" % (name, text[-4000:]))
        return bad


def gateway_argv(host, port, ctl, stats, db):
    return [os.path.join(BIN, "gateway"), "--host", host, "--port", str(port),
            "--ctl-bind", ctl, "--stats-bind", stats, "--model", MODEL,
            "--heartbeat-ms", str(HB_MS), "--dead-after-ms", str(DEAD_AFTER_MS),
            "--state-db", db]


def worker_argv(wid, role, gateway, kv_ep, extra=()):
    prog = "decode_worker" if role == "decode" else "prefill_worker"
    return [os.path.join(BIN, prog), "--role", role, "--gateway", gateway, "--model", MODEL,
            "--worker-id", wid, "--kv-bind", kv_ep, "--kv-advertise", kv_ep] + list(extra)


# --- the test


class MultiHost(unittest.TestCase):
    """One topology and one cluster for every case; the cases run in name order."""

    @classmethod
    def setUpClass(cls):
        why = netns_unavailable()
        if why:
            raise unittest.SkipTest("netns multi-host test skipped: " + why)
        for prog in ("gateway", "prefill_worker", "decode_worker"):
            if not os.access(os.path.join(BIN, prog), os.X_OK):
                raise RuntimeError("%s/%s is missing: build first (make -j2 all)" % (BIN, prog))
        cls.t0 = time.time()
        cls.tmp = tempfile.mkdtemp(prefix="tidepool-netns-")
        cls.topo = Topology("tp%d-" % os.getpid())
        cls.procs = Procs(cls.tmp)
        cls.client = None
        cls.report = []
        cls.cleaned = False
        cls.client_log = os.path.join(cls.tmp, "client.log")
        # SIGTERM (a CI timeout) unwinds like an error; an interrupt that escapes unittest
        # still deletes the namespaces at exit
        cls.old_term = signal.signal(signal.SIGTERM, _raise_interrupt)
        cls.addClassCleanup(cls.cleanup)
        atexit.register(cls.cleanup)
        cls.topo.create()
        cls.refs = cls.single_host_reference()
        cls.start_cluster()

    @classmethod
    def cleanup(cls):
        """Stop every process we started (SIGTERM, then SIGKILL), check their logs, then
        delete the namespaces, veths and bridge; also runs when setUpClass failed."""
        if cls.cleaned:
            return
        cls.cleaned = True
        errors = []
        try:
            if cls.client:
                cls.client.close()
            cls.procs.stop()
            errors += cls.procs.sanitizer_reports()
        finally:
            errors += cls.topo.destroy()
            signal.signal(signal.SIGTERM, cls.old_term)
            print("\n".join(["", "== netns multi-host: %.1f s in all, logs in %s" %
                             (time.time() - cls.t0, cls.tmp)] + cls.report), file=sys.stderr)
        if errors:
            raise AssertionError("\n".join(errors))

    # -- set-up

    @classmethod
    def single_host_reference(cls):
        """Greedy texts of every prompt from a one-host cluster: gateway, one prefill and one
        decode worker in the gateway's namespace, on its loopback."""
        ns = cls.topo.ns("gw")
        lo = "127.0.0.1"
        names = ["ref-gateway", "ref-prefill", "ref-decode"]
        cls.procs.spawn(names[0], ns, gateway_argv(lo, 18000, "tcp://%s:15557" % lo,
                                                   "tcp://%s:15558" % lo,
                                                   os.path.join(cls.tmp, "ref.db")))
        ctl = "tcp://%s:15557" % lo
        cls.procs.spawn(names[1], ns, worker_argv("ref-p", "prefill", ctl, "tcp://%s:15560" % lo,
                                                  ["--heartbeat-ms", str(HB_MS)]))
        cls.procs.spawn(names[2], ns, worker_argv("ref-d", "decode", ctl, "tcp://%s:15561" % lo,
                                                  ["--heartbeat-ms", str(HB_MS)]))
        client = NetClient(ns, lo, 18000, cls.client_log)
        try:
            wait_for(lambda: client_get_ok(client, "/health"), 30, "one-host cluster healthy")
            ids = {(p,) + kind: client.stream(p, *kind) for p in PROMPTS
                   for kind in (SHORT, OUTLAST)}
            ids[(LONG_PROMPT,) + CHUNKED] = client.stream(LONG_PROMPT, *CHUNKED)
            refs = {}
            for key, i in ids.items():
                r = client.wait(i, 60)
                if not r or r.get("status") != 200 or not r.get("done") or r.get("errors"):
                    raise AssertionError("one-host reference for %r failed: %r" % (key, r))
                refs[key] = (r["text"], r["finish"])
        finally:
            client.close()
            cls.procs.stop(names)
        for p, want in REF.items():  # test_e2e's texts (run.c's) are the first 48 tokens
            text = refs[(p,) + SHORT][0]
            if not text.startswith(want):
                raise AssertionError("one-host text for %r is not run.c's: %r" % (p, text))
        return refs

    @classmethod
    def start_cluster(cls):
        gw = ADDR["gw"]
        cls.ctl = "tcp://%s:%d" % (gw, CTL_PORT)
        cls.procs.spawn("gateway", cls.topo.ns("gw"),
                        gateway_argv(gw, HTTP_PORT, cls.ctl, "tcp://%s:%d" % (gw, STATS_PORT),
                                     os.path.join(cls.tmp, "gateway.db")))
        for h in PREFILL + DECODE:
            cls.start_worker(h)
        cls.client = NetClient(cls.topo.ns("gw"), gw, HTTP_PORT, cls.client_log)
        wait_for(lambda: len(cls.ready_workers()) == 4, 30, "4 workers registered")

    @classmethod
    def start_worker(cls, host):
        role = "decode" if host in DECODE else "prefill"
        kv = "tcp://%s:%d" % (ADDR[host], KV_PORT)
        return cls.procs.spawn(host, cls.topo.ns(host),
                               worker_argv(host, role, cls.ctl, kv, WORKER_ARGS))

    # -- figures

    @classmethod
    def workers(cls):
        status, body = cls.client.get("/workers")
        return {w["id"]: w for w in body["workers"]} if status == 200 else {}

    @classmethod
    def ready_workers(cls):
        """Ids of the workers the gateway lists as ready, heard from within the last 3
        heartbeats (a worker cut off but not declared dead yet is still listed), whose pid
        is the process we run."""
        out = set()
        for wid, w in cls.workers().items():
            p = cls.procs.procs.get(wid, (None,))[0]
            if (w["state"] == "ready" and w["last_seen_ms_ago"] < 3 * HB_MS and p is not None
                    and p.poll() is None and w["pid"] == p.pid):
                out.add(wid)
        return out

    def gateway_log_mark(self):
        return len(self.procs.log("gateway"))

    def gateway_log_since(self, mark):
        return self.procs.log("gateway")[mark:]

    # -- load and checks

    def start_load(self, n=N_STREAMS, kind=SHORT):
        """n streamed greedy completions of kind (max_tokens, mtp_depth), STAGGER_S apart
        (from a thread). Returns the list ((prompt, max_tokens, mtp_depth), id), filled as
        they start, and the thread."""
        started = []

        def go():
            for k in range(n):
                p = PROMPTS[k % len(PROMPTS)]
                started.append(((p,) + kind, self.client.stream(p, *kind)))
                time.sleep(STAGGER_S)
        t = threading.Thread(target=go, daemon=True)
        t.start()
        return started, t

    def finish_load(self, started, thread, what, timeout=90):
        """Wait for every stream; each must be exactly its reference. Returns (results, time
        the last one ended)."""
        thread.join(30)
        results = []
        deadline = time.time() + timeout
        for p, i in started:
            results.append((p, self.client.wait(i, max(1, deadline - time.time()))))
        t_end = time.time()
        bad = []
        for k, (p, r) in enumerate(results):
            want_text, want_finish = self.refs[p]
            if r is None:
                bad.append("stream %d (%r): no answer within %d s (hang)" % (k, p, timeout))
            elif r.get("status") != 200 or r.get("errors") or not r.get("done"):
                bad.append("stream %d (%r): status %s, errors %r, done %s, exc %s" %
                           (k, p, r.get("status"), r.get("errors"), r.get("done"), r.get("exc")))
            elif r["text"] != want_text or r["finish"] != want_finish:
                bad.append("stream %d (%r): text differs from the one-host run:\n  got  %r (%s)\n"
                           "  want %r (%s)" % (k, p, r["text"], r["finish"], want_text,
                                               want_finish))
        if bad:
            self.fail("%s: %d of %d streams wrong:\n%s\n%s" %
                      (what, len(bad), len(results), "\n".join(bad), self.log_tails()))
        return results, t_end

    def log_tails(self, n=3000):
        return "\n".join("== %s ==\n%s" % (name, self.procs.log(name)[-n:])
                         for name in ("gateway",) + PREFILL + DECODE if name in self.procs.logs)

    def wait_kv_free(self, t_end, what, within=5.0):
        """Every live worker lists all its KV blocks free within `within` s of t_end.
        Returns the seconds it took."""
        last = {}
        while True:
            ws = self.workers()
            last = {k: (w["kv_blocks_free"], w["kv_blocks_total"], w["running"])
                    for k, w in ws.items()}
            live = [h for h in PREFILL + DECODE if self.procs.procs[h][0].poll() is None]
            if all(h in ws and ws[h]["kv_blocks_free"] == ws[h]["kv_blocks_total"] for h in live):
                return time.time() - t_end
            if time.time() - t_end > within:
                self.fail("%s: KV not all free %.1f s after the load ended: %r\n%s" %
                          (what, within, last, self.log_tails()))
            time.sleep(0.1)

    def wait_ready(self, hosts, since, what, within=15.0):
        """hosts registered and ready (our pids) again; returns the seconds since `since`."""
        deadline = since + within
        while time.time() < deadline:
            if set(hosts) <= self.ready_workers():
                return time.time() - since
            time.sleep(0.1)
        self.fail("%s: %s not ready %.0f s after the heal: %r\n%s" %
                  (what, hosts, within, self.workers(), self.log_tails()))

    def counts(self, what, mark, results, extra, max_attempts=2):
        """Print and keep the figures of one case: requests sent/completed/retried (from the
        gateway log's "request end" lines of this case: attempts per request), re-runs.
        One fault may cost a request one re-run, not more: every re-run counts against its
        --max-retries, so a fault that took several would leave it less for the next one."""
        log = self.gateway_log_since(mark)
        attempts = [int(a) for a in re.findall(r"request end: .* attempts=(\d+)", log)]
        retried = sum(1 for a in attempts if a > 1)
        n_retry_lines = len(re.findall(r"retrying \(attempt", log))
        ok = sum(1 for _, r in results if r and r.get("status") == 200 and r.get("done"))
        m1 = self.metrics()
        gw = {k: m1.get(k, 0) - self.m0.get(k, 0) for k in m1}
        line = ("%-32s sent %2d, completed %2d, retried %2d (%d re-runs, attempts at most %d); "
                "gateway /metrics: received %d, succeeded %d, failed %d; %s" %
                (what, len(results), ok, retried, n_retry_lines, max(attempts or [0]),
                 gw["received"], gw["success"], gw["failure"], extra))
        self.report.append(line)
        print("\n" + line, file=sys.stderr)
        self.assertEqual(len(attempts), len(results), "a request end line per stream")
        self.assertEqual((gw["received"], gw["success"], gw["failure"]),
                         (len(results), len(results), 0), "the gateway's own counts")
        self.assertLessEqual(max(attempts or [0]), max_attempts,
                             "%s: a request ran more than %d attempts for one fault:\n%s" %
                             (what, max_attempts, "\n".join(
                                 l for l in log.splitlines() if "retrying" in l)))
        return retried

    def kvx_counters(self):
        """Per-worker KV transfer outcomes from /metrics (kv_transfers_total)."""
        status, text = self.client.get("/metrics")
        out = {}
        for m in re.finditer(r'kv_transfers_total\{[^}]*worker="([^"]+)"[^}]*side="(\w+)",'
                             r'result="(\w+)"\} (\d+)', text if isinstance(text, str) else ""):
            if int(m.group(4)):
                out.setdefault(m.group(1), {})["%s_%s" % (m.group(2), m.group(3))] = \
                    int(m.group(4))
        return out

    def metrics(self):
        """The gateway's request counters from /metrics: received, success, failure."""
        status, text = self.client.get("/metrics")
        out = {"received": 0, "success": 0, "failure": 0}
        names = {"requests_received_total": "received", "request_success_total": "success",
                 "request_failure_total": "failure"}
        for m in re.finditer(r"^tidepool_(\w+)\{[^}]*\} (\S+)$", text, re.M):
            if m.group(1) in names:
                out[names[m.group(1)]] += int(float(m.group(2)))
        return out

    def assert_baseline(self):
        """Start of a case: every worker ready and idle; the gateway's counters noted."""
        wait_for(lambda: len(self.ready_workers()) == 4, 20, "4 workers ready")
        self.wait_kv_free(time.time(), "baseline", within=10)
        self.m0 = self.metrics()

    # -- the cases

    def test_0_greedy_equals_single_host(self):
        self.assert_baseline()
        mark = self.gateway_log_mark()
        started, t = self.start_load(len(PROMPTS) * 2)
        results, t_end = self.finish_load(started, t, "no fault")
        took = self.wait_kv_free(t_end, "no fault")
        self.counts("no fault (greedy = one host)", mark, results, "KV free after %.1f s" % took)

    def test_1_prefill_link_down_mid_transfer(self):
        self.assert_baseline()
        mark = self.gateway_log_mark()
        before = self.kvx_counters()
        started, t = self.start_load()
        time.sleep(STAGGER_S * N_STREAMS / 2)
        # two long prompts: routing gives one to each prefill host (the least queued prompt
        # tokens); each takes seconds to compute, its transfer open all that time
        started += [((LONG_PROMPT,) + CHUNKED, self.client.stream(LONG_PROMPT, *CHUNKED))
                    for _ in range(2)]
        time.sleep(0.5)
        t_cut = time.time()
        self.topo.link("p0", False)
        try:
            time.sleep(PREFILL_CUT_S)
        finally:
            self.topo.link("p0", True)
        t_heal = time.time()
        back = self.wait_ready(["p0"], t_heal, "prefill link down")
        results, t_end = self.finish_load(started, t, "prefill link down")
        took = self.wait_kv_free(t_end, "prefill link down")
        after = self.kvx_counters()
        # a transfer that was open on a decode host when the link went down ended there
        # without completing (cancelled by the gateway's re-run, or its lease ran out)
        cut = {d: sum(after.get(d, {}).get("recv_" + k, 0) - before.get(d, {}).get("recv_" + k, 0)
                      for k in ("cancelled", "timeout", "aborted")) for d in DECODE}
        self.counts("a. p0 link down %.1f s" % (t_heal - t_cut), mark, results,
                    "transfers cut mid-way %r, KV free after %.1f s, p0 ready %.1f s after the "
                    "heal" % (cut, took, back))
        self.assertGreaterEqual(sum(cut.values()), 1, "no transfer was cut mid-way: %r -> %r" %
                                (before, after))

    def test_2_decode_host_killed(self):
        self.assert_baseline()
        mark = self.gateway_log_mark()
        started, t = self.start_load()
        time.sleep(STAGGER_S * N_STREAMS / 2 + 0.5)
        pids = run("ip", "netns", "pids", self.topo.ns("d1")).stdout.split()
        self.assertEqual(pids, [str(self.procs.procs["d1"][0].pid)],
                         "d1's namespace runs exactly the decode worker we started")
        self.procs.kill("d1")  # SIGKILL: every process of that host
        t_kill = time.time()
        results, t_end = self.finish_load(started, t, "decode host killed")
        took = self.wait_kv_free(t_end, "decode host killed")
        self.start_worker("d1")  # the host comes back
        back = self.wait_ready(["d1"], time.time(), "decode host restarted")
        self.counts("b. d1 killed", mark, results,
                    "load ended %.1f s after the kill, KV free after %.1f s, new d1 ready in "
                    "%.1f s" % (t_end - t_kill, took, back))

    def test_3_gateway_partitioned(self):
        self.assert_baseline()
        mark = self.gateway_log_mark()
        started, t = self.start_load(kind=OUTLAST)
        time.sleep(STAGGER_S * N_STREAMS / 2 + 0.5)
        t_cut = time.time()
        self.topo.link("gw", False)
        try:
            time.sleep(PARTITION_S)
        finally:
            self.topo.link("gw", True)
        t_heal = time.time()
        back = self.wait_ready(list(PREFILL + DECODE), t_heal, "gateway partition")
        clean = self.wait_no_orphans(t_heal, "gateway partition")
        results, t_end = self.finish_load(started, t, "gateway partitioned", timeout=120)
        took = self.wait_kv_free(t_end, "gateway partitioned")
        self.counts("c. gateway partitioned %.1f s" % (t_heal - t_cut), mark, results,
                    "all 4 ready %.1f s after the heal, decode workers run only the gateway's "
                    "attempts %.1f s after it, KV free after %.1f s" % (back, clean, took))

    def wait_no_orphans(self, since, what, within=2.0):
        """After a heal, every decode worker runs no more sequences than the gateway has
        assigned to it: the attempts it gave up on while the worker was cut off (and re-ran
        once it was back) are gone there, their KV freed. Returns when that holds, in seconds
        since `since`, and fails after `within` s past the workers' return. ("running" comes
        with heartbeats only: a worker just registered again lists 0 until its first one.)"""
        time.sleep(3 * HB_MS / 1000)
        deadline = time.time() + within
        while True:
            ws = self.workers()
            extra = {d: (ws[d]["running"], ws[d]["assigned"]) for d in DECODE if d in ws}
            if len(extra) == len(DECODE) and all(r <= a for r, a in extra.values()):
                return time.time() - since
            if time.time() > deadline:
                self.fail("%s: decode workers still run attempts the gateway re-ran elsewhere "
                          "(running, assigned): %r\n%s" % (what, extra, self.log_tails()))
            time.sleep(0.05)


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt("signal %d" % signum)


def client_get_ok(client, path):
    try:
        return client.get(path, timeout=5)[0] == 200
    except OSError:
        return False


def wait_for(pred, timeout, what):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if pred():
            return
        time.sleep(0.1)
    raise AssertionError("timed out after %s s waiting for %s" % (timeout, what))


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--client":
        client_main(sys.argv[2], int(sys.argv[3]))
    else:
        unittest.main()
