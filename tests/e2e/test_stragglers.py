"""Stragglers on the namespace cluster: one node whose workers compute slower than the others'.

A head node runs ddp-rendezvous; nodes run `ddplaunch ... build/bin/train` (or the Python DDP
job scripts/elastic_ddp.py). One node is made slow through its environment: `train` sleeps
DDP_TRAIN_SLOW_MS milliseconds inside each step, before its all-reduces, as a slow GPU would;
elastic_ddp.py sleeps ELASTIC_DDP_STEP_DELAY seconds after each optimizer step, as slow data
loading would. Every node then makes its steps at the same rate (synchronous DDP): only the busy
time per step tells the slow one apart, which its workers measure (the worker SDK around its
all-reduces; for Python, the bootstrap, with no change to the script) and its agent reports.
The jobs run with `--straggler_window=3` so that a test takes seconds, not a minute:

- report (the default): the daemon names the slow node in `status --json` and `status` (a
  "straggler: node ..." line with the factor, the rank and both busy times) and in its log,
  while the round goes on untouched: no restart, no node lost, every agent running;
- the same for the Python job, whose script neither imports ddplaunch for it nor changes;
- `--straggler=replace`: at `--nnodes=2:2` with a third node waiting beyond MAX, the slow
  node is drained onto the spare: its ddplaunch exits 0 saying it was drained, the survivors
  and the spare go on from memory at world size 4 (not a counted restart), and the job
  finishes with every sample of every epoch trained exactly once.

Needs root and `ip netns` (skips with the reason otherwise) and the worker SDK's `train`.
"""

import importlib.util
import json
import os
import sys
import time
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import test_drain  # noqa: E402  (its TestCase is not imported by name: unittest would run its tests here too)
from elastic_job import PYTHON, RENDEZVOUS, ElasticJob, TimedTrainTest  # noqa: E402
from test_drain import EPOCHS, FINISH_TIMEOUT, train_args  # noqa: E402

FLAGS = ["--straggler_window=3"]
SLOW_MS = "60"           # train: per step, on the slow node
SLOW_PYTHON_S = "0.06"   # elastic_ddp.py: per step, on the slow node
LONG_EPOCHS = 200        # a job that outlasts its test (the cluster's teardown kills it)
NAMED_WITHIN = 60        # s: the window, the agents' progress every 2 s, and the workers' start


