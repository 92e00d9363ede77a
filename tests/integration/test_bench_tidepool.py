"""tidepool-bench against a real tidepool cluster: its token totals must equal the
server's own counts exactly (usage totals, and /metrics prompt/generation counters)."""

import json
import os
import re
import subprocess
import sys
import tempfile
import time
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cluster import BIN, Cluster  # noqa: E402


def metric(text, name):
    total = 0.0
    for line in text.splitlines():
        if name in (QUERIES, HITS):  # either metric prefix (tidepool: or tidepool_)
            m = re.match(r"^tidepool[:_]%s(\{[^}]*\})? ([0-9.e+-]+)$" % name, line)
        else:
            m = re.match(r"^%s(\{[^}]*\})? ([0-9.e+-]+)$" % re.escape(name), line)
        if m:
            total += float(m.group(2))
    return total


QUERIES, HITS = "prefix_cache_queries_total", "prefix_cache_hits_total"


class BenchAgainstTidepool(unittest.TestCase):
    def test_token_counts_match_server(self):
        with Cluster(roles=("prefill", "decode")) as c:
            _, before = c.request("GET", "/metrics")
            out = os.path.join(tempfile.mkdtemp(prefix="tidepool-bench-"), "run.json")
            p = subprocess.run(
                [os.path.join(BIN, "tidepool-bench"), "--url", "http://127.0.0.1:%d" % c.port,
                 "--num-prompts", "24", "--concurrency", "6", "--input-len-range", "4:40",
                 "--output-len-range", "8:64", "--seed", "3", "--no-progress",
                 "--result-json", out],
                capture_output=True, text=True, timeout=120)
            self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
            with open(out) as f:
                res = json.load(f)
            self.assertEqual(res["completed"], 24)
            self.assertEqual(res["failed"], 0)
            _, after = c.request("GET", "/metrics")
            gen = metric(after, "tidepool_generation_tokens_total") - \
                metric(before, "tidepool_generation_tokens_total")
            prompt = metric(after, "tidepool_prompt_tokens_total") - \
                metric(before, "tidepool_prompt_tokens_total")
            self.assertEqual(res["total_output_tokens"], int(gen))
            self.assertEqual(res["total_input_tokens"], int(prompt))
            per_req = sum(r["output_tokens"] for r in res["requests"])
            self.assertEqual(per_req, res["total_output_tokens"])

    def test_multi_turn_workload(self):
        """--workload multi-turn on the chat endpoint: every turn resends its conversation
        (prompts grow turn by turn, replies included: a turn's prompt is longer than the
        previous turn's prompt plus its reply) and the prefill worker finds the earlier
        turns in its prefix cache."""
        with Cluster(roles=("prefill", "decode"), worker_args=["--heartbeat-ms", "50"]) as c:
            out = os.path.join(tempfile.mkdtemp(prefix="tidepool-bench-"), "run.json")
            p = subprocess.run(
                [os.path.join(BIN, "tidepool-bench"), "--url", "http://127.0.0.1:%d" % c.port,
                 "--endpoint", "/v1/chat/completions", "--workload", "multi-turn",
                 "--conversations", "3", "--turns", "3", "--system-len", "40",
                 "--input-len", "6", "--output-len", "12", "--no-progress",
                 "--result-json", out],
                capture_output=True, text=True, timeout=120)
            self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
            with open(out) as f:
                res = json.load(f)
            self.assertEqual((res["completed"], res["failed"]), (9, 0))
            recs = res["requests"]
            for conv in range(3):
                turns = [recs[t * 3 + conv] for t in range(3)]
                for a, b in zip(turns, turns[1:]):
                    self.assertGreater(b["prompt_tokens"], a["prompt_tokens"] + a["output_tokens"])
                    self.assertGreaterEqual(b["start_s"], a["start_s"] + a["e2el_ms"] / 1000 - 1e-3)
            deadline = time.time() + 10
            while time.time() < deadline:
                _, text = c.request("GET", "/metrics")
                if metric(text, QUERIES) == res["total_input_tokens"]:
                    break
                time.sleep(0.05)
            self.assertEqual(metric(text, QUERIES), res["total_input_tokens"])
            self.assertGreater(metric(text, HITS), 0.3 * res["total_input_tokens"])

    def test_trace_replay_exact_lengths(self):
        """--trace against tidepool: every prompt is exactly the trace's prompt_tokens (the
        server's usage and its prompt-token counter say so), every answer exactly its
        output_tokens (ignore_eos, min_tokens), offline lines go to the offline tier (its
        generation counter counts exactly their tokens)."""
        rows = [(0.0, 1, 4, "online"), (0.05, 37, 9, "offline"), (0.1, 200, 30, "online"),
                (0.1, 96, 1, "online"), (0.2, 450, 40, "offline"), (0.25, 12, 17, "online"),
                (0.3, 311, 6, "online"), (0.4, 64, 25, "offline")]
        tmp = tempfile.mkdtemp(prefix="tidepool-bench-")
        trace, out = os.path.join(tmp, "t.csv"), os.path.join(tmp, "run.json")
        with open(trace, "w") as f:
            f.write("arrival_s,prompt_tokens,output_tokens,class\n")
            f.writelines("%g,%d,%d,%s\n" % r for r in rows)
        with Cluster(roles=("prefill", "decode")) as c:
            _, before = c.request("GET", "/metrics")
            p = subprocess.run(
                [os.path.join(BIN, "tidepool-bench"), "--url", "http://127.0.0.1:%d" % c.port,
                 "--trace", trace, "--goodput", "ttft:60000", "--no-progress",
                 "--result-json", out], capture_output=True, text=True, timeout=180)
            self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
            self.assertIn("BOS first; context window checked", p.stderr)
            _, after = c.request("GET", "/metrics")
        with open(out) as f:
            res = json.load(f)
        self.assertEqual((res["completed"], res["failed"]), (8, 0))
        recs = res["requests"]
        self.assertEqual([r["prompt_tokens"] for r in recs], [r[1] for r in rows])
        self.assertEqual([r["prompt_tokens_source"] for r in recs], ["usage"] * 8)
        self.assertEqual([r["output_tokens"] for r in recs], [r[2] for r in rows])
        self.assertEqual([r["class"] for r in recs], [r[3] for r in rows])

        def delta(name):
            return int(metric(after, name) - metric(before, name))
        self.assertEqual(delta("tidepool_prompt_tokens_total"), sum(r[1] for r in rows))
        self.assertEqual(delta("tidepool_generation_tokens_total"), sum(r[2] for r in rows))
        self.assertEqual(delta("tidepool_offline_generation_tokens_total"),
                         sum(r[2] for r in rows if r[3] == "offline"))
        tr = res["trace"]
        self.assertEqual((tr["online"], tr["online_good"], tr["offline_completed"],
                          tr["offline_output_tokens"]), (5, 5, 3, 9 + 40 + 25))

    def test_trace_over_the_context_window(self):
        """A line longer than the model's context (stories260K: 512) stops the run before
        anything is sent, naming the line."""
        tmp = tempfile.mkdtemp(prefix="tidepool-bench-")
        trace = os.path.join(tmp, "t.csv")
        with open(trace, "w") as f:
            f.write("0,100,10\n0.5,500,13,offline\n")
        with Cluster(roles=("prefill", "decode")) as c:
            _, before = c.request("GET", "/metrics")
            p = subprocess.run(
                [os.path.join(BIN, "tidepool-bench"), "--url", "http://127.0.0.1:%d" % c.port,
                 "--trace", trace, "--no-progress"], capture_output=True, text=True,
                timeout=60)
            _, after = c.request("GET", "/metrics")
        self.assertEqual(p.returncode, 1, p.stdout + p.stderr)
        self.assertIn("t.csv:2: prompt + output = 513 tokens exceeds the server's context "
                      "window (max_model_len 512)", p.stderr)
        self.assertEqual(metric(after, "tidepool_prompt_tokens_total"),
                         metric(before, "tidepool_prompt_tokens_total"))


if __name__ == "__main__":
    unittest.main()
