"""CURVE on the ctl and kv sockets (docs/security.md): a cluster with keys answers exactly
as one without; a worker whose key is not listed cannot register, a sender whose key is
not listed cannot deliver KV, a CURVE worker refuses to send KV to a decode worker without
a key, plain and CURVE peers do not connect, and a key file readable by others is refused
at start."""

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import unittest

import zmq

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import fake_gateway as fg  # noqa: E402
from cluster import BIN, MODEL, ROOT, Cluster, free_port  # noqa: E402

PROMPTS = ["Once upon a time", "The little dog", "Lily and Ben went to the park"]


def keygen(base):
    subprocess.run([os.path.join(BIN, "tidepool-keygen"), base], check=True,
                   stdout=subprocess.DEVNULL)
    return base


def read_key(path, name="public-key"):
    with open(path) as f:
        for line in f:
            if line.strip().startswith(name):
                return line.split("=", 1)[1].strip().strip('"')
    raise ValueError("no %s in %s" % (name, path))


def answers(c):
    """Greedy completions (text) of PROMPTS, one streamed, and the workers' ids."""
    out = []
    for p in PROMPTS:
        status, body = c.complete(p, max_tokens=40)
        assert status == 200, (status, body)
        out.append(body["choices"][0]["text"])
    status, text, _, done = c.stream_text(PROMPTS[0], max_tokens=40)
    assert status == 200 and done
    out.append(text)
    return out


def worker_ids(c):
    status, body = c.request("GET", "/workers")
    assert status == 200, body
    return sorted(w["id"] for w in body["workers"])


