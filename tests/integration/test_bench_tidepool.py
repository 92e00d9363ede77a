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


if __name__ == "__main__":
    unittest.main()
