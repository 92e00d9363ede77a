"""Shared helpers of the deploy tests (tests/deploy/): the image, podman, free ports, HTTP,
and the reference text a greedy completion must equal. Python standard library only.

The tests run podman as root with runc and keep every container on the host's network
(or in one pod sharing it), so all test traffic goes to 127.0.0.1. Each test names what it
creates with a prefix of its own (run_id()) and removes exactly that, also on failure."""

import http.client
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.join(ROOT, "tests", "integration"))
import cluster as _cluster  # noqa: E402  (free_port: one copy)
IMAGE = os.environ.get("TIDEPOOL_IMAGE", "localhost/tidepool:latest")
MODELS_DIR = os.path.realpath(os.environ.get("TIDEPOOL_MODELS_DIR",
                                             os.path.join(ROOT, "..", "shared", "models")))
BUILD = os.environ.get("TIDEPOOL_BUILD", "build")
BIN = os.path.join(ROOT, BUILD, "bin")
REFERENCE_FILE = os.path.join(HERE, "reference.json")

# The requests every deploy test sends: greedy, so the text is a function of the model.
PROMPTS = ["Once upon a time", "The little dog"]
MAX_TOKENS = 48


def log(msg):
    print("[deploy] " + msg, file=sys.stderr, flush=True)


# --- cleanup, also when the runner's timeout sends SIGTERM (unittest would not run
# tearDownClass then)

_cleanups = []


def on_cleanup(fn):
    """Register fn (what a test created must go); returns a function that runs it once."""
    state = {"done": False}

    def once():
        if state["done"]:
            return
        state["done"] = True
        if once in _cleanups:
            _cleanups.remove(once)
        fn()
    _cleanups.append(once)
    return once


def _on_signal(sig, frame):
    log("signal %d: removing what this test created, then exiting" % sig)
    for fn in list(reversed(_cleanups)):
        try:
            fn()
        except Exception as e:  # noqa: BLE001
            log("cleanup failed: %r" % e)
    os._exit(128 + sig)


signal.signal(signal.SIGTERM, _on_signal)
signal.signal(signal.SIGINT, _on_signal)


def run_id(kind):
    """A name prefix unique to this test process: tp-<kind>-<pid>."""
    return "tp-%s-%d" % (kind, os.getpid())


def free_port():
    """A free TCP port on 127.0.0.1, drawn below the ephemeral range (tests/integration/
    cluster.py free_port: bind(0) hands out ports any outgoing connection may take)."""
    return free_ports(1)[0]


def free_ports(n):
    """n distinct free ports on 127.0.0.1, each drawn at random below the kernel's ephemeral
    range (as tests/integration/cluster.py free_port does) and checked by binding it."""
    ports = []
    while len(ports) < n:
        p = _cluster.free_port()
        if p not in ports:
            ports.append(p)
    return ports


# --- podman

_podman_env = None


def podman_env():
    """The environment podman runs with. Some hosts (VMs with lowered RLIMIT_NPROC or
    RLIMIT_NOFILE caps) refuse the ulimits rootful podman gives containers by default
    ("error setting rlimits for ready process"); then podman gets a containers.conf of its
    own (CONTAINERS_CONF) with default_ulimits within this process's limits. Probed once."""
    global _podman_env
    if _podman_env is not None:
        return _podman_env
    env = dict(os.environ)
    img = local_image()
    if img is None:
        return env  # nothing to probe with yet (building needs no workaround)
    probe = subprocess.run(["podman", "run", "--rm", "--pull=never", "--network", "none",
                            "--entrypoint", "/bin/true", img],
                           capture_output=True, text=True, env=env)
    if probe.returncode != 0 and "rlimit" in probe.stderr:
        nofile = min(resource.getrlimit(resource.RLIMIT_NOFILE)[1], 65536)
        nproc = min(resource.getrlimit(resource.RLIMIT_NPROC)[1], 16384)
        src = next((p for p in ("/etc/containers/containers.conf",
                                "/usr/share/containers/containers.conf") if os.path.exists(p)),
                   None)
        text = ""
        if src:
            with open(src) as f:
                text = f.read()
        line = 'default_ulimits = ["nofile=%d:%d", "nproc=%d:%d"]\n' % (nofile, nofile,
                                                                         nproc, nproc)
        if "\n[containers]" in "\n" + text:
            text = ("\n" + text).replace("\n[containers]\n", "\n[containers]\n" + line, 1)[1:]
        else:
            text = "[containers]\n" + line + text
        path = os.path.join(tempfile.gettempdir(), "tidepool-deploy-containers.conf")
        with open(path, "w") as f:
            f.write(text)
        env["CONTAINERS_CONF"] = path
        log("podman's default ulimits are refused here (%s); using CONTAINERS_CONF=%s with "
            "nofile=%d nproc=%d" % (probe.stderr.strip().splitlines()[-1][:120], path, nofile,
                                    nproc))
    _podman_env = env
    return env


