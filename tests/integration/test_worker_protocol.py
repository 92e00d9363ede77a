"""Workers driven directly over the ctl socket by a scripted gateway (fake_gateway.py):
greedy tokens, batching, cancel in every state, drain, re-registration, bad input."""

import os
import subprocess
import sys
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import fake_gateway  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(HERE))


class WorkerProtocol(unittest.TestCase):
    pass


def make_case(name):
    def run(self):
        p = subprocess.run([sys.executable, os.path.join(HERE, "fake_gateway.py"),
                            "--build", os.environ.get("TIDEPOOL_BUILD", "build"), name],
                           capture_output=True, text=True, timeout=120, cwd=ROOT)
        # the case's verdict line first (the workers' logs after it can push it out of
        # the tail), then the end of the output
        verdict = [ln for ln in p.stdout.splitlines() if ln.startswith(name + " ")]
        self.assertEqual(p.returncode, 0, "\n".join(verdict) + "\n" + p.stdout[-6000:] +
                         p.stderr[-2000:])
    return run


for _name in fake_gateway.CASES:
    setattr(WorkerProtocol, "test_" + _name, make_case(_name))

if __name__ == "__main__":
    unittest.main()
