"""Spare nodes, and draining with a secret or with --force, on the namespace cluster.

A head node runs ddp-rendezvous; nodes run `ddplaunch ... build/bin/train --checkpoint-dir
<shared dir>`. A node that joins a job whose round runs at its `--nnodes` MAX waits as a spare
(`ddp-rendezvous status --json`: state waiting, `"spare": true`, group rank -1) and takes the
place of a node that fails, is lost or is drained:

- a spare replaces a crashed node: `--nnodes=2:2`, a third node joins once the round stepped and
  waits; every process of the node holding group rank 1 is SIGKILLed; the next round has the
  same world size (4), includes the spare, continues from memory (in-memory restart, the default
  for `train`), and the job finishes;
- more nodes than MAX from the start never fail the job (the case of nvidia-resiliency-ext
  issue 348, where a node beyond max_nodes ended whole jobs): three nodes start at once at
  `--nnodes=2:2`, exactly one waits as a spare, never runs a worker, and every agent, the spare
  included, exits 0 when the job succeeds, with no restart;
- a drained waiting spare just leaves: it exits 0 saying it was drained, and the running round
  goes on untouched (same generation, no restart);
- drain with a secret: daemon and agents have a cluster secret (--token_file, token_file= in
  --rdzv_conf); `drain` without the secret or with a wrong one is refused (exit 1, bad_token) and
  changes nothing, with the right one it drains and the job finishes at world size 4;
- `drain --force` below MIN: at `--nnodes=2:3` with two nodes, the drained node exits 0 and the
  other one waits for a node to join (the job gathers with 1 node; its agent keeps running).

The finishing scenarios assert every ddplaunch's exit code, the world size of each round, where
the round after a fault resumed, the final accuracy, and that the steps whose updates the final
model holds used every sample of every epoch exactly once (the SDK's sample records). The time
from the crash to the next round's first step is printed, not asserted.

Needs root and `ip netns` (skips with the reason otherwise) and the worker SDK's `train`.
"""

import json
import os
import secrets
import shutil
import signal
import sys
import tempfile
import time
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import test_drain  # noqa: E402  (its TestCase is not imported by name: unittest would run its tests here too)
from elastic_job import HEADER_RE, RENDEZVOUS, ElasticJob, TimedTrainTest, programs_in  # noqa: E402
from test_drain import EPOCHS, FINISH_TIMEOUT, STATE_RECEIVED_RE, train_args  # noqa: E402

FAULT_AFTER_STEPS = test_drain.DRAIN_AFTER_STEPS   # the round has saved a periodic checkpoint
STEPS_UNTOUCHED = 20   # steps the round makes after a drain or refusal that must not touch it
LONG_EPOCHS = 200      # a job that outlasts its test (the cluster's teardown kills it)
SPARE_SAYS = "is a spare: the round runs at MAX nodes"