def local_image():
    """The tidepool image or its base, whichever exists (None: neither)."""
    for img in (IMAGE, os.environ.get("TIDEPOOL_BASE_IMAGE", "localhost/tidepool-debian:12")):
        if image_exists(img):
            return img
    return None


def podman(*args, check=True, timeout=300, capture=True):
    """Run podman; returns the CompletedProcess (stdout/stderr text). podman's errors about
    systemd healthcheck timers on hosts without systemd are dropped from stderr."""
    p = subprocess.run(["podman"] + list(args), capture_output=capture, text=True,
                       timeout=timeout, env=podman_env())
    if capture:
        p.stderr = "\n".join(l for l in p.stderr.splitlines()
                             if "unable to get systemd connection" not in l)
    if check and p.returncode != 0:
        raise AssertionError("podman %s: exit %d\n%s%s" % (" ".join(args), p.returncode,
                                                          p.stdout[-3000:], p.stderr[-3000:]))
    return p


def image_exists(image=IMAGE):
    return subprocess.run(["podman", "image", "exists", image]).returncode == 0


def build_image(tag=IMAGE, extra=()):
    """deploy/container/build.sh (which makes the base image first when it is missing)."""
    t0 = time.time()
    p = subprocess.run([os.path.join(ROOT, "deploy", "container", "build.sh"), "--tag", tag]
                       + list(extra), capture_output=True, text=True, timeout=1800,
                       env=podman_env())
    if p.returncode != 0:
        raise AssertionError("build.sh failed (%d):\n%s\n%s" % (p.returncode, p.stdout[-4000:],
                                                                 p.stderr[-4000:]))
    log("build.sh --tag %s %s: %.0f s" % (tag, " ".join(extra), time.time() - t0))
    return p


def ensure_image():
    if not image_exists():
        log("%s missing: building it" % IMAGE)
        build_image()


def image_size_mb(image=IMAGE):
    out = podman("image", "inspect", "--format", "{{.Size}}", image).stdout.strip()
    return int(out) / 1e6


def container_logs(name, lines=60):
    p = podman("logs", "--tail", str(lines), name, check=False)
    return "---- %s\n%s%s" % (name, p.stdout, p.stderr)


def container_exit_code(name):
    return int(podman("inspect", "--format", "{{.State.ExitCode}}", name).stdout.strip())


def remove_containers(names):
    for n in names:
        podman("rm", "-f", "-t", "2", n, check=False)


# --- HTTP

def request(method, port, path, body=None, headers=None, timeout=30):
    """(status, body bytes) of one request to 127.0.0.1:port."""
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        h = dict(headers or {})
        data = None
        if body is not None:
            data = body if isinstance(body, bytes) else json.dumps(body).encode()
            h.setdefault("Content-Type", "application/json")
        c.request(method, path, body=data, headers=h)
        r = c.getresponse()
        return r.status, r.read()
    finally:
        c.close()


def wait_health(port, timeout=90, want=None, alive=None):
    """Wait for GET /health 200 (and, if want is given, its "workers" counts to include
    want, e.g. {"prefill": 2, "decode": 2}). alive(): raises if what should serve died.
    Returns the last /health body."""
    deadline = time.time() + timeout
    last = None
    while time.time() < deadline:
        if alive:
            alive()
        try:
            st, body = request("GET", port, "/health", timeout=2)
            last = (st, body[:300])
            if st == 200:
                h = json.loads(body)
                if not want or all(h["workers"].get(k, 0) >= v for k, v in want.items()):
                    return h
        except (OSError, http.client.HTTPException, ValueError) as e:
            last = repr(e)
        time.sleep(0.3)
    raise AssertionError("no healthy gateway on 127.0.0.1:%d within %d s (last: %r)"
                         % (port, timeout, last))


