#!/usr/bin/python3
"""A fake gateway for testing the worker programs alone: binds a ctl ROUTER, starts real
prefill/decode/mixed workers, and drives them with PREFILL/CANCEL orders as the gateway
would (docs/protocol.md). Standard library plus python3-zmq (msgpack is done by hand).

    tests/integration/fake_gateway.py [--build build] [--model PATH] [case ...]

Cases: greedy_disagg, greedy_mixed, batch_disagg, max_tokens_1, cancel_running,
cancel_queued, bad_prompt, decode_unreachable, drain, second_signal, reregister,
health_file, migrate, migrate_before_kv, migrate_refused, migrate_unreachable, role_hands_back_queued.
Exit
status 0 when every case passes. Each worker logs to a file in a temporary directory; the logs are scanned for
sanitizer reports."""

import argparse
import os
import signal
import struct
import subprocess
import sys
import tempfile
import time

import zmq

# --- minimal msgpack (the subset protocol.c emits and accepts)


def mp_pack(o):
    if o is None:
        return b"\xc0"
    if o is True:
        return b"\xc3"
    if o is False:
        return b"\xc2"
    if isinstance(o, int):
        if 0 <= o < 0x80:
            return bytes([o])
        if -32 <= o < 0:
            return struct.pack("b", o)
        if o >= 0:
            return b"\xcf" + struct.pack(">Q", o)
        return b"\xd3" + struct.pack(">q", o)
    if isinstance(o, float):
        return b"\xcb" + struct.pack(">d", o)
    if isinstance(o, str):
        b = o.encode()
        if len(b) < 32:
            return bytes([0xA0 | len(b)]) + b
        return b"\xda" + struct.pack(">H", len(b)) + b
    if isinstance(o, (list, tuple)):
        out = b"\xdd" + struct.pack(">I", len(o))
        return out + b"".join(mp_pack(x) for x in o)
    if isinstance(o, dict):
        out = b"\xdf" + struct.pack(">I", len(o))
        return out + b"".join(mp_pack(k) + mp_pack(v) for k, v in o.items())
    raise TypeError(type(o))


def mp_unpack(b):
    def rd(i):
        c = b[i]
        if c < 0x80:
            return c, i + 1
        if c >= 0xE0:
            return c - 256, i + 1
        if 0xA0 <= c <= 0xBF:
            n = c & 31
            return b[i + 1:i + 1 + n].decode(), i + 1 + n
        if 0x90 <= c <= 0x9F:
            return arr(c & 15, i + 1)
        if 0x80 <= c <= 0x8F:
            return mp(c & 15, i + 1)
        fixed = {0xCC: ">B", 0xCD: ">H", 0xCE: ">I", 0xCF: ">Q", 0xD0: ">b", 0xD1: ">h",
                 0xD2: ">i", 0xD3: ">q", 0xCA: ">f", 0xCB: ">d"}
        if c in fixed:
            f = fixed[c]
            n = struct.calcsize(f)
            return struct.unpack(f, b[i + 1:i + 1 + n])[0], i + 1 + n
        if c in (0xD9, 0xDA, 0xDB):
            ln = {0xD9: ">B", 0xDA: ">H", 0xDB: ">I"}[c]
            k = struct.calcsize(ln)
            n = struct.unpack(ln, b[i + 1:i + 1 + k])[0]
            return b[i + 1 + k:i + 1 + k + n].decode(), i + 1 + k + n
        if c in (0xDC, 0xDD):
            ln = ">H" if c == 0xDC else ">I"
            k = struct.calcsize(ln)
            return arr(struct.unpack(ln, b[i + 1:i + 1 + k])[0], i + 1 + k)
        if c in (0xDE, 0xDF):
            ln = ">H" if c == 0xDE else ">I"
            k = struct.calcsize(ln)
            return mp(struct.unpack(ln, b[i + 1:i + 1 + k])[0], i + 1 + k)
        if c == 0xC0:
            return None, i + 1
        if c in (0xC2, 0xC3):
            return c == 0xC3, i + 1
        raise ValueError("msgpack byte 0x%02x" % c)

    def arr(n, i):
        out = []
        for _ in range(n):
            v, i = rd(i)
            out.append(v)
        return out, i

    def mp(n, i):
        out = {}
        for _ in range(n):
            k, i = rd(i)
            v, i = rd(i)
            out[k] = v
        return out, i

    v, i = rd(0)
    if i != len(b):
        raise ValueError("trailing bytes")
    return v


# --- protocol constants (common/protocol.h)

REGISTER, REGISTER_ACK, HEARTBEAT, PREFILL, CANCEL, TOKENS, FINISH, ERROR, BYE = range(1, 10)
ROLE, MIGRATE, BUNDLE = 10, 11, 12
NAMES = {1: "REGISTER", 2: "REGISTER_ACK", 3: "HEARTBEAT", 4: "PREFILL", 5: "CANCEL",
         6: "TOKENS", 7: "FINISH", 8: "ERROR", 9: "BYE"}

