"""API keys on the gateway, end to end: a real gateway + worker over HTTP.

- every /v1/ route answers 401 in OpenAI's exact shape (with WWW-Authenticate: Bearer) to a
  request without a key, with another scheme or with a wrong key, and serves a right one;
- /metrics, /workers and POST /workers/{id}/role need an admin key (401, 403, then
  served); /health stays open;
- the Batch API's files and batches belong to the key that created them: another key gets
  exactly the 404 of a nonexistent object and does not see them listed; an admin key sees
  everything; rows of a database from before keys (schema version 1) are admin-only;
- a key's requests/s and tokens/s limits answer 429 with Retry-After, then recover;
- a key file readable by group or others, or with a malformed line, stops the gateway at
  start (exit 1) with a message that never shows a key;
- no key appears in the gateway's log (run at debug level);
- the launcher passes --api-key-file to its gateway;
- tidepool-bench sends its --api-key (or TIDEPOOL_API_KEY / OPENAI_API_KEY) and hides it in
  its result JSON."""

import hashlib
import http.client
import json
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import threading
import time
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cluster import BIN, MODEL, ROOT, Cluster, free_port  # noqa: E402

ALICE = "sk-test-alice-7d1c0f3a9b2e4d68"
BOB = "sk-test-bob-51e9a2c7f0d34b86"
ADMIN = "sk-test-admin-c4f8e1a06b9d2573"
SLOW = "sk-test-slow-0a9e3d7c1f5b8246"      # requests-per-s=1
TOKENS = "sk-test-tokens-e62b9f04d1a7c385"  # tokens-per-s=100
FLAG_USER = "sk-test-flaguser-93c0d5a1e7f2b4"
FLAG_ADMIN = "sk-test-flagadmin-2b7e4c9f1a0d6"
ALL_KEYS = (ALICE, BOB, ADMIN, SLOW, TOKENS, FLAG_USER, FLAG_ADMIN)
KEY_FILE = """# keys of test_auth.py
%s
  %s   # bob: a user key

%s admin
%s requests-per-s=1
%s tokens-per-s=100
""" % (ALICE, BOB, ADMIN, SLOW, TOKENS)

NO_KEY = {"error": {
    "message": "You didn't provide an API key. You need to provide your API key in an "
               "Authorization header using Bearer auth (i.e. Authorization: Bearer YOUR_KEY).",
    "type": "invalid_request_error", "param": None, "code": "invalid_api_key"}}
WRONG_KEY = {"error": {"message": "Incorrect API key provided.", "type": "invalid_request_error",
                       "param": None, "code": "invalid_api_key"}}
NOT_ADMIN = {"error": {
    "message": "You have insufficient permissions for this operation: it needs an admin API "
               "key.",
    "type": "permission_error", "param": None, "code": "insufficient_permissions"}}
BOUNDARY = "tidepool-auth-boundary-91c3"


def key_id(key):
    """The gateway's id of a key: the first 12 hex digits of its BLAKE2b-256 digest."""
    return hashlib.blake2b(key.encode(), digest_size=32).hexdigest()[:12]


def bearer(key):
    return {"Authorization": "Bearer " + key}


def upload_body(text):
    return (("--%s\r\nContent-Disposition: form-data; name=\"purpose\"\r\n\r\nbatch\r\n"
             "--%s\r\nContent-Disposition: form-data; name=\"file\"; filename=\"in.jsonl\"\r\n"
             "Content-Type: application/jsonl\r\n\r\n%s\r\n--%s--\r\n") %
            (BOUNDARY, BOUNDARY, text, BOUNDARY)).encode()


def batch_lines(n=2, max_tokens=4):
    return "\n".join(json.dumps({"custom_id": "r%d" % i, "method": "POST",
                                 "url": "/v1/completions",
                                 "body": {"model": "stories260K", "prompt": "Once upon a time",
                                          "max_tokens": max_tokens, "temperature": 0}})
                     for i in range(n)) + "\n"


def key_cluster(tmp_key_file_text=KEY_FILE, mode=0o600, roles=("mixed",), extra=(),
                worker_args=()):
    """A cluster whose gateway reads a key file written with mode, plus the flag keys."""
    c = Cluster(roles=roles, worker_args=list(worker_args))
    path = os.path.join(c.tmp, "keys")
    with open(path, "w") as f:
        f.write(tmp_key_file_text)
    os.chmod(path, mode)
    c.key_file = path
    c.gateway_args = ["--api-key-file", path, "--api-key", FLAG_USER, "--admin-api-key",
                      FLAG_ADMIN, "--log-level", "debug"] + list(extra)
    return c


class AuthTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        # a decode step takes >= 20 ms: a 150-token request is still running 0.2 s later
        cls.c = key_cluster(worker_args=["--debug-step-delay-ms", "20"],
                            extra=["--responses-store", "true"])
        cls.c.start()

    @classmethod
    def tearDownClass(cls):
        cls.c.stop()
        assert cls.c.sanitizer_reports() == [], cls.c.sanitizer_reports()

    def call(self, method, path, key=None, body=None, raw=None, headers=None):
        """(status, headers dict (lower-case names), parsed JSON or text)."""
        h = {"Content-Type": "application/json"}
        if key is not None:
            h.update(bearer(key))
        h.update(headers or {})
        conn = http.client.HTTPConnection("127.0.0.1", self.c.port, timeout=60)
        data = raw if raw is not None else (json.dumps(body).encode() if body is not None
                                            else None)
        conn.request(method, path, body=data, headers=h)
        r = conn.getresponse()
        text = r.read().decode("utf-8", errors="replace")
        hdrs = {k.lower(): v for k, v in r.getheaders()}
        self.last_reason = r.reason
        conn.close()
        try:
            return r.status, hdrs, json.loads(text)
        except ValueError:
            return r.status, hdrs, text

    CHAT = {"model": "stories260K", "messages": [{"role": "user", "content": "Hi"}],
            "max_tokens": 4, "temperature": 0}
    COMPLETION = {"model": "stories260K", "prompt": "Once upon a time", "max_tokens": 4,
                  "temperature": 0}
    V1_ROUTES = [("POST", "/v1/chat/completions", CHAT), ("POST", "/v1/completions", COMPLETION),
                 ("GET", "/v1/models", None), ("GET", "/v1/models/stories260K", None),
                 ("POST", "/v1/files?purpose=batch", None), ("GET", "/v1/files/file-x", None),
                 ("GET", "/v1/files/file-x/content", None), ("GET", "/v1/files", None),
                 ("DELETE", "/v1/files/file-x", None), ("GET", "/v1/batches", None),
                 ("POST", "/v1/batches", {"input_file_id": "file-x",
                                          "endpoint": "/v1/completions",
                                          "completion_window": "24h"}),
                 ("GET", "/v1/batches/batch_x", None), ("POST", "/v1/batches/batch_x/cancel", None),
                 ("GET", "/v1/responses/resp_x", None), ("DELETE", "/v1/responses/resp_x", None)]

    def test_v1_needs_a_key(self):
        for method, path, body in self.V1_ROUTES:
            for headers, want in (({}, NO_KEY), (bearer("sk-wrong-key-00000000000"), WRONG_KEY),
                                  (bearer(ALICE + "x"), WRONG_KEY), (bearer(ALICE[:-1]), WRONG_KEY),
                                  ({"Authorization": "Basic " + ALICE}, NO_KEY),
                                  ({"Authorization": "Bearer "}, NO_KEY)):
                status, h, got = self.call(method, path, body=body, headers=headers)
                self.assertEqual((status, got), (401, want), (method, path, headers))
                self.assertEqual(h.get("www-authenticate"), "Bearer", (method, path))
                self.assertEqual(h.get("content-type"), "application/json")

    def test_two_authorization_headers(self):
        """One Authorization field only: with two, the first decided (a right key then a
        wrong one was served, the other order refused)."""
        for first, second in ((ALICE, "sk-wrong-key-00000000000"),
                              ("sk-wrong-key-00000000000", ALICE), (ALICE, ALICE), (ADMIN, ALICE)):
            for path in ("/v1/models", "/workers"):
                conn = http.client.HTTPConnection("127.0.0.1", self.c.port, timeout=60)
                conn.putrequest("GET", path)
                conn.putheader("Authorization", "Bearer " + first)
                conn.putheader("Authorization", "Bearer " + second)
                conn.endheaders()
                r = conn.getresponse()
                got = json.loads(r.read())
                conn.close()
                self.assertEqual(r.status, 401, (first, second, path, got))
                self.assertEqual(r.getheader("WWW-Authenticate"), "Bearer")
                self.assertEqual(got, {"error": {
                    "message": "More than one Authorization header was sent; send one, with "
                               "your API key as a Bearer token.",
                    "type": "invalid_request_error", "param": None, "code": "invalid_api_key"}})
        self.assertEqual(self.call("GET", "/v1/models", ALICE)[0], 200)

    def test_exact_bytes(self):
        conn = http.client.HTTPConnection("127.0.0.1", self.c.port, timeout=60)
        conn.request("GET", "/v1/models", headers=bearer("sk-wrong-key-00000000000"))
        r = conn.getresponse()
        self.assertEqual((r.status, r.read()), (401, b'{"error":{"message":"Incorrect API key '
                         b'provided.","type":"invalid_request_error","param":null,'
                         b'"code":"invalid_api_key"}}'))
        conn.close()

    def test_right_keys_are_served(self):
        for key in (ALICE, FLAG_USER, ADMIN, FLAG_ADMIN):
            status, _, got = self.call("POST", "/v1/chat/completions", key, self.CHAT)
            self.assertEqual(status, 200, got)
            self.assertEqual(got["object"], "chat.completion")
            status, _, got = self.call("POST", "/v1/completions", key, self.COMPLETION)
            self.assertEqual(status, 200, got)
            self.assertEqual(got["usage"]["completion_tokens"], 4)
            status, _, got = self.call("GET", "/v1/models", key)
            self.assertEqual(status, 200)
            self.assertEqual([m["id"] for m in got["data"]], ["stories260K"])
            status, _, got = self.call("GET", "/v1/batches", key)
            self.assertEqual(status, 200)
        # the scheme is case-insensitive, surrounding spaces are ignored
        status, _, _ = self.call("GET", "/v1/models", headers={"Authorization":
                                                               "bearer   %s  " % BOB})
        self.assertEqual(status, 200)
        # streaming, through the harness's own key
        self.c.api_key = ALICE
        try:
            status, text, events, done = self.c.stream_text("Once upon a time", max_tokens=4)
        finally:
            self.c.api_key = None
        self.assertEqual((status, done), (200, True))
        # an unknown path is still 404, a wrong method 405 (before the key is looked at)
        status, _, got = self.call("GET", "/v1/nothing")
        self.assertEqual((status, got["error"]["code"]), (404, "unknown_url"))

    def test_admin_endpoints(self):
        for method, path, body in (("GET", "/metrics", None), ("GET", "/workers", None),
                                   ("POST", "/workers/mixed-0/role", {"role": "decode"})):
            status, h, got = self.call(method, path, body=body)
            self.assertEqual((status, got, h.get("www-authenticate")), (401, NO_KEY, "Bearer"))
            status, _, got = self.call(method, path, "sk-wrong-key-00000000000", body)
            self.assertEqual((status, got), (401, WRONG_KEY))
            for key in (ALICE, FLAG_USER, BOB):
                status, h, got = self.call(method, path, key, body)
                self.assertEqual((status, got), (403, NOT_ADMIN), (path, key))
                self.assertNotIn("www-authenticate", h)
        for key in (ADMIN, FLAG_ADMIN):
            status, h, text = self.call("GET", "/metrics", key)
            self.assertEqual(status, 200)
            self.assertTrue(text.startswith("# HELP tidepool_"), text[:200])
            status, _, got = self.call("GET", "/workers", key)
            self.assertEqual(status, 200)
            self.assertEqual([w["id"] for w in got["workers"]], ["mixed-0"])
            # past the key check: the role endpoint's own answer (a mixed worker cannot change)
            status, _, got = self.call("POST", "/workers/nobody/role", key, {"role": "decode"})
            self.assertEqual((status, got["error"]["code"]), (404, "worker_not_found"))
            # the id is percent-decoded: "mixed%2D0" is mixed-0 (refused: mixed), not a 404
            for wid in ("mixed%2D0", "mixed%2d0", "%6Dixed-0"):
                status, _, got = self.call("POST", "/workers/%s/role" % wid, key,
                                           {"role": "decode"})
                self.assertEqual((status, got["error"]["code"]), (409, "role_change_refused"),
                                 wid)
            # one that decodes to a NUL or "/", or a bad escape, is 400 (it was 404)
            for wid, code in (("mixed%00-0", "invalid_value"), ("mixed%2F0", "invalid_value"),
                              ("mixed-0%", "bad_request")):
                status, _, got = self.call("POST", "/workers/%s/role" % wid, key,
                                           {"role": "decode"})
                self.assertEqual((status, got["error"]["code"]), (400, code), (wid, got))
        status, _, got = self.call("GET", "/health")
        self.assertEqual((status, got["status"]), (200, "ok"))
        status, _, got = self.call("GET", "/health", "sk-wrong-key-00000000000")
        self.assertEqual(status, 200)

    def wait_batch(self, key, batch_id, timeout=60):
        deadline = time.time() + timeout
        while time.time() < deadline:
            status, _, b = self.call("GET", "/v1/batches/" + batch_id, key)
            self.assertEqual(status, 200, b)
            if b["status"] in ("completed", "failed", "cancelled"):
                return b
            time.sleep(0.1)
        raise AssertionError("batch %s not done: %r" % (batch_id, b))

    def test_batch_ownership(self):
        h = {"Content-Type": "multipart/form-data; boundary=" + BOUNDARY}
        status, _, f = self.call("POST", "/v1/files", ALICE, raw=upload_body(batch_lines()),
                                 headers=h)
        self.assertEqual(status, 200, f)
        fid = f["id"]
        status, _, b = self.call("POST", "/v1/batches", ALICE,
                                 {"input_file_id": fid, "endpoint": "/v1/completions",
                                  "completion_window": "24h"})
        self.assertEqual(status, 200, b)
        bid = b["id"]
        # bob: every answer is the one for an object that does not exist
        no_file = {"error": {"message": "No such File object: " + fid,
                             "type": "invalid_request_error", "param": "file_id",
                             "code": "file_not_found"}}
        no_batch = {"error": {"message": "No such batch: " + bid, "type": "invalid_request_error",
                              "param": "batch_id", "code": "batch_not_found"}}
        for key in (BOB, FLAG_USER):
            self.assertEqual(self.call("GET", "/v1/files/" + fid, key)[::2], (404, no_file))
            self.assertEqual(self.call("GET", "/v1/files/%s/content" % fid, key)[::2],
                             (404, no_file))
            self.assertEqual(self.call("GET", "/v1/batches/" + bid, key)[::2], (404, no_batch))
            self.assertEqual(self.call("POST", "/v1/batches/%s/cancel" % bid, key)[::2],
                             (404, no_batch))
            status, _, got = self.call("POST", "/v1/batches", key,
                                       {"input_file_id": fid, "endpoint": "/v1/completions",
                                        "completion_window": "24h"})
            self.assertEqual((status, got), (404, {"error": {
                "message": "No such File object: " + fid, "type": "invalid_request_error",
                "param": "input_file_id", "code": "file_not_found"}}))
            status, _, got = self.call("GET", "/v1/batches", key)
            self.assertEqual(status, 200)
            self.assertNotIn(bid, [x["id"] for x in got["data"]])
            status, _, got = self.call("GET", "/v1/batches?after=" + bid, key)
            self.assertEqual((status, got["error"]["code"]), (404, "batch_not_found"))
            # nor list, page from or delete her file
            self.assertEqual(self.call("DELETE", "/v1/files/" + fid, key)[::2], (404, no_file))
            status, _, got = self.call("GET", "/v1/files", key)
            self.assertEqual(status, 200)
            self.assertNotIn(fid, [x["id"] for x in got["data"]])
            status, _, got = self.call("GET", "/v1/files?after=" + fid, key)
            self.assertEqual((status, got), (404, {"error": dict(no_file["error"],
                                                                 param="after")}))
        # the same answers for a nonexistent object (the bodies above are those of 404s)
        self.assertEqual(self.call("GET", "/v1/files/file-nope", BOB)[0], 404)
        # alice and the admins see them
        for key in (ALICE, ADMIN, FLAG_ADMIN):
            self.assertEqual(self.call("GET", "/v1/files/" + fid, key)[0], 200)
            status, _, got = self.call("GET", "/v1/files", key)
            self.assertIn(fid, [x["id"] for x in got["data"]])
            status, _, got = self.call("GET", "/v1/batches", key)
            self.assertIn(bid, [x["id"] for x in got["data"]])
        b = self.wait_batch(ALICE, bid)
        self.assertEqual((b["status"], b["request_counts"]["completed"]), ("completed", 2))
        out = b["output_file_id"]
        status, _, text = self.call("GET", "/v1/files/%s/content" % out, ALICE)
        self.assertEqual(status, 200)
        self.assertEqual(len(text.strip().split("\n")) if isinstance(text, str) else 1, 2)
        self.assertEqual(self.call("GET", "/v1/files/%s/content" % out, BOB)[0], 404)
        self.assertEqual(self.call("GET", "/v1/files/%s/content" % out, ADMIN)[0], 200)
        # the owner deletes her output file; an admin deletes her input file
        self.assertEqual(self.call("DELETE", "/v1/files/" + out, ALICE)[::2],
                         (200, {"id": out, "object": "file", "deleted": True}))
        self.assertEqual(self.call("DELETE", "/v1/files/" + fid, ADMIN)[::2],
                         (200, {"id": fid, "object": "file", "deleted": True}))
        self.assertEqual(self.call("GET", "/v1/files/" + fid, ALICE)[0], 404)
        # bob's own batch is his; alice does not see it; list shows each only their own
        status, _, f2 = self.call("POST", "/v1/files", BOB, raw=upload_body(batch_lines(1)),
                                  headers=h)
        status, _, b2 = self.call("POST", "/v1/batches", BOB,
                                  {"input_file_id": f2["id"], "endpoint": "/v1/completions",
                                   "completion_window": "24h"})
        self.assertEqual(status, 200, b2)
        self.assertEqual(self.call("GET", "/v1/batches/" + b2["id"], ALICE)[0], 404)
        ids = [x["id"] for x in self.call("GET", "/v1/batches", BOB)[2]["data"]]
        self.assertIn(b2["id"], ids)
        self.assertNotIn(bid, ids)
        ids = [x["id"] for x in self.call("GET", "/v1/batches?limit=100", ADMIN)[2]["data"]]
        self.assertIn(b2["id"], ids)
        self.assertIn(bid, ids)
        # the log names the owner by its id, never by the key
        self.assertRegex(self.c.log("gateway"), r"batch %s created: .* key [0-9a-f]{12}" % bid)

    def test_stored_response_ownership(self):
        status, _, r = self.call("POST", "/v1/responses", ALICE, {
            "input": "Tell me a story.", "max_output_tokens": 4, "temperature": 0})
        self.assertEqual(status, 200, r)
        rid = r["id"]
        gone = {"error": {"message": "Response with id '%s' not found." % rid,
                          "type": "invalid_request_error", "param": "response_id",
                          "code": "response_not_found"}}
        self.assertEqual(self.call("GET", "/v1/responses/" + rid)[0], 401)
        for key in (BOB, FLAG_USER):  # another key: as if there were none
            self.assertEqual(self.call("GET", "/v1/responses/" + rid, key)[::2], (404, gone))
            self.assertEqual(self.call("DELETE", "/v1/responses/" + rid, key)[::2], (404, gone))
        for key in (ALICE, ADMIN):
            self.assertEqual(self.call("GET", "/v1/responses/" + rid, key)[::2], (200, r))
        self.assertEqual(self.call("DELETE", "/v1/responses/" + rid, ALICE)[::2],
                         (200, {"id": rid, "object": "response", "deleted": True}))
        self.assertEqual(self.call("GET", "/v1/responses/" + rid, ADMIN)[::2], (404, gone))

    def test_request_rate_limit(self):
        status, _, _ = self.call("GET", "/v1/models", SLOW)
        self.assertEqual(status, 200)
        status, h, got = self.call("GET", "/v1/models", SLOW)
        self.assertEqual(status, 429)
        self.assertEqual(self.last_reason, "Too Many Requests")  # RFC 6585 (libevent: none)
        self.assertEqual(h.get("retry-after"), "1")
        e = got["error"]
        self.assertEqual((e["type"], e["param"], e["code"]), ("requests", None,
                                                              "rate_limit_exceeded"))
        self.assertRegex(e["message"], r"^Rate limit reached for requests per second \(RPS\) of "
                                       r"API key [0-9a-f]{12}: limit 1\. Please try again in 1s\.$")
        self.assertEqual(self.call("GET", "/v1/models", ALICE)[0], 200)  # others unaffected
        time.sleep(1.05)
        self.assertEqual(self.call("GET", "/v1/models", SLOW)[0], 200)

    def test_token_rate_limit(self):
        # 150 tokens + a 5-token prompt > the bucket (100): admitted on a full bucket, which
        # goes 55 into debt while it runs (>= 0.2 s at 20 ms per step)
        body = dict(self.COMPLETION, max_tokens=150)
        first = {}
        t = threading.Thread(target=lambda: first.update(
            r=self.call("POST", "/v1/completions", TOKENS, body)))
        t.start()
        time.sleep(0.2)
        status, h, got = self.call("POST", "/v1/completions", TOKENS,
                                   dict(self.COMPLETION, max_tokens=1))
        t.join()
        self.assertEqual(first["r"][0], 200, first["r"])
        self.assertGreater(first["r"][2]["usage"]["completion_tokens"], 30)
        self.assertEqual(status, 429, got)
        e = got["error"]
        self.assertEqual((e["type"], e["param"], e["code"]), ("tokens", None,
                                                              "rate_limit_exceeded"))
        ra = int(h["retry-after"])
        self.assertGreaterEqual(ra, 1)
        self.assertRegex(e["message"], r"^Rate limit reached for tokens per second \(TPS\) of API "
                                       r"key [0-9a-f]{12}: limit 100, requested 6 \(prompt \+ "
                                       r"max_tokens\)\. Please try again in %ds\.$" % ra)
        time.sleep(ra + 0.05)
        status, _, got = self.call("POST", "/v1/completions", TOKENS,
                                   dict(self.COMPLETION, max_tokens=1))
        self.assertEqual(status, 200, got)

    def test_zz_no_key_in_the_log(self):
        # after the others (alphabetical order): every key was sent many times by now; refusals
        # are logged at most once a second
        time.sleep(1.1)
        self.call("GET", "/v1/models", "sk-wrong-key-00000000000")
        log = self.c.log("gateway")
        self.assertIn("config api-key = (1 given, not shown)", log)
        self.assertIn("401: an unknown API key", log)
        for key in ALL_KEYS + ("sk-wrong-key-00000000000",):
            self.assertNotIn(key, log)
            self.assertNotIn(key[8:], log)  # not even the key's tail


