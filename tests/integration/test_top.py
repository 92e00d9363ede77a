"""tidepool-top, the terminal dashboard, as a person would use it: a real cluster, the
dashboard in a detached tmux session of fixed size (on a private tmux server socket),
keys sent with send-keys and the screen read with capture-pane."""

import os
import shutil
import subprocess
import sys
import time
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cluster import BIN, Cluster  # noqa: E402

TMUX = shutil.which("tmux")


class Tmux:
    def __init__(self, argv, width=200, height=50):
        self.sock = "tidepool-top-test-%d" % os.getpid()
        self.session = "top"
        self.base = [TMUX, "-L", self.sock]
        env = dict(os.environ, TERM="xterm-256color")
        subprocess.run(self.base + ["-f", "/dev/null", "new-session", "-d", "-s", self.session,
                                    "-x", str(width), "-y", str(height)] + argv,
                       check=True, env=env, timeout=30)

    def screen(self):
        p = subprocess.run(self.base + ["capture-pane", "-p", "-t", self.session],
                           capture_output=True, text=True, timeout=30)
        return p.stdout

    def keys(self, *keys):
        subprocess.run(self.base + ["send-keys", "-t", self.session] + list(keys), check=True,
                       timeout=30)

    def alive(self):
        return subprocess.run(self.base + ["has-session", "-t", self.session],
                              capture_output=True, timeout=30).returncode == 0

    def wait(self, pred, timeout=15, what="screen"):
        deadline = time.time() + timeout
        text = ""
        while time.time() < deadline:
            text = self.screen()
            if pred(text):
                return text
            time.sleep(0.2)
        raise AssertionError("%s not seen within %ss; screen:\n%s" % (what, timeout, text))

    def kill(self):
        subprocess.run(self.base + ["kill-server"], capture_output=True, timeout=30)


@unittest.skipUnless(TMUX, "tmux not installed")
class Top(unittest.TestCase):
    def test_dashboard_in_tmux(self):
        with Cluster(roles=("prefill", "decode"),
                     gateway_args=["--stats-interval-ms", "200"]) as c:
            for _ in range(3):
                status, body = c.complete("Once upon a time", max_tokens=24)
                self.assertEqual(status, 200)
            t = Tmux([os.path.join(BIN, "tidepool-top"), "--stats", c.stats])
            try:
                text = t.wait(lambda s: "prefill-0" in s and "decode-1" in s and
                              "finished 3" in s, what="workers and totals")
                for heading in ("tidepool-top", "WORKER", "ROLE", "STATE", "KV", "IN/s",
                                "OUT/s", "TTFT", "TPOT", "ITL", "EVENTS", "requests",
                                "cluster", "q: quit"):
                    self.assertIn(heading, text)
                self.assertIn("worker_up", text)  # the snapshot's recent events
                self.assertNotIn("PAUSED", text)
                rows = [line for line in text.splitlines() if "decode-1" in line and "[" in line]
                self.assertTrue(rows, text)
                self.assertIn("decode", rows[0])
                self.assertIn("ready", rows[0])
                t.keys("p")
                text = t.wait(lambda s: "PAUSED" in s, what="PAUSED")
                # paused: the screen does not change while the cluster does
                c.complete("Once upon a time", max_tokens=8)
                time.sleep(1.0)
                self.assertIn("finished 3", t.screen())
                t.keys("p")
                t.wait(lambda s: "PAUSED" not in s and "finished 4" in s, what="resumed")
                t.keys("s")
                t.wait(lambda s: "sort (by role)" in s, what="sort by role")
                t.keys("q")
                deadline = time.time() + 10
                while t.alive() and time.time() < deadline:
                    time.sleep(0.1)
                self.assertFalse(t.alive(), "q must quit tidepool-top")
            finally:
                t.kill()


@unittest.skipUnless(TMUX, "tmux not installed")
class HostilePublisher(unittest.TestCase):
    def test_out_of_range_numbers(self):
        """The stats messages are network input: an event whose rid printed to more digits
        than the 64-byte detail buffer (rid 1e300) made tidepool-top write its " status=..."
        at the full length's offset, past the buffer (ASan: stack-buffer-overflow, WRITE of
        size 310). It must show such messages and go on."""
        import zmq  # python3-zmq, as fake_gateway.py
        from fake_gateway import mp_pack
        from cluster import free_port
        ctx = zmq.Context()
        pub = ctx.socket(zmq.XPUB)
        endpoint = "tcp://127.0.0.1:%d" % free_port()
        pub.bind(endpoint)
        logf = os.path.join(os.environ.get("TMPDIR", "/tmp"), "top-hostile-%d.log" % os.getpid())
        t = Tmux(["sh", "-c", "%s --stats %s 2>%s" % (os.path.join(BIN, "tidepool-top"),
                                                       endpoint, logf)])
        try:
            # seq -5 (read as 2^64 - 5) and 1e300 hid every later event for good; a ts_ms
            # out of time_t's range was converted all the same (undefined behaviour)
            events = [{"seq": -5.0, "ts_ms": -1e300, "event": "bogus_a"},
                      {"seq": 1e300, "ts_ms": 1e300, "event": "bogus_b"},
                      {"seq": 2.0, "ts_ms": 1.0e12, "event": "request_end", "rid": 1e300,
                       "status": 1e300, "worker": "w" * 300, "reason": "r" * 300},
                      {"seq": 3.0, "ts_ms": 1.0e12, "event": "worker_state", "worker": "x",
                       "role": "decode", "state": "ready", "reason": "ok-3"}]
            snap = {"schema": 1, "seq": 1, "model": "m", "events": events,
                    "workers": [{"id": "w" * 300, "role": "decode", "running": 1e300}]}
            deadline = time.time() + 15
            while time.time() < deadline and "ok-3" not in t.screen():
                pub.send_multipart([b"snapshot", mp_pack(snap)])
                time.sleep(0.2)
            time.sleep(0.5)
            self.assertTrue(t.alive(), open(logf).read() if os.path.exists(logf) else "")
            text = t.screen()
            self.assertIn("request_end", text)
            self.assertIn("ok-3", text)
        finally:
            t.kill()
            pub.close(0)
            ctx.term()
            report = open(logf).read() if os.path.exists(logf) else ""
            if os.path.exists(logf):
                os.unlink(logf)
        self.assertNotIn("ERROR: AddressSanitizer", report)
        self.assertNotIn("runtime error", report)

if __name__ == "__main__":
    unittest.main()
