"""Worker membership: a second process that claims a worker id in use must not take the id
away from the live worker (which would leave the cluster without it); a worker with another
model or KV block size than the cluster's is refused at registration, exits with status 78
and is never routed to."""

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cluster import BIN, ROOT, Cluster, free_port  # noqa: E402
from test_e2e import REF, worker_figures  # noqa: E402

EXIT_REFUSED = 78  # worker/runtime.h RUNTIME_EXIT_REFUSED
OTHER_MODEL_DIR = os.path.join(ROOT, "..", "shared", "models", "tinystories280K-saltyduckegg")


class Membership(unittest.TestCase):
    def test_duplicate_worker_id_does_not_steal(self):
        with Cluster(roles=("prefill", "decode")) as c:
            before = worker_figures(c)["decode-1"]["pid"]
            log = open(os.path.join(c.tmp, "intruder.log"), "wb")
            intruder = subprocess.Popen(
                [os.path.join(BIN, "decode_worker"), "--gateway", c.ctl, "--model", c.model,
                 "--worker-id", "decode-1", "--heartbeat-ms", "200",
                 "--kv-bind", "tcp://127.0.0.1:%d" % free_port()],
                stdout=log, stderr=subprocess.STDOUT)
            time.sleep(1.5)
            self.assertEqual(worker_figures(c)["decode-1"]["pid"], before)
            intruder.send_signal(signal.SIGTERM)
            intruder.wait(15)
            log.close()
            time.sleep(1.0)  # several heartbeats: the real decode-1 must still be there
            self.assertEqual(c.request("GET", "/health")[0], 200)
            self.assertEqual(worker_figures(c)["decode-1"]["pid"], before)
            status, body = c.complete("Once upon a time", max_tokens=48)
            self.assertEqual(status, 200, body)
            self.assertEqual(body["choices"][0]["text"], REF["Once upon a time"])


