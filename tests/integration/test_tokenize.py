"""POST /tokenize and POST /detokenize (vLLM's shapes) and GET /v1/models' card
(max_model_len, mtp_depth), against a real cluster of stories260K: exact token ids, the ids
the completion endpoints compute (usage.prompt_tokens equal to count), 4xx with an OpenAI
error body for every bad body, and the same API-key check as the completion routes.
    python3 -m unittest -v tests/integration/test_tokenize.py
"""

import os
import sys
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cluster import Cluster  # noqa: E402

N_CTX = 512  # stories260K
ONCE = [1, 403, 407, 261, 378]  # BOS + "Once upon a time" (fake_gateway.py's PROMPT)
KEY = "sk-test-tokenize-5e0c2b7d41a9"


class Tokenize(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.c = Cluster(roles=("prefill", "decode"),
                        worker_args=["--mtp-depth", "1", "--mtp-adaptive", "false"],
                        gateway_args=["--api-key", KEY, "--max-body-bytes", "16384"])
        cls.c.__enter__()
        cls.c.api_key = KEY

    @classmethod
    def tearDownClass(cls):
        cls.c.__exit__(None, None, None)

    def error(self, path, body, status, param, code, raw=None):
        st, got = self.c.request("POST", path, body, raw=raw)
        self.assertEqual(st, status, got)
        self.assertEqual(sorted(got["error"]), ["code", "message", "param", "type"], got)
        self.assertEqual(got["error"]["param"], param, got)
        self.assertEqual(got["error"]["code"], code, got)
        self.assertEqual(got["error"]["type"], "invalid_request_error", got)
        return got["error"]["message"]

    def test_prompt_exact_ids(self):
        st, got = self.c.request("POST", "/tokenize", {"prompt": "Once upon a time"})
        self.assertEqual(st, 200, got)
        self.assertEqual(got, {"count": 5, "max_model_len": N_CTX, "tokens": ONCE,
                               "token_strs": None})
        st, got = self.c.request("POST", "/tokenize", {"model": "stories260K",
                                                       "prompt": "Once upon a time",
                                                       "add_special_tokens": False})
        self.assertEqual((st, got["tokens"], got["count"]), (200, ONCE[1:], 4))
        st, got = self.c.request("POST", "/tokenize", {"prompt": ""})
        self.assertEqual((st, got["tokens"], got["count"]), (200, [1], 1))

    def test_count_is_what_completions_compute(self):
        for path, body in (("/v1/completions", {"prompt": "Tom and Sue went to the"}),
                           ("/v1/chat/completions",
                            {"messages": [{"role": "system", "content": "Be brief."},
                                          {"role": "user", "content": "Tell a story."}]})):
            st, tok = self.c.request("POST", "/tokenize", body)
            self.assertEqual(st, 200, tok)
            st, out = self.c.request("POST", path, dict(body, max_tokens=1, temperature=0))
            self.assertEqual(st, 200, out)
            self.assertEqual(out["usage"]["prompt_tokens"], tok["count"], path)
            self.assertEqual(len(tok["tokens"]), tok["count"])

    def test_messages_generation_prompt(self):
        msgs = [{"role": "user", "content": "hi"}]
        st, with_gen = self.c.request("POST", "/tokenize", {"messages": msgs})
        self.assertEqual(st, 200, with_gen)
        st, plain = self.c.request("POST", "/tokenize", {"prompt": "user: hi\nassistant:"})
        self.assertEqual(with_gen["tokens"], plain["tokens"])  # docs/api.md's template
        st, no_gen = self.c.request("POST", "/tokenize", {"messages": msgs,
                                                          "add_generation_prompt": False})
        st, plain = self.c.request("POST", "/tokenize", {"prompt": "user: hi\n"})
        self.assertEqual(st, 200)
        self.assertEqual(no_gen["tokens"], plain["tokens"])
        self.assertLess(no_gen["count"], with_gen["count"])

    def test_detokenize(self):
        st, got = self.c.request("POST", "/detokenize", {"tokens": ONCE})
        self.assertEqual((st, got), (200, {"prompt": "Once upon a time"}))
        st, got = self.c.request("POST", "/detokenize", {"model": "stories260K", "tokens": []})
        self.assertEqual((st, got), (200, {"prompt": ""}))
        # round trip of a text with bytes outside the vocabulary's pieces (byte fallback)
        text = "Lily saw a caf\u00e9 \u2603 and said \"hi\"."
        st, tok = self.c.request("POST", "/tokenize", {"prompt": text})
        st, got = self.c.request("POST", "/detokenize", {"tokens": tok["tokens"]})
        self.assertEqual((st, got["prompt"]), (200, text))
        # a lone byte token of a 3-byte character: U+FFFD, as Hugging Face decodes it
        st, snow = self.c.request("POST", "/tokenize", {"prompt": "\u2603",
                                                        "add_special_tokens": False})
        # the dummy-prefix space, then <0xE2> <0x98> <0x83> (byte tokens are 3 + byte)
        self.assertEqual(snow["tokens"], [410, 3 + 0xE2, 3 + 0x98, 3 + 0x83])
        st, got = self.c.request("POST", "/detokenize", {"tokens": [3 + 0xE2]})
        self.assertEqual((st, got), (200, {"prompt": "\ufffd"}))
        # bytes of no whole character: one U+FFFD per maximal ill-formed subsequence, as
        # Hugging Face (and Python) decode them and as a completion's text shows them; an
        # echoed token-id prompt is that text too (it was "??", or cut at a cut character)
        upon = ONCE[2]  # " upon"
        for raw, ids in ((b"\xe6\x97", [3 + 0xE6, 3 + 0x97]),
                         (b"\xe6\x97 upon", [3 + 0xE6, 3 + 0x97, upon]),
                         (b"\xc3A\x97\x97", [3 + 0xC3, 3 + 0x41, 3 + 0x97, 3 + 0x97]),
                         (b"\xf0\x80\xe2\x98\x83", [3 + 0xF0, 3 + 0x80, 3 + 0xE2, 3 + 0x98,
                                                   3 + 0x83])):
            want = raw.decode("utf-8", errors="replace")
            st, got = self.c.request("POST", "/detokenize", {"tokens": ids})
            self.assertEqual((st, got), (200, {"prompt": want}), ids)
            st, out = self.c.request("POST", "/v1/completions",
                                     {"prompt": [1] + ids, "echo": True, "max_tokens": 1,
                                      "temperature": 0, "logit_bias": {"2": 100}})
            self.assertEqual(st, 200, out)
            self.assertEqual(out["choices"][0]["text"], want, ids)

    def test_bad_bodies(self):
        self.error("/tokenize", None, 400, None, "invalid_json", raw=b'{"prompt": "a"')
        self.error("/tokenize", [1], 400, None, "invalid_type")
        self.error("/tokenize", {}, 400, "prompt", "missing_required_parameter")
        self.error("/tokenize", {"prompt": "a", "messages": [{"role": "user", "content": "a"}]},
                   400, "messages", "invalid_value")
        self.error("/tokenize", {"prompt": 5}, 400, "prompt", "invalid_type")
        self.error("/tokenize", {"prompt": ["a"]}, 400, "prompt", "invalid_type")
        self.error("/tokenize", {"prompt": "a", "add_special_tokens": "yes"}, 400,
                   "add_special_tokens", "invalid_type")
        self.error("/tokenize", {"messages": "hi"}, 400, "messages", "invalid_type")
        self.error("/tokenize", {"messages": [{"role": "robot", "content": "x"}]}, 400,
                   "messages", "invalid_value")
        self.error("/tokenize", {"messages": [{"role": "user", "content": "x"}],
                                 "add_generation_prompt": 1}, 400, "add_generation_prompt",
                   "invalid_type")
        self.error("/tokenize", {"model": "gpt-4", "prompt": "a"}, 404, "model",
                   "model_not_found")
        self.error("/detokenize", {}, 400, "tokens", "missing_required_parameter")
        self.error("/detokenize", {"tokens": "1 2"}, 400, "tokens", "invalid_type")
        msg = self.error("/detokenize", {"tokens": [1, 512]}, 400, "tokens", "invalid_value")
        self.assertEqual(msg, "'tokens[1]' must be a token id in [0, 512), got 512.")
        msg = self.error("/detokenize", {"tokens": [-1]}, 400, "tokens", "invalid_value")
        self.assertEqual(msg, "'tokens[0]' must be a token id in [0, 512), got -1.")
        msg = self.error("/detokenize", {"tokens": [1, 2.5]}, 400, "tokens", "invalid_value")
        self.assertEqual(msg, "'tokens[1]' must be a token id in [0, 512), got a number.")
        self.error("/detokenize", {"tokens": [1], "model": 3}, 400, "model", "invalid_type")
        # a body that is not UTF-8: invalid_encoding, as on the completion routes
        for path in ("/tokenize", "/detokenize"):
            self.error(path, None, 400, None, "invalid_encoding", raw=b'{"prompt": "\xff"}')
            self.error(path, None, 400, None, "invalid_encoding", raw=b'\xfe\xff')
        st, got = self.c.request("GET", "/tokenize")
        self.assertEqual((st, got["error"]["code"]), (405, "method_not_allowed"))
        st, got = self.c.request("POST", "/tokenize", {"prompt": "x" * 20000})
        self.assertEqual((st, got["error"]["code"]), (413, "request_too_large"))

    def test_api_key(self):
        for path, body in (("/tokenize", {"prompt": "a"}), ("/detokenize", {"tokens": [1]})):
            st, got = self.c.request("POST", path, body, headers={"Authorization": ""})
            self.assertEqual((st, got["error"]["code"]), (401, "invalid_api_key"), path)
            st, got = self.c.request("POST", path, body,
                                     headers={"Authorization": "Bearer sk-wrong-0000000000"})
            self.assertEqual(st, 401, path)
            st, got = self.c.request("POST", path, body)
            self.assertEqual(st, 200, got)

    def test_models_card(self):
        want = {"id": "stories260K", "object": "model", "owned_by": "tidepool",
                "root": "stories260K", "max_model_len": N_CTX, "mtp_depth": 1}
        st, got = self.c.request("GET", "/v1/models")
        self.assertEqual(st, 200, got)
        self.assertEqual(got["object"], "list")
        self.assertEqual(len(got["data"]), 1)
        card = dict(got["data"][0])
        self.assertIsInstance(card.pop("created"), int)
        self.assertEqual(card, want)
        st, one = self.c.request("GET", "/v1/models/stories260K")
        self.assertEqual((st, one), (200, got["data"][0]))
        # the id is a path segment: percent-encoded as clients encode it (openai-node's
        # encodeURIComponent turns an "org/name" id into org%2Fname)
        st, enc = self.c.request("GET", "/v1/models/stories%32%360K")
        self.assertEqual((st, enc), (200, got["data"][0]))
        # a model id may hold "/" (no such model here); a NUL or a bad escape is 400
        for bad, status, code in (("stories260K%2F", 404, "model_not_found"),
                                  ("stories260K%00", 400, "invalid_value"),
                                  ("stories260K%2", 400, "bad_request"),
                                  ("%ZZ", 400, "bad_request")):
            st, miss = self.c.request("GET", "/v1/models/" + bad)
            self.assertEqual((st, miss["error"]["code"]), (status, code), bad)


class ModelsNoMtp(unittest.TestCase):
    def test_mtp_depth_zero_without_modules(self):
        with Cluster(roles=("mixed",), worker_args=["--mtp", "none"]) as c:
            st, got = c.request("GET", "/v1/models")
            self.assertEqual(st, 200, got)
            self.assertEqual(got["data"][0]["mtp_depth"], 0)
            self.assertEqual(got["data"][0]["max_model_len"], N_CTX)


if __name__ == "__main__":
    unittest.main()