class SpareTest(TimedTrainTest, unittest.TestCase):
    maxDiff = None

    # The drain test's helpers (methods of its TestCase, shared rather than copied). They ask the
    # daemon through self.status, which here proves the job's secret when it has one.
    node_with_rank = test_drain.DrainTest.node_with_rank
    assert_drained = test_drain.DrainTest.assert_node_left
    wait_until_waiting = test_drain.DrainTest.wait_until_waiting
    rounds_after = test_drain.DrainTest.rounds_after
    assert_resumed_from_memory = test_drain.DrainTest.assert_resumed_from_memory
    assert_finished_well = test_drain.DrainTest.assert_finished_well
    wait_next_round_stepped = test_drain.DrainTest.wait_next_round_stepped

    def start_job(self, job_id, nnodes, nodes, epochs=EPOCHS, token_file=None):
        job = ElasticJob(self, self.cluster, train_args(epochs), job_id=job_id, nnodes=nnodes, epochs=epochs,
                         ddplaunch_flags=[], token_file=token_file)
        job.start_rendezvous()
        for node in nodes:
            job.start_node(node)
        self.addrs = {self.cluster.addr(n): n for n in (1, 2, 3)}
        return job

    def secret_file(self, name):
        """A file holding a fresh cluster secret (32 hex digits on one line, docs/security.md)."""
        directory = tempfile.mkdtemp(prefix="ddp-e2e-secret-")
        self.addCleanup(shutil.rmtree, directory, True)
        path = os.path.join(directory, name)
        with open(path, "w") as f:
            f.write(secrets.token_hex(16) + "\n")
        os.chmod(path, 0o600)
        return path

    # ---- the daemon, asked from the head namespace ---------------------------------------------

    @staticmethod
    def client_env():
        """The tests' environment without a secret of its own: `--token_file` alone decides."""
        env = dict(os.environ)
        env.pop("DDPLAUNCH_RDZV_TOKEN_FILE", None)
        return env

    def drain(self, job, node, *flags):
        """Runs `ddp-rendezvous drain JOB NODE FLAGS` in the head; returns its processes.Result."""
        return self.cluster.run("head", [RENDEZVOUS, "drain", job.job_id, node, "--endpoint", job.endpoint]
                                + list(flags), timeout=30, env=self.client_env())

    def status(self, job, missing_ok=False):
        """The job's entry of `ddp-rendezvous status --json` (with the job's secret, if any); with
        `missing_ok`, None while no node of the job has reached the daemon yet."""
        secret = ["--token_file", job.token_file] if job.token_file else []
        r = self.cluster.run("head", [RENDEZVOUS, "status", "--json", "--endpoint", job.endpoint] + secret,
                             timeout=30, env=self.client_env())
        self.assertEqual(r.returncode, 0, r.describe())
        jobs = [j for j in json.loads(r.stdout)["jobs"] if j["job_id"] == job.job_id]
        if missing_ok and not jobs:
            return None
        self.assertEqual(len(jobs), 1, r.stdout)
        return jobs[0]

    def spares(self, status):
        """The cluster nodes `status` (a job's entry) shows as spares, checking how it shows them."""
        found = []
        for n in status["nodes"]:
            if n.get("spare"):
                self.assertEqual((n["state"], n["group_rank"]), ("waiting", -1), status)
                found.append(self.addrs[n["addr"]])
        return sorted(found)

    def assert_spare_logged(self, job, node):
        addr = "(%s)" % self.cluster.addr(node)
        self.assertTrue([line for line in self.server_lines(job) if SPARE_SAYS in line and addr in line],
                        "the daemon did not log node%s as a spare\n%s" % (node, job.describe()))

    def assert_round_untouched(self, job, before, nodes):
        """Round `before` (still the newest) makes STEPS_UNTOUCHED more steps while every agent of
        `nodes` keeps running, and no round after it forms; returns the job's status after."""
        now = next(r for r in job.rounds() if r.generation == before.generation)
        self.assert_round_goes_on(job, now, STEPS_UNTOUCHED, agents=nodes, banned=("restart after",))
        status = self.status(job)
        self.assertEqual((status["generation"], status["restarts_used"], status["state"]),
                         (before.generation, 0, "running"), status)
        return status

    # ---- the scenarios -------------------------------------------------------------------------

    def test_a_spare_takes_the_place_of_a_crashed_node_at_the_same_world_size(self):
        job = self.start_job("spare-crash", "2:2", (1, 2))
        job.wait_for_steps(world=4, steps=1, timeout=90)
        job.start_node(3)   # the round runs at MAX: node3 waits as a spare
        self.wait_until_waiting(job, 3)
        self.assertEqual(self.spares(self.status(job)), [3])
        self.assert_spare_logged(job, 3)
        before = job.wait_for_steps(world=4, steps=FAULT_AFTER_STEPS, timeout=90)
        victim = self.node_with_rank(job, 1)
        survivor = next(n for n in (1, 2) if n != victim)

        crashed_at = time.monotonic()
        self.cluster.crash(victim)
        self.wait_next_round_stepped(job, before.generation, "crash of node%d" % victim, crashed_at)

        codes = job.wait_for_exit([survivor, 3], FINISH_TIMEOUT)
        self.assertEqual(codes, {survivor: 0, 3: 0}, job.describe())
        self.assertEqual(job.agent(victim).wait(10), -signal.SIGKILL, job.describe())
        after = self.rounds_after(job, before.generation)
        self.assertEqual([r.world for r in after], [4], "expected one more round of 4 workers\n" + job.describe())
        after = after[0]
        print("restart count (TORCHELASTIC_RESTART_COUNT) before the crash %s, after %s"
              % (before.restart, after.restart), file=sys.stderr)
        self.assertIn("generation %d: this node is group rank" % after.generation, job.agent(3).output(),
                      "the spare is not in the round after the crash\n" + job.describe())
        self.assert_resumed_from_memory(job, before, after)
        received = {int(m.group("step")) for m in STATE_RECEIVED_RE.finditer(job.agent(3).stdout())}
        self.assertEqual(received, {after.resumed_from_step},
                         "the spare's workers did not receive the survivor's state\n" + job.describe())
        self.assert_finished_well(job, EPOCHS)

    def test_more_nodes_than_max_from_the_start_never_fail_the_job(self):
        # nvidia-resiliency-ext issue 348: there, a node beyond max_nodes ended whole jobs.
        job = self.start_job("spare-from-start", "2:2", (1, 2, 3))
        deadline = time.monotonic() + 60
        while True:
            for node in (1, 2, 3):
                self.assertIsNone(job.agent(node).poll(), "ddplaunch on node%d exited\n%s" % (node, job.describe()))
            status = self.status(job, missing_ok=True)  # the agents may not have joined yet
            if status is not None and status["state"] == "running" and len(status["nodes"]) == 3:
                break
            if time.monotonic() >= deadline:
                self.fail("the job did not run with 3 nodes present within 60 s: %s\n%s" % (status, job.describe()))
            time.sleep(0.05)
        spares = self.spares(status)
        self.assertEqual(len(spares), 1, "expected exactly one spare\n%s" % status)
        spare = spares[0]
        self.assertEqual(sorted((n["state"], n["group_rank"]) for n in status["nodes"] if not n.get("spare")),
                         [("running", 0), ("running", 1)], status)
        self.assertEqual(status["restarts_used"], 0, status)
        self.assertEqual(programs_in(self.cluster, spare, "train"), {},
                         "the spare node%d runs workers\n%s" % (spare, job.describe()))

        codes = job.wait_for_exit([1, 2, 3], FINISH_TIMEOUT)
        self.assertEqual(codes, {1: 0, 2: 0, 3: 0}, job.describe())
        rounds = job.rounds()
        self.assertEqual([(r.generation, r.world, r.restart) for r in rounds],
                         [(status["generation"], 4, 0)], "expected one round of 4 workers\n" + job.describe())
        self.assert_finished_well(job, EPOCHS)
        # The spare never ran a worker of the job: no round header, no group rank, and (the one
        # round's sample records being exactly its 4 ranks') no records.
        out = job.agent(spare).stdout()
        self.assertEqual([line for line in out.splitlines() if HEADER_RE.match(line)], [], job.describe())
        self.assertNotIn("this node is group rank", job.agent(spare).output(), job.describe())
        self.assertEqual(sorted({rec[1] for rec in rounds[0].records}), [0, 1, 2, 3], job.describe())
        self.assertEqual([line for line in self.server_lines(job) if "restart after" in line], [], job.describe())
        final = self.status(job)
        self.assertEqual((final["state"], final["restarts_used"], final["generation"]),
                         ("succeeded", 0, status["generation"]), final)

    def test_a_drained_spare_just_leaves_and_the_round_goes_on(self):
        job = self.start_job("spare-drain", "2:2", (1, 2), epochs=LONG_EPOCHS)
        job.wait_for_steps(world=4, steps=1, timeout=90)
        job.start_node(3)
        self.wait_until_waiting(job, 3)
        self.assert_spare_logged(job, 3)
        before = job.wait_for_steps(world=4, steps=FAULT_AFTER_STEPS, timeout=90)

        # The namespaces share one host name: the spare (no group rank) is named by its address.
        r = self.drain(job, self.cluster.addr(3))
        self.assertEqual(r.returncode, 0, "%s\n%s" % (r.describe(), job.describe()))
        self.assertIn("drained", r.stdout, r.describe())
        self.assertIn(self.cluster.addr(3), r.stdout, r.describe())
        self.assertNotIn("restarts", r.stdout, r.describe())
        self.assert_drained(job, 3)
        self.assertNotIn("this node is group rank", job.agent(3).output(), job.describe())

        status = self.assert_round_untouched(job, before, (1, 2))
        self.assertEqual(sorted((n["state"], n["group_rank"]) for n in status["nodes"]),
                         [("running", 0), ("running", 1)], status)
        self.assertEqual(self.spares(status), [], status)
        drained = [line for line in self.server_lines(job) if " drained: " in line]
        self.assertEqual(len(drained), 1, job.describe())
        self.assertIn(self.cluster.addr(3), drained[0], job.describe())

    def test_drain_proves_the_cluster_secret(self):
        token = self.secret_file("cluster-secret")
        wrong = self.secret_file("another-secret")
        job = self.start_job("spare-secret", "2:3", (1, 2, 3), token_file=token)
        before = job.wait_for_steps(world=6, steps=FAULT_AFTER_STEPS, timeout=90)

        for flags in ((), ("--token_file", wrong)):
            r = self.drain(job, "1", *flags)
            self.assertEqual(r.returncode, 1, "%s\n%s" % (r.describe(), job.describe()))
            self.assertIn("bad_token", r.stderr, r.describe())
        # The refusals changed nothing: nobody drained, no new round.
        self.assertEqual([line for line in self.server_lines(job) if " drained: " in line], [], job.describe())
        self.assertEqual(self.rounds_after(job, before.generation), [], job.describe())

        victim = self.node_with_rank(job, 1)
        survivors = [n for n in (1, 2, 3) if n != victim]
        r = self.drain(job, "1", "--token_file", token)
        self.assertEqual(r.returncode, 0, "%s\n%s" % (r.describe(), job.describe()))
        self.assertIn("group rank 1", r.stdout, r.describe())
        self.assert_drained(job, victim)
        codes = job.wait_for_exit(survivors, FINISH_TIMEOUT)
        self.assertEqual(codes, {n: 0 for n in survivors}, job.describe())
        after = self.rounds_after(job, before.generation)
        self.assertEqual([r.world for r in after], [4], "expected one more round of 4 workers\n" + job.describe())
        self.assert_resumed_from_memory(job, before, after[0])
        self.assert_finished_well(job, EPOCHS)

    def test_a_forced_drain_below_min_leaves_the_other_node_waiting_for_one(self):
        job = self.start_job("spare-force", "2:3", (1, 2), epochs=LONG_EPOCHS)
        job.wait_for_steps(world=4, steps=FAULT_AFTER_STEPS, timeout=90)
        victim = self.node_with_rank(job, 1)
        survivor = next(n for n in (1, 2) if n != victim)

        r = self.drain(job, "1", "--force")
        self.assertEqual(r.returncode, 0, "%s\n%s" % (r.describe(), job.describe()))
        print("forced drain: %s" % r.stdout.strip(), file=sys.stderr)
        self.assert_drained(job, victim)
        # The other node waits for a node to join (up to join_timeout, 60 s here): the job
        # gathers with it alone, and its agent keeps running.
        addr = self.cluster.addr(survivor)
        deadline = time.monotonic() + 30
        while True:
            self.assertIsNone(job.agent(survivor).poll(), job.describe())
            status = self.status(job)
            nodes = [(n["addr"], n["state"], n["group_rank"]) for n in status["nodes"]]
            if status["state"] == "gathering" and nodes == [(addr, "waiting", -1)]:
                break
            if time.monotonic() >= deadline:
                self.fail("the job did not gather with node%d alone within 30 s: %s\n%s"
                          % (survivor, status, job.describe()))
            time.sleep(0.1)
        still = time.monotonic() + 3
        while time.monotonic() < still:
            self.assertIsNone(job.agent(survivor).poll(),
                              "ddplaunch on node%d exited while the job waits\n%s" % (survivor, job.describe()))
            time.sleep(0.2)
        status = self.status(job)
        self.assertEqual((status["state"], [(n["addr"], n["state"]) for n in status["nodes"]]),
                         ("gathering", [(addr, "waiting")]), status)
        self.assertEqual(status["restarts_used"], 0, status)
        # The test ends here: the cluster's teardown kills the waiting agent and its workers.


if __name__ == "__main__":
    unittest.main(verbosity=2)