class BenchWithKeyTest(unittest.TestCase):
    def bench(self, c, args, env_key=None, env_name="TIDEPOOL_API_KEY"):
        out = os.path.join(c.tmp, "bench.json")
        env = {k: v for k, v in os.environ.items()
               if k not in ("TIDEPOOL_API_KEY", "OPENAI_API_KEY")}
        if env_key:
            env[env_name] = env_key
        p = subprocess.run([os.path.join(BIN, "tidepool-bench"), "--url",
                            "http://127.0.0.1:%d" % c.port, "--num-prompts", "4",
                            "--input-len", "4", "--output-len", "4", "--no-progress",
                            "--model", "stories260K", "--result-json", out] + args,
                           capture_output=True, text=True, timeout=120, env=env)
        with open(out) as f:
            text = f.read()
        return p, json.loads(text), text

    def test_bench_sends_the_key(self):
        with Cluster(roles=("mixed",), gateway_args=["--api-key", ALICE]) as c:
            p, res, text = self.bench(c, ["--api-key", ALICE])
            self.assertEqual((res["completed"], res["failed"]), (4, 0), p.stdout + p.stderr)
            self.assertNotIn(ALICE, text)
            self.assertIn("(hidden)", res["argv"])
            p, res, text = self.bench(c, ["--api-key=" + ALICE])
            self.assertEqual(res["completed"], 4)
            self.assertIn("--api-key=(hidden)", res["argv"])
            self.assertNotIn(ALICE, text)
            for name in ("TIDEPOOL_API_KEY", "OPENAI_API_KEY"):
                p, res, _ = self.bench(c, [], env_key=ALICE, env_name=name)
                self.assertEqual(res["completed"], 4, name)
            p, res, _ = self.bench(c, [])
            self.assertEqual((res["completed"], res["failed"]), (0, 4))
            self.assertEqual([(e["count"], "401" in e["first_message"]) for e in res["errors"]],
                             [(4, True)], res["errors"])

    def test_401_hint_names_the_key(self):
        """Without --model, a 401 on /v1/models points to --api-key, not to --model."""
        with Cluster(roles=("mixed",), gateway_args=["--api-key", ALICE]) as c:
            url = "http://127.0.0.1:%d" % c.port
            env = {k: v for k, v in os.environ.items()
                   if k not in ("TIDEPOOL_API_KEY", "OPENAI_API_KEY")}
            for extra, why in (([], "the server wants an API key"),
                               (["--api-key", BOB], "the server refused the API key given")):
                p = subprocess.run([os.path.join(BIN, "tidepool-bench"), "--url", url,
                                    "--num-prompts", "1", "--no-progress"] + extra,
                                   capture_output=True, text=True, timeout=60, env=env)
                self.assertEqual(p.returncode, 1, p.stderr)
                self.assertEqual(p.stderr, "tidepool-bench: %s/v1/models: HTTP 401: %s: pass "
                                 "--api-key KEY (or set TIDEPOOL_API_KEY)\n" % (url, why))


