"""POST /v1/responses (the Responses API, text) end to end, over plain HTTP: the response
object and the streamed events equal the chat completion of the same conversation
(instructions as a system message first), every event numbered in order; the refusals
(stateful and tool features, bad input) are 400s naming the field; without
--responses-store nothing is kept (GET /v1/responses/{id} is 404), with it a stored response
(streamed or not) is GET's answer byte for byte, survives a restart, and DELETE removes it
and its bytes."""

import http.client
import json
import os
import sys
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cluster import Cluster  # noqa: E402

INSTR = "You tell short stories."


class ResponsesTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.c = Cluster(roles=("mixed",))
        cls.c.start()

    @classmethod
    def tearDownClass(cls):
        cls.c.stop()
        assert not cls.c.sanitizer_reports(), cls.c.sanitizer_reports()

    def chat(self, msgs, max_tokens):
        status, b = self.c.request("POST", "/v1/chat/completions",
                                   {"messages": msgs, "max_tokens": max_tokens, "temperature": 0})
        self.assertEqual(status, 200, b)
        return b

    def test_object(self):
        ref = self.chat([{"role": "system", "content": INSTR},
                         {"role": "user", "content": "Tell me a story."}], 20)
        text = ref["choices"][0]["message"]["content"]
        for inp in ("Tell me a story.",
                    [{"role": "user", "content": "Tell me a story."}],
                    [{"type": "message", "role": "user",
                      "content": [{"type": "input_text", "text": "Tell me "},
                                  {"type": "input_text", "text": "a story."}]}]):
            status, r = self.c.request("POST", "/v1/responses", {
                "input": inp, "instructions": INSTR, "max_output_tokens": 20, "temperature": 0,
                "store": False})
            self.assertEqual(status, 200, r)
            self.assertTrue(r["id"].startswith("resp_"))
            self.assertEqual((r["object"], r["status"], r["incomplete_details"], r["store"],
                              r["instructions"], r["max_output_tokens"], r["model"]),
                             ("response", "incomplete", {"reason": "max_output_tokens"}, False,
                              INSTR, 20, "stories260K"))
            self.assertEqual(len(r["output"]), 1)
            msg = r["output"][0]
            self.assertEqual((msg["type"], msg["role"], msg["id"]),
                             ("message", "assistant", "msg_" + r["id"][5:]))
            self.assertEqual(msg["content"], [{"type": "output_text", "text": text,
                                               "annotations": [], "logprobs": []}])
            self.assertEqual(r["usage"]["input_tokens"], ref["usage"]["prompt_tokens"])
            self.assertEqual(r["usage"]["output_tokens"], 20)
            self.assertEqual(r["usage"]["total_tokens"], ref["usage"]["total_tokens"])

    def test_completed_status(self):
        """A response that ends before max_output_tokens (EOS) is "completed"."""
        status, r = self.c.request("POST", "/v1/responses", {
            "input": "Tell me a story.", "temperature": 0})
        self.assertEqual(status, 200, r)
        ref = self.chat([{"role": "user", "content": "Tell me a story."}], None)
        want = "completed" if ref["choices"][0]["finish_reason"] == "stop" else "incomplete"
        self.assertEqual(r["status"], want)
        self.assertEqual(r["output"][0]["content"][0]["text"],
                         ref["choices"][0]["message"]["content"])
        self.assertEqual(r["store"], True)  # OpenAI's default, echoed (nothing is stored)

    def test_stream(self):
        ref = self.chat([{"role": "user", "content": "Tell me a story."}], 16)
        text = ref["choices"][0]["message"]["content"]
        body = {"input": "Tell me a story.", "max_output_tokens": 16, "temperature": 0,
                "stream": True}
        conn = self.c.conn()
        conn.request("POST", "/v1/responses", body=json.dumps(body).encode(),
                     headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        self.assertEqual(resp.status, 200)
        self.assertEqual(resp.getheader("Content-Type"), "text/event-stream")
        raw = resp.read().decode()
        conn.close()
        events = []
        for block in raw.split("\n\n"):
            if not block or block.startswith(":"):  # an SSE comment (": keep-alive")
                continue
            name, data = block.split("\n")
            self.assertTrue(name.startswith("event: ") and data.startswith("data: "), block)
            ev = json.loads(data[6:])
            self.assertEqual(ev["type"], name[7:])
            events.append(ev)
        types = [e["type"] for e in events]
        self.assertEqual(types[:4], ["response.created", "response.in_progress",
                                     "response.output_item.added", "response.content_part.added"])
        self.assertEqual(types[-4:], ["response.output_text.done", "response.content_part.done",
                                      "response.output_item.done", "response.incomplete"])
        self.assertEqual(set(types[4:-4]), {"response.output_text.delta"})
        self.assertEqual([e["sequence_number"] for e in events], list(range(len(events))))
        self.assertEqual(events[0]["response"]["status"], "in_progress")
        self.assertEqual(events[0]["response"]["output"], [])
        self.assertEqual("".join(e["delta"] for e in events[4:-4]), text)
        self.assertEqual(events[-4]["text"], text)
        self.assertEqual(events[-2]["item"]["content"][0]["text"], text)
        final = events[-1]["response"]
        self.assertEqual(final["output"][0]["content"][0]["text"], text)
        self.assertEqual(final["usage"]["output_tokens"], 16)
        self.assertEqual(final["usage"]["input_tokens"], ref["usage"]["prompt_tokens"])
        self.assertEqual(len({e["response"]["id"] for e in (events[0], events[-1])}), 1)

    def test_refusals(self):
        cases = [
            ({"input": "x", "previous_response_id": "resp_1"}, "previous_response_id",
             "unsupported_parameter"),
            ({"input": "x", "tools": [{"type": "function", "name": "f"}]}, "tools",
             "unsupported_parameter"),
            ({"input": "x", "text": {"format": {"type": "json_schema"}}}, "text",
             "unsupported_parameter"),
            ({"input": "x", "background": True}, "background", "unsupported_parameter"),
            ({"max_output_tokens": 5}, "input", "missing_required_parameter"),
            ({"input": ""}, "input", "invalid_value"),
            ({"input": 5}, "input", "invalid_type"),
            ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]}, "input",
             "unsupported_value"),
            ({"input": [{"role": "user", "content": [{"type": "input_video"}]}]}, "input",
             "invalid_value"),
            ({"input": [{"type": "function_call_output", "output": "1"}]}, "input",
             "unsupported_value"),
            ({"input": "x", "instructions": 3}, "instructions", "invalid_type"),
            ({"input": "x", "max_output_tokens": 0}, "max_output_tokens", "invalid_value"),
            ({"input": "x", "max_output_tokens": 600}, "max_output_tokens",
             "context_length_exceeded"),
            ({"input": "x", "store": "no"}, "store", "invalid_type"),
        ]
        for body, param, code in cases:
            status, b = self.c.request("POST", "/v1/responses", body)
            self.assertEqual(status, 400, (body, b))
            self.assertEqual((b["error"]["param"], b["error"]["code"]), (param, code), body)
        status, b = self.c.request("GET", "/v1/responses")
        self.assertEqual(status, 405, b)

    def test_nothing_stored_by_default(self):
        status, r = self.c.request("POST", "/v1/responses", {
            "input": "Tell me a story.", "max_output_tokens": 4, "temperature": 0})
        self.assertEqual((status, r["store"]), (200, True))
        for method in ("GET", "DELETE"):
            self.assertEqual(self.c.request(method, "/v1/responses/" + r["id"]),
                             (404, not_found(r["id"])))
        status, b = self.c.request("PUT", "/v1/responses/" + r["id"])
        self.assertEqual((status, b["error"]["code"]), (405, "method_not_allowed"))
        status, b = self.c.request("GET", "/v1/responses/%s/input_items" % r["id"])
        self.assertEqual((status, b["error"]["code"]), (404, "unknown_url"))


