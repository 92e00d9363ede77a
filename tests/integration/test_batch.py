"""Offline serving and the Batch API, end to end: real gateway + workers over HTTP.

- service_tier "flex" requests complete and echo their tier;
- the Files and Batch API: upload (multipart and raw), create, poll, output lines equal to
  the non-streaming answers of the same greedy requests, bad lines in the error file, every
  bad request a 4xx OpenAI error, cancel;
- files listed (purpose, limit, order, after) and deleted, with exact bodies; a file a
  running batch names is refused (409) until the batch ends; a deleted file's bytes leave
  the database file and its WAL, and it stays deleted across a restart;
- a gateway SIGKILLed in the middle of a batch and restarted on the same state database and
  ports loses no finished line and finishes the rest;
- online requests are served before queued offline ones, and offline work is preempted
  (and still answered in full) when online load rises."""

import http.client
import json
import os
import re
import sqlite3
import sys
import threading
import time
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cluster import Cluster  # noqa: E402

PROMPTS = ["Once upon a time", "Tom and Sue went to the", "The cat", "One day, a little bird"]
BOUNDARY = "tidepool-test-boundary-4f2a"


def multipart(fields, files, boundary=BOUNDARY):
    """A multipart/form-data body: fields [(name, str)], files [(name, filename, bytes)]."""
    out = b""
    for name, value in fields:
        out += ("--%s\r\nContent-Disposition: form-data; name=\"%s\"\r\n\r\n" %
                (boundary, name)).encode() + value.encode() + b"\r\n"
    for name, filename, data in files:
        out += ("--%s\r\nContent-Disposition: form-data; name=\"%s\"; filename=\"%s\"\r\n"
                "Content-Type: application/jsonl\r\n\r\n" % (boundary, name, filename)).encode()
        out += data + b"\r\n"
    out += ("--%s--\r\n" % boundary).encode()
    return out


def line(custom_id, body, url="/v1/completions", method="POST"):
    return json.dumps({"custom_id": custom_id, "method": method, "url": url, "body": body})