class LauncherWithKeysTest(unittest.TestCase):
    def test_launcher_passes_the_key_file(self):
        c = Cluster(roles=())  # its temporary directory and its HTTP client only
        c.port = free_port()
        keys = os.path.join(c.tmp, "keys")
        with open(keys, "w") as f:
            f.write("%s\n%s admin\n" % (ALICE, ADMIN))
        os.chmod(keys, 0o600)
        env = {k: v for k, v in os.environ.items() if not k.startswith("TIDEPOOL_API")}
        env["TIDEPOOL_BIN"] = BIN
        log = open(os.path.join(c.tmp, "launcher.log"), "wb")
        p = subprocess.Popen(
            [os.path.join(ROOT, "deploy/local/start"), "--no-build", "--mixed", "1",
             "--port", str(c.port), "--ctl-port", str(free_port()), "--kv-port", str(free_port()),
             "--stats-port", str(free_port()), "--model", MODEL, "--api-key-file", keys],
            stdout=subprocess.PIPE, stderr=log, env=env, start_new_session=True)
        try:
            line = p.stdout.readline().decode()
            self.assertIn("mixed workers; API keys required). Ctrl-C stops it.", line)
            self.assertEqual(c.request("GET", "/v1/models")[0], 401)
            self.assertEqual(c.request("GET", "/v1/models", headers=bearer(ALICE))[0], 200)
            self.assertEqual(c.request("GET", "/workers", headers=bearer(ALICE))[0], 403)
            self.assertEqual(c.request("GET", "/workers", headers=bearer(ADMIN))[0], 200)
        finally:
            p.send_signal(signal.SIGTERM)
            try:
                self.assertEqual(p.wait(timeout=40), 0)
            finally:
                if p.poll() is None:
                    os.killpg(p.pid, signal.SIGKILL)
                p.stdout.close()
                log.close()
        with open(os.path.join(c.tmp, "launcher.log"), errors="replace") as f:
            text = f.read()
        self.assertNotIn(ALICE, text)
        self.assertNotIn(ADMIN, text)


