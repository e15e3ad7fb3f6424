"""The network-namespace test cluster (scripts/netns-cluster) for Python tests.

    from cluster import Cluster

    class MyTest(unittest.TestCase):
        def setUp(self):
            reason = Cluster.unavailable_reason()
            if reason:
                self.skipTest(reason)
            self.cluster = Cluster(nodes=3)        # a unique prefix per instance
            self.addCleanup(self.cluster.down)     # torn down even when the test fails
            self.cluster.up()

        def test_x(self):
            head = self.cluster.addr("head")       # 10.213.0.1
            p = self.cluster.spawn("head", [rdzv, "--host", head])   # a processes.Proc
            self.cluster.crash(2)                  # SIGKILL every process in node2

Nodes are ``"head"`` or ``1..N`` (also ``"node2"``). Every call runs the script with a deadline
and raises ``ClusterError`` carrying its output when it fails.
"""

import itertools
import os
import shutil
import subprocess

import processes

__all__ = ["Cluster", "ClusterError", "SCRIPT"]

_SOURCE_DIR = os.environ.get("DDPLAUNCH_SOURCE_DIR") or os.path.abspath(
    os.path.join(os.path.dirname(__file__), "..", ".."))
SCRIPT = os.path.join(_SOURCE_DIR, "scripts", "netns-cluster")
_counter = itertools.count()


class ClusterError(RuntimeError):
    pass


class Cluster:
    """One cluster of namespaces ``<prefix>-head``, ``<prefix>-node1..N`` and ``<prefix>-br``.

    The prefix is unique per instance (pid and a counter), so parallel tests do not clash.
    ``down()`` is idempotent and also runs from ``__exit__``. Not thread-safe."""

    COMMAND_TIMEOUT = 60.0  # seconds for one script call (up of many nodes takes longest)

    def __init__(self, nodes=3, prefix=None):
        self.nodes = nodes
        self.prefix = prefix or "ddpt%d-%d" % (os.getpid(), next(_counter))
        self._spawned = []

    @staticmethod
    def unavailable_reason():
        """None when namespaces can be made here; else why not (for ``skipTest``)."""
        if os.geteuid() != 0:
            return "network-namespace tests need root (run as root, as CI does)"
        if shutil.which("ip") is None and not os.path.exists("/usr/sbin/ip"):
            return "'ip' (iproute2) is not installed"
        try:
            r = subprocess.run(["ip", "netns", "list"], capture_output=True, timeout=10)
        except (OSError, subprocess.TimeoutExpired) as e:
            return "'ip netns' is not usable: %s" % e
        if r.returncode != 0:
            return "'ip netns' is not available: %s" % r.stderr.decode(errors="replace").strip()
        return None

    def script(self, *args, timeout=None, check=True):
        """Runs ``scripts/netns-cluster --prefix P ARGS`` and returns its processes.Result."""
        cmd = [SCRIPT, "--prefix", self.prefix] + [str(a) for a in args]
        result = processes.run(cmd, timeout=timeout or self.COMMAND_TIMEOUT)
        if check and (result.timed_out or result.returncode != 0):
            raise ClusterError(result.describe())
        return result

    def up(self):
        self.script("up", self.nodes)
        return self

    def down(self):
        """Kills what this object spawned, then every process in the cluster; deletes it."""
        for p in self._spawned:
            p.kill()
        self._spawned.clear()
        self.script("down")

    def namespaces(self):
        """This cluster's namespaces that exist now."""
        r = processes.run(["ip", "netns", "list"], timeout=10).check()
        names = [line.split()[0] for line in r.stdout.splitlines() if line.strip()]
        return [n for n in names if n.startswith(self.prefix + "-")]

    def ns(self, node):
        return "%s-head" % self.prefix if str(node) == "head" else "%s-node%s" % (
            self.prefix, str(node).replace("node", ""))

    def addr(self, node):
        return self.script("addr", node).stdout.strip()

    def exec_args(self, node, cmd):
        """The argument list that runs ``cmd`` inside ``node`` (for your own Popen)."""
        return ["ip", "netns", "exec", self.ns(node)] + [str(c) for c in cmd]

    def run(self, node, cmd, timeout, env=None, cwd=None, input=None):
        """Runs ``cmd`` in ``node`` to completion with a deadline; returns processes.Result."""
        return processes.run(self.exec_args(node, cmd), timeout=timeout, env=env, cwd=cwd, input=input)

    def spawn(self, node, cmd, env=None, cwd=None, name=None):
        """Starts ``cmd`` in ``node`` as a processes.Proc; killed by ``down()`` at the latest."""
        p = processes.spawn(self.exec_args(node, cmd), env=env, cwd=cwd,
                            name=name or "%s@%s" % (os.path.basename(str(cmd[0])), node))
        self._spawned.append(p)
        return p

    def crash(self, node):
        """SIGKILLs every process in ``node`` (the script waits until none is left)."""
        self.script("crash", node)

    def cut(self, node):
        self.script("cut", node)

    def restore(self, node):
        self.script("restore", node)

    def blip(self, node, seconds):
        """The node's link down for `seconds`, then up, by one real-time process: a short outage
        stays short on a loaded machine."""
        self.script("blip", node, seconds)

    def status(self):
        return self.script("status").stdout

    def __enter__(self):
        return self.up()

    def __exit__(self, *exc):
        self.down()
        return False