def completion_body(prompt, max_tokens=24, **kw):
    body = {"model": "stories260K", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    body.update(kw)
    return body


def upload(c, text, multipart_form=True, filename="input.jsonl"):
    data = text.encode() if isinstance(text, str) else text
    if multipart_form:
        return c.request("POST", "/v1/files",
                         raw=multipart([("purpose", "batch")], [("file", filename, data)]),
                         headers={"Content-Type": "multipart/form-data; boundary=" + BOUNDARY})
    return c.request("POST", "/v1/files?purpose=batch", raw=data,
                     headers={"Content-Type": "application/jsonl"})


def create(c, file_id, endpoint="/v1/completions"):
    return c.request("POST", "/v1/batches", {"input_file_id": file_id, "endpoint": endpoint,
                                             "completion_window": "24h"})


def wait_batch(c, batch_id, timeout=60, until=("completed", "failed", "cancelled", "expired")):
    deadline = time.time() + timeout
    while time.time() < deadline:
        status, b = c.request("GET", "/v1/batches/" + batch_id)
        if status == 200 and b["status"] in until:
            return b
        time.sleep(0.1)
    raise AssertionError("batch %s not %s after %ss: %r\n%s" % (batch_id, until, timeout, b,
                                                                 c.log("gateway")[-3000:]))


def file_lines(c, file_id):
    status, text = c.request("GET", "/v1/files/%s/content" % file_id)
    assert status == 200, (status, text)
    if isinstance(text, dict):  # one line parses as a JSON document
        return [text]
    return [json.loads(x) for x in text.splitlines() if x.strip()]


def metric(c, name):
    status, text = c.request("GET", "/metrics")
    for l in text.splitlines():
        if l.startswith("tidepool_" + name + "{") or l.startswith("tidepool_" + name + " "):
            return float(l.rsplit(" ", 1)[1])
    raise AssertionError("metric %s not found" % name)


class BatchApi(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.c = Cluster(roles=("prefill", "decode"),
                        gateway_args=["--batch-max-lines", "20", "--batch-max-file-bytes", "20000"])
        cls.c.__enter__()

    @classmethod
    def tearDownClass(cls):
        cls.c.__exit__(None, None, None)

    def reference(self, body, path="/v1/completions"):
        status, r = self.c.request("POST", path, body)
        self.assertEqual(status, 200, r)
        return r

    def test_flex_requests(self):
        c = self.c
        ref = self.reference(completion_body("Once upon a time", 16))
        self.assertEqual(ref["service_tier"], "default")
        status, r = c.complete("Once upon a time", max_tokens=16, service_tier="flex")
        self.assertEqual(status, 200, r)
        self.assertEqual(r["service_tier"], "flex")
        self.assertEqual(r["choices"][0]["text"], ref["choices"][0]["text"])
        for tier in ("auto", "default"):
            status, r = c.complete("Once upon a time", max_tokens=4, service_tier=tier)
            self.assertEqual((status, r["service_tier"]), (200, "default"))
        status, text, events, done = c.stream_text("Once upon a time", max_tokens=16,
                                                   service_tier="flex")
        self.assertTrue(done)
        self.assertEqual(text, ref["choices"][0]["text"])
        self.assertTrue(all(e["service_tier"] == "flex" for e in events))
        status, r = c.complete("Once upon a time", max_tokens=4, service_tier="priority")
        self.assertEqual(status, 400)
        self.assertEqual((r["error"]["param"], r["error"]["code"]),
                         ("service_tier", "invalid_value"))
        self.assertGreaterEqual(metric(c, "offline_generation_tokens_total"), 32)

    def test_roundtrip_completions(self):
        c = self.c
        bodies = [completion_body(p, 20 + i) for i, p in enumerate(PROMPTS)]
        bodies.append(completion_body("Once upon a time", 40, stop=["Lily"]))
        refs = [self.reference(b) for b in bodies]
        text = "\n".join(line("req-%d" % i, b) for i, b in enumerate(bodies)) + "\n"
        status, f = upload(c, text)
        self.assertEqual(status, 200, f)
        self.assertEqual((f["object"], f["purpose"], f["bytes"], f["filename"]),
                         ("file", "batch", len(text.encode()), "input.jsonl"))
        self.assertTrue(f["id"].startswith("file-"))
        self.assertEqual(c.request("GET", "/v1/files/" + f["id"]), (200, f))
        status, content = c.request("GET", "/v1/files/%s/content" % f["id"])
        self.assertEqual(status, 200)
        status, b = create(c, f["id"])
        self.assertEqual(status, 200, b)
        self.assertTrue(b["id"].startswith("batch_"))
        self.assertEqual((b["object"], b["endpoint"], b["input_file_id"],
                          b["completion_window"]),
                         ("batch", "/v1/completions", f["id"], "24h"))
        self.assertIn(b["status"], ("validating", "in_progress"))
        b = wait_batch(c, b["id"])
        self.assertEqual(b["status"], "completed", b)
        self.assertEqual(b["request_counts"], {"total": 5, "completed": 5, "failed": 0})
        self.assertIsNone(b["error_file_id"])
        for key in ("created_at", "in_progress_at", "finalizing_at", "completed_at"):
            self.assertIsInstance(b[key], int, key)
        out = file_lines(c, b["output_file_id"])
        self.assertEqual(len(out), 5)
        by_id = {o["custom_id"]: o for o in out}
        for i, ref in enumerate(refs):
            o = by_id["req-%d" % i]
            self.assertTrue(o["id"].startswith("batch_req_"))
            self.assertIsNone(o["error"])
            self.assertEqual(o["response"]["status_code"], 200)
            body = o["response"]["body"]
            self.assertEqual(o["response"]["request_id"], body["id"])
            self.assertEqual(body["choices"][0]["text"], ref["choices"][0]["text"])
            self.assertEqual(body["choices"][0]["finish_reason"],
                             ref["choices"][0]["finish_reason"])
            self.assertEqual(body["usage"], ref["usage"])
            self.assertEqual(body["object"], "text_completion")
        status, f2 = c.request("GET", "/v1/files/" + b["output_file_id"])
        self.assertEqual(f2["purpose"], "batch_output")
        status, lst = c.request("GET", "/v1/batches?limit=100")
        self.assertEqual(status, 200)
        self.assertEqual(lst["object"], "list")
        self.assertIn(b["id"], [x["id"] for x in lst["data"]])

    def test_filename_not_utf8(self):
        """The client's file name is made valid UTF-8 (a byte that starts no character as
        '?', one cut short at the end or by the 255-byte limit dropped): a name with the
        byte 0xFF got 500 "out of memory" (with a NUL after the body), the file stored all
        the same."""
        data = (line("a", completion_body("Once", 2)) + "\n").encode()
        for name, want in ((b"a\xffb.jsonl", "a?b.jsonl"), (b"x\xc3", "x")):
            with self.subTest(name):
                body = (b"--" + BOUNDARY.encode() + b"\r\nContent-Disposition: form-data; "
                        b"name=\"purpose\"\r\n\r\nbatch\r\n--" + BOUNDARY.encode() +
                        b"\r\nContent-Disposition: form-data; name=\"file\"; filename=\"" +
                        name + b"\"\r\n\r\n" + data + b"\r\n--" + BOUNDARY.encode() + b"--\r\n")
                status, f = self.c.request(
                    "POST", "/v1/files", raw=body,
                    headers={"Content-Type": "multipart/form-data; boundary=" + BOUNDARY})
                self.assertEqual(status, 200, f)
                self.assertEqual(f["filename"], want)
                status, g = self.c.request("GET", "/v1/files/" + f["id"])
                self.assertEqual((status, g["filename"]), (200, want))
        for query, want in (("%FF%FEx.jsonl", "??x.jsonl"), ("%C3%A9" * 150, "\u00e9" * 127)):
            with self.subTest(query):
                status, f = self.c.request("POST", "/v1/files?purpose=batch&filename=" + query,
                                           raw=data, headers={"Content-Type": "application/jsonl"})
                self.assertEqual((status, f["filename"]), (200, want), f)

    def test_nul_in_the_answer(self):
        """A completion whose text holds U+0000 (the byte token <0x00>, here forced by
        logit_bias) is valid JSON ("\\u0000") and is answered so online; a batch line with
        it went to the error file as 500 "could not format the response" (the response was
        re-read by jansson, which refuses \\u0000 by default)."""
        c = self.c
        bodies = {"c": (completion_body("Once", 3, logit_bias={"3": 100}), "/v1/completions"),
                  "ch": ({"model": "stories260K", "max_tokens": 3, "temperature": 0,
                          "logit_bias": {"3": 100}, "logprobs": True,
                          "messages": [{"role": "user", "content": "x"}]},
                         "/v1/chat/completions")}
        for cid, (body, url) in bodies.items():
            with self.subTest(url):
                ref = self.reference(body, url)
                status, f = upload(c, line(cid, body, url=url))
                self.assertEqual(status, 200, f)
                status, b = create(c, f["id"], url)
                b = wait_batch(c, b["id"])
                self.assertEqual(b["request_counts"], {"total": 1, "completed": 1, "failed": 0},
                                 b)
                got = file_lines(c, b["output_file_id"])[0]["response"]["body"]
                self.assertEqual(got["choices"], ref["choices"])
                ch = got["choices"][0]
                self.assertEqual(ch["text"] if "text" in ch else ch["message"]["content"],
                                 "\x00" * 3)

    def test_byte_order_mark(self):
        """A file that starts with a UTF-8 byte order mark (PowerShell 5's Out-File and
        Set-Content -Encoding UTF8 write one) runs its first line too: it went to the error
        file as "line 1 is not a JSON object: '[' or '{' expected near '\ufeff'" (RFC 8259
        8.1 lets a parser ignore the mark). The file's bytes are kept as uploaded."""
        c = self.c
        body = completion_body("Once upon a time", 8)
        text = "\ufeff" + line("bom-1", body) + "\r\n" + line("bom-2", body) + "\r\n"
        status, f = upload(c, text)
        self.assertEqual((status, f["bytes"]), (200, len(text.encode())), f)
        status, b = create(c, f["id"])
        b = wait_batch(c, b["id"])
        self.assertEqual(b["request_counts"], {"total": 2, "completed": 2, "failed": 0}, b)
        out = file_lines(c, b["output_file_id"])
        self.assertEqual([o["custom_id"] for o in out], ["bom-1", "bom-2"])
        self.assertEqual(c.request("GET", "/v1/files/%s/content" % f["id"])[1], text)
        status, e = upload(c, "\ufeff\r\n")  # a mark and nothing else: an empty file
        self.assertEqual((status, e["error"]["code"]), (400, "invalid_file"), e)

    def test_roundtrip_chat_raw_upload(self):
        c = self.c
        msgs = [{"role": "user", "content": "Tell me a story"}]
        body = {"model": "stories260K", "messages": msgs, "max_tokens": 20, "temperature": 0}
        ref = self.reference(body, "/v1/chat/completions")
        text = line("chat-1", body, url="/v1/chat/completions")
        status, f = upload(c, text, multipart_form=False)
        self.assertEqual(status, 200, f)
        status, b = create(c, f["id"], "/v1/chat/completions")
        self.assertEqual(status, 200, b)
        b = wait_batch(c, b["id"])
        out = file_lines(c, b["output_file_id"])
        self.assertEqual(len(out), 1)
        got = out[0]["response"]["body"]
        self.assertEqual(got["object"], "chat.completion")
        self.assertEqual(got["choices"][0]["message"], ref["choices"][0]["message"])

    def test_bad_lines_go_to_the_error_file(self):
        c = self.c
        good = completion_body("Once upon a time", 8)
        lines = [
            line("ok-1", good),
            "this is not json",
            json.dumps({"method": "POST", "url": "/v1/completions", "body": good}),
            line("bad-method", good, method="GET"),
            line("bad-url", good, url="/v1/chat/completions"),
            json.dumps({"custom_id": "bad-body", "method": "POST", "url": "/v1/completions",
                        "body": "x"}),
            line("ok-1", good),  # duplicate custom_id
            line("bad-max-tokens", dict(good, max_tokens=0)),
            line("bad-model", dict(good, model="gpt-4")),
            line("too-long", dict(good, max_tokens=100000)),
            line("no-prompt", {"model": "stories260K"}),
            line("ok-2", good),
        ]
        # blank lines are skipped, but counted in an error's "line" (the file's line
        # number: "this is not json" is line 3; until 3 Dec 2026 it was the count of
        # non-blank lines, 2, so a client was pointed at the wrong line)
        status, f = upload(c, "\n\n".join(lines))
        self.assertEqual(status, 200, f)
        status, b = create(c, f["id"])
        b = wait_batch(c, b["id"])
        self.assertEqual(b["status"], "completed")
        self.assertEqual(b["request_counts"], {"total": 12, "completed": 2, "failed": 10})
        out = file_lines(c, b["output_file_id"])
        self.assertEqual(sorted(o["custom_id"] for o in out), ["ok-1", "ok-2"])
        errs = file_lines(c, b["error_file_id"])
        self.assertEqual(len(errs), 10)
        codes = {}
        for e in errs:
            if e["response"] is None:
                codes[e["error"]["line"]] = e["error"]["code"]
            else:
                self.assertIsNone(e["error"])
                # a refused request has a request id too (docs/api.md "Batch API")
                self.assertRegex(e["response"]["request_id"], r"^cmpl-[0-9a-f]{16,}$")
                codes[e["custom_id"]] = (e["response"]["status_code"],
                                         e["response"]["body"]["error"]["code"])
        self.assertEqual(codes[3], "invalid_json_line")
        self.assertEqual(codes[5], "missing_custom_id")
        self.assertEqual(codes[7], "invalid_method")
        self.assertEqual(codes[9], "mismatched_url")
        self.assertEqual(codes[11], "invalid_body")
        self.assertEqual(codes[13], "duplicate_custom_id")
        msgs = {e["error"]["line"]: e["error"]["message"] for e in errs if e["error"]}
        self.assertTrue(msgs[3].startswith("line 3 is not a JSON object: "), msgs[3])
        self.assertEqual(msgs[5], "line 5: 'custom_id' must be a non-empty string of at most "
                                  "512 bytes")
        self.assertEqual(codes["bad-max-tokens"], (400, "invalid_value"))
        self.assertEqual(codes["bad-model"], (404, "model_not_found"))
        self.assertEqual(codes["too-long"], (400, "context_length_exceeded"))
        self.assertEqual(codes["no-prompt"], (400, "missing_required_parameter"))

    def test_bad_requests(self):
        c = self.c
        ok_line = line("a", completion_body("Hi", 2))

        def check(resp, status, code=None, param=None):
            st, body = resp
            self.assertEqual(st, status, body)
            self.assertIn("error", body)
            self.assertIn("message", body["error"])
            if code:
                self.assertEqual(body["error"]["code"], code, body)
            if param:
                self.assertEqual(body["error"]["param"], param, body)

        mp = {"Content-Type": "multipart/form-data; boundary=" + BOUNDARY}
        # uploads
        check(c.request("POST", "/v1/files", raw=multipart([], [("file", "x", b"{}")]),
                        headers=mp), 400, "missing_required_parameter", "purpose")
        check(c.request("POST", "/v1/files", raw=multipart([("purpose", "fine-tune")],
                                                           [("file", "x", b"{}")]),
                        headers=mp), 400, "invalid_value", "purpose")
        check(c.request("POST", "/v1/files", raw=multipart([("purpose", "batch")], []),
                        headers=mp), 400, "missing_required_parameter", "file")
        check(c.request("POST", "/v1/files", raw=b"--" + BOUNDARY.encode() + b"\r\nbroken",
                        headers=mp), 400, "invalid_multipart")
        check(c.request("POST", "/v1/files",
                        raw=b"no boundary", headers={"Content-Type": "multipart/form-data"}),
              400, "invalid_multipart")
        check(c.request("POST", "/v1/files", raw=ok_line.encode(),
                        headers={"Content-Type": "application/jsonl"}),
              400, "missing_required_parameter", "purpose")
        check(upload(c, "  \n\n"), 400, "invalid_file")
        check(upload(c, b"\xff\xfe{}\n"), 400, "invalid_encoding")
        check(upload(c, "\n".join([ok_line] * 21)), 400, "too_many_lines")
        check(upload(c, ok_line + " " * 20000), 413, "file_too_large")
        # batches
        status, f = upload(c, ok_line)
        self.assertEqual(status, 200)
        check(c.request("POST", "/v1/batches", raw=b"{nope"), 400, "invalid_json")
        check(c.request("POST", "/v1/batches", [1]), 400, "invalid_type")
        check(c.request("POST", "/v1/batches", {"endpoint": "/v1/completions",
                                                "completion_window": "24h"}),
              400, "missing_required_parameter", "input_file_id")
        check(c.request("POST", "/v1/batches", {"input_file_id": f["id"],
                                                "completion_window": "24h"}),
              400, "missing_required_parameter", "endpoint")
        check(c.request("POST", "/v1/batches", {"input_file_id": f["id"],
                                                "endpoint": "/v1/completions"}),
              400, "missing_required_parameter", "completion_window")
        check(c.request("POST", "/v1/batches", {"input_file_id": 7, "endpoint": "/v1/completions",
                                                "completion_window": "24h"}),
              400, "invalid_type", "input_file_id")
        check(create(c, "file-doesnotexist"), 404, "file_not_found", "input_file_id")
        check(create(c, f["id"], "/v1/embeddings"), 400, "invalid_value", "endpoint")
        check(c.request("POST", "/v1/batches", {"input_file_id": f["id"],
                                                "endpoint": "/v1/completions",
                                                "completion_window": "1h"}),
              400, "invalid_value", "completion_window")
        check(c.request("POST", "/v1/batches", {"input_file_id": f["id"],
                                                "endpoint": "/v1/completions",
                                                "completion_window": "24h", "metadata": [1]}),
              400, "invalid_value", "metadata")
        check(c.request("GET", "/v1/batches/batch_nope"), 404, "batch_not_found")
        check(c.request("POST", "/v1/batches/batch_nope/cancel"), 404, "batch_not_found")
        check(c.request("GET", "/v1/files/file-nope"), 404, "file_not_found")
        check(c.request("GET", "/v1/files/file-nope/content"), 404, "file_not_found")
        check(c.request("GET", "/v1/batches?limit=0"), 400, "invalid_value", "limit")
        check(c.request("GET", "/v1/batches?after=batch_nope"), 404)
        check(c.request("DELETE", "/v1/files"), 405, "method_not_allowed")
        check(c.request("DELETE", "/v1/batches"), 405, "method_not_allowed")
        check(c.request("GET", "/v1/batches/x/y"), 404, "unknown_url")
        # a finished batch cannot be cancelled; an output file cannot be a batch's input
        status, b = create(c, f["id"])
        b = wait_batch(c, b["id"])
        check(c.request("POST", "/v1/batches/%s/cancel" % b["id"]), 400, "invalid_state")
        check(create(c, b["output_file_id"]), 400, "invalid_value", "input_file_id")


def no_file(fid, param="file_id"):
    return {"error": {"message": "No such File object: " + fid, "type": "invalid_request_error",
                      "param": param, "code": "file_not_found"}}


def bad_value(param, message):
    return {"error": {"message": message, "type": "invalid_request_error", "param": param,
                      "code": "invalid_value"}}


def raw_request(c, method, path):
    """(status, Allow header, body bytes) of one bodiless request."""
    conn = http.client.HTTPConnection("127.0.0.1", c.port, timeout=60)
    conn.request(method, path, headers=c.auth_headers({}))
    r = conn.getresponse()
    out = (r.status, r.getheader("Allow"), r.read())
    conn.close()
    return out


class Files(unittest.TestCase):
    """GET /v1/files and DELETE /v1/files/{id} on a gateway of its own (no worker needed)."""

    @classmethod
    def setUpClass(cls):
        cls.c = Cluster(roles=())
        cls.c.start_gateway()
        deadline = time.time() + 20
        while True:
            try:
                cls.c.request("GET", "/v1/batches", timeout=2)
                break
            except OSError:
                if time.time() > deadline:
                    raise
                time.sleep(0.1)

    @classmethod
    def tearDownClass(cls):
        cls.c.stop()
        assert cls.c.sanitizer_reports() == []

    def listing(self, query=""):
        status, lst = self.c.request("GET", "/v1/files" + query)
        self.assertEqual(status, 200, lst)
        return lst

    def test_list_and_delete(self):
        c = self.c
        files = []
        for i in range(3):
            status, f = upload(c, line("r%d" % i, completion_body("Hi", 2)),
                               filename="in%d.jsonl" % i)
            self.assertEqual(status, 200, f)
            files.append(f)
        ids = [f["id"] for f in files]
        # newest first (created_at, then upload order), every field as the upload answered
        lst = self.listing()
        self.assertEqual(lst["object"], "list")
        self.assertEqual(lst["has_more"], False)
        mine = [x for x in lst["data"] if x["id"] in ids]
        self.assertEqual(mine, files[::-1])
        self.assertEqual(lst["first_id"], lst["data"][0]["id"])
        self.assertEqual(lst["last_id"], lst["data"][-1]["id"])
        asc = self.listing("?order=asc")
        self.assertEqual([x["id"] for x in asc["data"]], [x["id"] for x in lst["data"]][::-1])
        self.assertEqual([x for x in asc["data"] if x["id"] in ids], files)
        # pages of 2 by cursor give the whole list
        pages, after = [], ""
        while True:
            p = self.listing("?limit=2" + after)
            pages += p["data"]
            self.assertLessEqual(len(p["data"]), 2)
            if not p["has_more"]:
                break
            self.assertEqual(len(p["data"]), 2)
            after = "&after=" + p["last_id"]
        self.assertEqual(pages, lst["data"])
        self.assertEqual(self.listing("?limit=1&order=desc")["has_more"], True)
        self.assertEqual(self.listing("?purpose=fine-tune"),
                         {"object": "list", "data": [], "first_id": None, "last_id": None,
                          "has_more": False})
        self.assertTrue(all(x["purpose"] == "batch" for x in self.listing("?purpose=batch")["data"]))
        # bad query parameters
        limit_msg = "'limit' must be an integer from 1 to 10000, got '%s'."
        for q, param, msg in (("limit=0", "limit", limit_msg % "0"),
                              ("limit=10001", "limit", limit_msg % "10001"),
                              ("limit=2x", "limit", limit_msg % "2x"),
                              ("limit=", "limit", limit_msg % ""),
                              ("order=up", "order", "'order' must be 'asc' or 'desc', got 'up'."),
                              ("purpose=nope", "purpose",
                               "'purpose' must be one of assistants, assistants_output, batch, "
                               "batch_output, fine-tune, fine-tune-results, vision, user_data, "
                               "evals; got 'nope'."),
                              ("after=", "after", "'after' must be a file id."),
                              ("limit", None, "The query string could not be parsed (each "
                               "parameter must be name=value).")):
            self.assertEqual(c.request("GET", "/v1/files?" + q), (400, bad_value(param, msg)), q)
        self.assertEqual(c.request("GET", "/v1/files?after=file-nope"),
                         (404, no_file("file-nope", "after")))
        # delete the middle one
        gone = ids[1]
        self.assertEqual(c.request("DELETE", "/v1/files/" + gone),
                         (200, {"id": gone, "object": "file", "deleted": True}))
        self.assertEqual(c.request("GET", "/v1/files/" + gone), (404, no_file(gone)))
        self.assertEqual(c.request("GET", "/v1/files/%s/content" % gone), (404, no_file(gone)))
        self.assertEqual(c.request("DELETE", "/v1/files/" + gone), (404, no_file(gone)))
        self.assertEqual(c.request("DELETE", "/v1/files/file-nope"), (404, no_file("file-nope")))
        after = self.listing()
        self.assertEqual(after["data"], [x for x in lst["data"] if x["id"] != gone])
        # a deleted file is still a cursor (a client deleting what it pages through)
        self.assertEqual(self.listing("?after=" + gone)["data"][0], files[0])
        self.assertEqual(self.listing("?order=asc&after=" + gone)["data"][0], files[2])
        self.assertEqual(c.request("GET", "/v1/files/" + ids[0]), (200, files[0]))

    def test_methods(self):
        c = self.c
        # HEAD wherever GET (RFC 9110 9.3.2)
        for method, path, allow in (("DELETE", "/v1/files", "GET, HEAD, POST"),
                                    ("PUT", "/v1/files", "GET, HEAD, POST"),
                                    ("POST", "/v1/files/file-x", "GET, HEAD, DELETE"),
                                    ("PATCH", "/v1/files/file-x", "GET, HEAD, DELETE"),
                                    ("DELETE", "/v1/files/file-x/content", "GET, HEAD"),
                                    ("DELETE", "/v1/batches/batch_x", "GET, HEAD")):
            status, got_allow, body = raw_request(c, method, path)
            self.assertEqual((status, got_allow), (405, allow), (method, path))
            self.assertEqual(json.loads(body), {"error": {
                "message": "Method %s is not allowed for %s (use %s)." % (method, path, allow),
                "type": "invalid_request_error", "param": None, "code": "method_not_allowed"}})
        status, _, body = raw_request(c, "HEAD", "/v1/files")
        self.assertEqual((status, body), (200, b""))


class FileInUse(unittest.TestCase):
    """A batch's input file cannot be deleted while the batch runs (409), can once it ended;
    deleting a final batch's result files deletes their bytes and the batch's stored results
    of that kind, the batch object stays; all of it holds across a gateway restart."""

    MARK = "zq7marker"  # in custom_ids: the input file, the results and the output file

    def test_delete_while_running_and_after(self):
        with Cluster(roles=("mixed",), worker_args=["--debug-step-delay-ms", "25"],
                     gateway_args=["--batch-max-inflight", "1"]) as c:
            n = 6
            text = "\n".join(line("%s-%d" % (self.MARK, i), completion_body("Once upon a time", 40))
                             for i in range(n))
            status, f = upload(c, text)
            self.assertEqual(status, 200, f)
            status, b = create(c, f["id"])
            self.assertEqual(status, 200, b)
            bid, fid = b["id"], f["id"]
            deadline = time.time() + 30
            while time.time() < deadline:
                status, b = c.request("GET", "/v1/batches/" + bid)
                if b["request_counts"]["completed"] >= 1:
                    break
                time.sleep(0.05)
            self.assertEqual(b["status"], "in_progress", b)
            in_use = {"error": {
                "message": "The file %s is the input file of batch %s, which is in_progress: "
                           "cancel the batch or wait until it ends, then delete the file." %
                           (fid, bid),
                "type": "invalid_request_error", "param": "file_id", "code": "file_in_use"}}
            self.assertEqual(c.request("DELETE", "/v1/files/" + fid), (409, in_use))
            # still in use after a restart (the batch is resumed from its input file)
            c.kill("gateway")
            c.start_gateway()
            c.wait_healthy(30)
            status, b = c.request("GET", "/v1/batches/" + bid)
            if b["status"] == "in_progress":
                self.assertEqual(c.request("DELETE", "/v1/files/" + fid), (409, in_use))
            status, b = c.request("POST", "/v1/batches/%s/cancel" % bid)
            self.assertEqual(status, 200, b)
            b = wait_batch(c, bid, until=("cancelled",))
            done = b["request_counts"]["completed"]
            self.assertGreaterEqual(done, 1)
            out = b["output_file_id"]
            self.assertEqual(len(file_lines(c, out)), done)
            # the batch ended: its files may go
            self.assertEqual(c.request("DELETE", "/v1/files/" + fid),
                             (200, {"id": fid, "object": "file", "deleted": True}))
            self.assertEqual(len(file_lines(c, out)), done)  # the results are not lost
            def rows():  # a connection of its own, closed: a reader would hold the checkpoint
                db = sqlite3.connect(c.state_db)
                n = db.execute("SELECT count(*) FROM results WHERE batch_id = ? AND ok = 1",
                               (bid,)).fetchone()[0]
                db.close()
                return n

            self.assertEqual(rows(), done)
            self.assertEqual(c.request("DELETE", "/v1/files/" + out),
                             (200, {"id": out, "object": "file", "deleted": True}))
            self.assertEqual(rows(), 0)
            if b["error_file_id"]:
                self.assertEqual(c.request("DELETE", "/v1/files/" + b["error_file_id"])[0], 200)
            status, b2 = c.request("GET", "/v1/batches/" + bid)
            self.assertEqual((status, b2), (200, b))  # the batch keeps its ids, as OpenAI's
            for name in ("", "-wal"):
                path = c.state_db + name
                data = open(path, "rb").read() if os.path.exists(path) else b""
                self.assertNotIn(self.MARK.encode(), data, path)
            # deleted for good: after a restart too
            c.kill("gateway")
            c.start_gateway()
            c.wait_healthy(30)
            for x in (fid, out):
                self.assertEqual(c.request("GET", "/v1/files/" + x), (404, no_file(x)))
                self.assertEqual(c.request("DELETE", "/v1/files/" + x), (404, no_file(x)))
            status, lst = c.request("GET", "/v1/files")
            self.assertEqual([x["id"] for x in lst["data"]], [])
            self.assertEqual(c.request("GET", "/v1/batches/" + bid), (200, b))
            self.assertIn("file %s deleted (batch_output, " % out, c.log("gateway"))


class Cancel(unittest.TestCase):
    def test_cancel(self):
        with Cluster(roles=("mixed",), worker_args=["--debug-step-delay-ms", "25"],
                     gateway_args=["--batch-max-inflight", "2"]) as c:
            text = "\n".join(line("r%d" % i, completion_body("Once upon a time", 60))
                             for i in range(10))
            status, f = upload(c, text)
            status, b = create(c, f["id"])
            self.assertEqual(status, 200)
            deadline = time.time() + 30
            while time.time() < deadline:
                status, b = c.request("GET", "/v1/batches/" + b["id"])
                if b["request_counts"]["completed"] >= 2:
                    break
                time.sleep(0.05)
            status, b2 = c.request("POST", "/v1/batches/%s/cancel" % b["id"])
            self.assertEqual(status, 200, b2)
            self.assertIn(b2["status"], ("cancelling", "cancelled"))
            b = wait_batch(c, b["id"], until=("cancelled",))
            self.assertIsInstance(b["cancelled_at"], int)
            done = b["request_counts"]["completed"]
            self.assertGreaterEqual(done, 2)
            self.assertLess(done, 10)
            self.assertEqual(b["request_counts"]["total"], 10)
            out = file_lines(c, b["output_file_id"])
            self.assertEqual(len(out), done)
            status, e = c.request("POST", "/v1/batches/%s/cancel" % b["id"])
            self.assertEqual(status, 400)
            # the worker is free again: an online request is served at once
            status, r = c.complete("Once upon a time", max_tokens=4)
            self.assertEqual(status, 200)
            # every request received ended in one bucket: the lines the cancel stopped count
            # as cancelled (finished_reason "abort"); they were in none, so received ran
            # ahead of the ends by them for good (docs/stats.md: received = finished +
            # failed + cancelled + in flight)
            status, text = c.request("GET", "/metrics")
            got = {}
            for m in re.finditer(r'(?m)^tidepool_(\w+)\{([^}]*)\} (\S+)$', text):
                reason = re.search(r'finished_reason="(\w+)"', m.group(2))
                got[m.group(1) + (":" + reason.group(1) if reason else "")] = float(m.group(3))
            ends = (got["request_success_total:stop"] + got["request_success_total:length"] +
                    got["request_success_total:abort"] + got["request_failure_total"])
            self.assertEqual(got["requests_received_total"], ends, got)
            self.assertGreaterEqual(got["request_success_total:abort"], 1, got)


class LoadedBytes(unittest.TestCase):
    def test_input_files_in_memory_are_bounded(self):
        """A batch holds its input file in memory until it is final. Every POST /v1/batches
        loaded another copy at once, so one 100 MB file and a loop of creates took the
        gateway's memory without bound (6 creates over a 28 MB file: 16 -> 234 MB RSS).
        Now the loaded input files of the batches that are not final fit in
        --batch-max-file-bytes (one always fits): a later batch waits, validating with
        total 0, until those before it end; a waiting batch can be cancelled at once."""
        with Cluster(roles=("mixed",), worker_args=["--debug-step-delay-ms", "25"],
                     gateway_args=["--batch-max-inflight", "2",
                                   "--batch-max-file-bytes", "3000"]) as c:
            def text(tag, n):
                return "\n".join(line("%s%d" % (tag, i), completion_body("Once upon a time", 60))
                                 for i in range(n))
            ids = {}
            for tag, n in (("a", 14), ("b", 14), ("c", 1)):
                self.assertGreater(len(text(tag, n)), 1500 if n > 1 else 0)
                status, f = upload(c, text(tag, n))
                self.assertEqual(status, 200, f)
                status, b = create(c, f["id"])
                self.assertEqual(status, 200, b)
                ids[tag] = b
            self.assertEqual(ids["a"]["request_counts"]["total"], 14)
            for tag in ("b", "c"):  # waiting: not loaded
                status, b = c.request("GET", "/v1/batches/" + ids[tag]["id"])
                self.assertEqual((b["status"], b["request_counts"]["total"]), ("validating", 0),
                                 (tag, b))
            status, cb = c.request("POST", "/v1/batches/%s/cancel" % ids["c"]["id"])
            self.assertEqual(status, 200, cb)
            cb = wait_batch(c, ids["c"]["id"], timeout=5, until=("cancelled",))
            self.assertEqual(cb["status"], "cancelled")
            self.assertIsNone(cb["output_file_id"])
            status, a = c.request("GET", "/v1/batches/" + ids["a"]["id"])
            self.assertEqual(a["status"], "in_progress", "a finished before c was cancelled")
            for tag in ("a", "b"):
                b = wait_batch(c, ids[tag]["id"], timeout=90)
                self.assertEqual((b["status"], b["request_counts"]),
                                 ("completed", {"total": 14, "completed": 14, "failed": 0}))
                self.assertEqual(len(file_lines(c, b["output_file_id"])), 14)
            log = c.log("gateway")
            self.assertIn("batch %s created: /v1/completions, file %s (%d bytes; waiting"
                          % (ids["b"]["id"], ids["b"]["input_file_id"], len(text("b", 14))), log)
            self.assertIn("batch %s loaded (validating)" % ids["b"]["id"], log)


class Restart(unittest.TestCase):
    def test_gateway_killed_mid_batch(self):
        with Cluster(roles=("mixed",), worker_args=["--debug-step-delay-ms", "30"],
                     gateway_args=["--batch-max-inflight", "2"]) as c:
            n = 12
            bodies = [completion_body(PROMPTS[i % len(PROMPTS)], 40 + i) for i in range(n)]
            text = "\n".join(line("r%d" % i, b) for i, b in enumerate(bodies))
            status, f = upload(c, text)
            status, b = create(c, f["id"])
            self.assertEqual(status, 200, b)
            db = sqlite3.connect(c.state_db)

            def stored():
                rows = db.execute("SELECT line, body FROM results WHERE batch_id = ?",
                                  (b["id"],)).fetchall()
                return {row[0]: json.loads(row[1]) for row in rows}

            deadline = time.time() + 30
            before = {}
            while time.time() < deadline and len(before) < 3:
                before = stored()
                time.sleep(0.05)
            self.assertGreaterEqual(len(before), 3, c.log("gateway")[-2000:])
            c.kill("gateway")  # SIGKILL: no flush, no goodbye
            before = stored()  # everything committed before the kill
            self.assertLess(len(before), n, "the batch finished before the kill; slow it down")
            c.start_gateway()
            c.wait_healthy(30)
            b = wait_batch(c, b["id"], timeout=60)
            self.assertEqual(b["status"], "completed", b)
            self.assertEqual(b["request_counts"], {"total": n, "completed": n, "failed": 0})
            out = file_lines(c, b["output_file_id"])
            self.assertEqual(sorted(o["custom_id"] for o in out),
                             sorted("r%d" % i for i in range(n)))
            by_id = {o["custom_id"]: o for o in out}
            for line_no, res in before.items():  # not recomputed: the very same result
                self.assertEqual(by_id[res["custom_id"]], res)
            self.assertIn("resumed (in_progress): %d of %d lines already done" %
                          (len(before), n), c.log("gateway"))
            db.close()
            for i, body in enumerate(bodies):  # and every answer is the greedy one
                status, ref = c.request("POST", "/v1/completions", body)
                self.assertEqual(by_id["r%d" % i]["response"]["body"]["choices"][0]["text"],
                                 ref["choices"][0]["text"])


class Tiers(unittest.TestCase):
    def run_concurrently(self, c, jobs):
        """jobs: [(name, body, wait)] started in order; wait: seconds to sleep first, or a
        function to poll until true. Returns {name: (finish time, status, response)}."""
        done = {}

        def run(name, body):
            status, r = c.request("POST", "/v1/completions", body, timeout=120)
            done[name] = (time.time(), status, r)

        threads = []
        for name, body, wait in jobs:
            if callable(wait):
                deadline = time.time() + 30
                while not wait() and time.time() < deadline:
                    time.sleep(0.02)
            elif wait:
                time.sleep(wait)
            t = threading.Thread(target=run, args=(name, body))
            t.start()
            threads.append(t)
        for t in threads:
            t.join(120)
        return done

    def test_online_first(self):
        # one slow worker with room for 8 sequences: offline may fill floor(0.6 * 0.5 * 8) = 2
        with Cluster(roles=("mixed",),
                     worker_args=["--debug-step-delay-ms", "20", "--max-seqs", "8"],
                     gateway_args=["--smooth-s", "0"]) as c:
            jobs = [("off-%d" % i, completion_body("Once upon a time", 60, service_tier="flex"),
                     0) for i in range(8)]
            jobs.append(("online", completion_body("Tom and Sue went to the", 60),
                         lambda: metric(c, "num_offline_requests_waiting") >= 6))
            done = self.run_concurrently(c, jobs)
            self.assertTrue(all(v[1] == 200 for v in done.values()), done)
            t_online = done["online"][0]
            later = [k for k, v in done.items() if k != "online" and v[0] > t_online]
            self.assertGreaterEqual(len(later), 5, "online finished after most offline: %r" %
                                    {k: v[0] - t_online for k, v in done.items()})
            self.assertEqual(done["online"][2]["service_tier"], "default")

    def test_preemption(self):
        # room for 4 sequences, offline admission floor(0.6 * 0.5 * 4) = 1; two online
        # sequences already put the decode pressure at 1.0 >= 0.95: the offline one yields
        with Cluster(roles=("mixed",),
                     worker_args=["--debug-step-delay-ms", "25", "--max-seqs", "4"],
                     gateway_args=["--smooth-s", "0", "--offline-max-wait-s", "1000"]) as c:
            ref_off = c.complete("Once upon a time", max_tokens=240)[1]["choices"][0]["text"]
            jobs = [("off-%d" % i, completion_body("Once upon a time", 240, service_tier="flex"),
                     0) for i in range(2)]
            started = lambda: (metric(c, "num_offline_requests_running") >= 1 and  # noqa: E731
                               metric(c, "offline_generation_tokens_total") == 0 and
                               time.sleep(0.3) is None)
            jobs += [("on-%d" % i, completion_body("Tom and Sue went to the", 20),
                      started if i == 0 else 0) for i in range(3)]
            done = self.run_concurrently(c, jobs)
            self.assertTrue(all(v[1] == 200 for v in done.values()), done)
            for k in ("off-0", "off-1"):  # preempted and resumed: still one unbroken answer
                self.assertEqual(done[k][2]["choices"][0]["text"], ref_off)
                self.assertEqual(done[k][2]["usage"]["completion_tokens"], 240)
                self.assertEqual(done[k][2]["service_tier"], "flex")
            self.assertGreaterEqual(metric(c, "offline_preemptions_total"), 1,
                                    c.log("gateway")[-3000:])
            self.assertIn("preempted", c.log("gateway"))


class OneOwner(unittest.TestCase):
    """Two gateways started on one Batch API database: the second is refused at start with
    a message naming the owner, instead of resuming the first one's batches (it computed
    every line again); once the owner has gone the database can be opened."""

    def test_second_gateway_on_the_same_database_is_refused(self):
        with Cluster(roles=("mixed",)) as a:
            b = Cluster(roles=())
            b.state_db = a.state_db
            try:
                p = b.start_gateway()
                rc = p.wait(timeout=20)
                self.assertNotEqual(rc, 0)
                log = b.log("gateway")
                self.assertIn("in use by another gateway (pid %d)" % a.procs["gateway"].pid, log)
                self.assertIn(a.state_db, log)
                status, _ = a.request("GET", "/v1/batches")
                self.assertEqual(status, 200)  # the owner serves on
            finally:
                b.stop()
        c = Cluster(roles=())
        c.state_db = a.state_db
        try:
            c.start_gateway()
            deadline = time.time() + 20
            status = None
            while time.time() < deadline and status != 200:
                try:
                    status, _ = c.request("GET", "/v1/batches", timeout=2)
                except OSError:
                    time.sleep(0.1)
            self.assertEqual(status, 200, c.log("gateway"))
        finally:
            c.stop()
        for cl in (a, b, c):
            self.assertEqual(cl.sanitizer_reports(), [])

if __name__ == "__main__":
    unittest.main()
