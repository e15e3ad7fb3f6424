"""`cmake --install` gives a package that a separate project finds with find_package(ddplaunch)
and links as ddp::worker_sdk."""
import os
import subprocess
import tempfile
import unittest

import sdk_harness as h

SOURCE = os.environ.get("DDPLAUNCH_SOURCE_DIR", os.path.join(os.path.dirname(__file__), "..", ".."))


def cache_value(build, name):
    with open(os.path.join(build, "CMakeCache.txt")) as f:
        for line in f:
            if line.startswith(name + ":"):
                return line.split("=", 1)[1].strip()
    return None


class PackageTest(unittest.TestCase):
    def run_step(self, cmd, timeout=600):
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              timeout=timeout)
        self.assertEqual(proc.returncode, 0, "%s failed:\n%s" % (" ".join(cmd), proc.stdout[-4000:]))
        return proc.stdout

    def test_an_outside_project_builds_and_runs_against_the_installed_package(self):
        with tempfile.TemporaryDirectory(prefix="ddp-sdk-package-") as d:
            prefix = os.path.join(d, "prefix")
            self.run_step(["cmake", "--install", h.BUILD, "--prefix", prefix,
                           "--component", "worker_sdk"])
            installed = [os.path.relpath(os.path.join(root, f), prefix)
                         for root, _, files in os.walk(prefix) for f in files]
            self.assertIn("include/ddp/worker_sdk.h", installed)
            self.assertTrue(any(p.endswith("cmake/ddplaunch/ddplaunchConfig.cmake") for p in installed))
            self.assertFalse(any("bin/" in p for p in installed), installed)
            # The contracts with the agent (contracts/) are compiled into the library: no header of
            # theirs, or of any other folder of ddplaunch, is installed beside the SDK's own.
            self.assertEqual([p for p in installed if p.startswith("include/") and not p.startswith("include/ddp/")],
                             [])
            build = os.path.join(d, "build")
            self.run_step(["cmake", "-S", os.path.join(SOURCE, "tests", "worker_sdk", "consumer"),
                           "-B", build, "-G", "Ninja", "-DCMAKE_PREFIX_PATH=" + prefix])
            self.run_step(["cmake", "--build", build, "--", "-j2"])
            env = h.clean_env()
            out = subprocess.run([os.path.join(build, "consumer")], stdout=subprocess.PIPE,
                                 stderr=subprocess.STDOUT, text=True, env=env, timeout=60)
            self.assertEqual(out.returncode, 0, out.stdout)
            self.assertIn("consumer: world size 1, trained 4 steps", out.stdout)
            # The consumer found the libtorch the SDK was built against (torch 2.x from the
            # project venv by default), not another one on the system.
            ours, theirs = cache_value(h.BUILD, "TORCH_LIBRARY"), cache_value(build, "TORCH_LIBRARY")
            print("SDK built against %s; consumer linked against %s" % (ours, theirs))
            self.assertIsNotNone(theirs)
            self.assertEqual(os.path.realpath(theirs), os.path.realpath(ours))
            linked = subprocess.run(["ldd", os.path.join(build, "consumer")], stdout=subprocess.PIPE,
                                    text=True).stdout
            torch_lib = os.path.dirname(os.path.realpath(ours))
            if "site-packages" in torch_lib:  # a wheel's torch/lib (Debian's is the system's)
                self.assertIn(os.path.join(torch_lib, "libtorch_cpu.so"), linked)
                self.assertNotIn("libtorch_cpu.so.1", linked, "Debian's libtorch linked too")


if __name__ == "__main__":
    unittest.main()