# Greedy "Once upon a time" with stories260K (shared/models/stories260K/SOURCE.md): the
# prompt is BOS + 4 tokens, then run.c's continuation.
PROMPT = [1, 403, 407, 261, 378]
REF_IDS = [int(x) for x in (
    "403 407 261 378 432 383 286 261 376 298 315 421 395 317 426 338 401 396 267 337 410 408 "
    "419 292 411 322 265 282 295 433 426 385 328 432 358 394 261 370 432 352 266 268 388 426 "
    "338 391 266 267 337 335 312 432 398 312 286 267 414 270 333 415").split()]
CONTINUATION = REF_IDS[4:]


class Gateway:
    def __init__(self, build, model, logdir, curve_secret=None):
        """curve_secret: a Z85 secret key: the ctl ROUTER is then a CURVE server (this
        context has no ZAP handler: every client key is admitted)."""
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        if curve_secret:
            self.sock.curve_secretkey = curve_secret.encode()
            self.sock.curve_server = True
        self.sock.bind("tcp://127.0.0.1:*")
        self.endpoint = self.sock.getsockopt(zmq.LAST_ENDPOINT).decode()
        self.build, self.model, self.logdir = build, model, logdir
        self.procs = {}
        self.workers = {}   # wid -> REGISTER fields
        self.heartbeats = {}
        self.events = []    # (wid, msg) of TOKENS/FINISH/ERROR/BYE
        self.n_bundled = 0  # TOKENS / FINISH that came in a BUNDLE
        self.next_rid = 100
        self.ack = True

    def start(self, name, program, *args):
        log = open(os.path.join(self.logdir, name + ".log"), "w")
        cmd = [os.path.join(self.build, "bin", program), "--gateway", self.endpoint,
               "--model", self.model, "--worker-id", name, "--heartbeat-ms", "100",
               "--lease-ms", "1000"] + list(args)
        self.procs[name] = (subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT), log)

    def logpath(self, name):
        return os.path.join(self.logdir, name + ".log")

    def send(self, wid, msg):
        msg = dict(msg)
        msg.setdefault("v", 1)
        self.sock.send_multipart([wid.encode(), mp_pack(msg)])

    def pump(self, timeout=0.05):
        if not self.sock.poll(int(timeout * 1000)):
            return
        while True:
            try:
                frames = self.sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            wid = frames[0].decode()
            m = mp_unpack(frames[1])
            t = m["t"]
            if t == REGISTER:
                self.workers[wid] = m
                if self.ack:
                    self.send(wid, {"t": REGISTER_ACK, "hb_ms": 100})
            elif t == HEARTBEAT:
                self.heartbeats[wid] = m
                if wid not in self.workers:
                    self.send(wid, {"t": BYE, "wid": wid})
            elif t == BUNDLE:  # a loop iteration's TOKENS / FINISH, one per frame, in order
                if len(frames) < 4:
                    raise AssertionError("BUNDLE from %s with %d message(s): one goes alone"
                                         % (wid, len(frames) - 2))
                for f in frames[2:]:
                    b = mp_unpack(f)
                    if b["t"] not in (TOKENS, FINISH):
                        raise AssertionError("%s in a BUNDLE from %s" % (b["t"], wid))
                    self.events.append((wid, b))
                    self.n_bundled += 1
            else:
                self.events.append((wid, m))

    def wait(self, cond, timeout=10.0, what="condition"):
        deadline = time.time() + timeout
        while time.time() < deadline:
            self.pump()
            if cond():
                return
        raise AssertionError("timed out waiting for " + what)

    def wait_registered(self, *names, timeout=30.0):
        """Until every named worker registered (a sanitized worker on a loaded machine spends
        seconds loading and calibrating MTP before it connects)."""
        self.wait(lambda: all(n in self.workers for n in names), timeout,
                  what="REGISTER of %s" % (names,))

    def prefill(self, wid, tokens, max_tokens, dw="", dep="", temp=0.0, rng=0, dpk=None,
                pri=0, age_us=0):
        rid = self.next_rid
        self.next_rid += 1
        m = {"t": PREFILL, "rid": rid, "tokens": tokens, "max_tokens": max_tokens,
             "temp": temp, "top_p": 1.0, "top_k": 0, "rng": rng, "dw": dw, "dep": dep}
        if pri:
            m["pri"] = pri  # the offline tier
        if age_us:
            m["age_us"] = age_us  # admitted that long ago (a retry)
        if dpk is not None:
            m["dpk"] = dpk  # the decode worker's CURVE key
        self.send(wid, m)
        return rid

    def outcome(self, rid):
        """(tokens assembled by index, finish reason or None, error or None)."""
        toks, reason, err = {}, None, None
        for _, m in self.events:
            if m.get("rid") != rid:
                continue
            if m["t"] == TOKENS:
                for k, t in enumerate(m["tokens"]):
                    if m["index"] + k in toks and toks[m["index"] + k] != t:
                        raise AssertionError("rid %d: index %d repeated with %d != %d" %
                                             (rid, m["index"] + k, t, toks[m["index"] + k]))
                    toks[m["index"] + k] = t
            elif m["t"] == FINISH:
                reason = m["reason"]
            elif m["t"] == ERROR:
                err = m
        ids = [toks[i] for i in range(len(toks))] if set(toks) == set(range(len(toks))) else None
        return ids, reason, err

    def wait_done(self, rid, timeout=20.0):
        self.wait(lambda: self.outcome(rid)[1] is not None or self.outcome(rid)[2] is not None,
                  timeout, "end of request %d" % rid)
        return self.outcome(rid)

    def stop(self):
        """SIGTERM every worker still running (they drain and exit 0; sanitizer leak reports
        land in the logs); returns the names of those that did not exit cleanly."""
        bad = []
        for name, (p, log) in self.procs.items():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for name, (p, log) in self.procs.items():
            try:
                rc = p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                rc = p.wait()
            if rc != 0:
                bad.append("%s exited with %d" % (name, rc))
            log.close()
        self.procs = {}
        self.sock.close()
        self.ctx.term()
        return bad

    def check_logs(self):
        bad = []
        for f in os.listdir(self.logdir):
            text = open(os.path.join(self.logdir, f)).read()
            for marker in ("ERROR: AddressSanitizer", "runtime error:", "LeakSanitizer",
                           "assertion failed"):
                if marker in text:
                    bad.append("%s: %s" % (f, marker))
        return bad


