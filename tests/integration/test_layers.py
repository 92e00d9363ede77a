"""The include layering (docs/architecture.md): the tree is clean, and the checker fails on
each kind of forbidden include planted in a copy of the tree's folders."""
import os
import shutil
import subprocess
import tempfile
import unittest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
PY = "/usr/bin/python3"
CHECKER = os.path.join(ROOT, "tools", "check-layers.py")


def layer_args():
    out = subprocess.run(["make", "-s", "--no-print-directory", "print-layers"], cwd=ROOT,
                         check=True, capture_output=True, text=True, timeout=60).stdout
    return out.split()


def c_sources_only(folder, names):
    """copytree's ignore: every file but the .c and .h ones (the checker reads only those;
    the fuzzing corpora alone are thousands of files)."""
    return [n for n in names if not n.endswith((".c", ".h"))
            and not os.path.isdir(os.path.join(folder, n))]


class LayersTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.args = layer_args()

    def run_checker(self, root):
        return subprocess.run([PY, CHECKER, "--root", root] + self.args, capture_output=True,
                              text=True, timeout=60)

    def test_tree_is_clean(self):
        r = self.run_checker(ROOT)
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
        self.assertIn("every include within its layer", r.stdout)

    def planted(self, path, line):
        """A copy of the tree's C folders with `line` added to the top of `path`."""
        tmp = tempfile.mkdtemp(prefix="tp-layers-")
        self.addCleanup(shutil.rmtree, tmp)
        for d in ("common", "transport", "kvtransfer", "worker", "prefill_worker",
                  "decode_worker", "gateway", "tools", "tests"):
            src = os.path.join(ROOT, d)
            if os.path.isdir(src):
                shutil.copytree(src, os.path.join(tmp, d), ignore=c_sources_only)
        full = os.path.join(tmp, path)
        with open(full) as f:
            text = f.read()
        with open(full, "w") as f:
            f.write(line + "\n" + text)
        return tmp

    def assert_refused(self, path, line, expect):
        r = self.run_checker(self.planted(path, line))
        self.assertEqual(r.returncode, 1, r.stdout + r.stderr)
        self.assertIn(path + ":1:", r.stdout)
        self.assertIn(expect, r.stdout)

    def test_common_may_not_include_kvtransfer(self):
        self.assert_refused("common/protocol.c", '#include "kvtransfer.h"',
                            "is kvtransfer/kvtransfer.h, outside what layer common")

    def test_common_may_not_include_the_engine(self):
        self.assert_refused("common/protocol.c", '#include "kvcache.h"',
                            "is common/engine/kvcache.h, outside what layer common")

    def test_common_may_not_include_zmq(self):
        self.assert_refused("common/log.c", "#include <zmq.h>",
                            "<zmq.h> belongs to")

    def test_relative_path_is_caught(self):
        self.assert_refused("common/engine/model.c", '#include "../../gateway/http.h"',
                            "is gateway/http.h, outside what layer engine")

    def test_roles_may_not_include_each_other(self):
        decode_h = sorted(f for f in os.listdir(os.path.join(ROOT, "decode_worker"))
                          if f.endswith(".h"))
        prefill_h = sorted(f for f in os.listdir(os.path.join(ROOT, "prefill_worker"))
                           if f.endswith(".h"))
        if not decode_h or not prefill_h:
            self.skipTest("role folders have no headers")
        self.assert_refused("prefill_worker/main.c", '#include "%s"' % decode_h[0],
                            "outside what layer prefill_worker")
        self.assert_refused("decode_worker/main.c", '#include "%s"' % prefill_h[0],
                            "outside what layer decode_worker")

    def test_gateway_may_not_include_worker(self):
        self.assert_refused("gateway/main.c", '#include "kvtransfer.h"',
                            "outside what layer gateway")

    def test_build_refuses_it_too(self):
        """The compiler's include paths follow the same table: a forbidden include does not
        even compile with the flags common/ is built with."""
        inc = subprocess.run(["make", "-s", "--no-print-directory", "print-inc-common"],
                             cwd=ROOT, check=True, capture_output=True, text=True,
                             timeout=60).stdout.split()
        self.assertIn("-Icommon", inc)
        tmp = tempfile.mkdtemp(prefix="tp-layers-cc-")
        self.addCleanup(shutil.rmtree, tmp)
        src = os.path.join(tmp, "planted.c")
        for line, ok in (('#include "protocol.h"', True), ('#include "kvtransfer.h"', False),
                         ('#include "wire.h"', False), ('#include "http.h"', False)):
            with open(src, "w") as f:
                f.write(line + "\nint planted;\n")
            r = subprocess.run(["cc", "-fsyntax-only"] + inc + [src], cwd=ROOT,
                               capture_output=True, text=True, timeout=60)
            self.assertEqual(r.returncode == 0, ok, line + ": " + r.stderr)


if __name__ == "__main__":
    unittest.main()
