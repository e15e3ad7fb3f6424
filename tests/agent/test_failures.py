"""A failed worker stops its group and every worker restarts (TORCHELASTIC_RESTART_COUNT goes
up) until the restart budget is spent; then ddplaunch exits 1 with torchrun's failure summary."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ddplaunch_helpers import PYTHON, LaunchTestCase, main  # noqa: E402

FAIL_UNTIL_SECOND_RESTART = """
import json, os, sys, time
restart = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
rank = os.environ["RANK"]
path = os.path.join(os.environ["OUT_DIR"], "run_%d_%s.json" % (restart, rank))
with open(path + ".tmp", "w") as f:
    json.dump({"restart": restart, "generation": os.environ["DDPLAUNCH_GENERATION"]}, f)
os.replace(path + ".tmp", path)  # stopped mid-write, it leaves no torn record behind
if restart < 2 and rank == "1":
    sys.exit(3)
if restart < 2:
    time.sleep(60)   # stopped by the agent when rank 1 fails
"""

RECORDED_FAILURE = """
import os, sys, time
from torch.distributed.elastic.multiprocessing.errors import record

@record
def main():
    if os.environ["RANK"] == "1":
        raise ValueError("boom from rank 1")
    time.sleep(60)

main()
"""

STRING_ERROR_FILE = """
import json, os, sys
with open(os.environ["TORCHELASTIC_ERROR_FILE"], "w") as f:
    json.dump({"message": "a plain string message", "timestamp": 1700000000}, f)
sys.exit(5)
"""

SEGFAULT = """
import os, signal, time
if os.environ["LOCAL_RANK"] == "0":
    os.kill(os.getpid(), signal.SIGSEGV)
time.sleep(60)
"""


class FailuresAndRestarts(LaunchTestCase):
    def test_a_failing_rank_is_restarted_with_the_whole_group_until_it_succeeds(self):
        script = self.script("flaky.py", FAIL_UNTIL_SECOND_RESTART)
        result = self.launch(["--nproc_per_node=2", "--max_restarts=3", "--python", PYTHON, script],
                             env={"OUT_DIR": self.out})
        self.assertEqual(result.returncode, 0, result.describe())
        runs = self.records("run_")
        # Rank 1 ran in every round (rank 0 may be stopped before it writes in the failed ones);
        # both ran in the last, with the restart count and generation of that round.
        for restart in range(3):
            self.assertEqual(runs["run_%d_1.json" % restart]["generation"], str(restart + 1))
        self.assertEqual(runs["run_2_0.json"]["restart"], 2)
        self.assertNotIn("run_3_1.json", runs)
        self.assertIn("restarting the workers", result.stderr)

    def test_a_spent_restart_budget_exits_1_with_rank_exit_code_and_error_file_message(self):
        script = self.script("fails.py", RECORDED_FAILURE)
        result = self.launch(["--nproc_per_node=2", "--max_restarts=1", "--python", PYTHON,
                              "--log_dir", os.path.join(self.tmp, "logs"), "--rdzv_id=failjob", script],
                             timeout=120)
        self.assertEqual(result.returncode, 1, result.describe())
        err = result.stderr
        self.assertIn("fails.py FAILED", err)
        self.assertIn("Root Cause (first observed failure)", err)
        self.assertIn("rank      : 1 (local_rank: 1)", err)
        self.assertIn("exitcode  : 1 (pid: ", err)
        self.assertIn("host      : " + os.uname().nodename, err)
        self.assertIn("ValueError: boom from rank 1", err)
        self.assertIn("Traceback", err)
        self.assertIn(os.path.join(self.tmp, "logs", "failjob", "attempt_1", "1", "error.json"), err)
        self.assertEqual(err.count("restarting the workers"), 1)

    def test_the_string_form_of_the_error_file_is_shown(self):
        script = self.script("string_error.py", STRING_ERROR_FILE)
        result = self.launch(["--nproc_per_node=1", "--python", PYTHON, script])
        self.assertEqual(result.returncode, 1, result.describe())
        self.assertIn("a plain string message", result.stderr)
        self.assertIn("exitcode  : 5", result.stderr)

    def test_a_worker_killed_by_a_signal_is_reported_with_the_signal_name(self):
        script = self.script("segv.py", SEGFAULT)
        result = self.launch(["--nproc_per_node=2", "--python", PYTHON, script])
        self.assertEqual(result.returncode, 1, result.describe())
        self.assertIn("SIGSEGV", result.stderr)
        self.assertIn("exitcode  : -11", result.stderr)
        self.assertIn("rank      : 0 (local_rank: 0)", result.stderr)

    def test_a_worker_that_exits_0_early_does_not_end_the_others(self):
        script = self.script("staggered.py", "import os, time\n"
                             "time.sleep(0.0 if os.environ['RANK'] == '0' else 1.0)\n"
                             "open(os.path.join(os.environ['OUT_DIR'], 'done_%s.json' % os.environ['RANK']), 'w').write('{}')\n")
        result = self.launch(["--nproc_per_node=2", "--python", PYTHON, script], env={"OUT_DIR": self.out})
        self.assertEqual(result.returncode, 0, result.describe())
        self.assertEqual(sorted(self.records("done_")), ["done_0.json", "done_1.json"])


if __name__ == "__main__":
    main()
