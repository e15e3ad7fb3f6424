"""--log_dedup: a line that several local ranks print alike reaches the console once, as
"[ranks 0-2] LINE"; other lines keep their prefix; each rank's lines keep their order; log files
stay complete; a held line is written when its window ends, and before the agent speaks of a
failure. With a daemon, a restart's reason and the job's failure summary are printed in full by
one node of the job, not by every node."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ddplaunch_helpers import PYTHON, LaunchTestCase, main, wait_for  # noqa: E402

# Rank 2 prints one line differently from the others.
CHATTY = """
import os, sys
rank = int(os.environ["RANK"])
print("hello from everyone", flush=True)
print("only rank %d" % rank, flush=True)
print("epoch 1 loss %s" % ("0.7" if rank == 2 else "0.5"), flush=True)
sys.stderr.write("warning: same on stderr\\n")
"""

# Rank 0 prints a line no other rank prints, then every rank waits for the test to release it.
WAITS = """
import os, sys, time
rank = int(os.environ["RANK"])
if rank == 0:
    print("solo line", flush=True)
release = os.path.join(os.environ["OUT"], "release")
deadline = time.monotonic() + 60
while not os.path.exists(release):
    if time.monotonic() > deadline:
        sys.exit(3)
    time.sleep(0.02)
"""

# Rank 1 says why it fails and exits 1; rank 0 waits to be stopped.
FAILS = """
import os, sys, time
if os.environ["RANK"] == "1":
    sys.stderr.write("rank 1 fails here\\n")
    sys.exit(1)
time.sleep(120)
"""


# Rank 1 (the second node's worker) says why and exits 1 in every attempt; rank 0 waits.
FAILS_ON_NODE_TWO = """
import os, sys, time
if os.environ["RANK"] == "1":
    sys.stderr.write("rank 1 fails here\\n")
    sys.exit(1)
