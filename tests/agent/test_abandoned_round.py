"""A round lost to a failure is abandoned: survivors blocked in a collective die of the agent's
SIGTERM at once instead of sitting out --shutdown_timeout (docs/worker-sdk.md, "An abandoned
round").

Two ddplaunch "nodes" on one ddp-rendezvous daemon on loopback, one `train` worker each. Node b
is frozen whole (SIGSTOP to its agent and every process under it): its sockets stay open, as
when a node's link is cut, so node a's worker waits in an all-reduce that will never complete
and gets no error. The daemon declares b lost after its heartbeat timeout; node a's agent marks
the round abandoned and sends SIGTERM. The worker's SIGTERM handler alone would only ask it to
finish the step, which it cannot: before this, it was killed after --shutdown_timeout. Here
--shutdown_timeout is 300 s, so only the prompt exit lets node a's next round (world size 1)
start within the test's deadline; the agent's log must not show the SIGKILL escalation.
That is the path without in-memory restart (--in_memory_restart=off). With it, node a's worker
does not exit at all: it parks and continues in the next round, the same process, from memory.
Every process is killed in cleanup; every wait has a deadline.
"""

import os
import re
import signal
import sys
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ddplaunch_helpers import BUILD_DIR  # noqa: E402
import processes  # noqa: E402
from processes import wait_for  # noqa: E402
from test_multinode import CONF, MultiNodeTestCase  # noqa: E402

TRAIN = os.path.join(BUILD_DIR, "bin", "train")
RECORD_RE = re.compile(r"^attempt=\d+ world=(\d+) rank=(\d+) ")


def descendants(pid):
    """`pid` and every process under it, parents before children."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop(0)
        out.append(p)
        todo.extend(processes.children(p))
    return out


class AbandonedRound(MultiNodeTestCase):
    def start_train_node(self, name, in_memory):
        args = ["--nnodes=1:2", "--in_memory_restart=" + ("on" if in_memory else "off"), "--nproc_per_node=1", "--rdzv_backend=c10d",
                "--rdzv_endpoint=127.0.0.1:%d" % self.port, "--rdzv_id=%s" % self.job, "--rdzv_conf", CONF,
                "--shutdown_timeout=300", "--max_restarts=3", "--no_python", TRAIN,
                "--epochs", "1000", "--samples", "2048", "--batch-size", "16",
                "--checkpoint-dir", os.path.join(self.out, "ckpt"), "--checkpoint-every", "20",
                "--sample-log", os.path.join(self.out, "g{generation}-r{rank}.log")]
        proc = self.spawn_launch(args)
        proc.node = name
        return proc

    def worlds_with_steps(self):
        """{world size: number of sample records} over every log written so far."""
        seen = {}
        for name in os.listdir(self.out):
            if not name.endswith(".log"):
                continue
            with open(os.path.join(self.out, name)) as f:
                for line in f:
                    m = RECORD_RE.match(line)
                    if m:
                        seen[int(m.group(1))] = seen.get(int(m.group(1)), 0) + 1
        return seen

    def freeze_node_b_after_steps_together(self, in_memory):
        """Starts the daemon and both nodes, waits for steps at world size 2, freezes node b."""
        if not os.path.exists(TRAIN):
            self.skipTest("the worker SDK's train program is not built (DDPLAUNCH_BUILD_WORKER_SDK=OFF)")
        self.start_daemon()
        a = self.start_train_node("a", in_memory)
        b = self.start_train_node("b", in_memory)
        self.nodes = [a, b]
        wait_for(lambda: self.worlds_with_steps().get(2, 0) >= 20 or a.poll() is not None or b.poll() is not None,
                 120, "both workers to make steps together")
        self.assertIsNone(a.poll(), self.describe_nodes())
        self.assertIsNone(b.poll(), self.describe_nodes())

        frozen = descendants(b.pid)
        self.assertGreaterEqual(len(frozen), 2, "node b's agent and its worker")

        def thaw_and_kill():
            for p in frozen:
                for sig in (signal.SIGKILL, signal.SIGCONT):
                    try:
                        os.kill(p, sig)
                    except ProcessLookupError:
                        pass
        self.addCleanup(thaw_and_kill)
        for p in frozen:
            os.kill(p, signal.SIGSTOP)
        return a

    def test_a_worker_blocked_with_a_frozen_peer_exits_on_sigterm_without_the_shutdown_timeout(self):
        a = self.freeze_node_b_after_steps_together(in_memory=False)
        # Node a alone: a round of world size 1 makes steps. Its previous worker must be gone
        # first, which without the abandoned round takes the 300 s shutdown timeout.
        wait_for(lambda: self.worlds_with_steps().get(1, 0) >= 5 or a.poll() is not None, 120,
                 "node a's round of one worker")
        out = a.output()
        self.assertIsNone(a.poll(), self.describe_nodes())
        self.assertIn("the agent abandoned the round", out, self.describe_nodes())
        self.assertIn("exiting at once, nothing saved", out, self.describe_nodes())
        self.assertNotIn("sending SIGKILL", out, self.describe_nodes())

        a.signal(signal.SIGTERM)
        self.assertEqual(self.wait_exit([a], 120), [128 + signal.SIGTERM], self.describe_nodes())

    def test_with_in_memory_restart_the_blocked_worker_parks_and_continues_as_the_same_process(self):
        a = self.freeze_node_b_after_steps_together(in_memory=True)
        wait_for(lambda: self.worlds_with_steps().get(1, 0) >= 5 or a.poll() is not None, 120,
                 "node a's round of one worker")
        out = a.output()
        self.assertIsNone(a.poll(), self.describe_nodes())
        pids = re.findall(r"^\[train\] rank \d+ pid (\d+) generation (\d+)$", out, re.M)
        self.assertEqual(len({g for _, g in pids}), 2, "a line per round from node a's worker\n" + out)
        self.assertEqual(len({p for p, _ in pids}), 1, "one process in both rounds\n" + out)
        self.assertIn("waiting for the next one with the state of step", out, self.describe_nodes())
        self.assertIn("resumed from memory", out, self.describe_nodes())
        self.assertNotIn("sending SIGKILL", out, self.describe_nodes())

        a.signal(signal.SIGTERM)
        self.assertEqual(self.wait_exit([a], 120), [128 + signal.SIGTERM], self.describe_nodes())


if __name__ == "__main__":
    unittest.main(verbosity=2)
