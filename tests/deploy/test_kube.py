"""deploy/k8s/: every overlay renders with `kubectl kustomize` and has what the design asks
(probes, drain, budgets, stable worker ids); each of 1p1d and 2p2d (TIDEPOOL_KUBE_OVERLAYS)
is played with `podman kube play`, serves greedy completions equal to the local build's,
its probes mean what they say, it drains on stop, and `podman kube down` removes it.

podman 4.3 plays Pods, Deployments and PersistentVolumeClaims, not StatefulSets or
Services, so the rendered manifests are adapted (to_podman below): each StatefulSet
becomes its pods (<name>-0, -1, ... as Kubernetes names them), every pod gets hostNetwork
(so all traffic stays on 127.0.0.1) with its own free ports, the model volume becomes a
hostPath of the models folder, $(VAR) references in env values are expanded as the kubelet
does, and Services, budgets and autoscalers are left out (with one network namespace,
every address is 127.0.0.1). Everything is named tp-kube-<pid>-* and removed, also on
failure."""

import copy
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
from common import ROOT, podman  # noqa: E402

K8S = os.path.join(ROOT, "deploy", "k8s")
OVERLAYS = sorted(d for d in os.listdir(os.path.join(K8S, "overlays"))
                  if os.path.exists(os.path.join(K8S, "overlays", d, "kustomization.yaml")))
PLAY_OVERLAYS = os.environ.get("TIDEPOOL_KUBE_OVERLAYS", "1p1d,2p2d").split(",")
KUBECTL = shutil.which("kubectl")


def render(overlay, label="tidepool.test/rendered=1"):
    """The overlay's manifests as a list of dicts (kubectl kustomize, then kubectl's own
    YAML -> JSON: kubectl label --local works offline)."""
    y = subprocess.run([KUBECTL, "kustomize", os.path.join(K8S, "overlays", overlay)],
                       capture_output=True, text=True, timeout=60)
    if y.returncode != 0:
        raise AssertionError("kubectl kustomize overlays/%s: %s" % (overlay, y.stderr))
    j = subprocess.run([KUBECTL, "label", "--local", "-f", "-", "-o", "json", label],
                       input=y.stdout, capture_output=True, text=True, timeout=60)
    if j.returncode != 0:
        raise AssertionError("kubectl label --local: " + j.stderr)
    docs, dec, s, i = [], json.JSONDecoder(), j.stdout, 0
    while True:
        while i < len(s) and s[i].isspace():
            i += 1
        if i >= len(s):
            break
        obj, i = dec.raw_decode(s, i)
        docs.extend(obj["items"] if obj.get("kind") == "List" else [obj])
    return docs


def by_kind(docs, kind):
    return [d for d in docs if d["kind"] == kind]


def expand(value, env):
    """$(VAR) in an env value, as the kubelet expands it ($$ escapes)."""
    return re.sub(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)",
                  lambda m: "$" if m.group(0) == "$$" else env.get(m.group(1), m.group(0)),
                  value)