class StragglerTest(TimedTrainTest, unittest.TestCase):
    maxDiff = None

    status = test_drain.DrainTest.status
    wait_until_waiting = test_drain.DrainTest.wait_until_waiting
    assert_node_left = test_drain.DrainTest.assert_node_left
    assert_one_round_after = test_drain.DrainTest.assert_one_round_after
    rounds_after = test_drain.DrainTest.rounds_after
    assert_resumed_from_memory = test_drain.DrainTest.assert_resumed_from_memory
    assert_finished_well = test_drain.DrainTest.assert_finished_well

    def start_job(self, job_id, nnodes, nodes, slow, flags=(), epochs=LONG_EPOCHS, python=False):
        if python:
            args = ["--epochs", epochs, "--samples", 4800, "--batch-size", 24, "--seed", 3,
                    "--checkpoint-every", 20, "--log-every", 20]
            slow_env = {"ELASTIC_DDP_STEP_DELAY": SLOW_PYTHON_S}
        else:
            args = train_args(epochs)
            slow_env = {"DDP_TRAIN_SLOW_MS": SLOW_MS}
        job = ElasticJob(self, self.cluster, args, python=python, job_id=job_id, nnodes=nnodes, epochs=epochs,
                         ddplaunch_flags=FLAGS + list(flags))
        job.start_rendezvous()
        for node in nodes:
            job.start_node(node, env=slow_env if node == slow else None)
        self.addrs = {self.cluster.addr(n): n for n in (1, 2, 3)}
        return job

    def wait_until_named(self, job, node):
        """Waits until `status --json` names `node` a straggler; returns its status line."""
        addr = self.cluster.addr(node)
        deadline = time.monotonic() + NAMED_WITHIN
        while True:
            status = self.status(job)
            lines = status["stragglers"]
            if lines:
                self.assertEqual(len(lines), 1, json.dumps(status, indent=1))
                self.assertIn(addr, lines[0], json.dumps(status, indent=1))
                return lines[0]
            if time.monotonic() >= deadline:
                self.fail("node%d was not named a straggler within %d s\n%s\n%s"
                          % (node, NAMED_WITHIN, json.dumps(status, indent=1), job.describe()))
            time.sleep(0.2)

    def assert_named_and_untouched(self, job, node, others):
        job.wait_for_steps(world=6, steps=1, timeout=120)
        line = self.wait_until_named(job, node)
        self.assertRegex(line, r"\d+\.\dx the median busy time for \d+ s \(rank \d+: \d+(\.\d)? ms vs \d+(\.\d)? ms\)$")
        status = self.status(job)
        slow = [n for n in status["nodes"] if n["addr"] == self.cluster.addr(node)][0]
        fast = [n for n in status["nodes"] if n["addr"] != self.cluster.addr(node)]
        self.assertTrue(slow["straggler"], json.dumps(status, indent=1))
        self.assertEqual([n.get("straggler", False) for n in fast], [False, False], json.dumps(status, indent=1))
        self.assertGreater(slow["busy"], 1.5 * max(n["busy"] for n in fast), json.dumps(status, indent=1))
        text = self.cluster.run("head", [RENDEZVOUS, "status", "--endpoint", job.endpoint], timeout=30)
        self.assertIn("straggler: node", text.stdout, text.describe())
        self.assertTrue([line for line in self.server_lines(job) if ": straggler: node" in line], job.describe())
        # Reporting changes nothing: the round keeps stepping with every node in it.
        self.assert_status_steps_on(job, status, steps=10, agents=(node,) + others,
                                    banned=(" lost: ", "restart after", "replaced a straggler"))

    def assert_status_steps_on(self, job, status, steps, agents, banned):
        """The job's round of `status` makes `steps` more steps (its nodes' last step in `status
        --json`, within 60 s) in the same generation, as wait_untouched() watches it."""
        def last_step(s):
            return max(n.get("last_step", -1) for n in s["nodes"])
        target = last_step(status) + steps

        def stepped():
            now = self.status(job)
            self.assertEqual(now["generation"], status["generation"], "a new round formed\n" + job.describe())
            return last_step(now) >= target, "the round reached step %d, not %d" % (last_step(now), target)
        self.wait_untouched(job, stepped, agents, banned)

    def test_a_slow_node_is_named_and_the_round_goes_on(self):
        job = self.start_job("straggler-report", "2:3", (1, 2, 3), slow=3)
        self.assert_named_and_untouched(job, 3, (1, 2))

    def test_a_slow_python_node_is_named_without_a_change_to_its_script(self):
        if importlib.util.find_spec("torch") is None:  # this file runs on the Python the job does
            self.skipTest("%s has no torch (install python3-torch)" % PYTHON)
        job = self.start_job("straggler-python", "2:3", (1, 2, 3), slow=2, python=True)
        self.assert_named_and_untouched(job, 2, (1, 3))

    def test_replace_drains_the_straggler_onto_the_spare_and_the_job_finishes(self):
        epochs = 2 * EPOCHS  # outlasts the window at the slow node's pace
        job = self.start_job("straggler-replace", "2:2", (1, 2), slow=2, flags=["--straggler=replace"],
                             epochs=epochs)
        before = job.wait_for_steps(world=4, steps=1, timeout=90)
        job.start_node(3)   # the round runs at MAX: node3 waits as a spare
        self.wait_until_waiting(job, 3)

        self.assert_node_left(job, 2)
        out = job.agent(2).output()
        self.assertIn("as a straggler (node ", out, job.describe())
        lines = self.server_lines(job)
        self.assertTrue([line for line in lines if ": straggler: node" in line], job.describe())
        self.assertTrue([line for line in lines if "replaced a straggler" in line], job.describe())
        restarts = [line for line in lines if "restart after generation" in line]
        self.assertEqual(len(restarts), 1, job.describe())
        self.assertIn("(not counted)", restarts[0], job.describe())
        self.assertIn("was replaced as a straggler", restarts[0], job.describe())

        codes = job.wait_for_exit([1, 3], FINISH_TIMEOUT)
        self.assertEqual(codes, {1: 0, 3: 0}, job.describe())
        after = self.assert_one_round_after(job, before, 4)  # a waiting spare never ends the round
        self.assertIn("generation %d: this node is group rank" % after.generation, job.agent(3).output(),
                      "the spare is not in the round after the replacement\n" + job.describe())
        self.assert_resumed_from_memory(job, before, after)
        self.assert_finished_well(job, epochs)


if __name__ == "__main__":
    unittest.main()