class CurveCluster(unittest.TestCase):
    def test_same_output_with_and_without_keys(self):
        with Cluster(roles=("prefill", "decode")) as c:
            plain = answers(c)
        with Cluster(roles=("prefill", "decode"), curve=True) as c:
            encrypted = answers(c)
            self.assertEqual(worker_ids(c), ["decode-1", "prefill-0"])
            gw = c.log("gateway")
            self.assertIn("CURVE on the ctl socket", gw)
            # the decode worker registered its kv key, and the gateway logged it
            dkey = c.public_key(os.path.join(c.keys, "workers", "decode-1"))
            self.assertRegex(gw, r"worker decode-1 registered: role decode, pid \d+, kv "
                             r"tcp://\S+ key " + re.escape(dkey))
            self.assertNotIn("refused a connection", gw)
            self.assertNotIn("refused a connection", c.log("decode-1"))
        self.assertEqual(encrypted, plain)
        self.assertEqual(len(set(plain[:3])), 3)  # three different, non-trivial answers
        self.assertTrue(all(len(t) > 20 for t in plain))

    def test_unlisted_and_plain_workers_cannot_register(self):
        with Cluster(roles=("prefill", "decode"), curve=True) as c:
            # a key pair that is not in the gateway's authorized directory
            c.start_worker("decode-rogue", "decode", c.curve_worker_args("decode-rogue", "rogue"))
            rogue = c.public_key(os.path.join(c.keys, "rogue", "decode-rogue"))
            # and a worker without CURVE
            c.start_worker("decode-plain", "decode", ["--curve-secret-key", ""])
            # (a sanitized worker on a loaded machine takes seconds to load and calibrate)
            deadline = time.time() + 30
            want = "refused a connection to tidepool-ctl from 127.0.0.1: key not authorized, " \
                   "client key " + rogue
            while time.time() < deadline and want not in c.log("gateway"):
                time.sleep(0.1)
            self.assertIn(want, c.log("gateway"))
            time.sleep(1.0)  # several heartbeat intervals of both trying
            self.assertEqual(worker_ids(c), ["decode-1", "prefill-0"])
            self.assertIsNone(c.procs["decode-rogue"].poll())  # still running, still refused
            self.assertIsNone(c.procs["decode-plain"].poll())
            for p in PROMPTS:
                status, body = c.complete(p, max_tokens=16)
                self.assertEqual(status, 200, body)
            self.assertEqual(worker_ids(c), ["decode-1", "prefill-0"])
            for name in ("decode-rogue", "decode-plain"):
                log = c.log(name)
                self.assertNotIn("registered with the gateway", log)
                self.assertNotIn("req=", log)  # no request ever went there
            # the refusals are rate-limited: at most CURVE_ZAP_LOG_BURST lines per window
            self.assertLessEqual(c.log("gateway").count("refused a connection"), 10)

    def test_refused_worker_registers_once_admitted(self):
        """libzmq 4.3.4 does not retry a refused handshake: the worker opens a new ctl
        connection with a back-off, so once the gateway admits its key it registers without
        a restart; a plain worker's failed handshake is logged by the gateway."""
        with Cluster(roles=("prefill", "decode"), curve=True) as c:
            c.start_worker("decode-rogue", "decode", c.curve_worker_args("decode-rogue", "rogue"))
            c.start_worker("decode-plain", "decode", ["--curve-secret-key", ""])
            rogue = os.path.join(c.keys, "rogue", "decode-rogue")
            want = "key not authorized, client key " + c.public_key(rogue)
            deadline = time.time() + 30
            while time.time() < deadline and want not in c.log("gateway"):
                time.sleep(0.1)
            self.assertIn(want, c.log("gateway"))
            # the plain worker: the gateway names its address and the likely cause (a loaded
            # machine may start the plain worker late and its back-off doubles from 1 s)
            deadline = time.time() + 25
            plain = re.compile(r"ctl: handshake from 127\.0\.0\.1:\d+ on %s failed: the client "
                               r"does not use CURVE \(a worker started without "
                               r"--curve-secret-key\?\)" % re.escape(c.ctl))
            while time.time() < deadline and not plain.search(c.log("gateway")):
                time.sleep(0.1)
            self.assertRegex(c.log("gateway"), plain)
            # and the workers say why, as each attempt fails (libzmq may report one attempt
            # as "no detail" when the server closes first: a later attempt names the cause)
            # (or, a plain client on a loaded host, the server's close first, every attempt)
            why = {"decode-rogue": re.escape("ctl: handshake with %s failed: the server refused "
                                             "this process's CURVE key" % c.ctl),
                   "decode-plain": re.escape("ctl: handshake with %s failed: " % c.ctl) +
                   r"(the server uses CURVE and this process does not|the server closed the "
                   r"connection during the handshake \(errno \d+: [^)]*\): if it uses CURVE, "
                   r"this process does not)"}
            deadline = time.time() + 8
            while time.time() < deadline and not all(re.search(w, c.log(n))
                                                     for n, w in why.items()):
                time.sleep(0.1)
            for n, w in why.items():
                self.assertRegex(c.log(n), w)
            time.sleep(2.5)  # a few attempts of each: 1 s, then 2 s apart
            self.assertEqual(worker_ids(c), ["decode-1", "prefill-0"])
            self.assertIn("opening a new ctl connection (next in 2 s)", c.log("decode-rogue"))
            # the gateway again, now admitting the rogue key; the worker is not restarted
            c.kill("gateway", signal.SIGTERM)
            shutil.copy(rogue + ".pub", os.path.join(c.keys, "workers"))
            c.start_gateway()
            c.wait_healthy()
            deadline = time.time() + 30
            while time.time() < deadline and "decode-rogue" not in worker_ids(c):
                time.sleep(0.2)
            self.assertEqual(worker_ids(c), ["decode-1", "decode-rogue", "prefill-0"])
            self.assertIn("registered with the gateway as decode-rogue", c.log("decode-rogue"))
            self.assertIsNone(c.procs["decode-plain"].poll())
            self.assertNotIn("registered with the gateway", c.log("decode-plain"))
            # rate-limited: at most HSMON_LOG_BURST lines per 10 s window
            self.assertLessEqual(c.log("gateway").count("ctl: handshake from"), 20)

    def test_workers_shows_kv_send_failures(self):
        """A decode worker that does not list the prefill worker's key: requests fail, and
        /workers shows the prefill worker's failed transfers (while /health says ok)."""
        c = Cluster(roles=(), curve=True, worker_args=["--lease-ms", "1000"])
        try:
            c.keygen("prefill-0")
            own = os.path.join(c.keys, "own")
            args = c.curve_worker_args("decode-1", "own")
            args[args.index("--curve-authorized-keys") + 1] = own  # lists only itself
            shutil.copy(os.path.join(own, "decode-1.pub"), os.path.join(c.keys, "workers"))
            c.start_gateway()
            c.start_worker("prefill-0", "prefill")
            c.start_worker("decode-1", "decode", args)
            c.wait_healthy()
            status, body = c.complete(PROMPTS[0], max_tokens=8)
            self.assertEqual(status, 503, body)
            self.assertEqual(c.request("GET", "/health")[0], 200)
            deadline = time.time() + 5
            while time.time() < deadline:
                w = {x["id"]: x for x in c.request("GET", "/workers")[1]["workers"]}
                if w["prefill-0"].get("kv_send_failed"):
                    break
                time.sleep(0.1)
            self.assertEqual(w["prefill-0"]["kv_sent"], 0)
            self.assertGreaterEqual(w["prefill-0"]["kv_send_failed"], 1)
            self.assertNotIn("kv_sent", w["decode-1"])
        finally:
            c.stop()
        self.assertEqual(c.sanitizer_reports(), [])

    def test_curve_worker_cannot_join_plain_gateway(self):
        with Cluster(roles=("prefill", "decode")) as c:
            keys = tempfile.mkdtemp(dir=c.tmp)
            w = keygen(os.path.join(keys, "w"))
            g = keygen(os.path.join(keys, "g"))
            c.start_worker("decode-curve", "decode",
                           ["--curve-secret-key", w + ".key", "--curve-gateway-key", g + ".pub",
                            "--curve-authorized-keys", w + ".pub"])
            time.sleep(2.0)
            self.assertEqual(worker_ids(c), ["decode-1", "prefill-0"])
            self.assertNotIn("registered with the gateway", c.log("decode-curve"))
            self.assertIn("CURVE on: public key " + read_key(w + ".pub"), c.log("decode-curve"))


