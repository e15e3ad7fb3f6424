"""A leader cut off from etcd stops leading, and no job round is driven by two
replicas at once (network namespaces, scripts/netns-cluster; needs root and `ip netns`, skips
with the reason otherwise).

The head namespace runs etcd (one member, its data in a temporary directory); node1 and node2
run a ddp-rendezvous replica each (TTL 2 s), node1's started first so that it leads; node2 and
node3 run the agents of a 2-node job (tests/agent/mn_worker.py --loop --no-gloo). Then node1's
link is set down: the leader cannot renew its lease, steps down on its own timer before the
lease can expire (it logs so), etcd deletes the key, node2's replica takes over, and the agents
resume with it without restarting a worker. Each replica logs the rounds it drives ("round N
complete" when it forms one, "restored: ..." when it takes over a running one) and when it leads
and stops leading, with the time; the test compares the two logs: node1's last moment of
leadership comes before node2's first, and every round line of a replica falls inside its own
leadership. node1 comes back and follows node2. The cluster is torn down even when the test
fails; every wait has a deadline.
"""

import datetime
import glob
import os
import re
import shutil
import sys
import tempfile
import unittest

from cluster import Cluster
from etcd_cluster import ETCD
from processes import wait_for

BUILD_DIR = os.environ.get("DDPLAUNCH_BUILD_DIR") or os.path.join(
    os.path.dirname(os.path.abspath(__file__)), "..", "..", "build")
