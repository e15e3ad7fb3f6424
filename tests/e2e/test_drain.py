"""Draining a node out of a running job (`ddp-rendezvous drain`), on the namespace cluster.

A head node runs ddp-rendezvous; nodes run `ddplaunch ... build/bin/train --checkpoint-dir
<shared dir>`, and the test runs `ddp-rendezvous drain JOB NODE` in the head namespace while
a round makes progress. The drained node's ddplaunch stops its workers and exits 0; the job's
other nodes restart (not counted as a failure) and the next round goes on without it:

- with a spare: `--nnodes=2:2`, a third node joins while the round runs at MAX and waits; the
  node of group rank 1 is drained, the spare takes its place (world size 4 again) and receives
  the survivors' state in memory (in-memory restart, the default for `train`);
- without a spare: `--nnodes=2:3`, three nodes; the node holding group rank 0 (and the master
  address) is drained, named by its address; the other two go on from memory at world size 4;
- with `--in_memory_restart=off`: the workers get SIGTERM, finish their step, rank 0 saves a
  checkpoint at the step the round stopped at (newer than every periodic one), and the next
  round resumes from it;
- refusals: with two nodes at `--nnodes=2:3` draining either would leave fewer than MIN, so the
  daemon refuses (exit 1, naming the minimum and --force); so it does for an unknown node, a
  rank nobody holds, a host that several nodes share, and an unknown job; an unreachable daemon
  is exit 3, bad flags exit 2. The round goes on untouched (no new generation, no node lost).

The finishing scenarios assert every ddplaunch's exit code, the world size of the round after
the drain, where it resumed, the final accuracy, and that the steps whose updates the final
model holds used every sample of every epoch exactly once (the SDK's sample records). The time
from the drain command to the next round's first step is printed, not asserted.

Needs root and `ip netns` (skips with the reason otherwise) and the worker SDK's `train`.
"""

import json
import os
import re
import sys
import time
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from elastic_job import RENDEZVOUS, SAMPLE_FILE_RE, ElasticJob, TimedTrainTest, programs_in  # noqa: E402

# The job of test_fault_tolerance.py: no shard ever needs padding at 4 or 6 workers, so "each
# sample exactly once" is exact. 50 steps per epoch at 4 workers, ~34 at 6.
SAMPLES = 4800
BATCH = 24
CHECKPOINT_EVERY = 10
ACCURACY = 0.9
EPOCHS = 6
DRAIN_AFTER_STEPS = CHECKPOINT_EVERY + 4   # the round has saved a periodic checkpoint of its own
FINISH_TIMEOUT = 150
STEPS_AFTER_REFUSALS = 20

DRAINED_SAYS = ("; stopping the workers", "drained: the workers have stopped; this node is out of the job")
STATE_RECEIVED_RE = re.compile(r"^\[ddp\] rank \d+: received the state rank \d+ sent \(step (?P<step>\d+),", re.M)
SIGTERM_STOP_RE = re.compile(r"^\[ddp\] SIGTERM: stopping after step (?P<step>\d+)$", re.M)


def train_args(epochs):
    return ["--epochs", epochs, "--batch-size", BATCH, "--samples", SAMPLES, "--seed", 7,
            "--checkpoint-every", CHECKPOINT_EVERY, "--log-every", 50]


