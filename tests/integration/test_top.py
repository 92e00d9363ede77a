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


if __name__ == "__main__":
    unittest.main()
