"""The local launcher: starts a cluster, restarts a worker killed with SIGKILL, and the
request that was running when it died ends cleanly (an error or a correct completion, never
a hang); the gateway stays up and the next request is served correctly."""

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

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cluster import BIN, MODEL, ROOT, Cluster, free_port  # noqa: E402
from test_e2e import REF  # noqa: E402


def private_state_db(folder):
    """The launcher's flags for a Batch API database in folder: the default one
    (build/state/gateway.db) is locked by whichever gateway holds it, and other test
    programs may run beside this one (tests/run_tests.sh JOBS)."""
    return ["--gateway-arg", "--state-db", "--gateway-arg", os.path.join(folder, "gateway.db")]


class Launcher(unittest.TestCase):
    def setUp(self):
        self.port = free_port()
        self.ctl = free_port()
        self.kv = free_port()
        env = dict(os.environ, TIDEPOOL_BIN=BIN)
        # the workers' config file: empty; a test rewrites it to restart a worker differently
        self.worker_config = os.path.join(self.make_tmp(), "worker.conf")
        with open(self.worker_config, "w") as f:
            f.write("# worker settings of this test\n")
        # the launcher's own lines and its processes' logs, one file per test case
        self.log = open(os.path.join(ROOT, os.environ.get("TIDEPOOL_BUILD", "build"),
                                     "test-logs", "launcher-%s.out" % self._testMethodName),
                        "wb")
        self.proc = subprocess.Popen(
            [os.path.join(ROOT, "deploy/local/start"), "--no-build", "--port", str(self.port),
             "--ctl-port", str(self.ctl), "--kv-port", str(self.kv),
             "--stats-port", str(free_port()), "--model", MODEL,
             "--worker-arg", "--heartbeat-ms", "--worker-arg", "200",
             "--worker-arg", "--debug-step-delay-ms", "--worker-arg", "5",
             "--worker-arg", "--config", "--worker-arg", self.worker_config,
             "--gateway-arg", "--heartbeat-ms", "--gateway-arg", "200",
             "--gateway-arg", "--dead-after-ms", "--gateway-arg", "800"]
            + private_state_db(self.tmp),
            stdout=subprocess.PIPE, stderr=self.log, env=env, start_new_session=True)
        # a Cluster object only as an HTTP client
        self.c = Cluster()
        self.c.port = self.port
        line = self.proc.stdout.readline().decode()
        self.assertIn("tidepool is ready: http://127.0.0.1:%d/v1" % self.port, line)

    def make_tmp(self):
        self.tmp = tempfile.mkdtemp(prefix="tidepool-launcher-")
        return self.tmp

    def tearDown(self):
        shutil.rmtree(self.tmp, ignore_errors=True)
        if self.proc.poll() is not None:
            self.log.close()
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            rc = self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            raise
        self.log.close()
        self.assertEqual(rc, 0)

    def worker_pids(self, name):
        # only this test's launcher's children: other clusters on the machine are not ours
        out = subprocess.run(["pgrep", "-P", str(self.proc.pid), "-f", "--",
                              "--worker-id %s" % name],
                             capture_output=True, text=True).stdout.split()
        return [int(p) for p in out]

    def kill_during_request(self, name, freeze_first=False):
        """SIGKILL worker `name` while a request is on it. freeze_first: SIGSTOP it before
        the request is sent, so that the request is certainly held by it (queued in its
        socket, not yet prefilled) when it dies."""
        result = {}
        if freeze_first:
            for p in self.worker_pids(name):
                os.kill(p, signal.SIGSTOP)

        def run():
            try:
                result["r"] = self.c.complete("Once upon a time", max_tokens=200)
            except Exception as e:  # noqa: BLE001 — a closed connection is an acceptable end
                result["r"] = ("exception", repr(e))

        t = threading.Thread(target=run)
        t.start()
        time.sleep(0.3)
        pids = self.worker_pids(name)
        self.assertTrue(pids, "no process for %s" % name)
        for p in pids:
            os.kill(p, signal.SIGKILL)
        t.join(60)
        self.assertFalse(t.is_alive(), "request hung after %s was killed" % name)
        status, body = result["r"]
        if status == 200:
            # a retried request must still be the exact greedy continuation
            self.assertTrue(body["choices"][0]["text"].startswith(REF["Once upon a time"]))
        else:
            self.assertIn(status, (500, 502, 503, 504), body)
            self.assertIn("error", body)
        # the launcher restarts the worker and the next request is served correctly
        deadline = time.time() + 30
        while time.time() < deadline:
            if self.worker_pids(name) and self.c.request("GET", "/health")[0] == 200:
                break
            time.sleep(0.2)
        status, body = self.c.complete("Once upon a time", max_tokens=48)
        self.assertEqual(status, 200, body)
        self.assertEqual(body["choices"][0]["text"], REF["Once upon a time"])

    def test_sigterm_drains_running_requests(self):
        """Stopping the launcher lets requests already running finish (gateway drains
        first, then the workers), and every process exits."""
        results = [None] * 8

        def run(i):
            try:
                results[i] = self.c.stream_text("Once upon a time", max_tokens=48)
            except Exception as e:  # noqa: BLE001
                results[i] = ("exception", repr(e), [], False)

        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(results))]
        for t in threads:
            t.start()
        time.sleep(0.15)
        children = subprocess.run(["pgrep", "-P", str(self.proc.pid)], capture_output=True,
                                  text=True).stdout.split()
        self.proc.send_signal(signal.SIGTERM)
        for t in threads:
            t.join(60)
        self.assertEqual(self.proc.wait(timeout=60), 0)
        for i, (status, text, events, done) in enumerate(results):
            self.assertEqual(status, 200, "request %d: %r" % (i, text))
            self.assertTrue(done, "request %d ended without [DONE]" % i)
            self.assertEqual(text, REF["Once upon a time"], "request %d" % i)
        for pid in children:
            self.assertFalse(os.path.exists("/proc/%s" % pid) and
                             open("/proc/%s/stat" % pid).read().split()[2] != "Z",
                             "process %s still running" % pid)

    def wait_new_pid(self, name, old, timeout=15):
        deadline = time.time() + timeout
        while time.time() < deadline:
            pids = [p for p in self.worker_pids(name) if p not in old]
            if pids:
                return pids
            time.sleep(0.05)
        self.fail("%s was not restarted" % name)

    def test_restart_backoff_is_capped_and_resets(self):
        """A worker that keeps dying is restarted after 1, 2, 4, then at most 5 s; once it has
        run 10 s it restarts after 1 s again (it stayed down 30 s: found by a fresh-user
        trial, requests waited 25 s)."""
        log_path = self.log.name
        pids = self.worker_pids("decode-0")
        for want in (1, 2, 4, 5, 5):
            for p in pids:
                os.kill(p, signal.SIGKILL)
            pids = self.wait_new_pid("decode-0", pids, timeout=want + 10)
        time.sleep(10.5)  # healthy for longer than the reset time
        for p in pids:
            os.kill(p, signal.SIGKILL)
        self.wait_new_pid("decode-0", pids)
        self.log.flush()
        with open(log_path, errors="replace") as f:
            got = [int(m) for m in re.findall(r"decode-0 exited \(status \d+\); restarting in "
                                              r"(\d+) s", f.read())]
        self.assertEqual(got, [1, 2, 4, 5, 5, 1])
        status, body = self.c.request("GET", "/health")
        deadline = time.time() + 10
        while status != 200 and time.time() < deadline:
            time.sleep(0.2)
            status, body = self.c.request("GET", "/health")
        self.assertEqual(status, 200, body)

    def test_refused_worker_is_not_restarted(self):
        """A worker the gateway refuses (here: restarted with another KV block size) exits with
        status 78, and the launcher logs it and leaves it down instead of restarting it for
        ever (a restart would be refused again)."""
        with open(self.worker_config, "w") as f:
            f.write("block-size = 32\n")
        pids = self.worker_pids("decode-0")
        for p in pids:
            os.kill(p, signal.SIGKILL)
        want = "decode-0 was refused by the gateway (status 78"
        deadline = time.time() + 20
        text = ""
        while want not in text and time.time() < deadline:
            time.sleep(0.2)
            self.log.flush()
            with open(self.log.name, errors="replace") as f:
                text = f.read()
        self.assertIn(want + ": its model or KV block size is not the cluster's; see its log); "
                      "not restarting it", text)
        self.assertEqual(len(re.findall(r"restarting decode-0\b", text)), 1, text)
        time.sleep(3)  # longer than the back-off: still down, the launcher still running
        self.assertEqual(self.worker_pids("decode-0"), [])
        self.assertIsNone(self.proc.poll())
        status, body = self.c.request("GET", "/workers")
        self.assertEqual([w["id"] for w in body["refused"]], ["decode-0"])
        self.assertEqual(body["refused"][0]["reason"],
                         "KV block size 32 tokens, the cluster's is 16 (pinned by worker "
                         "prefill-0)")

    def test_kill_decode_worker(self):
        self.kill_during_request("decode-0")

    def test_kill_prefill_worker(self):
        self.kill_during_request("prefill-0", freeze_first=True)

    def test_kill_prefill_worker_while_idle_then_serve(self):
        self.kill_during_request("prefill-0")