def eq(a, b, what):
    if a != b:
        raise AssertionError("%s: got %r, want %r" % (what, a, b))


def kv_free_back(g, wid):
    """Wait until wid's heartbeat shows every KV block free."""
    g.wait(lambda: wid in g.heartbeats and
           g.heartbeats[wid]["kv_free"] == g.heartbeats[wid]["kv_total"] and
           g.heartbeats[wid]["running"] == 0,
           what="KV of %s back to free" % wid)


def disagg(g):
    g.start("p0", "prefill_worker")
    g.start("d0", "decode_worker", "--kv-bind", "tcp://127.0.0.1:*")
    g.wait_registered("p0", "d0")
    return g.workers["d0"]["kvep"]


def case_greedy_disagg(g):
    dep = disagg(g)
    rid = g.prefill("p0", PROMPT, len(CONTINUATION), dw="d0", dep=dep)
    ids, reason, err = g.wait_done(rid)
    eq(err, None, "error")
    eq(ids, CONTINUATION, "greedy tokens")
    eq(reason, 2, "finish reason")
    senders = {w for w, m in g.events if m.get("rid") == rid and m["t"] == TOKENS}
    eq(senders, {"p0", "d0"}, "TOKENS senders")
    kv_free_back(g, "d0")
    kv_free_back(g, "p0")


def case_greedy_mixed(g):
    g.start("m0", "prefill_worker", "--role", "mixed", "--kv-bind", "tcp://127.0.0.1:*")
    g.wait_registered("m0")
    eq(g.workers["m0"]["role"], 3, "role")
    rid = g.prefill("m0", PROMPT, len(CONTINUATION))
    ids, reason, err = g.wait_done(rid)
    eq(err, None, "error")
    eq(ids, CONTINUATION, "greedy tokens")
    eq(reason, 2, "finish reason")
    kv_free_back(g, "m0")


def first_token_order(g, rids):
    """Wait for the 2-token greedy answers of rids; their ids in the order of their first
    TOKENS (the order the worker's prefill batches took them)."""
    for rid in rids:
        ids, reason, err = g.wait_done(rid, timeout=60)
        eq(err, None, "error of %d" % rid)
        eq(ids, CONTINUATION[:2], "greedy tokens of %d" % rid)

    def first(rid):
        return next(i for i, (_, m) in enumerate(g.events)
                    if m.get("rid") == rid and m["t"] == TOKENS)
    return sorted(rids, key=first)


def case_online_prompt_before_queued_offline(g):
    """Queued offline prompts (pri 1) wait for an online prompt that came after them; each
    tier stays in arrival order. One prompt per prefill batch (--max-batch-tokens), each
    batch padded to an emulated accelerator's time (about 0.1 s), so all nine PREFILLs are
    queued before the second batch."""
    g.start("m0", "prefill_worker", "--role", "mixed", "--kv-bind", "tcp://127.0.0.1:*",
            "--max-batch-tokens", str(len(PROMPT)), "--emulate", "a100-llama3-8b:dilate=20")
    g.wait_registered("m0")
    offline = [g.prefill("m0", PROMPT, 2, pri=1) for _ in range(8)]
    online = g.prefill("m0", PROMPT, 2)
    order = first_token_order(g, offline + [online])
    # the first offline prompt may already be in the first batch; the online one is next
    if order.index(online) > 1:
        raise AssertionError("online prompt's first token came %d-th of 9 (order %r)"
                             % (order.index(online) + 1, order))
    offline_order = [r for r in order if r != online]
    eq(offline_order, offline, "offline prompts in arrival order")
    kv_free_back(g, "m0")