class KeyFileTest(unittest.TestCase):
    def refused(self, text, mode, want):
        c = key_cluster(text, mode, roles=())
        try:
            p = c.start_gateway()
            rc = p.wait(timeout=20)
            log = c.log("gateway")
            self.assertEqual(rc, 1, log)
            self.assertIn(want.replace("FILE", c.key_file), log)
            for key in ALL_KEYS:
                self.assertNotIn(key, log)
        finally:
            c.stop()

    def test_group_or_world_readable_file_refused(self):
        self.refused(KEY_FILE, 0o644,
                     "FILE: the API key file is accessible by group or others (mode 0644): "
                     "make it readable by its owner only (chmod 600)")
        self.refused(KEY_FILE, 0o640, "(mode 0640)")

    def test_malformed_lines_refused(self):
        self.refused("# ok\n%s\n%s %s\n" % (ALICE, BOB, ADMIN), 0o600,
                     "FILE: line 3: word 2 is not an attribute (want admin, requests-per-s=N or "
                     "tokens-per-s=N after the key)")
        self.refused("%s requests-per-s=-1\n" % ALICE, 0o600,
                     "FILE: line 1: word 2: a rate must be a number in (0, 1e9]")
        self.refused("%s\n%s admin\n" % (ALICE, ALICE), 0o600,
                     "FILE: line 2: the API key with id ")
        self.refused("# no key\n", 0o600, "FILE: the API key file holds no key")
        self.refused("%s admin admin\n" % ALICE, 0o600,
                     "FILE: line 1: word 3 repeats the attribute admin")
        self.refused("%s\n%s requests-per-s=1 requests-per-s=2\n" % (ALICE, BOB), 0o600,
                     "FILE: line 2: word 3 repeats the attribute requests-per-s")

    def start_refused(self, args=(), env=None, rc=2, want="", config=None, config_mode=0o600):
        """Start a gateway that must exit with rc, its log holding want (CONFIG: the path of
        the config file written from config with config_mode, FILE: the key file)."""
        c = Cluster(roles=(), env=env or {})
        cfg = os.path.join(c.tmp, "gateway.ini")
        if config is not None:
            with open(cfg, "w") as f:
                f.write(config)
            os.chmod(cfg, config_mode)
            args = list(args) + ["--config", cfg]
        c.gateway_args = list(args)
        try:
            p = c.start_gateway()
            got = p.wait(timeout=20)
            log = c.log("gateway")
            self.assertEqual(got, rc, log)
            self.assertIn(want.replace("CONFIG", cfg), log)
            self.assertNotIn("API keys: none", log)
            for key in ALL_KEYS:
                self.assertNotIn(key, log)
        finally:
            c.stop()

    def test_blank_keys_refused(self):
        """An empty or blank key anywhere stops the gateway: it must not start open (the
        trial: --api-key "$UNSET_VAR", TIDEPOOL_API_KEY=" " and `api-key =` all did)."""
        empty = "empty value for %s (from %s)%s: give a value, or leave the setting out"
        no_file = ("api-key-file is empty (--api-key-file, TIDEPOOL_API_KEY_FILE or the config "
                   "file): give the key file's path, or leave the setting out")
        cases = [
            (["--api-key", ""], {}, 2, empty % ("api-key", "flags", "")),
            (["--api-key", ALICE, "--admin-api-key", " "], {}, 2,
             empty % ("admin-api-key", "flags", "")),
            (["--api-key-file", ""], {}, 1, no_file),
            (["--api-key-file", " "], {}, 1, no_file),
            ([], {"TIDEPOOL_API_KEY_FILE": ""}, 1, no_file),
            ([], {"TIDEPOOL_API_KEY": ""}, 2, empty % ("api-key", "TIDEPOOL_API_KEY", "")),
            ([], {"TIDEPOOL_API_KEY": " "}, 2, empty % ("api-key", "TIDEPOOL_API_KEY", "")),
            ([], {"TIDEPOOL_API_KEY": ", ,"}, 2,
             empty % ("api-key", "TIDEPOOL_API_KEY",
                      " (value 1 of the comma-separated list)")),
            ([], {"TIDEPOOL_ADMIN_API_KEY": "%s,," % ADMIN}, 2,
             empty % ("admin-api-key", "TIDEPOOL_ADMIN_API_KEY",
                      " (value 2 of the comma-separated list)")),
            ([], {"TIDEPOOL_API_KEY": "%s admin" % ADMIN}, 2,
             "invalid value for api-key (from TIDEPOOL_API_KEY): a value holds whitespace (one "
             "key per value, separated by commas in the environment; attributes such as admin "
             "go in the key file)"),
        ]
        for args, env, rc, want in cases:
            with self.subTest(args=args, env=env):
                self.start_refused(args, env, rc, want)
        self.start_refused(config="api-key =\n", want=empty % ("api-key", "CONFIG", ""))
        self.start_refused(config="api-key-file =\n", rc=1, want=no_file)

    def test_config_file_with_keys_must_be_private(self):
        """A config file that sets api-key is mode-checked as the key file is."""
        for mode in (0o644, 0o640):
            self.start_refused(config="api-key = %s\n" % ALICE, config_mode=mode,
                               want="CONFIG: the config file sets api-key but is accessible by "
                                    "group or others (mode %04o): make it readable by its owner "
                                    "only (chmod 600), or move the keys to a key file" % mode)
        self.start_refused(config="[auth]\nadmin-api-key = %s\n" % ADMIN, config_mode=0o604,
                           want="CONFIG: the config file sets admin-api-key but is accessible")
        c = Cluster(roles=("mixed",))
        cfg = os.path.join(c.tmp, "gateway.ini")
        with open(cfg, "w") as f:
            f.write("api-key = %s\n" % ALICE)
        os.chmod(cfg, 0o600)
        c.gateway_args = ["--config", cfg]
        with c:
            self.assertEqual(c.request("GET", "/v1/models")[0], 401)
            self.assertEqual(c.request("GET", "/v1/models", headers=bearer(ALICE))[0], 200)

    def test_duplicate_names_both_sources(self):
        """TIDEPOOL_API_KEY=$(head -n 1 keys) with --api-key-file keys: the refusal says
        where the other copy is."""
        c = key_cluster("%s\n%s admin\n" % (BOB, ALICE), 0o600, roles=())
        c.env["TIDEPOOL_API_KEY"] = ALICE
        c.gateway_args = ["--api-key-file", c.key_file]
        try:
            p = c.start_gateway()
            self.assertEqual(p.wait(timeout=20), 1)
            log = c.log("gateway")
            self.assertIn("%s: line 2: the API key with id %s is given twice: in "
                          "TIDEPOOL_API_KEY and in %s line 2" % (c.key_file, key_id(ALICE),
                                                                 c.key_file), log)
            self.assertNotIn(ALICE, log)
        finally:
            c.stop()
        c = Cluster(roles=())
        c.gateway_args = ["--api-key", BOB, "--api-key", ALICE, "--admin-api-key", ALICE]
        try:
            p = c.start_gateway()
            self.assertEqual(p.wait(timeout=20), 1)
            self.assertIn("--admin-api-key: the API key with id %s is given twice: in --api-key "
                          "(value 2) and in --admin-api-key" % key_id(ALICE), c.log("gateway"))
        finally:
            c.stop()

    def test_unreadable_file_refused(self):
        c = Cluster(roles=())
        c.gateway_args = ["--api-key-file", os.path.join(c.tmp, "absent")]
        try:
            p = c.start_gateway()
            self.assertEqual(p.wait(timeout=20), 1)
            self.assertIn("absent: cannot open the API key file: No such file or directory",
                          c.log("gateway"))
        finally:
            c.stop()

    def test_keys_without_admin_warn(self):
        c = Cluster(roles=("mixed",), gateway_args=["--api-key", ALICE])
        c.api_key = ALICE
        with c:
            self.assertIn("API keys but no admin key", c.log("gateway"))
            status, _ = c.request("GET", "/metrics")
            self.assertEqual(status, 403)
            status, _ = c.request("GET", "/metrics", headers={"Authorization": "Bearer " + BOB})
            self.assertEqual(status, 401)
            status, _ = c.complete("Once upon a time", max_tokens=2)
            self.assertEqual(status, 200)

    def test_keys_from_the_environment(self):
        c = Cluster(roles=("mixed",), env={"TIDEPOOL_API_KEY": "%s,%s" % (ALICE, BOB),
                                           "TIDEPOOL_ADMIN_API_KEY": ADMIN})
        with c:
            for key, want in ((ALICE, 200), (BOB, 200), (ADMIN, 200), (FLAG_USER, 401)):
                status, _ = c.request("GET", "/v1/models", headers=bearer(key))
                self.assertEqual(status, want, key)
            status, _ = c.request("GET", "/workers", headers=bearer(ADMIN))
            self.assertEqual(status, 200)
            self.assertIn("config api-key = (2 given, not shown)", c.log("gateway"))

    def test_old_database_rows_are_admin_only(self):
        c = key_cluster(roles=("mixed",))
        os.makedirs(os.path.dirname(c.state_db))
        db = sqlite3.connect(c.state_db)
        db.executescript(
            "CREATE TABLE meta(key TEXT PRIMARY KEY, value TEXT NOT NULL);"
            "CREATE TABLE files(id TEXT PRIMARY KEY, purpose TEXT NOT NULL,"
            " filename TEXT NOT NULL, bytes INTEGER NOT NULL, created_at INTEGER NOT NULL,"
            " content BLOB NOT NULL);"
            "CREATE TABLE batches(id TEXT PRIMARY KEY, object TEXT NOT NULL);"
            "CREATE TABLE results(batch_id TEXT NOT NULL, line INTEGER NOT NULL,"
            " ok INTEGER NOT NULL, body TEXT NOT NULL, PRIMARY KEY(batch_id, line));"
            "INSERT INTO meta VALUES('schema_version', '1');"
            "INSERT INTO files VALUES('file-old', 'batch', 'old.jsonl', 3, 7, 'abc');")
        db.commit()
        db.close()
        with c:
            status, got = c.request("GET", "/v1/files/file-old", headers=bearer(ALICE))
            self.assertEqual((status, got["error"]["code"]), (404, "file_not_found"))
            status, got = c.request("GET", "/v1/files/file-old", headers=bearer(ADMIN))
            self.assertEqual((status, got["filename"]), (200, "old.jsonl"))
            self.assertIn("schema migrated from version 1 to 2", c.log("gateway"))


