"""Worker membership: a second process that claims a worker id in use must not take the id
away from the live worker (which would leave the cluster without it)."""

import os
import signal
import subprocess
import sys
import time
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cluster import BIN, Cluster, free_port  # noqa: E402
from test_e2e import REF, worker_figures  # noqa: E402


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


if __name__ == "__main__":
    unittest.main()
