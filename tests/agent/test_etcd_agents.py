"""torchrun's --rdzv_backend=etcd and etcd-v2, no head node (docs/etcd.md,
"Agents on etcd").

Every ddplaunch agent hosts a replica of its job's rendezvous in-process; the replicas elect
their leader through a real 3-member etcd on loopback (tests/support/etcd_cluster.py, nothing
mocked). The node hosting the leader is lost (its agent and workers SIGKILLed): another agent's
replica takes over after the lease TTL and the job finishes on the survivor. Every wait has a
deadline; etcd members and agents are killed in cleanup.
"""

import os
import re
import signal
import sys
import time
import unittest
import uuid

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "support"))

from ddplaunch_helpers import PYTHON, LaunchTestCase, pid_alive
from etcd_cluster import EtcdCluster
from processes import free_port, wait_for
from test_multinode import WORKER, MultiNodeTestCase

TTL = 2
# Short deadlines for tests (test_multinode.CONF) and the etcd keys of each test's own.
CONF = "heartbeat_interval=0.5,heartbeat_timeout=2,last_call_timeout=1,join_timeout=60"
LEADING = "rendezvous replica: etcd: leading"


class EtcdAgents(MultiNodeTestCase):
    def setUp(self):
        super().setUp()
        self.etcd = EtcdCluster.started_for(self)
        self.prefix = "/ddp-test-%s" % uuid.uuid4().hex[:8]

    def etcd_node(self, name, backend, endpoint, nnodes, nproc, worker_args, max_restarts=0, conf=""):
        """A torchrun command line with an etcd backend, as ddplaunch's arguments."""
        args = ["--nnodes=%s" % nnodes, "--nproc_per_node=%d" % nproc, "--rdzv_backend=%s" % backend,
                "--rdzv_endpoint=%s" % endpoint, "--rdzv_id=%s" % self.job,
                "--rdzv_conf", "%s,etcd_prefix=%s,etcd_lease_ttl=%d%s" % (CONF, self.prefix, TTL, conf),
                "--max_restarts=%d" % max_restarts, "--shutdown_timeout=5",
                "--python", PYTHON, WORKER, self.out] + list(worker_args)
        proc = self.spawn_launch(args, env={"MN_NODE": name})
        proc.node = name
        return proc

    def replica_endpoint(self, proc):
        m = re.search(r"hosting a replica of job \S+ rendezvous on (\S+) ", proc.stderr())
        return m.group(1) if m else None

    def job_keys(self):
        r = self.etcd.ctl("get", "--prefix", "--keys-only", "%s/%s/jobs/" % (self.prefix, self.job))
        return [line for line in r.stdout.splitlines() if line.strip()]

    def test_etcd_v2_job_survives_the_loss_of_the_node_hosting_the_leading_replica(self):
        # torchrun's form: one etcd endpoint, HOST:PORT without a scheme.
        endpoint = self.etcd.endpoints[0][len("http://"):]
        worker = ["--loop"]  # Gloo all-reduce, then wait for OUT/stop (no collective that could hang)
        first = self.etcd_node("n0", "etcd-v2", endpoint, "1:2", 2, worker, max_restarts=3)
        wait_for(lambda: LEADING in first.stderr() or first.poll() is not None, 30, "n0's replica to lead")
        second = self.etcd_node("n1", "etcd-v2", endpoint, "1:2", 2, worker, max_restarts=3)
        self.nodes = [first, second]
        gen, rs = self.wait_round(4)
        self.check_round(rs, 2, 2)
        leader = self.replica_endpoint(first)
        self.assertIsNotNone(leader, first.describe())
        self.assertIn("the leader is %s: going there" % leader, second.stderr(), second.describe())

        # Node loss: the agent whose replica leads dies with its workers.
        victim_workers = [r["pid"] for r in rs if r["env"]["MN_NODE"] == "n0"]
        log_before = len(second.stderr())  # before the kill: the survivor notices within milliseconds
        self.assertNotIn(LEADING, second.stderr())
        os.kill(first.pid, signal.SIGKILL)
        for pid in victim_workers:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        killed = time.monotonic()
        first.wait(10)

        # The survivor's replica takes the lead after the lease, and the job goes on without n0.
        gen2, rs2 = self.wait_round(2, after_gen=gen)
        print("\n[etcd-agents] leader node SIGKILL -> survivor's round of 2 workers done: %.2f s (lease TTL %d s)"
              % (time.monotonic() - killed, TTL), file=sys.stderr)
        self.check_round(rs2, 1, 2)
        self.assertEqual({r["env"]["MN_NODE"] for r in rs2}, {"n1"})
        after = second.stderr()[log_before:]
        self.assertIn("lost the rendezvous at %s" % leader, after, second.describe())
        self.assertIn(LEADING, after, "the survivor's replica became the leader\n" + second.describe())
        self.stop_workers()
        self.assertEqual(self.wait_exit([second]), [0], self.describe_nodes())
        # Nothing remains: the killed node's workers, the survivor's workers of both rounds.
        pids = [r["pid"] for r in self.recs("start")]
        wait_for(lambda: not any(pid_alive(p) for p in pids), 10, "every worker to be gone")
        # The job's records in etcd went with the job (a rerun of the id starts afresh).
        self.assertEqual(self.job_keys(), [])

    def test_etcd_backend_runs_a_2_node_job_and_the_same_id_runs_again(self):
        endpoints = ",".join(self.etcd.endpoints)  # every member, http:// as etcd writes them
        # The replicas guard the job with the shared token, as a daemon does (docs/security.md).
        token = self.script("token", "etcd-agents-secret\n")
        for attempt in range(2):
            nodes = [self.etcd_node("n%d" % i, "etcd", endpoints, 2, 1, ["--no-gloo"], conf=",token_file=" + token)
                     for i in range(2)]
            self.nodes = nodes
            self.assertEqual(self.wait_exit(nodes), [0, 0], self.describe_nodes())
            # One replica led; the other agent was redirected to it.
            ends = [self.replica_endpoint(p) for p in nodes]
            redirected = [p for p, other in zip(nodes, reversed(ends)) if "the leader is %s: going there" % other
                          in p.stderr()]
            self.assertEqual(len(redirected), 1, self.describe_nodes())
            gen, rs = self.wait_round(2)
            self.check_round(rs, 2, 1)
            self.assertEqual(gen, 1, "the rerun is a new job, not the finished one continued")
            self.assertEqual(self.job_keys(), [], "attempt %d left its records in etcd" % attempt)
            for name in os.listdir(self.out):
                os.unlink(os.path.join(self.out, name))


