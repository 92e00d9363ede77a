"""tools/tidal-bench.sh and what it relies on: dilated emulation (a worker emulating
"a100-llama3-8b:dilate=10" takes ten times the cost model's time and still produces the
real model's tokens), the gateway's tidal policy flags, and a short end-to-end run of the
script (the EMULATED table, both rankings, the offline comparison).
Run: python3 -m unittest -v tests/integration/test_tidal_bench.py (TIDEPOOL_BUILD picks the
build directory, default build/)."""

import os
import subprocess
import sys
import tempfile
import time
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cluster import BIN, BUILD, MODEL, ROOT, Cluster  # noqa: E402
from test_e2e import REF, worker_figures  # noqa: E402


class Dilation(unittest.TestCase):
    def test_dilated_worker_is_ten_times_slower_same_tokens(self):
        preset = "a100-llama3-8b:dilate=10"
        with Cluster(roles=("prefill", "decode"), worker_args=["--emulate", preset]) as c:
            figs = worker_figures(c)
            self.assertTrue(all(w.get("emulated") for w in figs.values()), figs)
            for name in c.worker_names():
                self.assertIn("EMULATED accelerator '%s'" % preset, c.log(name))
            t0 = time.time()
            status, body = c.complete("Once upon a time", max_tokens=48)
            elapsed = time.time() - t0
            self.assertEqual(status, 200, body)
            self.assertEqual(body["choices"][0]["text"], REF["Once upon a time"])
            # 47 decode steps, each at least the A100's 7.8 ms weight read (16 GB at full
            # bandwidth) times 10; undilated the same request takes well under a second
            self.assertGreater(elapsed, 10 * 47 * 0.0078, elapsed)
            self.assertLess(elapsed, 30, elapsed)


class GatewayFlags(unittest.TestCase):
    def test_policy_capacity_and_min_per_role(self):
        p = subprocess.run([os.path.join(BIN, "gateway"), "--help"], capture_output=True,
                           text=True, timeout=10)
        self.assertEqual(p.returncode, 0)
        for flag in ("--prefill-tokens-per-s", "--decode-tokens-per-s", "--tidal-min-per-role"):
            self.assertIn(flag, p.stdout)
        # --tidal's help says how roles change (docs/scheduler.md): migration, not draining
        tidal = next(l for l in p.stdout.splitlines() if l.split()[:1] == ["--tidal"])
        self.assertIn("migrates its running sequences", tidal)
        self.assertNotIn("draining", tidal)
        for bad in (["--tidal-min-per-role", "0"], ["--prefill-tokens-per-s", "0"],
                    ["--decode-tokens-per-s", "-1"]):
            p = subprocess.run([os.path.join(BIN, "gateway"), "--model", MODEL] + bad,
                               capture_output=True, text=True, timeout=10)
            self.assertEqual(p.returncode, 2, bad)
        with Cluster(gateway_args=["--tidal", "--prefill-tokens-per-s", "945",
                                   "--decode-tokens-per-s", "369",
                                   "--tidal-min-per-role", "2"]) as c:
            log = c.log("gateway")
            self.assertIn("prefill-tokens-per-s = 945", log)
            self.assertIn("decode-tokens-per-s = 369", log)
            self.assertIn("tidal-min-per-role = 2", log)
            # one worker of each role: min_per_role 2 only means the policy moves nothing
            self.assertEqual(c.complete("Once upon a time", max_tokens=48)[0], 200)