def to_podman(docs, rid, models_dir, image, ports):
    """(configmaps, playable docs, worker pods {pod name: (role, kv port)}) for podman kube
    play. ports: {"http", "ctl", "stats"} plus a free port per worker pod (popped from
    ports["kv"])."""
    cms, out, workers = [], [], {}
    rename = {}
    for cm in by_kind(docs, "ConfigMap"):
        cm = copy.deepcopy(cm)
        new = "%s-%s" % (rid, cm["metadata"]["name"])
        rename[cm["metadata"]["name"]] = new
        cm["metadata"] = {"name": new}
        cm["data"].update({
            "TIDEPOOL_HOST": "127.0.0.1", "TIDEPOOL_PORT": str(ports["http"]),
            "TIDEPOOL_CTL_BIND": "tcp://127.0.0.1:%d" % ports["ctl"],
            "TIDEPOOL_STATS_BIND": "tcp://127.0.0.1:%d" % ports["stats"],
            "TIDEPOOL_GATEWAY": "tcp://127.0.0.1:%d" % ports["ctl"]})
        cms.append(cm)
    claims = {}
    for pvc in by_kind(docs, "PersistentVolumeClaim"):
        pvc = copy.deepcopy(pvc)
        claims[pvc["metadata"]["name"]] = "%s-%s" % (rid, pvc["metadata"]["name"])
        pvc["metadata"] = {"name": claims[pvc["metadata"]["name"]]}
        out.append(pvc)

    def pod_spec(spec, pod_name, kv_port):
        spec = copy.deepcopy(spec)
        spec["hostNetwork"] = True
        for v in spec.get("volumes", []):
            claim = v.get("persistentVolumeClaim", {}).get("claimName")
            if claim == "tidepool-models":
                v.pop("persistentVolumeClaim")
                v["hostPath"] = {"path": models_dir, "type": "Directory"}
            elif claim in claims:
                v["persistentVolumeClaim"]["claimName"] = claims[claim]
        for c in spec["containers"]:
            c["image"] = image
            for ef in c.get("envFrom", []):
                ref = ef.get("configMapRef")
                if ref and ref["name"] in rename:
                    ref["name"] = rename[ref["name"]]
            env, known = [], {}
            for e in c.get("env", []):
                e = dict(e)
                fr = e.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath")
                if fr == "metadata.name":  # known here: needed to expand $(POD_NAME)
                    e = {"name": e["name"], "value": pod_name}
                if "value" in e:
                    e["value"] = expand(e["value"], known)
                    known[e["name"]] = e["value"]
                env.append(e)
            c["env"] = env
            if kv_port:
                # one network namespace for all: a kv port of its own, on 127.0.0.1. As flags
                # (they win over the environment): podman 4.3 lets envFrom override env, the
                # reverse of Kubernetes, so an env entry could not replace the ConfigMap's.
                c["args"] = c.get("args", []) + ["--kv-bind", "tcp://127.0.0.1:%d" % kv_port,
                                                 "--kv-advertise",
                                                 "tcp://127.0.0.1:%d" % kv_port]
            # with hostNetwork a containerPort is only a name in Kubernetes; podman makes it a
            # port mapping, which host networking refuses
            c.pop("ports", None)
            # podman turns an httpGet probe into a curl command in the container, and the
            # image has no curl: the test requests those endpoints itself instead
            for probe in ("livenessProbe", "readinessProbe", "startupProbe"):
                if "httpGet" in c.get(probe, {}):
                    c.pop(probe)
            lim = c.get("resources", {}).get("limits", {})
            if "cpu" in lim and cpu_cores(lim["cpu"]) > (os.cpu_count() or 1):
                lim["cpu"] = str(os.cpu_count() or 1)  # podman refuses more than the host has
        return spec

    for d in by_kind(docs, "Deployment"):
        d = copy.deepcopy(d)
        d["metadata"] = {"name": "%s-%s" % (rid, d["metadata"]["name"]),
                         "labels": d["metadata"].get("labels", {})}
        d["spec"]["template"]["spec"] = pod_spec(d["spec"]["template"]["spec"],
                                                 d["metadata"]["name"], None)
        out.append(d)
    for s in by_kind(docs, "StatefulSet"):
        role = s["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/component"]
        for i in range(s["spec"].get("replicas", 1)):
            name = "%s-%s-%d" % (rid, s["metadata"]["name"], i)
            kv = ports["kv"].pop()
            workers[name] = (role, kv)
            out.append({"apiVersion": "v1", "kind": "Pod",
                        "metadata": {"name": name,
                                     "labels": s["spec"]["template"]["metadata"]["labels"]},
                        "spec": pod_spec(s["spec"]["template"]["spec"], name, kv)})
    return cms, out, workers


def cpu_cores(q):
    return float(q[:-1]) / 1000 if str(q).endswith("m") else float(q)