def sub_gets_snapshot(endpoint, keypair=None, server_pub=None, timeout=3.0):
    """Whether a SUB on the stats socket (CURVE with keypair = (public, secret) Z85 and the
    gateway's public key, else plain) receives a snapshot within timeout seconds."""
    ctx = zmq.Context()
    try:
        s = ctx.socket(zmq.SUB)
        s.setsockopt(zmq.LINGER, 0)
        if keypair:
            s.curve_publickey, s.curve_secretkey = (k.encode() for k in keypair)
            s.curve_serverkey = server_pub.encode()
        s.setsockopt(zmq.SUBSCRIBE, b"")
        s.connect(endpoint)
        deadline = time.time() + timeout
        while time.time() < deadline:
            if s.poll(100) and s.recv_multipart()[0] == b"snapshot":
                return True
        return False
    finally:
        ctx.destroy(linger=0)


class CurveStats(unittest.TestCase):
    """With CURVE the stats socket is encrypted with the gateway's key too (it was plain
    beside an encrypted ctl socket: anyone reaching it read the cluster's state), and admits
    --stats-authorized-keys, or the workers' list when that is not given."""

    def setUp(self):
        self.keys = tempfile.mkdtemp(prefix="tidepool-curve-stats-")
        for d in ("workers", "dash"):
            os.makedirs(os.path.join(self.keys, d))
        self.g = keygen(os.path.join(self.keys, "gateway"))
        self.w = keygen(os.path.join(self.keys, "workers", "w"))
        self.d = keygen(os.path.join(self.keys, "dash", "top"))
        self.procs = []

    def tearDown(self):
        for p in self.procs:
            if p.poll() is None:
                p.terminate()
                p.wait(10)
        shutil.rmtree(self.keys, ignore_errors=True)

    def pair(self, base):
        return read_key(base + ".pub"), read_key(base + ".key", "secret-key")

    def gateway(self, *extra, capture=False):
        port, ctl, stats = free_port(), free_port(), free_port()
        argv = [os.path.join(BIN, "gateway"), "--port", str(port), "--host", "127.0.0.1",
                "--ctl-bind", "tcp://127.0.0.1:%d" % ctl,
                "--stats-bind", "tcp://127.0.0.1:%d" % stats, "--stats-interval-ms", "100",
                "--model", MODEL, "--state-db", ""] + list(extra)
        p = subprocess.Popen(argv, stdout=subprocess.DEVNULL, text=True,
                             stderr=subprocess.PIPE if capture else subprocess.DEVNULL)
        self.procs.append(p)
        return p, "tcp://127.0.0.1:%d" % stats

    def curve_args(self):
        return ["--curve-secret-key", self.g + ".key",
                "--curve-authorized-keys", os.path.join(self.keys, "workers")]

    def test_plain_gateway_plain_stats(self):
        _, ep = self.gateway()
        self.assertTrue(sub_gets_snapshot(ep, timeout=15))

    def test_stats_admit_the_workers_list_by_default(self):
        _, ep = self.gateway(*self.curve_args())
        gpub = read_key(self.g + ".pub")
        self.assertTrue(sub_gets_snapshot(ep, self.pair(self.w), gpub, timeout=15))
        self.assertFalse(sub_gets_snapshot(ep))  # plain: no handshake, nothing
        self.assertFalse(sub_gets_snapshot(ep, self.pair(self.d), gpub))  # unlisted key
        other = keygen(os.path.join(self.keys, "other-gw"))  # a client expecting another key
        self.assertFalse(sub_gets_snapshot(ep, self.pair(self.w), read_key(other + ".pub")))

    def test_stats_authorized_keys_is_its_own_list(self):
        _, ep = self.gateway(*self.curve_args(), "--stats-authorized-keys",
                             os.path.join(self.keys, "dash"))
        gpub = read_key(self.g + ".pub")
        self.assertTrue(sub_gets_snapshot(ep, self.pair(self.d), gpub, timeout=15))
        self.assertFalse(sub_gets_snapshot(ep, self.pair(self.w), gpub))  # a worker's key

    def test_stats_keys_without_curve_refused_at_start(self):
        p, _ = self.gateway("--stats-authorized-keys", os.path.join(self.keys, "dash"),
                            capture=True)
        _, err = p.communicate(timeout=30)
        self.assertEqual(p.returncode, 2)
        self.assertIn("--stats-authorized-keys needs CURVE (--curve-secret-key and "
                      "--curve-authorized-keys)", err)
        p, _ = self.gateway(*self.curve_args(), "--stats-authorized-keys",
                            os.path.join(self.keys, "missing"), capture=True)
        _, err = p.communicate(timeout=30)
        self.assertEqual(p.returncode, 1)
        self.assertIn("CURVE (--stats-authorized-keys): cannot read authorized keys %s: No such "
                      "file or directory" % os.path.join(self.keys, "missing"), err)

    def test_top_with_keys(self):
        """tidepool-top's --curve-* flags: both or neither (2), and a bad key file named."""
        top = os.path.join(BIN, "tidepool-top")
        p = subprocess.run([top, "--curve-secret-key", self.d + ".key"], capture_output=True,
                           text=True, timeout=30)
        self.assertEqual((p.returncode, p.stderr.strip()),
                         (2, "tidepool-top: CURVE needs both --curve-secret-key and "
                             "--curve-gateway-key"))
        p = subprocess.run([top, "--curve-secret-key", self.d + ".pub", "--curve-gateway-key",
                            self.g + ".pub"], capture_output=True, text=True, timeout=30)
        self.assertEqual(p.returncode, 2)
        self.assertIn(self.d + ".pub", p.stderr)
        # against a CURVE gateway: with its listed key it shows the snapshots; without keys,
        # or with a key it does not list, it waits and after a few seconds says why (the
        # handshake monitor's finding, then the likely causes); against an endpoint where
        # nothing listens, only the likely causes
        from test_top import TMUX, Tmux
        if not TMUX:
            return
        _, ep = self.gateway(*self.curve_args(), "--stats-authorized-keys",
                             os.path.join(self.keys, "dash"))
        nobody = "tcp://127.0.0.1:%d" % free_port()
        for stats, keys, shown, why in (
                (ep, [], False, "the server uses CURVE and this process does not"),
                (ep, ["--curve-secret-key", self.w + ".key", "--curve-gateway-key",
                      self.g + ".pub"], False, "the server refused this process's CURVE key"),
                (nobody, [], False, None),
                (ep, ["--curve-secret-key", self.d + ".key",
                      "--curve-gateway-key", self.g + ".pub"], True, None)):
            t = Tmux([top, "--stats", stats] + keys)
            try:
                if shown:
                    text = t.wait(lambda x: "requests" in x and "waiting for" not in x,
                                  what="a snapshot")
                    self.assertIn("cluster", text)
                    self.assertNotIn("likely causes", text)
                    continue
                t.wait(lambda x: "waiting for snapshots on " + stats in x, timeout=60,
                       what="waiting")  # a sanitized build on a loaded host starts slowly
                text = t.wait(lambda x: "likely causes" in x and (
                    why is None or "handshake with" in x), what="the hint")
                self.assertIn("waiting for snapshots on " + stats, text)
                self.assertIn("- the wrong endpoint: --stats must be the gateway's "
                              "--stats-bind", text)
                if keys:
                    self.assertIn("this key is not among the gateway's "
                                  "--stats-authorized-keys", text)
                else:
                    self.assertIn("give --curve-secret-key", text)
                if why is None:
                    self.assertNotIn("handshake with", text)
                    continue
                line = next(x for x in text.splitlines() if "handshake with" in x)
                self.assertIn("- handshake with %s failed: " % stats, line)
                if not keys and why not in line:  # the other form of a plain client's
                    why = "the server closed the connection during the handshake"
                self.assertIn(why, line)
            finally:
                t.kill()
                for _ in range(50):  # the next session reuses the server's socket name
                    if not t.alive():
                        break
                    time.sleep(0.1)