time.sleep(120)
"""


def ranks_named(line):
    """The ranks a console line names: [ranks 0-1,3] or [defaultN]:."""
    if line.startswith("[ranks "):
        out = []
        for part in line[len("[ranks "):line.index("]")].split(","):
            first, _, last = part.partition("-")
            out.extend(range(int(first), int(last or first) + 1))
        return out
    return [int(line[len("[default"):line.index("]")])]


class LogDedup(LaunchTestCase):
    def logs(self):
        return os.path.join(self.tmp, "logs")

    def test_identical_lines_become_one_line_naming_the_ranks_and_log_files_stay_whole(self):
        script = self.script("chatty.py", CHATTY)
        # A window longer than the job: what is collapsed does not depend on how fast ranks start.
        result = self.launch(["--nproc_per_node=3", "--log_dedup", "--log_dedup_window=30", "--tee=3",
                              "--log_dir", self.logs(), "--rdzv_id=dedup", "--python", PYTHON, script])
        self.assertEqual(result.returncode, 0, result.describe())
        lines = result.stdout.splitlines()
        self.assertEqual(sorted(lines), sorted([
            "[ranks 0-2] hello from everyone",
            "[default0]:only rank 0", "[default1]:only rank 1", "[default2]:only rank 2",
            "[ranks 0-1] epoch 1 loss 0.5", "[default2]:epoch 1 loss 0.7"]), result.describe())
        self.assertEqual(lines[0], "[ranks 0-2] hello from everyone")
        # Each rank's lines in the order it printed them.
        for rank in range(3):
            mine = [l.split("]", 1)[1].lstrip(": ") for l in lines if rank in ranks_named(l)]
            self.assertEqual(mine, ["hello from everyone", "only rank %d" % rank,
                                    "epoch 1 loss %s" % ("0.7" if rank == 2 else "0.5")], lines)
        self.assertEqual(result.stderr.count("warning: same on stderr"), 1, result.stderr)
        self.assertIn("[ranks 0-2] warning: same on stderr", result.stderr)
        for rank in range(3):
            path = os.path.join(self.logs(), "dedup", "attempt_0", str(rank), "stdout.log")
            with open(path) as f:
                self.assertEqual(f.read(), "hello from everyone\nonly rank %d\nepoch 1 loss %s\n"
                                 % (rank, "0.7" if rank == 2 else "0.5"))

    def test_a_line_no_other_rank_prints_is_written_when_its_window_ends(self):
        script = self.script("waits.py", WAITS)
        proc = self.spawn_launch(["--nproc_per_node=2", "--log_dedup", "--log_dedup_window=0.2",
                                  "--python", PYTHON, script], env={"OUT": self.out})
        # The job is still running: only the end of the window can have let the line out.
        wait_for(lambda: "[default0]:solo line" in proc.stdout() or proc.poll() is not None, 60,
                 "rank 0's line on the console")
        self.assertIsNone(proc.poll(), proc.describe())
        open(os.path.join(self.out, "release"), "w").close()
        self.assertEqual(proc.wait(60), 0, proc.describe())
        self.assertEqual(proc.stdout().count("solo line"), 1, proc.describe())

    def test_a_failing_workers_last_lines_come_before_what_the_agent_says_of_it(self):
        script = self.script("fails.py", FAILS)
        result = self.launch(["--nproc_per_node=2", "--log_dedup", "--log_dedup_window=30",
                              "--python", PYTHON, script])
        self.assertEqual(result.returncode, 1, result.describe())
        err = result.stderr
        self.assertIn("[default1]:rank 1 fails here", err)
        self.assertIn("exited with code 1", err)
        self.assertLess(err.index("[default1]:rank 1 fails here"), err.index("exited with code 1"), err)

    def test_with_a_daemon_one_node_prints_the_restart_reason_and_the_failure_summary(self):
        port = self.start_rendezvous_daemon()
        script = self.script("fails_on_two.py", FAILS_ON_NODE_TWO)
        args = ["--nnodes=2", "--nproc_per_node=1", "--rdzv_backend=c10d", "--rdzv_endpoint=127.0.0.1:%d" % port,
                "--rdzv_id=quiet", "--max_restarts=1", "--log_dedup", "--standby=off", "--shutdown_timeout=5",
                "--python", PYTHON, script]
        agents = [self.spawn_launch(args) for _ in range(2)]
        for a in agents:
            self.assertEqual(a.wait(120), 1, a.describe())
        outputs = [a.output() for a in agents]
        both = "\n".join(outputs)
        # The node whose worker failed says why, both times; the other says that it does.
        self.assertEqual(both.count("restarting the workers: worker rank 1"), 1, both)
        self.assertEqual(both.count("restarting the workers (another node of the job prints why: --log_dedup)"), 1,
                         both)
        self.assertEqual(both.count("job failed (another node of the job prints the summary: --log_dedup)"), 1, both)
        speaker = next(o for o in outputs if "restarting the workers: worker rank 1" in o)
        self.assertIn("[default0]:rank 1 fails here", speaker)
        self.assertIn("job failed: job quiet failed after 1 of 1 restarts", speaker)
        self.assertEqual(both.count("job failed: "), 1, both)

    def test_one_worker_on_the_console_says_there_is_nothing_to_collapse(self):
        script = self.script("hi.py", "print('hi')\n")
        result = self.launch(["--nproc_per_node=1", "--log_dedup", "--python", PYTHON, script])
        self.assertEqual(result.returncode, 0, result.describe())
        self.assertIn("--log_dedup: only one of this node's workers reaches the console", result.stderr)
        self.assertEqual(result.stdout, "[default0]:hi\n")
        result = self.launch(["--nproc_per_node=2", "--redirects=3", "--log_dedup", "--python", PYTHON, script])
        self.assertEqual(result.returncode, 0, result.describe())
        self.assertIn("--log_dedup: none of this node's workers reach the console", result.stderr)


if __name__ == "__main__":
    main()