def case_retried_prompt_keeps_its_arrival_order(g):
    """A PREFILL with an age (a prompt the gateway re-sends after a worker failed or handed
    it back in a role change) queues by its admission, ahead of prompts admitted after it:
    it used to go to the end of the queue, and under load missed its TTFT (docs/tidal.md,
    session 11). As the case above: one prompt per emulated batch, all queued at once."""
    g.start("m0", "prefill_worker", "--role", "mixed", "--kv-bind", "tcp://127.0.0.1:*",
            "--max-batch-tokens", str(len(PROMPT)), "--emulate", "a100-llama3-8b:dilate=20")
    g.wait_registered("m0")
    fresh = [g.prefill("m0", PROMPT, 2) for _ in range(8)]
    older = g.prefill("m0", PROMPT, 2, age_us=10000000)  # admitted 10 s ago
    order = first_token_order(g, fresh + [older])
    # the first fresh prompt may already be in the first batch; the older one is next
    if order.index(older) > 1:
        raise AssertionError("the older prompt's first token came %d-th of 9 (order %r)"
                             % (order.index(older) + 1, order))
    eq([r for r in order if r != older], fresh, "the fresh prompts in arrival order")
    kv_free_back(g, "m0")


def case_batch_disagg(g):
    """Many concurrent requests of different lengths: each is exactly the reference."""
    dep = disagg(g)
    rids = []
    for k in range(12):
        n = 3 + (k * 7) % 40
        rids.append((g.prefill("p0", PROMPT, n, dw="d0", dep=dep), n))
    for rid, n in rids:
        ids, reason, err = g.wait_done(rid)
        eq(err, None, "error rid %d" % rid)
        eq(ids, CONTINUATION[:n], "tokens rid %d" % rid)
        eq(reason, 2, "reason rid %d" % rid)
    # sequences decoded in one step report in one BUNDLE (one message per step)
    if g.n_bundled == 0:
        raise AssertionError("12 sequences decoded together, yet no TOKENS came in a BUNDLE")
    kv_free_back(g, "d0")
    kv_free_back(g, "p0")


def case_max_tokens_1(g):
    dep = disagg(g)
    rid = g.prefill("p0", PROMPT, 1, dw="d0", dep=dep)
    ids, reason, err = g.wait_done(rid)
    eq((ids, reason, err), ([CONTINUATION[0]], 2, None), "max_tokens 1")
    senders = {w for w, m in g.events if m.get("rid") == rid}
    eq(senders, {"p0"}, "only the prefill worker answers")
    kv_free_back(g, "p0")


def case_cancel_running(g):
    dep = disagg(g)
    rid = g.prefill("p0", PROMPT, 400, dw="d0", dep=dep)
    g.wait(lambda: any(m.get("rid") == rid and w == "d0" for w, m in g.events),
           what="decode started")
    g.send("d0", {"t": CANCEL, "rid": rid})
    g.send("d0", {"t": CANCEL, "rid": rid})        # idempotent
    g.send("d0", {"t": CANCEL, "rid": 999999})     # unknown
    kv_free_back(g, "d0")
    kv_free_back(g, "p0")
    n = len([m for w, m in g.events if m.get("rid") == rid])
    time.sleep(0.3)
    g.pump()
    eq(len([m for w, m in g.events if m.get("rid") == rid]), n, "no messages after CANCEL")
    eq(g.outcome(rid)[1], None, "no FINISH after CANCEL")


def case_cancel_before_kv(g):
    """A CANCEL that reaches the decode worker before the request's KV does (the prefill
    worker is frozen meanwhile): the KV is freed on arrival, nothing is decoded or sent."""
    dep = disagg(g)
    p0 = g.procs["p0"][0]
    p0.send_signal(signal.SIGSTOP)
    try:
        rid = g.prefill("p0", PROMPT, 200, dw="d0", dep=dep)
        time.sleep(0.1)
        g.send("d0", {"t": CANCEL, "rid": rid})   # d0 has never heard of rid yet
        time.sleep(0.1)
    finally:
        p0.send_signal(signal.SIGCONT)
    # p0 prefills and hands the KV over; d0 must drop it
    g.wait(lambda: any(m.get("rid") == rid and w == "p0" for w, m in g.events),
           what="prefill of the cancelled request")
    time.sleep(0.5)
    g.pump()
    eq([m for w, m in g.events if m.get("rid") == rid and w == "d0"], [],
       "the decode worker sent nothing for a cancelled request")
    kv_free_back(g, "d0")
    kv_free_back(g, "p0")


def case_cancel_queued(g):
    g.start("m0", "prefill_worker", "--role", "mixed", "--kv-bind", "tcp://127.0.0.1:*",
            "--max-seqs", "1")
    g.wait_registered("m0")
    r1 = g.prefill("m0", PROMPT, 300)
    r2 = g.prefill("m0", PROMPT, 5)
    g.send("m0", {"t": CANCEL, "rid": r2})
    ids, reason, err = g.wait_done(r1)
    eq(ids[:len(CONTINUATION)], CONTINUATION, "first request")
    time.sleep(0.3)
    g.pump()
    eq(g.outcome(r2), ([], None, None), "cancelled request: no message at all")
    kv_free_back(g, "m0")


