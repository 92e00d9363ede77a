"""deploy/compose/compose.yaml with podman-compose: a gateway, 2 prefill and 2 decode
workers up with `podman-compose up -d`, /health 200 with every worker, the image's
HEALTHCHECK healthy in each container, greedy completions equal to the local build's, the
Batch API database kept on its named volume across a gateway restart, a clean drain
(every container exits 0 on stop), `down -v`.

On this host the containers use host networking on free 127.0.0.1 ports
(compose.host.yaml, through deploy/compose/podman-hostnet for podman-compose 1.0.3), so no
test traffic goes to a container bridge address. The project is named tp-compose-<pid>;
only its containers, volume and network are removed, also on failure."""

import json
import os
import subprocess
import sys
import time
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
from common import ROOT, podman  # noqa: E402

COMPOSE_DIR = os.path.join(ROOT, "deploy", "compose")
SERVICES = ["gateway", "prefill-0", "prefill-1", "decode-0", "decode-1"]


class Compose(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        common.ensure_image()
        cls.project = common.run_id("compose")
        names = ["HTTP", "CTL", "STATS", "KV_D0", "KV_D1", "KV_P0", "KV_P1"]
        cls.ports = dict(zip(names, common.free_ports(len(names))))
        cls.env = dict(common.podman_env())
        cls.env.update({"TIDEPOOL_IMAGE": common.IMAGE, "TIDEPOOL_MODELS_DIR": common.MODELS_DIR,
                        "TIDEPOOL_HTTP_PORT": str(cls.ports["HTTP"]),
                        "TIDEPOOL_CTL_PORT": str(cls.ports["CTL"]),
                        "TIDEPOOL_STATS_PORT": str(cls.ports["STATS"])})
        for k in names[3:]:
            cls.env["TIDEPOOL_KV_PORT_" + k.split("_")[1]] = str(cls.ports[k])
        cls.containers = ["%s_%s_1" % (cls.project, s) for s in SERVICES]
        cls.cleanup = common.on_cleanup(cls.teardown_all)
        t0 = time.time()
        try:
            cls.compose("up", "-d")
        except Exception:
            cls.cleanup()
            raise
        common.log("podman-compose up -d: %.1f s" % (time.time() - t0))

    @classmethod
    def compose(cls, *args, check=True, timeout=300):
        argv = ["podman-compose", "--podman-path", os.path.join(COMPOSE_DIR, "podman-hostnet"),
                "-f", os.path.join(COMPOSE_DIR, "compose.yaml"),
                "-f", os.path.join(COMPOSE_DIR, "compose.host.yaml"), "-p", cls.project] \
            + list(args)
        p = subprocess.run(argv, capture_output=True, text=True, env=cls.env, timeout=timeout)
        if check and p.returncode != 0:
            raise AssertionError("%s: exit %d\n%s\n%s" % (" ".join(argv[1:]), p.returncode,
                                                         p.stdout[-4000:], p.stderr[-4000:]))
        return p

    @classmethod
    def teardown_all(cls):
        try:
            cls.compose("down", "-v", "-t", "40", check=False)
        finally:
            # whatever down left: this project's containers, its volume and network only
            left = podman("ps", "-a", "--format", "{{.Names}}", "--filter",
                          "label=io.podman.compose.project=" + cls.project, check=False)
            common.remove_containers(left.stdout.split())
            podman("volume", "rm", "-f", cls.project + "_state", check=False)
            podman("network", "rm", "-f", cls.project + "_default", check=False)

    @classmethod
    def tearDownClass(cls):
        cls.cleanup()

    def alive(self):
        for n in self.containers:
            st = podman("inspect", "--format", "{{.State.Status}}", n, check=False).stdout.strip()
            if st != "running":
                raise AssertionError("%s is %r\n%s" % (n, st, common.container_logs(n)))

    def test_1_up_health_completions(self):
        port = self.ports["HTTP"]
        t0 = time.time()
        h = common.wait_health(port, 90, {"prefill": 2, "decode": 2}, self.alive)
        common.log("compose: /health 200 with 2 prefill + 2 decode workers %.1f s after up (%s)"
                   % (time.time() - t0, json.dumps(h["workers"])))
        for n in self.containers:
            hc = podman("healthcheck", "run", n, check=False)
            self.assertEqual(hc.returncode, 0, "HEALTHCHECK of %s: %s%s\n%s" % (
                n, hc.stdout, hc.stderr, common.container_logs(n)))
        common.check_texts(self, port, "compose")
        # the workers advertise the kv endpoints they bound, and registered with their ids
        st, body = common.request("GET", port, "/workers")
        self.assertEqual(st, 200)
        text = body.decode()
        for s in SERVICES[1:]:
            self.assertIn('"%s"' % s, text)
        for k in ("KV_D0", "KV_D1"):
            self.assertIn("tcp://127.0.0.1:%d" % self.ports[k], text)

    def test_2_state_volume_survives_restart(self):
        port = self.ports["HTTP"]
        common.wait_health(port, 90, {"prefill": 2, "decode": 2}, self.alive)
        line = json.dumps({"custom_id": "a", "method": "POST", "url": "/v1/completions",
                           "body": {"model": "stories260K", "prompt": "Hi", "max_tokens": 4}})
        st, body = common.request("POST", port, "/v1/files?purpose=batch&filename=t.jsonl",
                                  (line + "\n").encode(),
                                  {"Content-Type": "application/octet-stream"})
        self.assertEqual(st, 200, body)
        fid = json.loads(body)["id"]
        vol = json.loads(podman("volume", "inspect", self.project + "_state").stdout)[0]
        common.log("compose: Batch API file %s in volume %s" % (fid, vol["Name"]))
        gw = self.project + "_gateway_1"
        podman("restart", "-t", "40", gw)
        common.wait_health(port, 60, {"prefill": 2, "decode": 2}, self.alive)
        st, body = common.request("GET", port, "/v1/files/" + fid)
        self.assertEqual(st, 200, "file lost across a gateway restart: %r" % body[:200])
        self.assertEqual(json.loads(body)["filename"], "t.jsonl")

    def test_3_stop_drains(self):
        """podman-compose stop: every process gets SIGTERM as PID 1 and exits 0."""
        common.wait_health(self.ports["HTTP"], 90, {"prefill": 2, "decode": 2}, self.alive)
        t0 = time.time()
        self.compose("stop", "-t", "40", "gateway")
        self.compose("stop", "-t", "40")
        took = time.time() - t0
        for n in self.containers:
            self.assertEqual(common.container_exit_code(n), 0, common.container_logs(n))
        self.assertLess(took, 60, "stop waited for timeouts instead of draining")
        common.log("compose: gateway then workers stopped (exit 0) in %.1f s" % took)


if __name__ == "__main__":
    unittest.main()