class EntrypointKeyFileTest(unittest.TestCase):
    """The image's entrypoint copies an API key file the gateway would refuse as shared (a
    Kubernetes Secret mounted with fsGroup: group-readable) to a private 0600 file. Run here
    with a stub for the gateway that prints what it was given."""

    def run_entrypoint(self, tmp, mode):
        bindir = os.path.join(tmp, "bin")
        os.makedirs(bindir, exist_ok=True)
        stub = os.path.join(bindir, "gateway")
        with open(stub, "w") as f:
            f.write('#!/bin/sh\nprintf "%s %s %s" "$TIDEPOOL_API_KEY_FILE" '
                    '"$(stat -c %a "$TIDEPOOL_API_KEY_FILE")" "$(cat "$TIDEPOOL_API_KEY_FILE")"\n')
        os.chmod(stub, 0o755)
        with open(os.path.join(ROOT, "deploy/container/entrypoint.sh")) as f:
            text = f.read().replace("\nBIN=/opt/tidepool/bin\n", "\nBIN=%s\n" % bindir, 1)
        ep = os.path.join(tmp, "entrypoint.sh")
        with open(ep, "w") as f:
            f.write(text)
        os.chmod(ep, 0o755)
        keys = os.path.join(tmp, "keys")
        if os.path.exists(keys):
            os.unlink(keys)
        with open(keys, "w") as f:
            f.write("%s admin\n" % ADMIN)
        os.chmod(keys, mode)
        env = dict(os.environ, TIDEPOOL_MODEL=MODEL, TIDEPOOL_API_KEY_FILE=keys)
        p = subprocess.run([ep, "gateway"], capture_output=True, text=True, timeout=60, env=env)
        self.assertEqual(p.returncode, 0, p.stderr)
        return keys, p.stdout.split(" ", 2), p.stderr

    def test_shared_key_file_is_copied(self):
        c = Cluster(roles=())  # its temporary directory only
        for mode in (0o640, 0o440, 0o644):
            keys, (path, got_mode, text), err = self.run_entrypoint(c.tmp, mode)
            self.assertNotEqual(path, keys)
            self.assertTrue(path.startswith("/tmp/tidepool-api-keys."), path)
            self.assertEqual((got_mode, text), ("600", "%s admin" % ADMIN))
            self.assertIn("API keys: %s is not a private file of this user; using a private "
                          "copy" % keys, err)
            shutil.rmtree(os.path.dirname(path))
        keys, (path, got_mode, _), err = self.run_entrypoint(c.tmp, 0o600)
        self.assertEqual((path, got_mode, err), (keys, "600", ""))
        c.stop()


if __name__ == "__main__":
    unittest.main()