def case_bad_prompt(g):
    g.start("m0", "prefill_worker", "--role", "mixed", "--kv-bind", "tcp://127.0.0.1:*")
    g.wait_registered("m0")
    rid = g.prefill("m0", [1] * 600, 5)
    _, _, err = g.wait_done(rid)
    eq((err["code"], err.get("retry", 0)), (8, 0), "too long prompt")
    rid = g.prefill("m0", [1, 9999], 5)
    _, _, err = g.wait_done(rid)
    eq((err["code"], err.get("retry", 0)), (8, 0), "token out of vocabulary")
    # garbage on the ctl socket is dropped, the worker keeps serving
    g.sock.send_multipart([b"m0", b"\xc1garbage"])
    g.send("m0", {"t": PREFILL})  # missing fields
    rid = g.prefill("m0", PROMPT, 3)
    ids, reason, err = g.wait_done(rid)
    eq(ids, CONTINUATION[:3], "after garbage")


def case_decode_unreachable(g):
    g.start("p0", "prefill_worker")
    g.wait_registered("p0")
    rid = g.prefill("p0", PROMPT, 10, dw="nobody", dep="tcp://127.0.0.1:1")
    ids, reason, err = g.wait_done(rid, timeout=10)
    eq(ids, [CONTINUATION[0]], "first token still reported")
    eq((err["code"], err["retry"]), (4, 1), "timeout error, retryable")
    kv_free_back(g, "p0")


def case_local_prefill_refused(g):
    """A PREFILL without a decode endpoint to a worker that does not decode (no decode role
    attached) is refused, retryable, and the worker keeps serving."""
    dep = disagg(g)
    rid = g.prefill("p0", PROMPT, 5)
    ids, reason, err = g.wait_done(rid)
    eq(ids, [], "no tokens")
    eq((err["code"], err["retry"]), (9, 1), "unavailable, retryable")
    rid = g.prefill("p0", PROMPT, len(CONTINUATION), dw="d0", dep=dep)
    ids, reason, err = g.wait_done(rid)
    eq(ids, CONTINUATION, "next request decodes as before")
    kv_free_back(g, "p0")


def case_drain(g):
    dep = disagg(g)
    rid = g.prefill("p0", PROMPT, 50, dw="d0", dep=dep)
    g.wait(lambda: any(m.get("rid") == rid and w == "d0" for w, m in g.events),
           what="decode started")
    g.procs["d0"][0].send_signal(signal.SIGTERM)
    g.procs["p0"][0].send_signal(signal.SIGTERM)
    g.wait(lambda: any(w == "d0" and m["t"] == BYE for w, m in g.events), what="BYE from d0")
    ids, reason, err = g.outcome(rid)
    eq((ids, reason), (CONTINUATION[:50], 2), "request finished while draining")
    eq(g.heartbeats["d0"]["state"], 2, "DRAINING in heartbeats")
    for name in ("d0", "p0"):
        eq(g.procs[name][0].wait(timeout=10), 0, "exit status of " + name)


def case_second_signal(g):
    """A second SIGTERM while draining exits at once (status 1) instead of waiting."""
    g.start("p0", "prefill_worker", "--lease-ms", "5000")
    g.wait_registered("p0")
    rid = g.prefill("p0", PROMPT, 10, dw="nobody", dep="tcp://127.0.0.1:1")
    g.wait(lambda: g.outcome(rid)[0], what="first token")
    p = g.procs["p0"][0]
    p.send_signal(signal.SIGTERM)
    g.wait(lambda: g.heartbeats.get("p0", {}).get("state") == 2, what="DRAINING heartbeat")
    eq(p.poll(), None, "still draining (transfer pending)")
    p.send_signal(signal.SIGTERM)
    eq(p.wait(timeout=5), 1, "exit status after a second signal")
    g.procs.pop("p0")[1].close()  # its non-zero status is the point here


def read_health(path):
    """The worker's --health-file as a dict (None while it does not exist)."""
    try:
        with open(path) as f:
            return dict(line.rstrip("\n").split("=", 1) for line in f if "=" in line)
    except FileNotFoundError:
        return None