def not_found(rid):
    return {"error": {"message": "Response with id '%s' not found." % rid,
                      "type": "invalid_request_error", "param": "response_id",
                      "code": "response_not_found"}}


class StoredResponses(unittest.TestCase):
    def get_raw(self, c, rid):
        conn = http.client.HTTPConnection("127.0.0.1", c.port, timeout=60)
        conn.request("GET", "/v1/responses/" + rid)
        r = conn.getresponse()
        out = (r.status, r.read())
        conn.close()
        return out

    def test_store_get_delete(self):
        with Cluster(roles=("mixed",), gateway_args=["--responses-store", "true"]) as c:
            body = {"input": "Tell me a story.", "instructions": INSTR, "max_output_tokens": 12,
                    "temperature": 0}
            conn = http.client.HTTPConnection("127.0.0.1", c.port, timeout=60)
            conn.request("POST", "/v1/responses", body=json.dumps(body).encode(),
                         headers={"Content-Type": "application/json"})
            resp = conn.getresponse()
            raw = resp.read()
            conn.close()
            self.assertEqual(resp.status, 200, raw)
            r = json.loads(raw)
            self.assertEqual(r["store"], True)
            self.assertEqual(self.get_raw(c, r["id"]), (200, raw))  # the very same bytes
            # streamed: the stored object is the last event's
            status, events, _ = c.stream("/v1/responses", dict(body, input="The cat"))
            self.assertEqual(status, 200)
            final = events[-1]["response"]
            self.assertEqual(c.request("GET", "/v1/responses/" + final["id"]), (200, final))
            # "store": false keeps nothing
            status, r2 = c.request("POST", "/v1/responses", dict(body, store=False))
            self.assertEqual((status, r2["store"]), (200, False))
            self.assertEqual(c.request("GET", "/v1/responses/" + r2["id"]),
                             (404, not_found(r2["id"])))
            # kept across a restart
            c.kill("gateway")
            c.start_gateway()
            c.wait_healthy(30)
            self.assertEqual(self.get_raw(c, r["id"]), (200, raw))
            self.assertEqual(c.request("DELETE", "/v1/responses/" + r["id"]),
                             (200, {"id": r["id"], "object": "response", "deleted": True}))
            for method in ("GET", "DELETE"):
                self.assertEqual(c.request(method, "/v1/responses/" + r["id"]),
                                 (404, not_found(r["id"])))
            self.assertEqual(c.request("GET", "/v1/responses/" + final["id"]), (200, final))
            files = b""  # its bytes are gone from the database's files; the other's are not
            for name in ("", "-wal"):
                path = c.state_db + name
                files += open(path, "rb").read() if os.path.exists(path) else b""
            self.assertNotIn(r["id"][5:].encode(), files)
            self.assertIn(final["id"][5:].encode(), files)
            self.assertEqual(c.sanitizer_reports(), [])

    def test_needs_a_state_db(self):
        c = Cluster(roles=(), gateway_args=["--responses-store", "true"])
        c.state_db = ""
        try:
            p = c.start_gateway()
            self.assertEqual(p.wait(timeout=20), 2)
            self.assertIn("--responses-store needs a --state-db", c.log("gateway"))
        finally:
            c.stop()


if __name__ == "__main__":
    unittest.main()
