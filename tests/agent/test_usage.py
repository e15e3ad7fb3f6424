"""What cannot start is refused with exit 2 and a message naming it; nothing is started."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ddplaunch_helpers import PYTHON, LaunchTestCase, main  # noqa: E402


class Refusals(LaunchTestCase):
    def test_a_missing_no_python_program_exits_2(self):
        result = self.launch(["--nproc_per_node=2", "--no_python", os.path.join(self.tmp, "nope")])
        self.assertEqual(result.returncode, 2, result.describe())
        self.assertIn("nope", result.stderr)
        self.assertIn("does not exist", result.stderr)

    def test_a_program_not_in_path_exits_2(self):
        result = self.launch(["--no_python", "surely-not-a-program-xyz"])
        self.assertEqual(result.returncode, 2, result.describe())
        self.assertIn("surely-not-a-program-xyz was not found in PATH", result.stderr)

    def test_a_missing_training_script_exits_2(self):
        result = self.launch(["--python", PYTHON, os.path.join(self.tmp, "missing.py")])
        self.assertEqual(result.returncode, 2, result.describe())
        self.assertIn("missing.py does not exist", result.stderr)

    def test_a_missing_interpreter_exits_2(self):
        script = self.script("ok.py", "pass\n")
        result = self.launch(["--python", "/nonexistent/python", script])
        self.assertEqual(result.returncode, 2, result.describe())
        self.assertIn("/nonexistent/python", result.stderr)

    def test_a_program_that_cannot_exec_exits_2_and_leaves_no_worker(self):
        # Every worker forks before their execs are confirmed together: all four fail, the
        # agent names why, and none is left behind (each failed worker is reaped once).
        marker = os.path.join(self.tmp, "ran")
        script = self.script("bad.sh", "#!/nonexistent/interpreter\ntouch %s\n" % marker)
        os.chmod(script, 0o755)
        result = self.launch(["--nproc_per_node=4", "--no_python", script], timeout=60)
        self.assertEqual(result.returncode, 2, result.describe())
        self.assertIn("cannot start " + script, result.stderr)
        self.assertIn("#! line", result.stderr)
        self.assertFalse(os.path.exists(marker))

    def test_a_static_job_with_an_elastic_node_count_exits_2(self):
        script = self.script("ok.py", "pass\n")
        result = self.launch(["--nnodes=1:2", "--rdzv_backend=static", "--python", PYTHON, script])
        self.assertEqual(result.returncode, 2, result.describe())
        self.assertIn("--nnodes=1:2", result.stderr)

    def test_the_job_exit_code_is_0_when_every_worker_succeeds(self):
        result = self.launch(["--nproc_per_node=4", "--no_python", "/bin/true"])
        self.assertEqual(result.returncode, 0, result.describe())


if __name__ == "__main__":
    main()