def case_health_file(g):
    """--health-file: registered=0 until REGISTER_ACK, 1 after, 0 after a BYE and while the
    gateway is gone; time_ms keeps moving; state draining on SIGTERM; removed at exit."""
    path = os.path.join(g.logdir, "d0.health")
    g.ack = False
    g.start("d0", "decode_worker", "--kv-bind", "tcp://127.0.0.1:*", "--health-file", path)
    g.wait(lambda: "d0" in g.workers and (read_health(path) or {}).get("registered") == "0",
           what="health file before REGISTER_ACK")
    h = read_health(path)
    eq((h["worker_id"], h["role"], h["state"]), ("d0", "decode", "ready"), "health fields")
    g.ack = True
    g.wait(lambda: (read_health(path) or {}).get("registered") == "1", what="registered=1")
    t0 = int(read_health(path)["time_ms"])
    if abs(t0 / 1000.0 - time.time()) > 5:
        raise AssertionError("time_ms %d is not the wall clock" % t0)
    g.wait(lambda: int(read_health(path)["time_ms"]) > t0, what="time_ms to advance")
    g.ack = False
    del g.workers["d0"]  # the gateway forgets d0: its next HEARTBEAT gets BYE
    g.wait(lambda: read_health(path)["registered"] == "0", what="registered=0 after BYE")
    g.ack = True
    g.wait(lambda: read_health(path)["registered"] == "1", what="registered=1 again")
    g.sock.close()  # the gateway goes away: heartbeats cannot go out
    deadline = time.time() + 10
    while read_health(path)["registered"] != "0":
        if time.time() > deadline:
            raise AssertionError("registered still 1 with the gateway gone")
        time.sleep(0.05)
    p = g.procs["d0"][0]
    p.send_signal(signal.SIGTERM)
    eq(p.wait(timeout=10), 0, "exit status")
    eq(read_health(path), None, "health file after exit")


def case_reregister(g):
    dep = disagg(g)
    del g.workers["d0"]  # the gateway "forgets" d0: its next HEARTBEAT gets BYE
    g.wait_registered("d0")
    rid = g.prefill("p0", PROMPT, 5, dw="d0", dep=dep)
    ids, _, err = g.wait_done(rid)
    eq(ids, CONTINUATION[:5], "after re-registering")


def migration_cluster(g):
    """p0 and two decode workers slowed to 20 ms a step, so a sequence is still running when
    it is told to move. Returns (d0's kv endpoint, d1's)."""
    g.start("p0", "prefill_worker")
    for d in ("d0", "d1"):
        g.start(d, "decode_worker", "--kv-bind", "tcp://127.0.0.1:*", "--debug-step-delay-ms",
                "20", "--mtp-adaptive", "false")
    g.wait_registered("p0", "d0", "d1")
    return g.workers["d0"]["kvep"], g.workers["d1"]["kvep"]


def tokens_from(g, rid, wid):
    return [m for w, m in g.events if m.get("rid") == rid and w == wid and m["t"] == TOKENS]


def mig(g, wid):
    """(out, out_failed, out_us, in) from wid's last heartbeat."""
    return tuple((g.heartbeats.get(wid, {}).get("mig") or [0, 0, 0, 0])[:4])


def case_migrate(g):
    """MIGRATE mid-decode: d0 sends the sequence's KV to d1, which goes on at the next index;
    the assembled tokens are exactly the undisturbed greedy ones, no index is repeated with
    another token, and both caches are free afterwards."""
    dep0, dep1 = migration_cluster(g)
    rid = g.prefill("p0", PROMPT, len(CONTINUATION), dw="d0", dep=dep0)
    g.wait(lambda: any(m["index"] + len(m["tokens"]) >= 10 for m in tokens_from(g, rid, "d0")),
           what="10 tokens decoded on d0")
    g.send("d0", {"t": MIGRATE, "rid": rid, "dw": "d1", "dep": dep1})
    ids, reason, err = g.wait_done(rid)
    eq(err, None, "error")
    eq(ids, CONTINUATION, "greedy tokens across the move")
    eq(reason, 2, "finish reason")
    moved = tokens_from(g, rid, "d1")
    if not moved or moved[0]["index"] < 10:
        raise AssertionError("d1 must continue after index 10, got %r" % moved[:1])
    g.wait(lambda: mig(g, "d0")[0] == 1 and mig(g, "d1")[3] == 1, what="migration counters")
    eq(mig(g, "d0")[1], 0, "failed moves")
    # the MTP modules' state moved too: d1 drafted for the one sequence it ever had
    if "migrating to %s: " % dep1 not in open(g.logpath("d0")).read() or \
            "with the MTP state" not in open(g.logpath("d0")).read():
        raise AssertionError("d0 must send the MTP state with the sequence")
    g.wait(lambda: (g.heartbeats["d1"].get("spec") or [0])[0] > 0, what="drafts on d1")
    for w in ("d0", "d1", "p0"):
        kv_free_back(g, w)


def case_migrate_before_kv(g):
    """A MIGRATE that reaches d0 before the request's KV does (p0 frozen meanwhile) is kept
    and carried out when the KV lands: d1 decodes the whole request, exactly."""
    dep0, dep1 = migration_cluster(g)
    p0 = g.procs["p0"][0]
    p0.send_signal(signal.SIGSTOP)
    try:
        rid = g.prefill("p0", PROMPT, len(CONTINUATION), dw="d0", dep=dep0)
        time.sleep(0.1)
        g.send("d0", {"t": MIGRATE, "rid": rid, "dw": "d1", "dep": dep1})
        time.sleep(0.1)
    finally:
        p0.send_signal(signal.SIGCONT)
    ids, reason, err = g.wait_done(rid)
    eq((ids, reason, err), (CONTINUATION, 2, None), "outcome")
    eq(tokens_from(g, rid, "d0"), [], "d0 decoded nothing")
    for w in ("d0", "d1"):
        kv_free_back(g, w)