@unittest.skipUnless(KUBECTL, "kubectl not on PATH (not a Debian package; see docs/deploy.md)")
class Render(unittest.TestCase):
    def test_overlays_render(self):
        self.assertTrue({"1p1d", "2p2d"} <= set(OVERLAYS), OVERLAYS)
        for overlay in OVERLAYS:
            docs = render(overlay)
            kinds = {d["kind"] for d in docs}
            for k in ("ConfigMap", "Deployment", "StatefulSet", "Service",
                      "PodDisruptionBudget", "PersistentVolumeClaim"):
                self.assertIn(k, kinds, overlay)
            cm = by_kind(docs, "ConfigMap")[0]
            self.assertTrue(all(k.startswith("TIDEPOOL_") for k in cm["data"]), overlay)
            gw = by_kind(docs, "Deployment")[0]["spec"]["template"]["spec"]
            c = gw["containers"][0]
            self.assertEqual(c["readinessProbe"]["httpGet"]["path"], "/health")
            # liveness must hold with API keys (no key needed: not /metrics, which then
            # needs an admin key) and while no worker is there (not /health's 200):
            # tidepool-health live takes /health's 200 or 503
            self.assertEqual(c["livenessProbe"]["exec"]["command"],
                             ["tidepool-health", "live"], overlay)
            self.assertNotIn("httpGet", c["livenessProbe"], overlay)
            for d in by_kind(docs, "Deployment") + by_kind(docs, "StatefulSet"):
                for k in d["spec"]["template"]["spec"]["containers"]:
                    for probe in ("livenessProbe", "readinessProbe", "startupProbe"):
                        path = k.get(probe, {}).get("httpGet", {}).get("path")
                        self.assertIn(path, (None, "/health"),
                                      "%s: %s %s: only /health is open with API keys" %
                                      (overlay, d["metadata"]["name"], probe))
            self.assertIn("preStop", c["lifecycle"])
            drain_s = int(cm["data"]["TIDEPOOL_DRAIN_TIMEOUT_MS"]) / 1000
            pre_s = int(c["lifecycle"]["preStop"]["exec"]["command"][-1])
            self.assertGreater(gw["terminationGracePeriodSeconds"], drain_s + pre_s,
                               "%s: the grace period must cover preStop + the drain" % overlay)
            sts = {s["metadata"]["name"]: s for s in by_kind(docs, "StatefulSet")}
            self.assertEqual(set(sts), {"tidepool-prefill", "tidepool-decode"}, overlay)
            for s in sts.values():
                spec = s["spec"]["template"]["spec"]
                w = spec["containers"][0]
                self.assertEqual(w["readinessProbe"]["exec"]["command"],
                                 ["tidepool-health", "ready"])
                self.assertEqual(w["livenessProbe"]["exec"]["command"],
                                 ["tidepool-health", "live"])
                env = {e["name"]: e for e in w["env"]}
                self.assertEqual(env["TIDEPOOL_WORKER_ID"]["value"], "$(POD_NAME)")
                self.assertIn(s["spec"]["serviceName"], env["TIDEPOOL_KV_ADVERTISE"]["value"])
                self.assertGreaterEqual(spec["terminationGracePeriodSeconds"], drain_s)
            svcs = {s["metadata"]["name"]: s for s in by_kind(docs, "Service")}
            for name in ("tidepool-prefill", "tidepool-decode", "tidepool-gateway-ctl"):
                self.assertTrue(svcs[name]["spec"].get("publishNotReadyAddresses"), name)
        n = {o: {s["metadata"]["name"]: s["spec"]["replicas"]
                 for s in by_kind(render(o), "StatefulSet")} for o in ("1p1d", "2p2d")}
        self.assertEqual(n["1p1d"], {"tidepool-prefill": 1, "tidepool-decode": 1})
        self.assertEqual(n["2p2d"], {"tidepool-prefill": 2, "tidepool-decode": 2})
        hpa = [o for o in OVERLAYS if by_kind(render(o), "HorizontalPodAutoscaler")]
        self.assertTrue(hpa, "an overlay with the example HorizontalPodAutoscaler")
        common.log("kube: overlays %s render (HPA example in %s)" % (", ".join(OVERLAYS),
                                                                     ", ".join(hpa)))

    def test_curve_overlay(self):
        """overlays/curve: every pod mounts the Secret tidepool-curve-keys read-only at /keys
        and names it in TIDEPOOL_CURVE_KEYS (the entrypoint needs a writable /tmp for its
        private copy of the secret key); the rest is 2p2d."""
        docs = render("curve")
        pods = [d["spec"]["template"]["spec"] for d in docs
                if d["kind"] in ("Deployment", "StatefulSet")]
        self.assertEqual(len(pods), 3)
        for spec in pods:
            c = spec["containers"][0]
            env = {e["name"]: e.get("value") for e in c.get("env", [])}
            self.assertEqual(env["TIDEPOOL_CURVE_KEYS"], "/keys")
            mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
            self.assertTrue(mounts["/keys"]["readOnly"])
            self.assertIn("/tmp", mounts)
            vols = {v["name"]: v for v in spec["volumes"]}
            self.assertEqual(vols[mounts["/keys"]["name"]]["secret"],
                             {"secretName": "tidepool-curve-keys", "defaultMode": 0o440})
        n = {s["metadata"]["name"]: s["spec"]["replicas"] for s in by_kind(docs, "StatefulSet")}
        self.assertEqual(n, {"tidepool-prefill": 2, "tidepool-decode": 2})