class Refusal(unittest.TestCase):
    """Issue 12: a decode worker with another block size or another model used to register,
    be listed ready and counted by /health, and requests were retried onto it until they
    failed with 503 (layout_mismatch / model fingerprint)."""

    @classmethod
    def setUpClass(cls):
        # another real model with the same tokenizer (tok512): only its weights differ
        cls.tmp = tempfile.mkdtemp(prefix="tidepool-refusal-")
        cls.other = os.path.join(cls.tmp, "tinystories280K.gguf")
        subprocess.run([os.path.join(BIN, "tidepool-convert"), "--checkpoint",
                        os.path.join(OTHER_MODEL_DIR, "model.bin"), "--tokenizer",
                        os.path.join(OTHER_MODEL_DIR, "tok512.bin"), "--out", cls.other],
                       check=True, capture_output=True)

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.tmp, ignore_errors=True)

    def run_refused(self, c, name, role="decode"):
        """Start worker `name` (with c.worker_args, which come last and win); it must exit
        with status 78 and log why. Returns its log."""
        p = c.start_worker(name, role)
        try:
            rc = p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
            self.fail("%s %s was not refused (still running):\n%s" % (name, c.worker_args,
                                                                      c.log(name)))
        self.assertEqual(rc, EXIT_REFUSED, c.log(name))
        return c.log(name)

    def test_mismatched_workers_are_refused(self):
        with Cluster(roles=("prefill", "decode")) as c:
            health_before = c.request("GET", "/health")[1]["workers"]
            c.worker_args = ["--block-size", "32"]
            log = self.run_refused(c, "decode-bs32")
            self.assertIn("the gateway refused this worker (layout_mismatch): KV block size 32 "
                          "tokens, the cluster's is 16 (pinned by worker ", log)
            # the same id again (a restart by hand): counted again, logged once
            log = self.run_refused(c, "decode-bs32")
            c.worker_args = ["--block-size", "8"]
            self.run_refused(c, "prefill-bs8", role="prefill")
            c.worker_args = ["--model", self.other]
            log = self.run_refused(c, "decode-other")
            self.assertRegex(log, r"refused this worker \(layout_mismatch\): model fingerprint "
                                  r"[0-9a-f]{16}, the gateway's model has [0-9a-f]{16}")
            c.worker_args = []

            status, body = c.request("GET", "/workers")
            self.assertEqual(status, 200)
            self.assertEqual(sorted(w["id"] for w in body["workers"]), ["decode-1", "prefill-0"])
            self.assertTrue(all(w["state"] == "ready" for w in body["workers"]))
            refused = {w["id"]: w for w in body["refused"]}
            self.assertEqual(sorted(refused), ["decode-bs32", "decode-other", "prefill-bs8"])
            # the most recent first
            self.assertEqual([w["id"] for w in body["refused"]],
                             ["decode-other", "prefill-bs8", "decode-bs32"])
            self.assertEqual({w["state"] for w in body["refused"]}, {"refused"})
            self.assertEqual(refused["decode-bs32"]["refused"], 2)
            self.assertEqual(refused["decode-bs32"]["role"], "decode")
            self.assertEqual(refused["decode-bs32"]["pid"], c.procs["decode-bs32"].pid)
            self.assertRegex(refused["decode-bs32"]["reason"],
                             r"^KV block size 32 tokens, the cluster's is 16 \(pinned by worker "
                             r"(decode-1|prefill-0)\)$")
            self.assertEqual(refused["prefill-bs8"]["role"], "prefill")
            self.assertTrue(refused["prefill-bs8"]["reason"].startswith(
                "KV block size 8 tokens, the cluster's is 16"))
            self.assertTrue(refused["decode-other"]["reason"].startswith("model fingerprint "))

            status, health = c.request("GET", "/health")
            self.assertEqual(status, 200)
            self.assertEqual(health["workers"], health_before)
            self.assertEqual(health["workers"],
                             {"prefill": 1, "decode": 1, "mixed": 0, "draining": 0})
            metrics = c.request("GET", "/metrics")[1]
            self.assertRegex(metrics, r"(?m)^tidepool_workers_refused_total\{[^}]*\} 4$")

            for i in range(6):
                prompt = ("Once upon a time", "Tom and Sue went to the")[i % 2]
                status, body = c.complete(prompt, max_tokens=48)
                self.assertEqual(status, 200, body)
                self.assertEqual(body["choices"][0]["text"], REF[prompt])
            gw = c.log("gateway")
            self.assertNotIn("retrying", gw)
            # one log line per worker id, not one per process or per REGISTER
            self.assertEqual(len(re.findall(r"worker decode-bs32 \(decode, pid \d+\) refused",
                                            gw)), 1, gw)
            self.assertEqual(len(re.findall(r"worker decode-other \(decode, pid \d+\) refused",
                                            gw)), 1, gw)

    def test_pinned_block_size(self):
        """--kv-block-size pins the block size before any worker registers."""
        with Cluster(roles=("prefill", "decode"), gateway_args=["--kv-block-size", "32"],
                     worker_args=["--block-size", "32"]) as c:
            c.worker_args = ["--block-size", "16"]
            log = self.run_refused(c, "decode-bs16")
            self.assertIn("KV block size 16 tokens, the cluster's is 32 (--kv-block-size)", log)
            status, body = c.complete("Once upon a time", max_tokens=48)
            self.assertEqual(status, 200, body)
            self.assertEqual(body["choices"][0]["text"], REF["Once upon a time"])

    def test_block_size_released_when_no_worker_is_left(self):
        """Without --kv-block-size the first worker accepted pins it until none is left."""
        with Cluster(roles=("prefill", "decode")) as c:
            for name in ("prefill-0", "decode-1"):
                c.kill(name, signal.SIGTERM)
            deadline = time.time() + 10
            while c.request("GET", "/workers")[1]["workers"] and time.time() < deadline:
                time.sleep(0.1)
            self.assertEqual(c.request("GET", "/workers")[1]["workers"], [])
            c.worker_args = ["--block-size", "32"]
            c.start_worker("prefill-2", "prefill")
            c.start_worker("decode-3", "decode")
            c.wait_healthy(30)
            status, body = c.complete("Once upon a time", max_tokens=48)
            self.assertEqual(status, 200, body)
            self.assertEqual(body["choices"][0]["text"], REF["Once upon a time"])
            c.worker_args = []
            log = self.run_refused(c, "decode-bs16")
            self.assertIn("KV block size 16 tokens, the cluster's is 32 (pinned by worker ", log)


if __name__ == "__main__":
    unittest.main()
