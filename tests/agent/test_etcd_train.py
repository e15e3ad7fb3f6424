"""Replicated daemons on etcd, end to end: 3 replicated daemons on a 3-member etcd, a 3-node `train`
job; the leader is SIGKILLed during training; the job finishes with exit 0, no worker restarted,
no step repeated or skipped, and status on any replica names the new leader.

`train --sample-log` records every step each rank starts (rank, epoch, step, sample indices).
After the job: one generation and one attempt only; every rank has every step from 0 to the last
exactly once; the three ranks' samples of each epoch cover the data set exactly once. The workers
are the same processes before and after the failover (their pids, alive after the agents resumed).
Every wait has a deadline; etcd members, replicas and agents are killed in cleanup.
"""

import collections
import os
import re
import signal
import sys
import time
import unittest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "support"))

import test_etcd_failover as failover  # noqa: E402
from ddplaunch_helpers import BUILD_DIR, pid_alive  # noqa: E402
from processes import children, run, started_as_standby, wait_for  # noqa: E402
from test_multinode import CONF, RENDEZVOUS, MultiNodeTestCase  # noqa: E402

TRAIN = os.path.join(BUILD_DIR, "bin", "train")
RECORD_RE = re.compile(r"^attempt=(\d+) world=(\d+) rank=(\d+) epoch=(\d+) step=(\d+) indices=([0-9,]*)$")
NODES, SAMPLES, BATCH, EPOCHS = 3, 768, 16, 40  # 768 = 3 ranks x 16 x 16 steps: no padding


class EtcdTrainFailover(MultiNodeTestCase):
    start_etcd = failover.EtcdFailover.start_etcd
    start_replicas = failover.EtcdFailover.start_replicas
    replica_view = failover.EtcdFailover.replica_view
    agreed_leader = failover.EtcdFailover.agreed_leader
    wait_leader = failover.EtcdFailover.wait_leader

    def setUp(self):
        super().setUp()
        if not os.path.exists(TRAIN):
            self.skipTest("the worker SDK's train program is not built (DDPLAUNCH_BUILD_WORKER_SDK=OFF)")
        self.start_etcd()

    def records(self):
        out = []
        for name in sorted(os.listdir(self.out)):
            if name.endswith(".log"):
                with open(os.path.join(self.out, name)) as f:
                    for line in f:
                        m = RECORD_RE.match(line.strip())
                        if m:
                            out.append((name,) + tuple(int(g) for g in m.groups()[:5]) + (m.group(6),))
        return out

    def test_leader_sigkilled_during_training_the_job_finishes_with_no_worker_restarted_and_no_step_lost(self):
        ports = self.start_replicas()
        leader = self.wait_leader(ports)
        followers = [p for p in ports if p != leader]
        endpoints = ",".join("127.0.0.1:%d" % p for p in followers + [leader])
        nodes = []
        for i in range(NODES):
            args = ["--nnodes=%d" % NODES, "--nproc_per_node=1", "--rdzv_backend=c10d", "--rdzv_endpoint=%s" % endpoints,
                    "--rdzv_id=%s" % self.job, "--rdzv_conf", CONF, "--shutdown_timeout=5", "--max_restarts=0",
                    "--no_python", TRAIN, "--epochs", str(EPOCHS), "--samples", str(SAMPLES), "--batch-size", str(BATCH),
                    "--sample-log", os.path.join(self.out, "g{generation}-r{rank}.log")]
            proc = self.spawn_launch(args)
            proc.node = "n%d" % i
            nodes.append(proc)
        self.nodes = nodes
        wait_for(lambda: len(self.records()) >= 3 * 20 or any(p.poll() is not None for p in nodes), 120,
                 "the 3 ranks to make steps")
        self.assertFalse([p for p in nodes if p.poll() is not None], self.describe_nodes())
        # The first round starts cold; the standbys that start once it has stepped are not workers.
        workers = sorted(w for p in nodes for w in children(p.pid, "train") if not started_as_standby(w))
        self.assertEqual(len(workers), NODES, "one train worker per node: %s" % workers)

        self.replicas[leader].signal(signal.SIGKILL)
        self.replicas[leader].wait(10)
        killed = time.monotonic()
        steps_at_kill = len(self.records()) // NODES
        new_leader = self.wait_leader(followers)
        try:
            wait_for(lambda: all("resumed generation" in p.stderr() for p in nodes) or
                     any(p.poll() is not None for p in nodes), 60, "every agent to resume")
        except TimeoutError as e:
            self.fail("%s\n%s" % (e, self.describe_nodes()))
        resumed = time.monotonic() - killed
        steps_at_resume = len(self.records()) // NODES
        print("\n[etcd-train] leader SIGKILL -> every agent resumed: observed within %.2f s; the ranks made steps "
              "%d..%d meanwhile" % (resumed, steps_at_kill, steps_at_resume), file=sys.stderr)
        self.assertTrue(all(pid_alive(w) for w in workers), "a worker was restarted: %s" % workers)
        for p in nodes:
            self.assertRegex(p.stderr(), r"resumed generation \d+ .* at 127\.0\.0\.1:%d" % new_leader, p.describe())
        follower = next(p for p in followers if p != new_leader)
        text = run([RENDEZVOUS, "status", "--endpoint", "127.0.0.1:%d" % follower], timeout=10)
        self.assertIn("replica: following; the leader is 127.0.0.1:%d" % new_leader, text.stdout, text.describe())

        self.assertEqual(self.wait_exit(nodes, 600), [0] * NODES, self.describe_nodes())
        recs = self.records()
        self.assertEqual(len({r[0].split("-")[0] for r in recs}), 1, "one generation only: %s" % sorted({r[0] for r in recs}))
        self.assertEqual({(r[1], r[2]) for r in recs}, {(0, NODES)}, "one attempt, world size 3")
        steps_per_epoch = SAMPLES // NODES // BATCH
        last = EPOCHS * steps_per_epoch - 1
        per_epoch = collections.defaultdict(collections.Counter)
        for rank in range(NODES):
            steps = [r[5] for r in recs if r[3] == rank]
            self.assertEqual(sorted(steps), list(range(last + 1)), "rank %d: a step repeated or skipped" % rank)
        for r in recs:
            per_epoch[r[4]].update(int(i) for i in r[6].split(",") if i)
        self.assertEqual(sorted(per_epoch), list(range(EPOCHS)))
        for epoch, used in per_epoch.items():
            self.assertEqual(sorted(used), list(range(SAMPLES)), "epoch %d: samples missing" % epoch)
            self.assertEqual(set(used.values()), {1}, "epoch %d: a sample used twice" % epoch)


if __name__ == "__main__":
    unittest.main(verbosity=2)
