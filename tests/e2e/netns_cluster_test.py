"""scripts/netns-cluster: nodes reach each other, cut/restore/crash/down do what they say."""

import sys
import unittest

from cluster import Cluster
from processes import run, wait_for

PYTHON = sys.executable  # the Python ctest runs the tests on (DDPLAUNCH_PYTHON)
PORT = 29555  # each node is a fresh namespace: nothing else listens there

# A TCP echo server that answers each connection once, forever (until killed).
ECHO_SERVER = r"""
import socket, sys
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], int(sys.argv[2]))); s.listen(16)
print("listening", flush=True)
while True:
    c, _ = s.accept()
    c.settimeout(5)
    try:
        c.sendall(c.recv(1024))
    except OSError:
        pass
    c.close()
"""

# Connects with a deadline, sends a line, prints the echo; exit 0 on success, 1 on failure.
ECHO_CLIENT = r"""
import socket, sys
try:
    c = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=float(sys.argv[3]))
    c.settimeout(float(sys.argv[3]))
    c.sendall(b"ping " + sys.argv[1].encode())
    print(c.recv(1024).decode())
except OSError as e:
    print("connect failed: %r" % e); sys.exit(1)
"""


class NetnsClusterTest(unittest.TestCase):
    def setUp(self):
        reason = Cluster.unavailable_reason()
        if reason:
            print("skipped: " + reason, file=sys.stderr)
            self.skipTest(reason)
        self.cluster = Cluster(nodes=3)
        self.addCleanup(self.assert_nothing_left)
        self.addCleanup(self.cluster.down)
        self.cluster.up()

    def assert_nothing_left(self):
        self.assertEqual(self.cluster.namespaces(), [], "namespaces left after down")

    def start_echo(self, node):
        p = self.cluster.spawn(node, [PYTHON, "-c", ECHO_SERVER, self.cluster.addr(node), PORT])
        wait_for(lambda: "listening" in p.stdout() or p.poll() is not None, 10,
                 "echo server in node %s" % node)
        self.assertIsNone(p.poll(), p.describe())
        return p

    def echo(self, from_node, to_node, timeout=2.0):
        return self.cluster.run(from_node, [PYTHON, "-c", ECHO_CLIENT, self.cluster.addr(to_node),
                                            PORT, timeout], timeout=timeout + 10)

    def test_every_node_reaches_every_other_over_tcp(self):
        for node in (1, 2, 3, "head"):
            self.start_echo(node)
        for a in (1, 2, 3, "head"):
            for b in (1, 2, 3, "head"):
                r = self.echo(a, b)
                self.assertEqual(r.returncode, 0, r.describe())
                self.assertIn("ping " + self.cluster.addr(b), r.stdout)

    def test_nodes_have_distinct_addresses_in_the_private_range(self):
        addrs = [self.cluster.addr(n) for n in ("head", 1, 2, 3)]
        self.assertEqual(len(set(addrs)), 4)
        for a in addrs:
            self.assertTrue(a.startswith("10.213.0."), a)

    def test_addresses_outside_the_cluster_are_unreachable(self):
        r = self.cluster.run(1, [PYTHON, "-c", ECHO_CLIENT, "10.213.1.1", PORT, 1.0], timeout=10)
        self.assertEqual(r.returncode, 1, r.describe())
        r = self.cluster.run(1, [PYTHON, "-c", ECHO_CLIENT, "192.0.2.1", PORT, 1.0], timeout=10)
        self.assertEqual(r.returncode, 1, r.describe())
        self.assertIn("unreachable", r.stdout.lower(), r.describe())

    def test_a_cut_node_is_unreachable_until_restored(self):
        self.start_echo(1)
        self.assertEqual(self.echo(2, 1).returncode, 0)
        self.cluster.cut(1)
        r = self.echo(2, 1, timeout=1.0)   # the client gives up within its 1 s deadline
        self.assertEqual(r.returncode, 1, r.describe())
        self.assertFalse(r.timed_out, r.describe())
        r = self.echo(1, "head", timeout=1.0)  # nor can the cut node reach out
        self.assertEqual(r.returncode, 1, r.describe())
        self.assertIn("cut", [line.split()[2] for line in self.cluster.status().splitlines()
                              if self.cluster.ns(1) in line][0])
        self.cluster.restore(1)
        # The link comes back at once; allow a few seconds for the bridge port to forward.
        wait_for(lambda: self.echo(2, 1).returncode == 0, 15, "node1 reachable after restore")
        self.cluster.cut(1)
        self.cluster.cut(1)  # idempotent
        self.cluster.restore(1)
        self.cluster.restore(1)
        wait_for(lambda: self.echo(3, 1).returncode == 0, 15, "node1 reachable after cut+restore twice")

    def test_crash_kills_every_process_in_the_node_and_only_there(self):
        victims = [self.start_echo(2),
                   self.cluster.spawn(2, ["sleep", "300"]),
                   self.cluster.spawn(2, ["sh", "-c", "sleep 300 & sleep 300"])]
        bystander = self.start_echo(3)
        self.cluster.crash(2)
        for p in victims:
            wait_for(lambda: p.poll() is not None, 10, "%s to die" % p.name)
        self.assertEqual(self.cluster.run("head", ["true"], timeout=10).returncode, 0)
        r = processes_in(self.cluster.ns(2))
        self.assertEqual(r, [], "processes left in node2 after crash")
        self.assertIsNone(bystander.poll(), "node3's server died with node2")
        self.assertEqual(self.echo(1, 3).returncode, 0)
        self.cluster.crash(2)  # idempotent: nothing left to kill
        # The node itself survives a crash: a new process can start there at once.
        self.start_echo(2)
        self.assertEqual(self.echo(1, 2).returncode, 0)

    def test_up_is_idempotent_and_down_removes_everything(self):
        self.start_echo(1)
        self.cluster.up()
        self.assertEqual(self.echo(2, 1).returncode, 0)
        self.cluster.spawn(3, ["sleep", "300"])
        self.cluster.down()
        self.assertEqual(self.cluster.namespaces(), [])
        self.cluster.down()  # idempotent
        self.assertIn("down", self.cluster.status())

    def test_bad_input_fails_with_a_clear_error(self):
        r = self.cluster.script("exec", 9, "true", check=False)
        self.assertEqual(r.returncode, 1)
        self.assertIn("does not exist", r.stderr)
        r = self.cluster.script("cut", "nosuchnode", check=False)
        self.assertEqual(r.returncode, 2)
        self.assertIn("bad node 'nosuchnode'", r.stderr)
        r = self.cluster.script("up", 0, check=False)
        self.assertEqual(r.returncode, 2)
        r = self.cluster.script("up", 2, check=False)  # would drop node3: refused
        self.assertEqual(r.returncode, 1)
        self.assertIn("down", r.stderr)


def processes_in(ns):
    r = run(["ip", "netns", "pids", ns], timeout=10).check()
    return [l for l in r.stdout.split() if l.strip()]


if __name__ == "__main__":
    unittest.main(verbosity=2)