if __name__ == "__main__":
    unittest.main()


class LauncherRefusalTest(unittest.TestCase):
    """A launcher whose gateway refuses its settings stops, says why, and never announces
    API keys the gateway does not require."""

    def run_launcher(self, args, env=None):
        env = dict({k: v for k, v in os.environ.items() if not k.startswith("TIDEPOOL_API")},
                   TIDEPOOL_BIN=BIN, **(env or {}))
        p = subprocess.Popen(
            [os.path.join(ROOT, "deploy/local/start"), "--no-build", "--mixed", "1",
             "--port", str(free_port()), "--ctl-port", str(free_port()),
             "--kv-port", str(free_port()), "--stats-port", str(free_port()),
             "--model", MODEL] + private_state_db(tempfile.mkdtemp(prefix="tidepool-launcher-"))
            + list(args),
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, start_new_session=True)
        try:
            out, err = p.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.communicate()
            raise
        return p.returncode, out.decode(), err.decode()

    def test_blank_key_in_the_environment(self):
        """TIDEPOOL_API_KEY=" " used to start an open gateway announced as "API keys
        required"; now the gateway refuses it and the launcher stops."""
        rc, out, err = self.run_launcher([], {"TIDEPOOL_API_KEY": " "})
        self.assertEqual(rc, 1, err)
        self.assertEqual(out, "")
        self.assertIn("empty value for api-key (from TIDEPOOL_API_KEY): give a value, or leave "
                      "the setting out", err)
        self.assertIn("start: gateway exited (status 2) before the cluster was ready; see its "
                      "log above", err)

    def test_empty_key_file_name(self):
        rc, out, err = self.run_launcher(["--api-key-file", ""])
        self.assertEqual((rc, out, err),
                         (2, "", "start: --api-key-file needs a file name (got an empty one)\n"))

    def test_log_dir_shows_the_failed_log(self):
        """With --log-dir the failure shows the end of the process's log and names it."""
        c = Cluster(roles=())  # its temporary directory only
        logs = os.path.join(c.tmp, "logs")
        rc, out, err = self.run_launcher(["--log-dir", logs, "--gateway-arg", "--api-key",
                                          "--gateway-arg", ""])
        self.assertEqual(rc, 1, err)
        self.assertIn("start: gateway exited (status 2) before the cluster was ready; the end "
                      "of its log, %s/gateway.log:\n    " % logs, err)
        self.assertIn("\n    empty value for api-key (from flags): give a value, or leave the "
                      "setting out\n", err)
        self.assertNotIn("see its log above", err)
        c.stop()

    def test_open_gateway_says_no_keys(self):
        """The ready line announces keys only when the gateway answers 401 without one."""
        c = Cluster(roles=())
        c.port = free_port()
        env = dict({k: v for k, v in os.environ.items() if not k.startswith("TIDEPOOL_API")},
                   TIDEPOOL_BIN=BIN)
        p = subprocess.Popen(
            [os.path.join(ROOT, "deploy/local/start"), "--no-build", "--mixed", "1",
             "--port", str(c.port), "--ctl-port", str(free_port()),
             "--kv-port", str(free_port()), "--stats-port", str(free_port()), "--model", MODEL]
            + private_state_db(c.tmp),
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env, start_new_session=True)
        try:
            line = p.stdout.readline().decode()
            self.assertIn("1 mixed workers). Ctrl-C stops it.", line)
            self.assertEqual(c.request("GET", "/v1/models")[0], 200)
        finally:
            p.send_signal(signal.SIGTERM)
            try:
                self.assertEqual(p.wait(timeout=40), 0)
            finally:
                if p.poll() is None:
                    os.killpg(p.pid, signal.SIGKILL)
                p.stdout.close()
            c.stop()


class MakeDefaultGoalTest(unittest.TestCase):
    def test_plain_make_builds_all(self):
        """README: "`make` builds into build/"; the first rule in the Makefile is an
        archive's, so the default goal must be set to all explicitly."""
        p = subprocess.run(["make", "-C", ROOT, "-pnq"], capture_output=True, text=True,
                           timeout=120)
        goals = [l for l in p.stdout.splitlines() if l.startswith(".DEFAULT_GOAL")]
        self.assertEqual(goals, [".DEFAULT_GOAL := all"])