def case_migrate_refused(g):
    """MIGRATE orders a worker cannot carry out are logged and ignored: to a prefill worker,
    to the worker itself, with an empty endpoint, for an unknown request; the request
    finishes where it is."""
    dep0, dep1 = migration_cluster(g)
    rid = g.prefill("p0", PROMPT, 30, dw="d0", dep=dep0)
    g.wait(lambda: tokens_from(g, rid, "d0"), what="decode started on d0")
    g.send("p0", {"t": MIGRATE, "rid": rid, "dw": "d1", "dep": dep1})
    g.send("d0", {"t": MIGRATE, "rid": rid, "dw": "d0", "dep": dep0})
    g.send("d0", {"t": MIGRATE, "rid": rid, "dw": "d1", "dep": ""})
    g.send("d0", {"t": MIGRATE, "rid": 424242, "dw": "d1", "dep": dep1})
    g.send("d0", {"t": MIGRATE, "rid": rid, "dw": "d1"})  # no endpoint: malformed, dropped
    ids, reason, err = g.wait_done(rid)
    eq((ids, reason, err), (CONTINUATION[:30], 2, None), "outcome")
    eq(tokens_from(g, rid, "d1"), [], "nothing moved to d1")
    time.sleep(0.3)
    g.pump()
    eq(mig(g, "d0"), (0, 0, 0, 0), "no migration counted")
    kv_free_back(g, "d0")


def case_migrate_unreachable(g):
    """A move to an endpoint nobody listens on fails after the lease (1 s): d0 reports a
    retryable ERROR (the gateway re-runs the request from its tokens) and frees the KV."""
    dep0, _ = migration_cluster(g)
    rid = g.prefill("p0", PROMPT, len(CONTINUATION), dw="d0", dep=dep0)
    g.wait(lambda: tokens_from(g, rid, "d0"), what="decode started on d0")
    g.send("d0", {"t": MIGRATE, "rid": rid, "dw": "nobody", "dep": "tcp://127.0.0.1:1"})
    ids, reason, err = g.wait_done(rid, timeout=10)
    eq(reason, None, "no FINISH")
    eq((err["code"], err["retry"]), (4, 1), "timeout error, retryable")
    if "migration" not in err.get("msg", ""):
        raise AssertionError("the error must name the migration: %r" % err)
    g.wait(lambda: mig(g, "d0")[1] == 1, what="failed move counted")
    kv_free_back(g, "d0")


def case_role_hands_back_queued(g):
    """ROLE prefill -> decode while prompts wait at a prefill worker: the one being computed
    (in 7-token chunks) finishes and hands its KV over; those not started come back at once
    as retryable UNAVAILABLE errors; then the worker registers again as decode."""
    g.start("p0", "prefill_worker", "--prefill-chunk-tokens", "7", "--max-batch-tokens", "7",
            "--debug-step-delay-ms", "30")
    g.start("d0", "decode_worker", "--kv-bind", "tcp://127.0.0.1:*")
    g.wait_registered("p0", "d0")
    dep = g.workers["d0"]["kvep"]
    long_prompt = PROMPT + CONTINUATION * 3  # 173 tokens: 25 chunks of 7, 30 ms apart
    rids = [g.prefill("p0", long_prompt, 4, dw="d0", dep=dep) for _ in range(3)]
    hb = g.heartbeats
    g.wait(lambda: hb.get("p0", {}).get("running") == 1 and hb["p0"].get("queued") == 2,
           what="the first prompt computing, two queued")
    g.send("p0", {"t": ROLE, "role": 2})
    ids, reason, err = g.wait_done(rids[0])
    eq((err, reason, len(ids)), (None, 2, 4), "the prompt being computed")
    for rid in rids[1:]:
        _, reason, err = g.wait_done(rid)
        eq((reason, err["code"], err["retry"]), (None, 9, 1), "a queued prompt handed back")
        if "handed back" not in err.get("msg", ""):
            raise AssertionError("the error must say why: %r" % err)
    g.wait(lambda: g.workers["p0"]["role"] == 2 and g.workers["p0"]["kvep"],
           what="p0 registered again as decode")