class Script(unittest.TestCase):
    def test_short_run_prints_every_part(self):
        env = dict(os.environ, BUILD=BUILD, MODEL=MODEL, PHASE_S="4", PHASES="2",
                   SPLITS="4:4", RATE="6", DECODE_RATE="12", OFFLINE_LINES="20", SIM1000="0",
                   TIE_PCT="3")
        p = subprocess.run(["bash", os.path.join(ROOT, "tools", "tidal-bench.sh")],
                           capture_output=True, text=True, timeout=500, env=env)
        self.assertEqual(p.returncode, 0, p.stderr[-3000:])
        out = p.stdout
        for want in ("EMULATED cluster of 8 workers (a100-llama3-8b:dilate=10",
                     "static 4:4", "ranking (EMULATED", "tidal / best static (static 4:4)",
                     "SIMULATED (tidepool-sim --trace", "ranking (SIMULATED, every split, by SLO attainment",
                     "'=': within 3 %", "pairs (EMULATED vs SIMULATED): static 4:4 ",
                     "the emulated and simulated rankings of the configurations run here: ",
                     ">= 0.99x: ", "OFFLINE (EMULATED", "without offline", "with offline",
                     "KV padding false", "prefix cache false",
                     "a100-llama3-8b:dilate=10:token-scale=0.1"):
            self.assertIn(want, out)
        # the gateway's policy gets the simulator's capacity figures, decode's token rate too
        self.assertRegex(out, r"--prefill-tokens-per-s [1-9]\d* --decode-tokens-per-s [1-9]\d*")
        # run as root the cluster is niced above everything else (NICE=-10 by default)
        self.assertIn("nice %d" % (-10 if os.geteuid() == 0 else 0), out)
        row = next(l for l in out.splitlines() if l.startswith("tidal "))
        self.assertRegex(row, r"^tidal\s+[\d.]+\s+\d+/\d+\s")
        # the EMU/SIM table: the emulated TPOT counted as the simulator does, a number
        sim_part = out[out.index("SIMULATED (tidepool-sim"):]
        row = next(l for l in sim_part.splitlines() if l.startswith("tidal "))
        self.assertNotIn("nan", row)
        self.assertNotIn("tidal-bench: runs kept", p.stderr)  # KEEP=0: cleaned up

    def test_trace_mode_offline_in_the_troughs(self):
        """TRACE=: the online lines replayed by tidal (and the simulator), the whole trace,
        then the offline lines alone; the OFFLINE IN THE TROUGHS table."""
        tmp = tempfile.mkdtemp(prefix="tidal-bench-trace-")
        trace = os.path.join(tmp, "t.csv")
        p = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "bench", "gen-trace.py"),
                            "--shape", "conversation", "--tide", "2:8", "--duration-s", "8",
                            "--scale", "0.1", "--max-context", "512", "--offline", "120",
                            "--offline-shape", "conversation", "--seed", "2"],
                           capture_output=True, text=True, timeout=60)
        self.assertEqual(p.returncode, 0, p.stderr)
        with open(trace, "w") as f:
            f.write(p.stdout)
        n_online = sum(1 for l in p.stdout.splitlines() if l.endswith(",online"))
        env = dict(os.environ, BUILD=BUILD, MODEL=MODEL, TRACE=trace, SPLITS=" ", SIM1000="0",
                   BIN_S="2", WARM_S="2", TRACE_TIME_SCALE="1.25")
        p = subprocess.run(["bash", os.path.join(ROOT, "tools", "tidal-bench.sh")],
                           capture_output=True, text=True, timeout=500, env=env)
        self.assertEqual(p.returncode, 0, p.stderr[-3000:])
        out = p.stdout
        # replayed retimed (TRACE_TIME_SCALE): the same lines, 1.25 times the arrival times
        self.assertIn("trace %s (--time-scale 1.25) (%d online lines over" % (trace, n_online),
                      out)
        for want in ("ranking (EMULATED", "ranking (SIMULATED, every split, by SLO attainment",
                     "OFFLINE IN THE TROUGHS (EMULATED, tidal; the trace's 120 offline lines",
                     "capacity for the offline lines alone:", "without offline",
                     "with offline", "(troughs)", "(whole run)",
                     "SIMULATED, the whole trace (tidal)"):
            self.assertIn(want, out)
        row = next(l for l in out.splitlines() if l.startswith("tidal "))
        self.assertRegex(row, r"^tidal\s+[\d.]+\s+\d+/%d\s" % n_online)


if __name__ == "__main__":
    unittest.main()