class DrainTest(TimedTrainTest, unittest.TestCase):
    maxDiff = None

    def start_job(self, job_id, nnodes, nodes, epochs=EPOCHS, flags=()):
        job = ElasticJob(self, self.cluster, train_args(epochs), job_id=job_id, nnodes=nnodes, epochs=epochs,
                         ddplaunch_flags=list(flags))
        job.start_rendezvous()
        for node in nodes:
            job.start_node(node)
        self.addrs = {self.cluster.addr(n): n for n in (1, 2, 3)}
        return job

    # ---- the daemon, asked from the head namespace ---------------------------------------------

    def drain(self, job, node, *flags, job_id=None):
        """Runs `ddp-rendezvous drain JOB NODE FLAGS` in the head; returns its processes.Result."""
        return self.cluster.run("head", [RENDEZVOUS, "drain", job_id or job.job_id, node, "--endpoint",
                                         job.endpoint] + list(flags), timeout=30)

    def status(self, job):
        """The job's entry of `ddp-rendezvous status --json`."""
        r = self.cluster.run("head", [RENDEZVOUS, "status", "--json", "--endpoint", job.endpoint], timeout=30)
        self.assertEqual(r.returncode, 0, r.describe())
        jobs = [j for j in json.loads(r.stdout)["jobs"] if j["job_id"] == job.job_id]
        self.assertEqual(len(jobs), 1, r.stdout)
        return jobs[0]

    def node_with_rank(self, job, group_rank):
        """The cluster node that holds `group_rank` in the running round."""
        for n in self.status(job)["nodes"]:
            if n["state"] == "running" and n["group_rank"] == group_rank:
                return self.addrs[n["addr"]]
        self.fail("no node holds group rank %d\n%s" % (group_rank, job.describe()))

    def wait_until_waiting(self, job, node, timeout=30):
        """Waits until `node` is a spare: joined, not in the running round."""
        deadline = time.monotonic() + timeout
        addr = self.cluster.addr(node)
        while True:
            states = {n["addr"]: (n["state"], n["group_rank"]) for n in self.status(job)["nodes"]}
            if states.get(addr) == ("waiting", -1):
                return
            if job.agent(node).poll() is not None or time.monotonic() >= deadline:
                self.fail("node%s did not wait as a spare within %d s: %s\n%s"
                          % (node, timeout, states, job.describe()))
            time.sleep(0.1)

    def drain_and_time(self, job, node, before):
        """Drains `node` (a group rank or an address, as the CLI takes it), asserts the CLI's
        success, and prints how long after the command the next round made its first step
        (its first sample record; polled every 10 ms). Returns the CLI's stdout."""
        started = time.monotonic()
        r = self.drain(job, node)
        self.assertEqual(r.returncode, 0, "%s\n%s" % (r.describe(), job.describe()))
        self.assertIn("drained", r.stdout, r.describe())
        self.wait_next_round_stepped(job, before.generation, "drain of %s" % node, started)
        return r.stdout

    def wait_next_round_stepped(self, job, generation, what, started):
        """Waits (60 s at most) until a round after `generation` made its first step (its first
        sample record; polled every 10 ms) and prints how long after `started` that was."""
        deadline = time.monotonic() + 60
        while not any(m and int(m.group(1)) > generation and os.path.getsize(os.path.join(job.sample_dir, name)) > 0
                      for name, m in ((n, SAMPLE_FILE_RE.match(n)) for n in os.listdir(job.sample_dir))):
            if time.monotonic() >= deadline:
                self.fail("no round after generation %d made a step within 60 s of the %s\n%s"
                          % (generation, what, job.describe()))
            time.sleep(0.01)
        print("%s: the next round's first step %.2f s after it began" % (what, time.monotonic() - started),
              file=sys.stderr)

    def assert_node_left(self, job, node):
        """`node`'s ddplaunch exited 0 saying it was drained, leaving no process behind: no
        worker, no standby (the agent reaps what it killed before it exits)."""
        codes = job.wait_for_exit([node], FINISH_TIMEOUT)
        self.assertEqual(codes, {node: 0}, job.describe())
        out = job.agent(node).output()
        for said in DRAINED_SAYS:
            self.assertIn(said, out, job.describe())
        self.assertEqual(programs_in(self.cluster, node, "train"), {},
                         "processes of the drained node%s are left\n%s" % (node, job.describe()))

    def assert_drained(self, job, node):
        """assert_node_left(), and the survivors restarted once, for the drain."""
        self.assert_node_left(job, node)
        # Not counted: the survivors' restart is the drain's, not a failure's.
        restarts = [line for line in self.server_lines(job) if "restart after generation" in line]
        self.assertEqual(len(restarts), 1, job.describe())
        self.assertIn("(not counted)", restarts[0], job.describe())
        self.assertIn("was drained", restarts[0], job.describe())

    def rounds_after(self, job, generation):
        """Rounds after `generation` that started workers (their rank 0 printed a header)."""
        return [r for r in job.rounds() if r.generation > generation and r.world is not None]

    def assert_resumed_from_memory(self, job, before, after):
        """Round `after` continued from memory where round `before` stopped (as in
        test_fault_tolerance.py: the step in flight when the round ended, or the one after)."""
        rounds = {r.generation: r for r in job.rounds()}
        before, after = rounds[before.generation], rounds[after.generation]
        self.assertTrue(after.steps, "round %r made no steps\n%s" % (after, job.describe()))
        self.assertEqual(after.steps[0], after.resumed_from_step,
                         "the first step of %r is not the resume step\n%s" % (after, job.describe()))
        self.assertEqual(after.resumed_from, "memory", "round %r did not resume from memory\n%s"
                         % (after, job.describe()))
        self.assertIn(before.steps[-1] - after.resumed_from_step, (-1, 0, 1),
                      "round %r did not continue where %r stopped\n%s" % (after, before, job.describe()))

    def assert_finished_well(self, job, epochs):
        return self.assert_trained_well(job, SAMPLES, epochs, ACCURACY)

    def assert_one_round_after(self, job, before, world):
        after = self.rounds_after(job, before.generation)
        self.assertEqual([r.world for r in after], [world],
                         "expected one more round of %d workers\n%s" % (world, job.describe()))
        self.assertEqual(after[0].restart, before.restart,
                         "the drain counted as a restart (TORCHELASTIC_RESTART_COUNT)\n" + job.describe())
        return after[0]

    # ---- the scenarios -------------------------------------------------------------------------

    def test_a_drained_node_is_replaced_by_the_spare_which_receives_the_state_in_memory(self):
        job = self.start_job("drain-spare", "2:2", (1, 2))
        job.wait_for_steps(world=4, steps=1, timeout=90)
        job.start_node(3)   # the round runs at MAX: node3 waits as a spare
        self.wait_until_waiting(job, 3)
        before = job.wait_for_steps(world=4, steps=DRAIN_AFTER_STEPS, timeout=90)
        victim = self.node_with_rank(job, 1)
        survivor = next(n for n in (1, 2) if n != victim)

        said = self.drain_and_time(job, "1", before)
        self.assertIn("group rank 1", said)
        self.assertIn("a waiting node in its place", said)
        self.assert_drained(job, victim)
        codes = job.wait_for_exit([survivor, 3], FINISH_TIMEOUT)
        self.assertEqual(codes, {survivor: 0, 3: 0}, job.describe())

        after = self.assert_one_round_after(job, before, 4)
        spare = job.agent(3).stdout()
        self.assertIn("generation %d: this node is group rank" % after.generation, job.agent(3).output(),
                      "the spare is not in the round after the drain\n" + job.describe())
        self.assert_resumed_from_memory(job, before, after)
        received = {int(m.group("step")) for m in STATE_RECEIVED_RE.finditer(spare)}
        self.assertEqual(received, {after.resumed_from_step},
                         "the spare's workers did not receive the survivors' state\n" + job.describe())
        self.assert_finished_well(job, EPOCHS)

    def test_the_node_of_rank_0_drained_by_address_leaves_two_nodes_that_finish_at_world_size_4(self):
        job = self.start_job("drain-no-spare", "2:3", (1, 2, 3))
        before = job.wait_for_steps(world=6, steps=DRAIN_AFTER_STEPS, timeout=90)
        # The node that holds rank 0 and the master address, named by its address.
        victim = self.node_with_rank(job, 0)
        survivors = [n for n in (1, 2, 3) if n != victim]

        said = self.drain_and_time(job, self.cluster.addr(victim), before)
        self.assertIn("restarts with 2 node(s)", said)
        self.assert_drained(job, victim)
        codes = job.wait_for_exit(survivors, FINISH_TIMEOUT)
        self.assertEqual(codes, {n: 0 for n in survivors}, job.describe())

        after = self.assert_one_round_after(job, before, 4)
        self.assert_resumed_from_memory(job, before, after)
        self.assert_finished_well(job, EPOCHS)

    def test_without_in_memory_restart_the_next_round_resumes_from_the_checkpoint_saved_at_the_drain(self):
        job = self.start_job("drain-checkpoint", "2:3", (1, 2, 3), flags=["--in_memory_restart=off"])
        before = job.wait_for_steps(world=6, steps=DRAIN_AFTER_STEPS, timeout=90)
        victim = self.node_with_rank(job, 2)
        survivors = [n for n in (1, 2, 3) if n != victim]

        self.drain_and_time(job, "2", before)
        self.assert_drained(job, victim)
        codes = job.wait_for_exit(survivors, FINISH_TIMEOUT)
        self.assertEqual(codes, {n: 0 for n in survivors}, job.describe())

        after = self.assert_one_round_after(job, before, 4)
        before = next(r for r in job.rounds() if r.generation == before.generation)
        # SIGTERM, not an abandoned round: every rank finished the step in flight (they agree on
        # stopping inside the step), and rank 0 saved the step they stopped after.
        stops = {int(m.group("step")) for n in (1, 2, 3) for m in SIGTERM_STOP_RE.finditer(job.agent(n).stdout())}
        self.assertEqual(len(stops), 1, "expected one SIGTERM stop of rank 0\n" + job.describe())
        stop = stops.pop()
        self.assertEqual(stop, before.steps[-1] + 1, "the round did not stop after its last recorded step\n"
                         + job.describe())
        self.assertEqual(before.saved_steps[-1], stop, "rank 0 saved no checkpoint at the stop\n" + job.describe())
        periodic = [s for s in before.saved_steps[:-1] if s % CHECKPOINT_EVERY == 0]
        self.assertEqual(periodic, before.saved_steps[:-1], job.describe())
        self.assertTrue(periodic, "the round saved no periodic checkpoint before the drain\n" + job.describe())
        self.assertGreater(stop, periodic[-1], job.describe())
        self.assertNotEqual(after.resumed_from, "memory", job.describe())
        self.assertEqual(after.resumed_from_step, stop,
                         "round %r did not resume from the checkpoint saved at the drain\n%s" % (after, job.describe()))
        self.assertEqual(after.steps[0], stop, job.describe())
        print("checkpoint at the drain: step %d (last periodic: step %d)" % (stop, periodic[-1]), file=sys.stderr)
        self.assert_finished_well(job, EPOCHS)

    def test_refused_drains_leave_the_round_untouched(self):
        job = self.start_job("drain-refused", "2:3", (1, 2), epochs=200)
        before = job.wait_for_steps(world=4, steps=DRAIN_AFTER_STEPS, timeout=90)
        status = self.status(job)
        host = status["nodes"][0]["host"]

        def refused(node, *expected, job_id=None):
            r = self.drain(job, node, job_id=job_id)
            self.assertEqual(r.returncode, 1, "%s\n%s" % (r.describe(), job.describe()))
            for text in expected:
                self.assertIn(text, r.stderr, r.describe())

        # Either node would leave 1 node, under MIN (2).
        refused("0", "fewer than its minimum of 2", "--force")
        refused(self.cluster.addr(2), "fewer than its minimum of 2", "--force")
        refused("nosuchhost", "has no node nosuchhost")
        refused("5", "has no node 5")
        refused("0", "no running job nosuchjob", job_id="nosuchjob")
        # The namespaces share the machine's hostname: a host that names several nodes is refused.
        self.assertEqual({n["host"] for n in status["nodes"]}, {host}, status)
        refused(host, "2 nodes of job %s have host %s" % (job.job_id, host), "group rank")
        # No daemon there: exit 3. Bad flags: exit 2.
        r = self.cluster.run("head", [RENDEZVOUS, "drain", job.job_id, "0", "--endpoint", "%s:1" % job.head_addr,
                                      "--timeout", 5], timeout=30)
        self.assertEqual(r.returncode, 3, r.describe())
        r = self.cluster.run("head", [RENDEZVOUS, "drain", job.job_id, "--endpoint", job.endpoint], timeout=30)
        self.assertEqual(r.returncode, 2, r.describe())
        r = self.cluster.run("head", [RENDEZVOUS, "drain", job.job_id, "0", "--no-such-flag", "--endpoint",
                                      job.endpoint], timeout=30)
        self.assertEqual(r.returncode, 2, r.describe())

        # Untouched: the same round makes more steps, nobody was dropped or lost.
        self.assert_round_goes_on(job, before, STEPS_AFTER_REFUSALS, agents=(1, 2),
                                  banned=(" drained: ", " lost: ", "restart after"))
        status = self.status(job)
        self.assertEqual((status["generation"], status["restarts_used"], status["state"]),
                         (before.generation, 0, "running"), status)
        self.assertEqual(sorted(n["state"] for n in status["nodes"]), ["running", "running"], status)
        for node in (1, 2):
            self.assertNotIn("drained", job.agent(node).output(), job.describe())


if __name__ == "__main__":
    unittest.main(verbosity=2)
