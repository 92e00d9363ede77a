"""The model-writing tools (tidepool-mkmodel; tidepool-convert shares the writer): a file is
written to "<out>.tmp.<pid>" and renamed, so a reader never sees half a model; a tool killed
by SIGINT or SIGTERM while writing removes its temporary file and dies of that signal.
Run: python3 -m unittest -v tests/integration/test_tools.py (TIDEPOOL_BUILD picks the build
directory, default build/)."""

import glob
import os
import shutil
import signal
import subprocess
import tempfile
import time
import unittest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BUILD = os.environ.get("TIDEPOOL_BUILD", "build")
MKMODEL = os.path.join(ROOT, BUILD, "bin", "tidepool-mkmodel")
# about 230 MB of F32: long enough to write that the test sees the temporary file
BIG = ["--dim", "512", "--hidden-dim", "1408", "--layers", "8", "--vocab", "32000"]


@unittest.skipUnless(os.path.exists(MKMODEL), "needs " + MKMODEL)
class InterruptedWrite(unittest.TestCase):
    def setUp(self):
        self.dir = tempfile.mkdtemp(prefix="tp-tools-")
        self.out = os.path.join(self.dir, "m.gguf")

    def tearDown(self):
        shutil.rmtree(self.dir, ignore_errors=True)

    def kill_while_writing(self, sig):
        p = subprocess.Popen([MKMODEL, "--out", self.out] + BIG, stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE)
        tmp = "%s.tmp.%d" % (self.out, p.pid)
        try:
            deadline = time.time() + 120
            while not os.path.exists(tmp) and p.poll() is None and time.time() < deadline:
                time.sleep(0.002)
            self.assertTrue(os.path.exists(tmp), "the temporary file never appeared")
            p.send_signal(sig)
            p.wait(60)
        finally:
            if p.poll() is None:
                p.kill()
                p.wait()
            p.stderr.close()
        # killed by the signal itself, not an exit status
        self.assertEqual(p.returncode, -sig)
        self.assertEqual(glob.glob(os.path.join(self.dir, "*")), [])

    def test_sigterm_removes_the_temporary_file(self):
        self.kill_while_writing(signal.SIGTERM)

    def test_sigint_removes_the_temporary_file(self):
        self.kill_while_writing(signal.SIGINT)

    def test_ignored_signal_stays_ignored(self):
        # nohup (SIGHUP ignored), a background job of a non-interactive shell (SIGINT
        # ignored): the cleanup handler must not turn an ignored signal into a fatal one
        def ignore():
            signal.signal(signal.SIGHUP, signal.SIG_IGN)
            signal.signal(signal.SIGINT, signal.SIG_IGN)
        p = subprocess.Popen([MKMODEL, "--out", self.out] + BIG, stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE, preexec_fn=ignore)
        tmp = "%s.tmp.%d" % (self.out, p.pid)
        try:
            deadline = time.time() + 120
            while not os.path.exists(tmp) and p.poll() is None and time.time() < deadline:
                time.sleep(0.002)
            self.assertTrue(os.path.exists(tmp), "the temporary file never appeared")
            p.send_signal(signal.SIGHUP)
            p.send_signal(signal.SIGINT)
            p.wait(120)
        finally:
            if p.poll() is None:
                p.kill()
                p.wait()
            p.stderr.close()
        self.assertEqual(p.returncode, 0)
        self.assertEqual(os.listdir(self.dir), ["m.gguf"])

    def test_finished_file_is_whole(self):
        small = os.path.join(self.dir, "s.gguf")
        r = subprocess.run([MKMODEL, "--out", small, "--dim", "64", "--hidden-dim", "128",
                            "--layers", "1", "--heads", "4", "--kv-heads", "2"],
                           capture_output=True, timeout=60)
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertEqual(os.listdir(self.dir), ["s.gguf"])
        with open(small, "rb") as f:
            self.assertEqual(f.read(4), b"GGUF")


if __name__ == "__main__":
    unittest.main()