class CurveKv(unittest.TestCase):
    """Workers driven by the scripted gateway of fake_gateway.py, CURVE on its ctl socket."""

    def setUp(self):
        self.tmp = tempfile.mkdtemp(prefix="tidepool-curve-")  # the workers' logs
        self.keys = tempfile.mkdtemp(prefix="tidepool-curve-keys-")
        os.makedirs(os.path.join(self.keys, "auth"))
        self.gw = keygen(os.path.join(self.keys, "gateway"))
        self.g = fg.Gateway(os.path.join(ROOT, os.environ.get("TIDEPOOL_BUILD", "build")),
                            MODEL, self.tmp, curve_secret=read_key(self.gw + ".key",
                                                                   "secret-key"))

    def tearDown(self):
        bad = self.g.stop() + self.g.check_logs()
        self.assertEqual(bad, [])

    def start(self, name, program, authorized, *args, base=None):
        """A worker with key pair base (default <keys>/<name>; made if missing), its kv
        socket admitting `authorized` (a directory or file). Returns its public key."""
        base = base or os.path.join(self.keys, name)
        if not os.path.exists(base + ".key"):
            keygen(base)
        self.g.start(name, program, "--curve-secret-key", base + ".key",
                     "--curve-gateway-key", self.gw + ".pub",
                     "--curve-authorized-keys", authorized, *args)
        return read_key(base + ".pub")

    def log(self, name):
        with open(self.g.logpath(name)) as f:
            return f.read()

    def test_kv_only_from_listed_senders(self):
        auth = os.path.join(self.keys, "auth")
        p0 = os.path.join(auth, "p0")  # p0 is listed by d0, p1 is not
        self.start("p0", "prefill_worker", auth, base=p0)
        p1 = self.start("p1", "prefill_worker", auth)
        dkey = self.start("d0", "decode_worker", auth, "--kv-bind", "tcp://127.0.0.1:*")
        self.g.wait_registered("p0", "p1", "d0")
        d = self.g.workers["d0"]
        self.assertEqual(d["kvpk"], dkey)  # REGISTER advertises the kv key
        self.assertNotIn("kvpk", self.g.workers["p0"])  # no kv socket: no key
        # listed: exactly the reference tokens
        rid = self.g.prefill("p0", fg.PROMPT, len(fg.CONTINUATION), dw="d0", dep=d["kvep"],
                             dpk=dkey)
        ids, reason, err = self.g.wait_done(rid)
        self.assertEqual((ids, reason, err), (fg.CONTINUATION, 2, None))
        # not listed: the handshake is refused, the transfer never starts, nothing decodes
        rid = self.g.prefill("p1", fg.PROMPT, 8, dw="d0", dep=d["kvep"], dpk=dkey)
        ids, reason, err = self.g.wait_done(rid, timeout=20)
        self.assertIsNone(reason)
        # retryable; timeout (no KV_RESULT within the lease) when the KV went into the pipe
        # of a connection being retried, unavailable (a send refused) when it found no pipe:
        # which one depends on where ZeroMQ's reconnect cycle is
        self.assertEqual(err["retry"], 1)
        self.assertIn(err["code"], (4, 9))
        self.assertTrue(err["msg"].startswith("KV transfer to " + d["kvep"] + " failed: "),
                        err["msg"])
        senders = {w for w, m in self.g.events if m.get("rid") == rid and m["t"] == fg.TOKENS}
        self.assertEqual(senders, {"p1"})  # its own first token only; d0 never had it
        dlog = self.log("d0")
        self.assertIn("refused a connection to tidepool-kv from 127.0.0.1: key not authorized, "
                      "client key " + p1, dlog)
        self.assertNotIn("client key " + read_key(p0 + ".pub"), dlog)
        fg.kv_free_back(self.g, "d0")
        hb = self.g.heartbeats["d0"]
        self.assertEqual(hb.get("kvx_rx", [0])[0], 1)  # one transfer received: p0's

    def test_kv_heals_when_the_receiver_admits_the_sender(self):
        """A sender refused by a decode worker's list gets through once that worker is
        restarted with the right list, without restarting the sender: the failed
        connection is closed and a new one opened at the next transfer."""
        auth, auth2 = os.path.join(self.keys, "auth"), os.path.join(self.keys, "auth2")
        os.makedirs(auth2)
        dbase = keygen(os.path.join(auth, "d0"))  # auth lists d0 only, auth2 p0 only
        self.start("p0", "prefill_worker", auth, base=os.path.join(auth2, "p0"))
        kv = "tcp://127.0.0.1:%d" % free_port()
        dkey = self.start("d0", "decode_worker", auth, "--kv-bind", kv, base=dbase)
        self.g.wait_registered("p0", "d0")
        for _ in range(2):  # refused, and the second try too
            rid = self.g.prefill("p0", fg.PROMPT, 8, dw="d0", dep=kv, dpk=dkey)
            ids, reason, err = self.g.wait_done(rid, timeout=20)
            self.assertIsNone(reason)
            self.assertEqual(err["retry"], 1)
            self.assertIn(err["code"], (4, 9))
        self.assertIn("refused a connection to tidepool-kv", self.log("d0"))
        # the decode worker again, on the same endpoint with the same key, now admitting p0
        p, log = self.g.procs.pop("d0")
        p.send_signal(signal.SIGTERM)
        self.assertEqual(p.wait(timeout=10), 0)
        log.close()
        del self.g.workers["d0"]
        self.start("d0", "decode_worker", auth2, "--kv-bind", kv, base=dbase)
        self.g.wait_registered("d0")
        rid = self.g.prefill("p0", fg.PROMPT, len(fg.CONTINUATION), dw="d0", dep=kv, dpk=dkey)
        ids, reason, err = self.g.wait_done(rid, timeout=20)
        self.assertEqual((ids, reason, err), (fg.CONTINUATION, 2, None))
        self.assertIn("kvx: decode endpoint %s: the last transfer there failed: opening a new "
                      "connection" % kv, self.log("p0"))

    def test_no_kv_to_a_decode_worker_without_key(self):
        auth = os.path.join(self.keys, "auth")
        self.start("p0", "prefill_worker", auth, base=os.path.join(auth, "p0"))
        dkey = self.start("d0", "decode_worker", auth, "--kv-bind", "tcp://127.0.0.1:*")
        self.g.wait_registered("p0", "d0")
        dep = self.g.workers["d0"]["kvep"]
        for _ in range(2):
            rid = self.g.prefill("p0", fg.PROMPT, 8, dw="d0", dep=dep)  # no "dpk"
            ids, reason, err = self.g.wait_done(rid)
            self.assertIsNone(reason)
            self.assertEqual((err["code"], err["retry"]), (9, 1))  # unavailable, retryable
            self.assertEqual(err["msg"], "cannot start a KV transfer to " + dep)
        self.assertEqual(self.log("p0").count("refusing to send KV to %s: this worker uses "
                                              "CURVE and that decode worker advertised no "
                                              "CURVE key" % dep), 2)
        # a malformed key never reaches the worker: its decoder refuses the PREFILL
        self.g.prefill("p0", fg.PROMPT, 8, dw="d0", dep=dep, dpk="x" * 40 + "!")
        rid = self.g.prefill("p0", fg.PROMPT, 8, dw="d0", dep=dep, dpk=dkey)
        ids, reason, err = self.g.wait_done(rid)
        self.assertEqual((ids, reason, err), (fg.CONTINUATION[:8], 2, None))
        self.assertIn("field 'dpk': not a CURVE key", self.log("p0"))


