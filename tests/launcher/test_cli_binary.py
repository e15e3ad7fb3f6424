"""The ddplaunch binary's command line, end to end: bad input exits 2 with a clear message and
starts nothing; --help and --version exit 0; the program's arguments reach it untouched.

The parser itself is unit-tested in config_test.cpp; this file checks what a user sees.
"""

import os
import shutil
import tempfile
import unittest

from processes import run

BUILD = os.environ.get("DDPLAUNCH_BUILD_DIR", "build")
DDPLAUNCH = os.path.join(BUILD, "bin", "ddplaunch")


def clean_env(**extra):
    """The test's environment without PET_ variables or PYTHON_EXEC, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PET_") and k != "PYTHON_EXEC"}
    env.update(extra)
    return env


class CommandLineTest(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.mkdtemp(prefix="ddplaunch-cli-")
        self.addCleanup(shutil.rmtree, self.tmp, True)
        self.marker = os.path.join(self.tmp, "started")

    def ddplaunch(self, *args, env=None):
        return run([DDPLAUNCH, *args], timeout=60, env=env or clean_env(), cwd=self.tmp)

    def test_bad_values_exit_2_name_the_flag_and_start_nothing(self):
        cases = [
            (["--nnodes=2:1"], "MIN (2) must not exceed MAX (1)"),
            (["--nnodes=1:2:3"], "--nnodes=1:2:3"),
            (["--nproc_per_node=many"], "--nproc_per_node=many"),
            (["--nproc-per-node=0"], "--nproc_per_node=0"),
            (["-m"], "cannot be used together"),
            (["--redirects=7"], "--redirects=7"),
            (["--rdzv_conf=join_timeout"], "'join_timeout' has no value"),
            (["--max_restarts=-1"], "--max_restarts=-1"),
            (["--env_check=maybe"], "--env_check=maybe"),
            (["--straggler=evict"], "--straggler=evict"),
            (["--straggler_factor=0.9"], "--straggler_factor=0.9"),
            (["--nnodes=2"], "--node_rank"),
            (["--bogus"], "unknown option '--bogus'"),
        ]
        for flags, expected in cases:
            with self.subTest(flags=flags):
                r = self.ddplaunch(*flags, "--no_python", "/usr/bin/touch", self.marker)
                self.assertEqual(r.returncode, 2, r.describe())
                self.assertTrue(r.stderr.startswith("ddplaunch: "), r.describe())
                self.assertIn(expected, r.stderr, r.describe())
                self.assertIn("ddplaunch --help", r.stderr, r.describe())
                self.assertEqual(r.stdout, "", r.describe())
                self.assertFalse(os.path.exists(self.marker), "a worker was started: " + r.describe())

    def test_a_straggler_flag_with_nothing_to_compare_is_said_once_at_start(self):
        # One node: no node to compare with. The job itself runs as without the flag.
        r = self.ddplaunch("--straggler=report", "--no_python", "/usr/bin/touch", self.marker)
        self.assertEqual(r.returncode, 0, r.describe())
        self.assertEqual(r.stderr.count("--straggler: this job has one node (--nnodes=1), so there is no node to "
                                        "compare this one with"), 1, r.describe())
        self.assertTrue(os.path.exists(self.marker), r.describe())
        # Without the flag (report is the default) nothing is said.
        r = self.ddplaunch("--no_python", "/usr/bin/touch", self.marker)
        self.assertNotIn("--straggler", r.stderr, r.describe())

    def test_missing_program_exits_2_with_the_synopsis(self):
        r = self.ddplaunch("--nproc_per_node=2")
        self.assertEqual(r.returncode, 2, r.describe())
        self.assertIn("missing PROGRAM", r.stderr, r.describe())

    def test_a_bad_pet_variable_exits_2_naming_the_variable(self):
        r = self.ddplaunch("--no_python", "/usr/bin/touch", self.marker, env=clean_env(PET_NNODES="2:1"))
        self.assertEqual(r.returncode, 2, r.describe())
        self.assertIn("PET_NNODES=2:1", r.stderr, r.describe())
        self.assertFalse(os.path.exists(self.marker))

    def test_help_prints_the_manual_and_exits_0(self):
        for flag in ("--help", "-h"):
            with self.subTest(flag=flag):
                r = self.ddplaunch(flag)
                self.assertEqual(r.returncode, 0, r.describe())
                for section in ("SYNOPSIS", "OPTIONS", "EXIT STATUS", "ENVIRONMENT", "EXAMPLES"):
                    self.assertIn(section, r.stdout)
                self.assertEqual(r.stderr, "")

    def test_version_prints_the_version_and_exits_0(self):
        r = self.ddplaunch("--version")
        self.assertEqual(r.returncode, 0, r.describe())
        self.assertRegex(r.stdout, r"^ddplaunch \d+\.\d+\.\d+\n$")

    def test_arguments_after_the_program_reach_it_unchanged(self):
        out = os.path.join(self.tmp, "args")
        r = self.ddplaunch("--nproc_per_node=1", "--no_python", "/bin/sh", "-c",
                           'printf "%s|" "$@" > "$0"', out, "--nnodes", "3", "--help", "a b", "")
        self.assertEqual(r.returncode, 0, r.describe())
        with open(out) as f:
            self.assertEqual(f.read(), "--nnodes|3|--help|a b||")


if __name__ == "__main__":
    unittest.main()
