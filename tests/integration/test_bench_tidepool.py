"""tidepool-bench against a real tidepool cluster: its token totals must equal the
server's own counts exactly (usage totals, and /metrics prompt/generation counters)."""

import json
import os
import re
import subprocess
import sys
import tempfile
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cluster import BIN, Cluster  # noqa: E402


def metric(text, name):
    total = 0.0
    for line in text.splitlines():
        m = re.match(r"^%s(\{[^}]*\})? ([0-9.e+-]+)$" % re.escape(name), line)
        if m:
            total += float(m.group(2))
    return total


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


if __name__ == "__main__":
    unittest.main()