class CurveKeyFiles(unittest.TestCase):
    def run_prog(self, argv):
        p = subprocess.run(argv, capture_output=True, text=True, timeout=30, cwd=ROOT)
        return p.returncode, p.stdout + p.stderr

    def test_key_file_readable_by_others_is_refused(self):
        tmp = tempfile.mkdtemp(prefix="tidepool-curve-")
        k = keygen(os.path.join(tmp, "k"))
        os.chmod(k + ".key", 0o644)
        msg = "%s.key holds a secret key but its mode 0644 lets group or others read it: " \
              "chmod 600 %s.key" % (k, k)
        ctl = "tcp://127.0.0.1:%d" % free_port()
        rc, out = self.run_prog([os.path.join(BIN, "decode_worker"), "--gateway", ctl,
                                 "--model", MODEL, "--kv-bind", "tcp://127.0.0.1:*",
                                 "--curve-secret-key", k + ".key", "--curve-gateway-key",
                                 k + ".pub", "--curve-authorized-keys", k + ".pub"])
        self.assertEqual(rc, 2, out)
        self.assertIn("CURVE: " + msg, out)
        rc, out = self.run_prog([os.path.join(BIN, "gateway"), "--port", "0", "--ctl-bind", ctl,
                                 "--stats-bind", "tcp://127.0.0.1:*", "--model", MODEL,
                                 "--state-db", "", "--curve-secret-key", k + ".key",
                                 "--curve-authorized-keys", k + ".pub"])
        self.assertEqual(rc, 2, out)
        self.assertIn("CURVE: " + msg, out)
        # 0600 again: the same worker starts (and is stopped at once: no gateway)
        os.chmod(k + ".key", 0o600)
        rc, out = self.run_prog([os.path.join(BIN, "tidepool-keygen"), "--check", k + ".key"])
        self.assertEqual(rc, 0, out)
        # malformed, half the flags, and a .pub where the key pair belongs
        with open(os.path.join(tmp, "bad.key"), "w") as f:
            f.write("curve\n    public-key = \"short\"\n")
        os.chmod(os.path.join(tmp, "bad.key"), 0o600)
        for args, want in (
                (["--curve-secret-key", os.path.join(tmp, "bad.key"), "--curve-gateway-key",
                  k + ".pub", "--curve-authorized-keys", k + ".pub"],
                 "bad.key:2: malformed key file: a key is not 40 Z85 characters"),
                (["--curve-secret-key", k + ".key"], "CURVE needs all of"),
                (["--curve-secret-key", k + ".pub", "--curve-gateway-key", k + ".pub",
                  "--curve-authorized-keys", k + ".pub"], "holds no secret-key"),
                (["--curve-secret-key", k + ".key", "--curve-gateway-key", k + ".pub",
                  "--curve-authorized-keys", k + ".key"], "holds a secret key: authorized")):
            rc, out = self.run_prog([os.path.join(BIN, "prefill_worker"), "--gateway", ctl,
                                     "--model", MODEL] + args)
            self.assertEqual(rc, 2, out)
            self.assertIn(want, out)

    def test_keygen(self):
        tmp = tempfile.mkdtemp(prefix="tidepool-curve-")
        base = os.path.join(tmp, "w")
        rc, out = self.run_prog([os.path.join(BIN, "tidepool-keygen"), base])
        self.assertEqual(rc, 0, out)
        self.assertEqual(os.stat(base + ".key").st_mode & 0o777, 0o600)
        self.assertEqual(os.stat(base + ".pub").st_mode & 0o777, 0o644)
        pub, sec = read_key(base + ".key"), read_key(base + ".key", "secret-key")
        self.assertEqual(read_key(base + ".pub"), pub)
        self.assertEqual(zmq.curve_public(sec.encode()).decode(), pub)
        with open(base + ".pub") as f:
            self.assertNotIn("secret-key", f.read())
        before = open(base + ".key").read()
        rc, out = self.run_prog([os.path.join(BIN, "tidepool-keygen"), base])
        self.assertEqual(rc, 1)
        self.assertIn("File exists (--force replaces it)", out)
        self.assertEqual(open(base + ".key").read(), before)
        rc, out = self.run_prog([os.path.join(BIN, "tidepool-keygen"), "--force", base])
        self.assertEqual(rc, 0, out)
        self.assertNotEqual(read_key(base + ".key"), pub)

    def test_keygen_check_says_one_thing(self):
        """--check on a .key file reports the key file's problem only, not also why it is
        no authorized-keys list; a list file that is neither says both."""
        tmp = tempfile.mkdtemp(prefix="tidepool-curve-")
        k = keygen(os.path.join(tmp, "k"))
        keygen_bin = os.path.join(BIN, "tidepool-keygen")
        os.chmod(k + ".key", 0o644)
        rc, out = self.run_prog([keygen_bin, "--check", k + ".key"])
        self.assertEqual((rc, out), (1, "tidepool-keygen: %s.key holds a secret key but its mode "
                                        "0644 lets group or others read it: chmod 600 %s.key\n"
                                     % (k, k)))
        with open(os.path.join(tmp, "bad.key"), "w") as f:
            f.write("curve\n    public-key = \"short\"\n")
        rc, out = self.run_prog([keygen_bin, "--check", os.path.join(tmp, "bad.key")])
        self.assertEqual((rc, out), (1, "tidepool-keygen: %s/bad.key:2: malformed key file: a key "
                                        "is not 40 Z85 characters\n" % tmp))
        rc, out = self.run_prog([keygen_bin, "--check", os.path.join(tmp, "none")])
        self.assertEqual((rc, out), (1, "tidepool-keygen: cannot open %s/none: No such file or "
                                        "directory\n" % tmp))
        with open(os.path.join(tmp, "list"), "w") as f:
            f.write("junk\n")
        rc, out = self.run_prog([keygen_bin, "--check", os.path.join(tmp, "list")])
        self.assertEqual(rc, 1)
        self.assertEqual(out.count("\n"), 2)
        self.assertIn("(as an authorized-keys list: %s/list:1: malformed authorized keys" % tmp,
                      out)