class EtcdBadInput(LaunchTestCase):
    def test_an_unreachable_etcd_exits_3_within_etcd_timeout_naming_the_endpoint(self):
        port = free_port()  # nothing listens there
        worker = self.script("w.py", "pass\n")
        started = time.monotonic()
        r = self.launch(["--nnodes=2", "--rdzv_backend=etcd-v2", "--rdzv_endpoint=127.0.0.1:%d" % port,
                         "--rdzv_id=j", "--rdzv_conf", "etcd_timeout=2", "--python", PYTHON, worker], timeout=60)
        elapsed = time.monotonic() - started
        self.assertEqual(r.returncode, 3, r.describe())
        self.assertIn("127.0.0.1:%d" % port, r.stderr, r.describe())
        self.assertIn("etcd_timeout", r.stderr, r.describe())
        self.assertLess(elapsed, 45, "etcd_timeout=2 was not honoured")

    def test_bad_etcd_rdzv_conf_values_are_usage_errors_naming_the_key(self):
        base = ["--nnodes=2", "--rdzv_backend=etcd", "--rdzv_id=j", "--python", PYTHON, self.script("w.py", "pass\n")]
        cases = [(["--rdzv_endpoint=127.0.0.1:2379", "--rdzv_conf", "etcd_lease_ttl=1"], ["etcd_lease_ttl", "2 to 600"]),
                 (["--rdzv_endpoint=127.0.0.1:2379", "--rdzv_conf", "protocol=ftp"], ["protocol=ftp", "http, https"]),
                 (["--rdzv_endpoint=127.0.0.1:2379", "--rdzv_conf", "protocol=https,cacert=/nonexistent/ca.pem"], ["/nonexistent/ca.pem"]),
                 (["--rdzv_endpoint=127.0.0.1:2379", "--rdzv_conf", "etcd_prefix=relative"], ["etcd_prefix=relative", "'/'"]),
                 (["--rdzv_endpoint=127.0.0.1:2379", "--rdzv_conf", "etcd_timeout=0"], ["etcd_timeout", "greater than 0"]),
                 (["--rdzv_endpoint=127.0.0.1:2379", "--rdzv_conf", "etcd_user=u"], ["etcd_password_file"]),
                 (["--rdzv_endpoint=127.0.0.1:99999"], ["--rdzv_endpoint=127.0.0.1:99999"]),
                 ([], ["--rdzv_endpoint=HOST[:PORT] of etcd"])]
        for extra, words in cases:
            r = self.launch(base[:3] + extra + base[3:], timeout=60)
            self.assertEqual(r.returncode, 2, r.describe())
            for w in words:
                self.assertIn(w, r.stderr, r.describe())


if __name__ == "__main__":
    unittest.main(verbosity=2)
