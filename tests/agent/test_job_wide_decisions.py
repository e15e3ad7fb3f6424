"""A node's decision that the job must end (--no_restart_exit_codes, --crash_loop_limit) ends it
on every node, also in an elastic job above its minimum size. Two agents on one
ddp-rendezvous daemon on loopback, one worker each; waits have deadlines."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ddplaunch_helpers import PYTHON, LaunchTestCase, main  # noqa: E402

# The worker of the "bad" node exits with EXIT_CODE at once on every attempt; the "good" node's
# worker would run for ten minutes: only a job-wide verdict ends it in time.
WORKER = """
import os, sys, time
role = os.environ["NODE_ROLE"]
attempt = os.environ["TORCHELASTIC_RESTART_COUNT"]
open(os.path.join(os.environ["OUT_DIR"], "%s_%s" % (role, attempt)), "w").close()
if role == "bad":
    sys.exit(int(os.environ["EXIT_CODE"]))
time.sleep(600)
"""


class JobWideDecisions(LaunchTestCase):
    def start_job(self, job_id, exit_code, bad_args, common_args=()):
        """A daemon and two agents of an elastic job (--nnodes=1:2); returns [good, bad]."""
        port = self.start_rendezvous_daemon()
        script = self.script("worker.py", WORKER)
        # A long last call: the first round waits for both nodes (it completes at MAX = 2).
        conf = "heartbeat_interval=0.5,heartbeat_timeout=5,last_call_timeout=60,join_timeout=60"
        nodes = []
        for role, extra in (("good", []), ("bad", list(bad_args))):
            args = ["--nnodes=1:2", "--nproc_per_node=1", "--rdzv_backend=c10d",
                    "--rdzv_endpoint=127.0.0.1:%d" % port, "--rdzv_id=" + job_id, "--rdzv_conf", conf,
                    "--max_restarts=10", "--shutdown_timeout=5"] + list(common_args) + extra + \
                   ["--python", PYTHON, script]
            nodes.append(self.spawn_launch(args, env={"OUT_DIR": self.out, "NODE_ROLE": role,
                                                      "EXIT_CODE": str(exit_code)}))
        return nodes

    def check_both_failed_with(self, nodes, reason):
        codes = [n.wait(120) for n in nodes]
        both = "\n".join(n.describe() for n in nodes)
        self.assertEqual(codes, [1, 1], both)
        for n in nodes:
            # The rendezvous' verdict, the same on every node, names the reason.
            verdicts = [line for line in n.stderr().splitlines() if "job failed:" in line]
            self.assertTrue(verdicts, n.describe())
            self.assertIn(reason, verdicts[-1], n.describe())
            self.assertIn("FAILED", n.stderr(), n.describe())
            # A failing job stops; it is not announced as a restart.
            self.assertNotIn("restarting the workers: the job is failing", n.stderr(), n.describe())
        good_verdict = [l for l in nodes[0].stderr().splitlines() if "job failed:" in l][-1]
        bad_verdict = [l for l in nodes[1].stderr().splitlines() if "job failed:" in l][-1]
        self.assertEqual(good_verdict.split("job failed:", 1)[1], bad_verdict.split("job failed:", 1)[1], both)
        return both

    def test_a_no_restart_exit_code_on_one_node_fails_the_job_on_both(self):
        nodes = self.start_job("jobwide-code", 3, [], ["--no_restart_exit_codes=3,4"])
        both = self.check_both_failed_with(nodes, "exited with code 3, which --no_restart_exit_codes lists")
        # The node that did not decide hears it from the rendezvous while its worker runs.
        self.assertIn("stopping the workers: the job is failing", nodes[0].stderr(), both)
        # No restart anywhere. (The good worker may be stopped before it wrote its file.)
        self.assertIn("bad_0", os.listdir(self.out), both)
        self.assertEqual([f for f in os.listdir(self.out) if not f.endswith("_0")], [], both)

    def test_a_crash_loop_found_by_one_node_fails_the_job_on_both(self):
        # Only the bad node watches for crash loops: the good one ends on the job-wide verdict.
        nodes = self.start_job("jobwide-loop", 1, ["--crash_loop_limit=2"])
        both = self.check_both_failed_with(nodes, "2 restart(s) in a row made no progress")
        self.assertNotIn("--crash_loop_limit", " ".join(nodes[0].cmd))
        # The first attempt and 2 restarts without progress; then no more on either node.
        files = os.listdir(self.out)
        self.assertEqual(sorted(f for f in files if f.startswith("bad_")), ["bad_0", "bad_1", "bad_2"], both)
        self.assertEqual([f for f in files if f.endswith("_3")], [], both)


if __name__ == "__main__":
    main()