class CurveLauncher(unittest.TestCase):
    def test_launcher_makes_and_wires_keys(self):
        tmp = tempfile.mkdtemp(prefix="tidepool-curve-")
        keys, logs = os.path.join(tmp, "keys"), os.path.join(tmp, "logs")
        port, stats_port = free_port(), free_port()
        env = dict(os.environ, TIDEPOOL_BIN=BIN)
        proc = subprocess.Popen(
            [os.path.join(ROOT, "deploy/local/start"), "--no-build", "--port", str(port),
             "--ctl-port", str(free_port()), "--kv-port", str(free_port()),
             "--stats-port", str(stats_port), "--model", MODEL, "--log-dir", logs,
             "--curve-keys", keys],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env, start_new_session=True)
        try:
            line = proc.stdout.readline().decode()
            self.assertIn("tidepool is ready: http://127.0.0.1:%d/v1" % port, line)
            # the stats socket admits the dashboard key it made, and not a plain subscriber
            sub = keys + "/dashboards/top"
            ep = "tcp://127.0.0.1:%d" % stats_port
            self.assertTrue(sub_gets_snapshot(ep, (read_key(sub + ".pub"),
                                                   read_key(sub + ".key", "secret-key")),
                                              read_key(keys + "/gateway.pub"), timeout=15))
            self.assertFalse(sub_gets_snapshot(ep, timeout=2))
            c = Cluster()
            c.port = port
            status, body = c.complete("Once upon a time", max_tokens=40)
            self.assertEqual(status, 200, body)
            with Cluster() as plain:  # the same answer as a cluster without keys
                self.assertEqual(body, dict(body, choices=plain.complete(
                    "Once upon a time", max_tokens=40)[1]["choices"]))
        finally:
            proc.send_signal(15)
            rc = proc.wait(timeout=60)
            proc.stdout.close()
        self.assertEqual(rc, 0)
        for name in ("gateway", "workers/prefill-0", "workers/decode-0", "dashboards/top"):
            self.assertEqual(os.stat(os.path.join(keys, name + ".key")).st_mode & 0o777, 0o600)
        self.assertEqual(os.stat(keys).st_mode & 0o777, 0o700)
        with open(os.path.join(logs, "gateway.log")) as f:
            gw = f.read()
        self.assertIn("CURVE on the ctl socket: public key %s, 2 worker keys admitted"
                      % read_key(os.path.join(keys, "gateway.pub")), gw)
        for w in ("prefill-0", "decode-0"):
            with open(os.path.join(logs, w + ".log")) as f:
                self.assertIn("CURVE on: public key " +
                              read_key(os.path.join(keys, "workers", w + ".pub")), f.read())


if __name__ == "__main__":
    unittest.main()
