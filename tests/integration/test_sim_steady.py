"""tidepool-sim: the issue-16 goodput targets on shortened runs (docs/tidal.md has the full
600 s tables). On every steady production-shaped workload (conversation, code, mix) at 50 %,
80 % and 90 % of the cost model's capacity ("100 %" of docs/tidal.md), tidal goodput is at
least 0.99x the best static split of 16 workers over 120 s of arrivals; on the shifting
mixes (the phase shift at load 0.8, the conversation <-> code day `shift` at load 0.9) at
least 1.3x. The old policy failed the first on code at 0.9 (0.872x here: the start-up
backlog behind the rate cap). Each run is a --compare-static of 16 splits, well under a
second; the whole file takes a few seconds.
Run: python3 -m unittest -v tests/integration/test_sim_steady.py (TIDEPOOL_BUILD picks the
build directory, default build/)."""

import os
import sys
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_sim import SIM, rows, run_sim  # noqa: E402


def ratio(args):
    """(tidal goodput, best static name, its goodput) of one --compare-static run."""
    rc, out, err, _ = run_sim(*args, "--compare-static")
    if rc != 0:
        raise AssertionError(err)
    r = rows(out)
    statics = {k: v for k, v in r.items() if k.startswith("static:")}
    best = max(statics.items(), key=lambda kv: kv[1][0])
    return r["tidal"][0], best[0], best[1][0]


@unittest.skipUnless(os.access(SIM, os.X_OK), "build tidepool-sim first (make)")
class SimSteadyTest(unittest.TestCase):
    def test_steady_at_least_099_of_best_static(self):
        for wl in ("conversation", "code", "mix"):
            for load in ("0.5", "0.8", "0.9"):
                args = ["--workers", "16", "--workload", wl, "--load", load,
                        "--duration-s", "120", "--seed", "1"]
                t, name, b = ratio(args)
                print(f"\n{wl} at {load}: tidal {t:.2f} req/s, best {name} {b:.2f}: "
                      f"{t / b:.3f}x", end="")
                self.assertGreaterEqual(t, 0.99 * b, " ".join(args))

    def test_shifting_mixes_at_least_13x(self):
        for args in (["--workers", "8", "--workload", "phase-shift", "--load", "0.8",
                      "--duration-s", "240", "--phase-s", "60", "--seed", "1"],
                     ["--workers", "16", "--workload", "shift", "--load", "0.9",
                      "--duration-s", "240", "--seed", "1"]):
            t, name, b = ratio(args)
            print(f"\n{' '.join(args)}: tidal {t:.2f} req/s, best {name} {b:.2f}: "
                  f"{t / b:.3f}x", end="")
            self.assertGreaterEqual(t, 1.3 * b, " ".join(args))


if __name__ == "__main__":
    unittest.main()
