"""The container image (deploy/container/): built from this checkout by build.sh (the local
Debian base image first when missing), every role's --help, a non-root user, its size, the
HEALTHCHECK of each role, and SIGTERM drain with the program as PID 1.

Containers run with host networking on free 127.0.0.1 ports; each is named tp-image-<pid>-*
and removed at the end, also on failure."""

import json
import os
import sys
import threading
import time
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
from common import IMAGE, MODELS_DIR, podman  # noqa: E402


class Image(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        # test_image is the one that builds: always run build.sh (cached layers make a
        # rebuild of an unchanged tree take seconds), so the image is this checkout's
        common.build_image()
        cls.rid = common.run_id("image")
        cls.names = []
        cls.cleanup = common.on_cleanup(lambda: common.remove_containers(cls.names))

    @classmethod
    def tearDownClass(cls):
        cls.cleanup()

    def run_c(self, *args, check=True):
        return podman("run", "--rm", "--pull=never", "--network", "none", IMAGE, *args,
                      check=check)

    def test_01_size(self):
        mb = common.image_size_mb()
        line = podman("images", "--filter", "reference=" + IMAGE, "--format",
                      "{{.Repository}}:{{.Tag}} {{.ID}} {{.Size}}").stdout.strip()
        common.log("image: %s (%.1f MB)" % (line, mb))
        print("IMAGE SIZE %s %.1f MB" % (IMAGE, mb))
        self.assertLess(mb, 250, "the runtime image should hold only programs and libraries")

    def test_02_roles_help(self):
        for role, usage in (("gateway", "usage: gateway"), ("prefill", "usage: prefill_worker"),
                            ("decode", "usage: decode_worker"),
                            ("mixed", "usage: prefill_worker"),
                            ("convert", "usage: tidepool-convert"),
                            ("health", "tidepool-health")):
            p = self.run_c(role, "--help", check=False)
            self.assertEqual(p.returncode, 0, "%s --help: %s%s" % (role, p.stdout, p.stderr))
            self.assertIn(usage, p.stdout + p.stderr, role)
        out = self.run_c("help").stdout
        for role in ("gateway", "prefill", "decode", "mixed"):
            self.assertIn(role, out)
        self.assertIn("--health-file", self.run_c("decode", "--help").stdout)

    def test_03_non_root(self):
        self.assertEqual(self.run_c("id", "-u").stdout.strip(), "10001")
        img = json.loads(podman("image", "inspect", IMAGE).stdout)[0]
        self.assertEqual(img["Config"]["User"], "10001:10001")
        self.assertIn("tidepool-health", " ".join((img.get("Healthcheck") or {}).get("Test", [])),
                      "HEALTHCHECK kept (docker format)")
        # only runtime libraries: no compiler, no headers
        p = self.run_c("bash", "-c", "command -v gcc cc make; ls /usr/include/zmq.h", check=False)
        self.assertEqual(p.stdout.strip(), "", "build tools in the runtime image")

    def test_04_model_from_volume_missing(self):
        """Without a model volume the entrypoint says what to mount instead of crashing."""
        p = self.run_c("gateway", check=False)
        self.assertEqual(p.returncode, 2)
        self.assertIn("mount the models at /models", p.stderr)

    def start(self, name, role, env, extra=()):
        full = "%s-%s" % (self.rid, name)
        self.names.append(full)
        args = ["run", "-d", "--pull=never", "--name", full, "--network", "host",
                "-v", "%s:/models:ro" % MODELS_DIR]
        for k, v in env.items():
            args += ["-e", "%s=%s" % (k, v)]
        podman(*args, IMAGE, role, *extra)
        return full

    def alive(self, *names):
        def check():
            for n in names:
                st = podman("inspect", "--format", "{{.State.Status}}", n).stdout.strip()
                if st != "running":
                    raise AssertionError("%s is %s\n%s" % (n, st, common.container_logs(n)))
        return check

    def health(self, name, *args):
        return podman("exec", name, "tidepool-health", *args, check=False)

    def test_05_health_and_drain(self):
        http, ctl, stats, kv_d, kv_p = common.free_ports(5)
        base = {"TIDEPOOL_GATEWAY": "tcp://127.0.0.1:%d" % ctl, "TIDEPOOL_HEARTBEAT_MS": "200"}
        # a worker with no gateway yet: alive, not registered
        d = self.start("decode", "decode", dict(base, TIDEPOOL_WORKER_ID="decode-0",
                                                TIDEPOOL_KV_BIND="tcp://127.0.0.1:%d" % kv_d,
                                                TIDEPOOL_DEBUG_STEP_DELAY_MS="25"))
        deadline = time.time() + 30
        while self.health(d, "live").returncode != 0:
            self.alive(d)()
            self.assertLess(time.time(), deadline, "worker never live")
            time.sleep(0.3)
        p = self.health(d)
        self.assertNotEqual(p.returncode, 0, "unregistered worker reported healthy")
        self.assertIn("not registered", p.stdout)
        self.assertNotEqual(podman("healthcheck", "run", d, check=False).returncode, 0)

        g = self.start("gateway", "gateway", {"TIDEPOOL_HOST": "127.0.0.1",
                                              "TIDEPOOL_PORT": str(http),
                                              "TIDEPOOL_CTL_BIND": "tcp://127.0.0.1:%d" % ctl,
                                              "TIDEPOOL_STATS_BIND":
                                              "tcp://127.0.0.1:%d" % stats,
                                              "TIDEPOOL_HEARTBEAT_MS": "200"})
        self.alive(g)()
        # the gateway alone with a decode worker: up, but /health is 503 -> unhealthy
        deadline = time.time() + 30
        while self.health(d).returncode != 0:
            self.alive(d, g)()
            self.assertLess(time.time(), deadline, "decode worker never registered")
            time.sleep(0.3)
        p = self.health(g)
        self.assertNotEqual(p.returncode, 0, p.stdout)
        self.assertIn("503", p.stdout)
        # ... but live (the Kubernetes liveness probe): its loop answers /health
        p = self.health(g, "live")
        self.assertEqual(p.returncode, 0, p.stdout)
        self.assertIn("/health 503", p.stdout)

        pw = self.start("prefill", "prefill", dict(base, TIDEPOOL_WORKER_ID="prefill-0",
                                                   TIDEPOOL_KV_BIND="tcp://127.0.0.1:%d" % kv_p))
        common.wait_health(http, 60, {"prefill": 1, "decode": 1}, self.alive(d, g, pw))
        for n in (g, d, pw):
            hc = podman("healthcheck", "run", n, check=False)
            self.assertEqual(hc.returncode, 0, "%s: %s%s" % (n, hc.stdout, hc.stderr))
        for prompt in common.PROMPTS:
            self.assertEqual(common.complete(http, prompt), common.reference()[prompt])

        # SIGTERM to PID 1 (podman stop) while a request runs: the gateway, then (after it
        # is started again) the decode worker drain, finish the request, and exit 0 well
        # before the stop timeout.
        took_g = self.stop_during_request(http, g)
        podman("start", g)
        common.wait_health(http, 60, {"prefill": 1, "decode": 1}, self.alive(d, g, pw))
        took_d = self.stop_during_request(http, d)
        logs = common.container_logs(d, 20)
        self.assertIn("draining", logs)
        self.assertIn("exit 0", logs)
        # the decode worker has left: the gateway is unhealthy again, the prefill worker
        # is still registered
        deadline = time.time() + 10
        while self.health(g).returncode == 0:
            self.assertLess(time.time(), deadline, "gateway still healthy without decode")
            time.sleep(0.3)
        self.assertEqual(self.health(pw).returncode, 0)
        for n in (g, pw):
            t0 = time.time()
            podman("stop", "-t", "60", n)
            self.assertEqual(common.container_exit_code(n), 0, common.container_logs(n))
            self.assertLess(time.time() - t0, 50, n)
        common.log("drain on SIGTERM as PID 1, a request in flight: the gateway finished it "
                   "and exited 0 in %.1f s, the decode worker in %.1f s" % (took_g, took_d))

    def stop_during_request(self, port, name):
        """podman stop NAME while a 400-token request decodes (25 ms a step): the request
        still completes whole and NAME exits 0 without waiting for the timeout. Returns the
        time the stop took."""
        result = {}

        def long_request():
            try:
                st, body = common.request("POST", port, "/v1/completions",
                                          {"model": "stories260K", "prompt": "Once upon a time",
                                           "max_tokens": 400, "temperature": 0}, timeout=120)
                result["status"], result["body"] = st, json.loads(body)
            except Exception as e:  # noqa: BLE001
                result["error"] = repr(e)
        t = threading.Thread(target=long_request)
        t.start()
        time.sleep(1.0)  # the request is decoding
        t0 = time.time()
        podman("stop", "-t", "60", name)
        took = time.time() - t0
        t.join(120)
        self.assertNotIn("error", result, result)
        self.assertEqual(result["status"], 200, result)
        self.assertEqual(result["body"]["usage"]["completion_tokens"], 400,
                         "request cut by stopping " + name)
        self.assertEqual(common.container_exit_code(name), 0, common.container_logs(name))
        self.assertGreater(took, 0.5, "%s stopped before the request ended?" % name)
        self.assertLess(took, 50, "stop waited for the timeout: SIGTERM not handled as PID 1")
        return took

    def test_06_baked_model(self):
        """--model bakes a llama2.c model, converted at build time, as the default model."""
        tag = IMAGE.rsplit(":", 1)[0] + ":test-baked-%d" % os.getpid()
        rmi = common.on_cleanup(lambda: podman("rmi", "-f", tag, check=False))
        try:
            common.build_image(tag, ["--model", os.path.join(MODELS_DIR, "stories260K")])
            p = podman("run", "--rm", "--pull=never", "--network", "none", tag, "bash", "-c",
                       "ls /opt/tidepool/models/")
            self.assertIn("stories260K.gguf", p.stdout)
            # the gateway starts on it without any volume (and leaves at once: --help would
            # not load it, so run it for a second)
            name = "%s-baked" % self.rid
            self.names.append(name)
            http, ctl, stats = common.free_ports(3)
            podman("run", "-d", "--pull=never", "--name", name, "--network", "host",
                   "-e", "TIDEPOOL_HOST=127.0.0.1", "-e", "TIDEPOOL_PORT=%d" % http,
                   "-e", "TIDEPOOL_CTL_BIND=tcp://127.0.0.1:%d" % ctl,
                   "-e", "TIDEPOOL_STATS_BIND=tcp://127.0.0.1:%d" % stats, tag, "gateway")
            deadline = time.time() + 20
            while True:
                try:
                    st, body = common.request("GET", http, "/v1/models", timeout=2)
                    if st == 200:
                        break
                except OSError:
                    pass
                self.assertLess(time.time(), deadline, common.container_logs(name))
                time.sleep(0.3)
            self.assertIn(b"stories260K", body)
            self.assertIn("/opt/tidepool/models/stories260K.gguf", common.container_logs(name))
        finally:
            common.remove_containers(["%s-baked" % self.rid])
            rmi()


if __name__ == "__main__":
    unittest.main()