SOURCE_DIR = os.environ.get("DDPLAUNCH_SOURCE_DIR") or os.path.abspath(
    os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
DDPLAUNCH = os.path.join(BUILD_DIR, "bin", "ddplaunch")
RENDEZVOUS = os.path.join(BUILD_DIR, "bin", "ddp-rendezvous")
WORKER = os.path.join(SOURCE_DIR, "tests", "agent", "mn_worker.py")
PYTHON = sys.executable
PORT = 29400
TTL = 2
CONF = "heartbeat_interval=0.5,heartbeat_timeout=2,last_call_timeout=1,join_timeout=60,reconnect_timeout=60"
LINE = re.compile(r"^(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3})Z (.*)$")


def events(log):
    """(time, text) of every timestamped line of a replica's log."""
    out = []
    for line in log.splitlines():
        m = LINE.match(line)
        if m:
            out.append((datetime.datetime.strptime(m.group(1), "%Y-%m-%dT%H:%M:%S.%f"), m.group(2)))
    return out


def terms(log):
    """The replica's terms of leadership as [start, end) (end None: still leading)."""
    spans, start = [], None
    for t, text in events(log):
        if text.startswith("etcd: leading") and start is None:
            start = t
        elif start is not None and (text.startswith("no longer the leader") or "stepping down" in text):
            spans.append((start, t))
            start = None
    if start is not None:
        spans.append((start, None))
    return spans


def rounds(log):
    """Times of the lines that say the replica drives a round: one formed, or one taken over."""
    return [t for t, text in events(log) if re.search(r"round \d+ complete|: restored: ", text)]


class NetnsEtcdPartition(unittest.TestCase):
    def setUp(self):
        reason = Cluster.unavailable_reason() or (None if os.access(ETCD, os.X_OK) else ETCD + " is not installed")
        if reason:
            print("\n[netns] skipped: %s" % reason, file=sys.stderr)
            self.skipTest(reason)
        for binary in (DDPLAUNCH, RENDEZVOUS):
            if not os.path.exists(binary):
                self.fail("not built: %s" % binary)
        self.tmp = tempfile.mkdtemp(prefix="ddp_netns_etcd_")
        self.addCleanup(shutil.rmtree, self.tmp, True)
        self.out = os.path.join(self.tmp, "out")
        os.mkdir(self.out)
        self.cluster = Cluster(nodes=3)
        self.addCleanup(self.cluster.down)
        self.cluster.up()
        head = self.cluster.addr("head")
        client, peer = "http://%s:2379" % head, "http://%s:2380" % head
        self.etcd = self.cluster.spawn("head", [ETCD, "--name", "m0", "--data-dir", os.path.join(self.tmp, "etcd"),
                                                "--listen-client-urls", client, "--advertise-client-urls", client,
                                                "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
                                                "--initial-cluster", "m0=" + peer,
                                                "--logger", "zap", "--log-outputs",
                                                os.path.join(self.tmp, "etcd.log")], name="etcd@head")
        self.etcd_endpoint = client
        self.replicas = {}

    def replica(self, node):
        addr = self.cluster.addr(node)
        p = self.cluster.spawn(node, [RENDEZVOUS, "--host", addr, "--port", PORT, "--advertise", "%s:%d" % (addr, PORT),
                                      "--etcd", self.etcd_endpoint, "--etcd_lease_ttl", TTL,
                                      "--etcd_prefix", "/netns-partition/"], name="replica@node%d" % node)
        self.replicas[node] = p
        return p

    def agent(self, node, endpoints):
        env = dict(os.environ, MN_NODE="node%d" % node, TMPDIR=self.tmp)
        return self.cluster.spawn(node, [DDPLAUNCH, "--nnodes=2", "--nproc_per_node=1", "--max_restarts=0",
                                         "--rdzv_backend=c10d", "--rdzv_endpoint=" + ",".join(endpoints),
                                         "--rdzv_id=netns-partition", "--rdzv_conf", CONF, "--python", PYTHON,
                                         WORKER, self.out, "--loop", "--no-gloo"],
                                  env=env, cwd=self.tmp, name="ddplaunch@node%d" % node)

    def describe(self):
        return "\n".join(p.describe() for p in list(self.replicas.values()) + getattr(self, "agents", []))

    def test_a_leader_cut_off_from_etcd_stops_leading_and_no_round_is_driven_twice(self):
        a = self.replica(1)
        wait_for(lambda: "etcd: leading" in a.stdout() or a.poll() is not None, 60, "node1's replica to lead")
        self.assertIsNone(a.poll(), a.describe())
        b = self.replica(2)
        wait_for(lambda: "etcd: following: the leader is" in b.stdout() or b.poll() is not None, 60,
                 "node2's replica to follow")
        endpoints = ["%s:%d" % (self.cluster.addr(n), PORT) for n in (1, 2)]
        self.agents = [self.agent(2, endpoints), self.agent(3, endpoints)]
        started = lambda: glob.glob(os.path.join(self.out, "start-*.json"))  # noqa: E731
        wait_for(lambda: len(started()) == 2, 90, "the first round's workers")
        first_workers = sorted(started())

        self.cluster.cut(1)  # node1 loses etcd (and everyone else)
        wait_for(lambda: "no longer the leader" in a.stdout(), 30, "the cut-off leader to step down")
        wait_for(lambda: "etcd: leading" in b.stdout(), 30, "node2's replica to take over")
        wait_for(lambda: all("resumed generation" in p.stderr() for p in self.agents), 90,
                 "both agents to resume with node2's replica")
        # By its own timer ("the lease was not renewed in time: stepping down before it can
        # expire") or by the election thread's failed renewals, whichever came first.
        self.assertIn("renewed in time", a.stdout())
        wait_for(lambda: ": restored: " in b.stdout(), 30, "node2's replica to restore the round")
        self.assertEqual(sorted(started()), first_workers, "no worker was restarted")

        self.cluster.restore(1)  # back: it must follow, not lead
        wait_for(lambda: "etcd: following: the leader is %s" % endpoints[1] in a.stdout().split("no longer the leader")[-1],
                 60, "node1's replica to follow node2's after it came back")

        open(os.path.join(self.out, "stop"), "w").close()
        for p in self.agents:
            self.assertEqual(p.wait(90), 0, self.describe())

        # The replicas' own logs: leadership never overlaps, and each round line lies in a term of
        # the replica that wrote it.
        logs = {n: p.stdout() for n, p in self.replicas.items()}
        ta, tb = terms(logs[1]), terms(logs[2])
        self.assertEqual(len(ta), 1, logs[1])
        self.assertEqual(len(tb), 1, logs[2])
        self.assertIsNotNone(ta[0][1], "node1's term ended")
        self.assertLess(ta[0][1], tb[0][0], "node1 stopped leading before node2 started:\n%s\n%s" % (logs[1], logs[2]))
        for n, spans in ((1, ta), (2, tb)):
            driven = rounds(logs[n])
            self.assertTrue(driven, "replica %d drove a round:\n%s" % (n, logs[n]))
            for t in driven:
                self.assertTrue(any(s <= t and (e is None or t < e) for s, e in spans),
                                "replica %d drove a round at %s outside its leadership %s" % (n, t, spans))


if __name__ == "__main__":
    unittest.main(verbosity=2)
