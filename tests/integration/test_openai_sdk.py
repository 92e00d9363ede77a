"""The official OpenAI Node SDK (the `openai` npm package, 4.x) against a real cluster.

The SDK is installed once with `npm install --prefix build/npm openai@4` (cached under
build/; the test is skipped, saying why, when node or npm is missing or the registry
cannot be reached). tests/integration/sdk/openai_sdk.mjs makes chat and completions calls
(streamed and not), `n: 2` with a seed, batched prompts (text and token ids) and
`client.responses.create` (streamed and not), `client.files` create / list (paginated) /
retrieve / del (also deleting every file while paging through them), and prints what the
SDK parsed; every text
must equal the gateway's own greedy (or seeded, at a pinned MTP depth) answer to the same
request over plain HTTP, and batched prompts' choices the one-prompt answers."""

import json
import os
import shutil
import subprocess
import sys
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cluster import Cluster, ROOT  # noqa: E402

NPM_PREFIX = os.path.join(ROOT, "build", "npm")
MODULES = os.path.join(NPM_PREFIX, "node_modules")
SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sdk", "openai_sdk.mjs")
MSGS = [{"role": "user", "content": "Tell me a story."}]
INSTR = "You tell short stories."
STREAM_EVENTS = ["response.created", "response.in_progress", "response.output_item.added",
                 "response.content_part.added"]
END_EVENTS = ["response.output_text.done", "response.content_part.done",
              "response.output_item.done"]


def install_sdk():
    """The SDK's node_modules, or the reason it is not there (a skip message)."""
    if not shutil.which("node") or not shutil.which("npm"):
        return None, "node and npm are needed (Debian: apt-get install nodejs npm)"
    if os.path.exists(os.path.join(MODULES, "openai", "package.json")):
        return MODULES, None
    try:
        p = subprocess.run(["npm", "install", "--prefix", NPM_PREFIX, "--no-audit", "--no-fund",
                            "openai@4"], capture_output=True, text=True, timeout=300)
    except subprocess.TimeoutExpired:
        return None, "npm install openai@4 timed out (is the npm registry reachable?)"
    if p.returncode != 0 or not os.path.exists(os.path.join(MODULES, "openai", "package.json")):
        return None, "npm install openai@4 failed (is the npm registry reachable?): " + \
            (p.stderr.strip().splitlines() or ["?"])[-1]
    return MODULES, None