class Play:
    """podman kube play of one overlay (the subclasses below set OVERLAY)."""
    OVERLAY = None

    @classmethod
    def setUpClass(cls):
        common.ensure_image()
        cls.rid = common.run_id("kube-" + cls.OVERLAY)
        cls.tmp = tempfile.mkdtemp(prefix="tidepool-kube-")
        docs = render(cls.OVERLAY)
        n_workers = sum(s["spec"].get("replicas", 1) for s in by_kind(docs, "StatefulSet"))
        free = common.free_ports(3 + n_workers)
        cls.ports = {"http": free[0], "ctl": free[1], "stats": free[2], "kv": free[3:]}
        cms, play, cls.workers = to_podman(docs, cls.rid, common.MODELS_DIR, common.IMAGE,
                                           cls.ports)
        cls.play_file = os.path.join(cls.tmp, "play.yaml")
        cls.cm_file = os.path.join(cls.tmp, "configmap.yaml")
        # JSON documents are YAML documents
        with open(cls.play_file, "w") as f:
            f.write("\n---\n".join(json.dumps(d, indent=1) for d in play) + "\n")
        with open(cls.cm_file, "w") as f:
            f.write("\n---\n".join(json.dumps(d, indent=1) for d in cms) + "\n")
        cls.volumes = [d["metadata"]["name"] for d in play
                       if d["kind"] == "PersistentVolumeClaim"]
        cls.gateway_pod = next(d["metadata"]["name"] for d in play if d["kind"] == "Deployment") \
            + "-pod-0"
        cls.kube_net_existed = podman("network", "exists", "podman-default-kube-network",
                                      check=False).returncode == 0
        cls.cleanup = common.on_cleanup(cls.teardown_all)
        t0 = time.time()
        try:
            podman("kube", "play", "--configmap", cls.cm_file, cls.play_file, timeout=300)
        except Exception:
            cls.cleanup()
            raise
        common.log("kube: podman kube play of overlays/%s (%d pods): %.1f s"
                   % (cls.OVERLAY, 1 + len(cls.workers), time.time() - t0))

    @classmethod
    def teardown_all(cls):
        try:
            podman("kube", "down", cls.play_file, check=False)
        finally:
            for v in cls.volumes:
                podman("volume", "rm", "-f", v, check=False)
            if not cls.kube_net_existed:  # podman kube play made it for this test
                podman("network", "rm", "podman-default-kube-network", check=False)
            shutil.rmtree(cls.tmp, ignore_errors=True)

    @classmethod
    def tearDownClass(cls):
        cls.cleanup()

    def container(self, pod):
        """The tidepool container of a pod (podman names it <pod>-<container>)."""
        names = podman("ps", "-a", "--filter", "pod=" + pod, "--format",
                       "{{.Names}} {{.IsInfra}}").stdout.split("\n")
        return next(n.split()[0] for n in names if n.strip() and n.split()[1] == "false")

    def alive(self):
        for pod in [self.gateway_pod] + list(self.workers):
            c = self.container(pod)
            st = podman("inspect", "--format", "{{.State.Status}}", c).stdout.strip()
            if st != "running":
                raise AssertionError("%s is %s\n%s" % (c, st, common.container_logs(c)))

    def probe(self, pod, *args):
        return podman("exec", self.container(pod), "tidepool-health", *args, check=False)

    def test_1_serves(self):
        want = {}
        for role, _ in self.workers.values():
            want[role] = want.get(role, 0) + 1
        t0 = time.time()
        common.wait_health(self.ports["http"], 90, want, self.alive)
        common.log("kube: /health 200 with %s %.1f s after play" % (want, time.time() - t0))
        common.check_texts(self, self.ports["http"], "kube play overlays/" + self.OVERLAY)
        # worker ids are the pod names (StatefulSet identity), kv endpoints as advertised
        st, body = common.request("GET", self.ports["http"], "/workers")
        for pod, (role, kv) in self.workers.items():
            self.assertIn('"%s"' % pod, body.decode())
        # the gateway's probes: readiness /health (the test asks it: podman has no curl for
        # an httpGet probe), liveness tidepool-health live
        p = self.probe(self.gateway_pod, "live")
        self.assertEqual(p.returncode, 0, p.stdout)
        self.assertIn("gateway /health 200", p.stdout)

    def test_2_probes_and_drain(self):
        common.wait_health(self.ports["http"], 90, None, self.alive)
        for pod in self.workers:
            for mode in ("live", "ready"):
                p = self.probe(pod, mode)
                self.assertEqual(p.returncode, 0, "%s %s: %s" % (pod, mode, p.stdout))
        # The gateway goes (SIGTERM: drain, exit 0): its workers stay live but are no
        # longer ready, so Kubernetes would not restart them, only stop counting them.
        t0 = time.time()
        podman("pod", "stop", "-t", "45", self.gateway_pod, timeout=120)
        took = time.time() - t0
        self.assertEqual(common.container_exit_code(self.container(self.gateway_pod)), 0)
        self.assertLess(took, 40, "the gateway did not drain on SIGTERM")
        deadline = time.time() + 15
        for pod in self.workers:
            while self.probe(pod, "ready").returncode == 0:
                self.assertLess(time.time(), deadline, "%s still ready without a gateway" % pod)
                time.sleep(0.3)
            p = self.probe(pod, "live")
            self.assertEqual(p.returncode, 0, "%s not live without a gateway: %s" % (pod,
                                                                                     p.stdout))
        # the workers drain and exit 0 well within terminationGracePeriodSeconds
        for pod in self.workers:
            t0 = time.time()
            podman("pod", "stop", "-t", "60", pod, timeout=120)
            self.assertEqual(common.container_exit_code(self.container(pod)), 0,
                             common.container_logs(self.container(pod)))
            self.assertLess(time.time() - t0, 50, pod)
        common.log("kube: gateway drained in %.1f s; workers live but not ready without it; "
                   "all exited 0" % took)


for _o in PLAY_OVERLAYS:
    _name = "Play_" + _o.replace("-", "_")
    globals()[_name] = unittest.skipUnless(KUBECTL, "kubectl not on PATH (not a Debian "
                                           "package; see docs/deploy.md)")(
        type(_name, (Play, unittest.TestCase), {"OVERLAY": _o}))


if __name__ == "__main__":
    unittest.main()
