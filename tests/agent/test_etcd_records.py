"""Job records: what must survive the leader is in etcd before agents hear of it.

Replicated ddp-rendezvous daemons on a real 3-member etcd cluster (loopback), real ddplaunch
agents whose workers (tests/agent/mn_worker.py --loop --fail-on-file) fail when the test says
so. A job between rounds, or after a counted restart, keeps its restart count and generation
across the leader's SIGKILL; a deposed leader writes nothing and tells no agent; a corrupt record
is refused with its reason while the replica serves on (docs/etcd.md, "Job records"). Every wait
has a deadline; etcd members, replicas and agents are killed in cleanup.
"""

import json
import os
import signal
import sys
import unittest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "support"))

import test_rendezvous_restart as restart
from ddplaunch_helpers import PYTHON
from processes import free_port, wait_for
import test_etcd_failover as failover
from test_multinode import WORKER, MultiNodeTestCase


class EtcdRecords(MultiNodeTestCase):
    # The replicas and checks of the failover tests (imported as a module, so that unittest does
    # not run that file's tests here too), and the agents' checks of the single-daemon restart tests.
    start_replicas = failover.EtcdFailover.start_replicas
    replica_view = failover.EtcdFailover.replica_view
    agreed_leader = failover.EtcdFailover.agreed_leader
    wait_leader = failover.EtcdFailover.wait_leader
    wait_resumed = restart.RendezvousRestart.wait_resumed

    def setUp(self):
        super().setUp()
        failover.EtcdFailover.start_etcd(self)

    def agent(self, node, endpoints, nnodes=2, max_restarts=1):
        """A ddplaunch node whose local rank 0 exits 7 each time OUT/fail-<node> appears."""
        args = ["--nnodes=%d" % nnodes, "--nproc_per_node=1", "--rdzv_backend=c10d",
                "--rdzv_endpoint=%s" % ",".join("127.0.0.1:%d" % p for p in endpoints),
                "--rdzv_id=%s" % self.job, "--rdzv_conf", restart.CONF, "--shutdown_timeout=5",
                "--max_restarts=%d" % max_restarts, "--python", PYTHON, WORKER, self.out,
                "--loop", "--no-gloo", "--fail-on-file"]
        proc = self.spawn_launch(args, env={"MN_NODE": node})
        proc.node = node
        return proc

    def fail_worker(self, node):
        with open(os.path.join(self.out, "fail-%s" % node), "w"):
            pass

    def record(self):
        """The job's record in etcd (a dict), or None."""
        out = self.etcd.ctl("get", self.prefix + "jobs/" + self.job, "--print-value-only").stdout.strip()
        return json.loads(out) if out else None

    def wait_record(self, what, check):
        try:
            return wait_for(lambda: (lambda r: r if r and check(r) else None)(self.record()), 30, what)
        except TimeoutError as e:
            self.fail("%s: %s\n%s\n%s" % (e, self.record(), self.describe_nodes(),
                                            "\n".join(p.describe() for p in self.replicas.values())))

    def test_a_job_between_rounds_keeps_its_restart_count_and_generation_on_the_new_leader(self):
        ports = self.start_replicas()
        leader = self.wait_leader(ports)
        self.nodes = [self.agent("n0", ports), self.agent("n1", ports)]
        gen1, _ = self.wait_round(2, kind="start")
        self.fail_worker("n0")  # counted: 1 of --max_restarts=1
        gen2, rs = self.wait_round(2, kind="start", after_gen=gen1)
        self.assertEqual({r["env"]["TORCHELASTIC_RESTART_COUNT"] for r in rs}, {"1"})
        self.wait_record("the record of the round after the restart",
                         lambda r: r["state"] == "running" and r["generation"] == gen2 and r["restarts_used"] == 1)
        # n1 dies: the round ends (not counted) and n0 waits for a second node: between rounds.
        lost = self.nodes[1]
        lost.signal(signal.SIGKILL)
        lost.wait(10)
        self.wait_record("the record of the job between rounds",
                         lambda r: r["state"] == "gathering" and r["restarts_used"] == 1)
        self.replicas[leader].signal(signal.SIGKILL)
        self.replicas[leader].wait(10)
        followers = [p for p in ports if p != leader]
        new_leader = self.wait_leader(followers)
        # A replacement node joins; the round on the new leader goes on from the record.
        self.nodes.append(self.agent("n1", followers))
        gen3, rs = self.wait_round(2, kind="start", after_gen=gen2)
        self.assertGreater(gen3, gen2, "generations stay monotonic across leaders")
        self.assertEqual({r["env"]["TORCHELASTIC_RESTART_COUNT"] for r in rs}, {"1"}, "the budget is not reset")
        # The budget is spent: a second failure fails the job everywhere (exit 1), no restart.
        self.fail_worker("n0")
        codes = self.wait_exit([self.nodes[0], self.nodes[2]])
        self.assertEqual(codes, [1, 1], self.describe_nodes())
        self.assertEqual(max(self.by_generation("start")), gen3, "no round after the failure")
        self.assertIn("job %s: loaded from etcd (gathering, generation %d, restarts 1/1)" % (self.job, gen2),
                      self.replicas[new_leader].stdout())

    def test_after_a_counted_restart_the_new_leader_keeps_the_count_and_a_second_failure_fails_the_job(self):
        ports = self.start_replicas()
        leader = self.wait_leader(ports)
        self.nodes = [self.agent("n0", ports), self.agent("n1", ports)]
        gen1, _ = self.wait_round(2, kind="start")
        self.fail_worker("n0")
        gen2, rs = self.wait_round(2, kind="start", after_gen=gen1)
        self.wait_record("the record of the round after the restart",
                         lambda r: r["state"] == "running" and r["generation"] == gen2 and r["restarts_used"] == 1)
        self.replicas[leader].signal(signal.SIGKILL)
        self.replicas[leader].wait(10)
        followers = [p for p in ports if p != leader]
        new_leader = self.wait_leader(followers)
        self.wait_resumed(self.nodes)
        out = self.replicas[new_leader].stdout()
        self.assertIn("job %s: loaded from etcd (running, generation %d, restarts 1/1)" % (self.job, gen2), out)
        self.assertIn("restored: every one of 2 nodes resumed generation %d, restarts 1/1" % gen2, out)
        self.fail_worker("n0")
        self.assertEqual(self.wait_exit(self.nodes), [1, 1], self.describe_nodes())
        self.assertEqual(max(self.by_generation("start")), gen2, "no worker restarted after the failover")

    def test_a_deposed_leader_cannot_write_a_record_and_tells_no_agent(self):
        # Without the watch (which would see the key change first: the next test), the
        # transaction's compare is what stops the deposed leader.
        [port] = self.start_replicas(1, extra=["--etcd_watch=false"])
        self.wait_leader([port])
        replica = self.replicas[port]
        # Another replica "took over" behind this one's back: the leader key is now someone else's
        # (a new create revision), while this replica's lease still renews.
        self.etcd.ctl("del", self.prefix + "leader")
        self.etcd.ctl("put", self.prefix + "leader", "127.0.0.1:%d" % free_port())
        self.nodes = [self.agent("n0", [port], nnodes=1, max_restarts=0)]
        wait_for(lambda: "no longer the leader" in replica.stdout(), 30, "the deposed replica to step down")
        out = replica.stdout()
        self.assertIn("deposed: the leader key is no longer the one this replica created", out)
        self.assertIn("the job records were not written (deposed): stepping down", out)
        self.assertNotIn("job records written", out)
        self.assertIsNone(self.record())
        # The round it formed was never told: no worker started (it forgot the job on stepping down).
        self.assertEqual(self.recs("start"), [])

    def test_a_deposed_leader_sees_the_key_change_through_its_watch_and_steps_down(self):
        [port] = self.start_replicas(1)
        self.wait_leader([port])
        replica = self.replicas[port]
        wait_for(lambda: "etcd: watching the leader key" in replica.stdout(), 30, "the leader's watch")
        other = "127.0.0.1:%d" % free_port()
        self.etcd.ctl("del", self.prefix + "leader")
        self.etcd.ctl("put", self.prefix + "leader", other)
        wait_for(lambda: "no longer the leader" in replica.stdout(), 30, "the deposed replica to step down")
        wait_for(lambda: "etcd: following: the leader is " + other in replica.stdout(), 30,
                 "the deposed replica to follow the key's holder")
        out = replica.stdout()
        self.assertIn("etcd: deposed: the leader key ", out)
        self.assertNotIn("job records written", out)

    def test_a_corrupt_record_is_refused_with_its_reason_and_the_replica_serves_on(self):
        self.etcd.ctl("put", self.prefix + "jobs/garbage", "{not json")
        self.etcd.ctl("put", self.prefix + "jobs/liar", json.dumps(
            {"version": 1, "job_id": "liar", "state": "running", "min_nodes": 1, "max_nodes": 1, "max_restarts": 0,
             "timeouts": {"join_timeout": 5, "heartbeat_timeout": 5}, "generation": 1, "restarts_used": 9,
             "failing": False, "failures": [], "summary": ""}))
        [port] = self.start_replicas(1)
        self.wait_leader([port])
        replica = self.replicas[port]
        wait_for(lambda: "record(s) before serving" in replica.stdout(), 20, "the records to be loaded")
        out = replica.stdout()
        self.assertIn("refused the job record %sjobs/garbage: a job record that is not a JSON object" % self.prefix, out)
        self.assertIn("refused the job record %sjobs/liar: the record of job liar: \"restarts_used\" = 9 is out of "
                      "range 0..0" % self.prefix, out)
        self.assertIn("0 job(s) loaded from 2 record(s) before serving", out)
        # It serves: a job runs to its end, and its record is written, then deleted once it is over.
        self.nodes = [self.agent("n0", [port], nnodes=1, max_restarts=0)]
        self.wait_round(1, kind="start")
        self.wait_record("the job's record", lambda r: r["state"] == "running")
        self.stop_workers()
        self.assertEqual(self.wait_exit(self.nodes), [0], self.describe_nodes())
        wait_for(lambda: self.record() is None, 30, "the finished job's record to be deleted")


if __name__ == "__main__":
    unittest.main(verbosity=2)