class OpenAISdkTest(unittest.TestCase):
    def test_sdk(self):
        modules, why = install_sdk()
        if not modules:
            self.skipTest(why)
        with Cluster(roles=("prefill", "decode")) as c:
            got = self.run_sdk(c, modules)
            self.check(c, got)

    def run_sdk(self, c, modules):
        p = subprocess.run(["node", SCRIPT, modules, "http://127.0.0.1:%d/v1" % c.port],
                           capture_output=True, text=True, timeout=300)
        self.assertEqual(p.returncode, 0, p.stderr[-3000:] + c.log("gateway")[-2000:])
        return json.loads(p.stdout)

    def post(self, c, path, body):
        status, b = c.request("POST", path, body)
        self.assertEqual(status, 200, b)
        return b

    def check(self, c, got):
        cmpl = lambda p, **kw: self.post(c, "/v1/completions", dict(
            {"prompt": p, "max_tokens": 24, "temperature": 0}, **kw))
        chat = lambda **kw: self.post(c, "/v1/chat/completions", dict(
            {"messages": MSGS, "max_tokens": 24, "temperature": 0}, **kw))

        ref = cmpl("Once upon a time")
        self.assertEqual(got["completion"]["text"], ref["choices"][0]["text"])
        self.assertEqual(got["completion"]["finish"], ref["choices"][0]["finish_reason"])
        self.assertEqual(got["completion"]["usage"], ref["usage"])
        self.assertEqual(got["completion_stream"], ref["choices"][0]["text"])

        ref_chat = chat()
        self.assertEqual(got["chat"]["text"], ref_chat["choices"][0]["message"]["content"])
        self.assertEqual(got["chat"]["usage"], ref_chat["usage"])
        self.assertEqual(got["chat_stream"], ref_chat["choices"][0]["message"]["content"])
        self.assertEqual(got["chat_stream_usage"], ref_chat["usage"])

        # n = 2, seed 11: the choices are seeds 11 and 12 alone
        seeded = {"temperature": 1.0, "mtp_depth": 0}
        want = [cmpl("Once upon a time", seed=11 + i, **seeded)["choices"][0]["text"]
                for i in range(2)]
        self.assertNotEqual(want[0], want[1])
        self.assertEqual(got["n2"], [[0, want[0]], [1, want[1]]])
        want = [chat(seed=11 + i, **seeded)["choices"][0]["message"]["content"]
                for i in range(2)]
        self.assertEqual(got["chat_n2"], [[0, want[0]], [1, want[1]]])
        self.assertEqual(got["chat_n2_stream"], want)

        # batched prompts: each choice is its prompt's answer alone
        a = cmpl("Once upon a time")
        b = cmpl("Tom and Sue went to the")
        self.assertEqual(got["batch"], [[0, a["choices"][0]["text"]],
                                        [1, b["choices"][0]["text"]]])
        self.assertEqual(got["batch_usage"]["completion_tokens"],
                         a["usage"]["completion_tokens"] + b["usage"]["completion_tokens"])
        self.assertEqual(got["batch_stream"], [a["choices"][0]["text"], b["choices"][0]["text"]])
        ids = cmpl([1, 403, 407])
        self.assertEqual(got["batch_ids"], [[0, a["choices"][0]["text"]],
                                            [1, ids["choices"][0]["text"]]])

        # log-probabilities: what the SDK returns is the gateway's answer over plain HTTP
        lp = cmpl("Once upon a time", max_tokens=8, logprobs=2)["choices"][0]["logprobs"]
        self.assertEqual(got["lp"], lp)
        self.assertEqual(len(lp["tokens"]), 8)
        self.assertEqual(got["lp_stream"], lp["token_logprobs"])
        e = cmpl("Once upon a time", max_tokens=8, logprobs=2, echo=True)["choices"][0]
        self.assertEqual(got["lp_echo"], {"text": e["text"], "logprobs": e["logprobs"]})
        self.assertEqual(e["logprobs"]["token_logprobs"][0], None)
        self.assertEqual(e["logprobs"]["token_logprobs"][5:], lp["token_logprobs"])
        clp = chat(max_tokens=8, logprobs=True, top_logprobs=3)["choices"][0]["logprobs"]
        self.assertEqual(got["chat_lp"], clp["content"])
        self.assertEqual(got["chat_lp_stream"], clp["content"])
        self.assertEqual([len(x["top_logprobs"]) for x in clp["content"]], [3] * 8)

        # the Responses API: the same text as chat with the instructions as a system message
        msgs = [{"role": "system", "content": INSTR}] + MSGS
        rc = self.post(c, "/v1/chat/completions", {"messages": msgs, "max_tokens": 24,
                                                    "temperature": 0})
        text = rc["choices"][0]["message"]["content"]
        status = "incomplete" if rc["choices"][0]["finish_reason"] == "length" else "completed"
        usage = {"input_tokens": rc["usage"]["prompt_tokens"],
                 "input_tokens_details": {"cached_tokens": 0},
                 "output_tokens": rc["usage"]["completion_tokens"],
                 "output_tokens_details": {"reasoning_tokens": 0},
                 "total_tokens": rc["usage"]["total_tokens"]}
        r = got["response"]
        self.assertTrue(r["id"].startswith("resp_"), r)
        self.assertEqual((r["object"], r["status"], r["text"], r["usage"], r["store"],
                          r["instructions"]),
                         ("response", status, text, usage, False, INSTR))
        rs = got["response_stream"]
        n = len(rs["types"])
        self.assertEqual(rs["types"][:4], STREAM_EVENTS)
        self.assertEqual(rs["types"][n - 4:n - 1], END_EVENTS)
        self.assertEqual(rs["types"][-1], "response.incomplete" if status == "incomplete"
                         else "response.completed")
        self.assertEqual(set(rs["types"][4:n - 4]), {"response.output_text.delta"})
        self.assertEqual(rs["seqs"], list(range(n)))
        self.assertEqual((rs["text"], rs["done_text"], rs["usage"], rs["status"]),
                         (text, text, usage, status))
        self.assertEqual(got["refusal"], {"status": 400, "param": "previous_response_id",
                                          "code": "unsupported_parameter"})

        # files: newest first over pages of 2; a deleted file is a 404 to the SDK; deleting
        # each file while paging by one (the cursor is the file just deleted) reaches them all
        up = got["files_uploaded"]
        self.assertEqual(got["files_listed"], up[::-1])
        self.assertEqual(got["files_batch"], up)
        self.assertEqual(got["file_deleted"], {"id": up[1], "object": "file", "deleted": True})
        self.assertEqual(got["file_gone"], {"status": 404, "param": "file_id",
                                            "code": "file_not_found"})
        self.assertEqual(got["files_deleted_paging"], [up[2], up[0]])
        self.assertEqual(got["files_left"], 0)


if __name__ == "__main__":
    unittest.main()