def case_migrate_queued_prompt(g):
    """MIGRATE to a prefill worker for a prompt still queued there (its decode worker is
    changing role): the prompt's KV goes to the new decode worker directly, which decodes
    the whole request exactly; the old one never sees it. An order for the prompt being
    computed is ignored (its KV goes where it was going)."""
    g.start("p0", "prefill_worker", "--prefill-chunk-tokens", "7", "--max-batch-tokens", "7",
            "--debug-step-delay-ms", "30")
    for d in ("d0", "d1"):  # (a fixed MTP depth: no cost probe at start, slow when sanitized)
        g.start(d, "decode_worker", "--kv-bind", "tcp://127.0.0.1:*", "--mtp-adaptive", "false")
    g.wait_registered("p0", "d0", "d1")
    dep0, dep1 = g.workers["d0"]["kvep"], g.workers["d1"]["kvep"]
    long_prompt = PROMPT + CONTINUATION * 3  # 173 tokens: 25 chunks of 7, 30 ms apart
    first = g.prefill("p0", long_prompt, 4, dw="d0", dep=dep0)
    rid = g.prefill("p0", PROMPT, len(CONTINUATION), dw="d0", dep=dep0)
    hb = g.heartbeats
    g.wait(lambda: hb.get("p0", {}).get("running") == 1 and hb["p0"].get("queued") == 1,
           what="the first prompt computing, the second queued")
    g.send("p0", {"t": MIGRATE, "rid": first, "dw": "d1", "dep": dep1})  # started: ignored
    g.send("p0", {"t": MIGRATE, "rid": rid, "dw": "d1", "dep": dep1})
    ids, reason, err = g.wait_done(rid)
    eq((ids, reason, err), (CONTINUATION, 2, None), "outcome")
    eq(tokens_from(g, rid, "d0"), [], "d0 decoded nothing of it")
    if not tokens_from(g, rid, "d1"):
        raise AssertionError("d1 must decode it")
    ids, reason, err = g.wait_done(first)
    eq((err, reason, len(ids)), (None, 2, 4), "the prompt being computed")
    if not tokens_from(g, first, "d0"):
        raise AssertionError("the prompt computed when the order came goes to d0")
    if "decode worker changed before the prefill started" not in open(g.logpath("p0")).read():
        raise AssertionError("p0 must log the new decode worker")
    for w in ("p0", "d0", "d1"):
        kv_free_back(g, w)


def case_role_switch_while_moving(g):
    """MIGRATE then ROLE prefill to a decode worker mid-decode: it registers again as a
    prefill worker (no kv endpoint) while the move is still on its way, the move completes
    in the background, the request ends exactly, and the decode role is detached afterwards
    with every KV block free."""
    dep0, dep1 = migration_cluster(g)
    rid = g.prefill("p0", PROMPT, len(CONTINUATION), dw="d0", dep=dep0)
    g.wait(lambda: any(m["index"] + len(m["tokens"]) >= 10 for m in tokens_from(g, rid, "d0")),
           what="10 tokens decoded on d0")
    g.send("d0", {"t": MIGRATE, "rid": rid, "dw": "d1", "dep": dep1})
    g.send("d0", {"t": ROLE, "role": 1})
    g.wait(lambda: g.workers["d0"]["role"] == 1, what="d0 registered again as prefill")
    eq(g.workers["d0"].get("kvep", ""), "", "a prefill worker's kv endpoint")
    ids, reason, err = g.wait_done(rid)
    eq((ids, reason, err), (CONTINUATION, 2, None), "outcome")
    log = lambda: open(g.logpath("d0")).read()  # noqa: E731
    if "moved on in the background" not in log():
        raise AssertionError("d0 must switch before the move is over")
    g.wait(lambda: "decode role detached" in log(), what="d0's decode role detached")
    g.wait(lambda: mig(g, "d0")[0] == 1 and mig(g, "d1")[3] == 1, what="migration counters")
    for w in ("d0", "d1"):
        kv_free_back(g, w)
    # it prefills now
    rid2 = g.prefill("d0", PROMPT, 8, dw="d1", dep=dep1)
    ids, reason, err = g.wait_done(rid2)
    eq((ids, reason, err), (CONTINUATION[:8], 2, None), "a request prefilled by d0")


CASES = [n[5:] for n in sorted(globals()) if n.startswith("case_")]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--build", default=os.environ.get("BUILD", "build"))
    ap.add_argument("--model", default=None)
    ap.add_argument("cases", nargs="*")
    a = ap.parse_args()
    model = a.model or os.path.join(a.build, "models", "stories260K.gguf")
    if not os.path.exists(model):
        model = "build/models/stories260K.gguf"
    failed = 0
    for name in a.cases or CASES:
        with tempfile.TemporaryDirectory() as logdir:
            g = Gateway(a.build, model, logdir)
            t0 = time.time()
            try:
                globals()["case_" + name](g)
                bad = None
            except Exception as e:  # noqa: BLE001
                bad = "%s: %s" % (type(e).__name__, e)
            finally:
                stopped = g.stop()
            bad = bad or "; ".join(stopped + g.check_logs()) or None
            print("%-20s %s (%.1fs)" % (name, "ok" if not bad else "FAIL " + bad,
                                        time.time() - t0), flush=True)
            if bad:
                failed += 1
                for f in sorted(os.listdir(logdir)):
                    print("---- %s" % f)
                    print(open(os.path.join(logdir, f)).read()[-4000:])
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