def complete(port, prompt, max_tokens=MAX_TOKENS, timeout=60):
    st, body = request("POST", port, "/v1/completions",
                    {"model": "stories260K", "prompt": prompt, "max_tokens": max_tokens,
                     "temperature": 0}, timeout=timeout)
    if st != 200:
        raise AssertionError("completion: HTTP %d %r" % (st, body[:300]))
    return json.loads(body)["choices"][0]["text"]


# --- the reference text

_reference = None


def reference():
    """{prompt: text} of greedy completions of PROMPTS (MAX_TOKENS) by the local build
    (build/bin: gateway + one prefill + one decode worker on free loopback ports). Without a
    local build, the committed tests/deploy/reference.json (made by the same code:
    tests/deploy/run.sh --update-reference)."""
    global _reference
    if _reference is not None:
        return _reference
    gguf = os.path.join(ROOT, BUILD, "models", "stories260K.gguf")
    if all(os.access(os.path.join(BIN, p), os.X_OK)
           for p in ("gateway", "prefill_worker", "decode_worker")) and os.path.exists(gguf):
        _reference = local_reference(gguf)
        src = "the local build (%s)" % BIN
    else:
        with open(REFERENCE_FILE) as f:
            _reference = json.load(f)["texts"]
        src = REFERENCE_FILE + " (no local build)"
    log("reference texts from %s" % src)
    return _reference


def local_reference(gguf):
    tmp = tempfile.mkdtemp(prefix="tidepool-deploy-ref-")
    port, ctl, kv0, kv1, stats = free_ports(5)
    procs = []
    try:
        def spawn(name, argv):
            with open(os.path.join(tmp, name + ".log"), "wb") as f:
                procs.append(subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT,
                                              cwd=ROOT))
        spawn("gateway", [os.path.join(BIN, "gateway"), "--host", "127.0.0.1", "--port",
                          str(port), "--ctl-bind", "tcp://127.0.0.1:%d" % ctl, "--stats-bind",
                          "tcp://127.0.0.1:%d" % stats, "--model", gguf, "--state-db", ""])
        for name, prog, kv in (("prefill", "prefill_worker", kv1), ("decode", "decode_worker",
                                                                     kv0)):
            spawn(name, [os.path.join(BIN, prog), "--gateway", "tcp://127.0.0.1:%d" % ctl,
                         "--model", gguf, "--worker-id", "ref-" + name, "--kv-bind",
                         "tcp://127.0.0.1:%d" % kv])

        def alive():
            for p in procs:
                if p.poll() is not None:
                    raise AssertionError("local reference cluster: a process exited; logs in "
                                         + tmp)
        wait_health(port, 30, {"prefill": 1, "decode": 1}, alive)
        return {p: complete(port, p) for p in PROMPTS}
    finally:
        for p in procs:
            if p.poll() is None:
                p.terminate()
        for p in procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
        shutil.rmtree(tmp, ignore_errors=True)


def update_reference_file():
    global _reference
    gguf = os.path.join(ROOT, BUILD, "models", "stories260K.gguf")
    _reference = local_reference(gguf)
    with open(REFERENCE_FILE, "w") as f:
        json.dump({"model": "stories260K (../shared/models, tidepool-convert)",
                   "request": {"max_tokens": MAX_TOKENS, "temperature": 0},
                   "texts": _reference}, f, indent=2)
        f.write("\n")
    log("wrote " + REFERENCE_FILE)


def check_texts(tc, port, what):
    """Send PROMPTS (each twice, concurrently) and compare with the reference."""
    import concurrent.futures
    ref = reference()
    jobs = PROMPTS * 2
    with concurrent.futures.ThreadPoolExecutor(len(jobs)) as ex:
        got = list(ex.map(lambda p: complete(port, p), jobs))
    for prompt, text in zip(jobs, got):
        tc.assertEqual(text, ref[prompt], "%s: greedy text of %r differs from the local build"
                       % (what, prompt))
    log("%s: %d greedy completions equal the reference (%r...)" % (what, len(jobs),
                                                                  got[0][:40]))


if __name__ == "__main__" and sys.argv[1:] == ["--update-reference"]:
    update_reference_file()
