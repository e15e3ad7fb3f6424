"""A real 3-member etcd cluster on loopback, for the etcd tests.

    from etcd_cluster import EtcdCluster

    with EtcdCluster(members=3) as etcd:      # started and healthy, or EtcdUnavailable / TimeoutError
        etcd.endpoints                      # ["http://127.0.0.1:P", ...] (client URLs)
        etcd.kill(1); etcd.restart(1)       # SIGKILL one member; start it again on its data
        etcd.enable_auth("ddp", "secret")   # root + a user with read-write on keys under "/"
    # every member stopped, its data directory removed

Members listen on free loopback ports only, keep their data in a temporary directory, and are
started in their own process groups (tests/support/processes.py), so a failing test leaves
nothing behind. etcd's default raft timings (100 ms heartbeat, 1 s election): shorter ones risk
spurious elections likely on a loaded 2-core machine.
``EtcdCluster.unavailable_reason()`` says why a test must be skipped (no etcd installed).
"""

import json
import os
import shutil
import signal
import tempfile
import urllib.request

from processes import free_port, run, spawn, wait_for

__all__ = ["EtcdCluster", "EtcdUnavailable"]

ETCD = shutil.which("etcd") or "/usr/bin/etcd"
ETCDCTL = shutil.which("etcdctl") or "/usr/bin/etcdctl"


class EtcdUnavailable(RuntimeError):
    pass


class EtcdCluster:
    def __init__(self, members=3, start_timeout=30.0):
        self.size = members
        self.start_timeout = start_timeout
        self.dir = None
        self.procs = [None] * members
        self.client_ports = []
        self.peer_ports = []
        self.auth = None  # (user, password) once enable_auth ran

    @staticmethod
    def unavailable_reason():
        """None when etcd and etcdctl are installed, else why not (for skipTest)."""
        for tool in (ETCD, ETCDCTL):
            if not os.access(tool, os.X_OK):
                return "%s is not installed (apt-get install etcd-server etcd-client; scripts/setup)" % tool
        return None

    @classmethod
    def started_for(cls, test, members=3):
        """A cluster started for `test` (a unittest.TestCase) and stopped in its cleanup; the test
        is skipped with the reason when etcd is not installed."""
        reason = cls.unavailable_reason()
        if reason:
            test.skipTest(reason)
        cluster = cls(members=members)
        cluster.__enter__()
        test.addCleanup(cluster.__exit__, None, None, None)
        return cluster

    @property
    def endpoints(self):
        return ["http://127.0.0.1:%d" % p for p in self.client_ports]

    def name(self, i):
        return "m%d" % i

    def _initial_cluster(self):
        return ",".join("%s=http://127.0.0.1:%d" % (self.name(i), self.peer_ports[i]) for i in range(self.size))

    def _start_member(self, i):
        data = os.path.join(self.dir, self.name(i))
        cmd = [ETCD, "--name", self.name(i), "--data-dir", data,
               "--listen-client-urls", self.endpoints[i], "--advertise-client-urls", self.endpoints[i],
               "--listen-peer-urls", "http://127.0.0.1:%d" % self.peer_ports[i],
               "--initial-advertise-peer-urls", "http://127.0.0.1:%d" % self.peer_ports[i],
               "--initial-cluster", self._initial_cluster(), "--initial-cluster-state", "new",
               "--initial-cluster-token", os.path.basename(self.dir),
               "--heartbeat-interval", "100", "--election-timeout", "1000",
               "--logger", "zap", "--log-outputs", os.path.join(self.dir, self.name(i) + ".log")]
        self.procs[i] = spawn(cmd, name="etcd-" + self.name(i))

    def healthy(self, i):
        """True when member i answers /health with health true (it has a leader)."""
        try:
            with urllib.request.urlopen(self.endpoints[i] + "/health", timeout=0.5) as r:
                return json.load(r).get("health") in (True, "true")
        except Exception:
            return False

    def leader(self, timeout=None):
        """Index of the member that leads, once every member that answers names the same one
        (/v3/maintenance/status through the JSON gateway); waits for that."""
        def agreed():
            members, leaders = {}, set()
            for i in range(self.size):
                request = urllib.request.Request(self.endpoints[i] + "/v3/maintenance/status", data=b"{}",
                                                 method="POST")
                try:
                    with urllib.request.urlopen(request, timeout=0.5) as r:
                        status = json.load(r)
                except Exception:
                    continue
                members[status["header"]["member_id"]] = i
                leaders.add(status.get("leader"))
            if len(leaders) == 1:
                found = members.get(leaders.pop())
                return None if found is None else [found]
            return None
        return wait_for(agreed, timeout or self.start_timeout, what="the etcd members to agree on a leader")[0]

    def wait_healthy(self, members=None, timeout=None):
        members = range(self.size) if members is None else members
        for i in members:
            wait_for(lambda: self._check_alive(i) and self.healthy(i), timeout or self.start_timeout,
                     what="etcd member %s at %s to be healthy" % (self.name(i), self.endpoints[i]))

    def _check_alive(self, i):
        p = self.procs[i]
        if p is None or p.poll() is not None:
            raise EtcdUnavailable("etcd member %s exited: %s\n%s" % (self.name(i), p.describe() if p else "not started",
                                                                     self.log(i)))
        return True

    def log(self, i):
        try:
            with open(os.path.join(self.dir, self.name(i) + ".log")) as f:
                return f.read()[-4000:]
        except OSError:
            return ""

    def start(self):
        reason = self.unavailable_reason()
        if reason:
            raise EtcdUnavailable(reason)
        self.dir = tempfile.mkdtemp(prefix="ddp-etcd-")
        self.client_ports = [free_port() for _ in range(self.size)]
        self.peer_ports = [free_port() for _ in range(self.size)]
        if len(set(self.client_ports + self.peer_ports)) != 2 * self.size:
            return self._retry_start()
        for i in range(self.size):
            self._start_member(i)
        self.wait_healthy()
        return self

    def _retry_start(self):
        self.stop()
        return self.start()

    def kill(self, i):
        """SIGKILLs member i (its data stays for restart)."""
        p = self.procs[i]
        if p is not None:
            p.kill()

    def stop_member(self, i, sig=signal.SIGSTOP):
        """Freezes member i (SIGSTOP): it keeps its port but answers nothing."""
        if self.procs[i] is not None:
            self.procs[i].signal(sig)

    def restart(self, i, timeout=None):
        """Starts member i again on its data directory and waits until it is healthy."""
        self.kill(i)
        self._start_member(i)
        self.wait_healthy([i], timeout)

    def ctl(self, *args, user=None, timeout=15):
        cmd = [ETCDCTL, "--endpoints", ",".join(self.endpoints)]
        if user:
            cmd += ["--user", user]
        return run(cmd + list(args), timeout=timeout, env=dict(os.environ, ETCDCTL_API="3")).check()

    def enable_auth(self, user, password, root_password="root-pw"):
        """Adds root and `user` (read-write on every key under "/") and turns authentication on."""
        self.ctl("user", "add", "root:" + root_password)
        self.ctl("user", "grant-role", "root", "root")
        self.ctl("role", "add", "ddp-rw")
        self.ctl("role", "grant-permission", "ddp-rw", "--prefix=true", "readwrite", "/")
        self.ctl("user", "add", "%s:%s" % (user, password))
        self.ctl("user", "grant-role", user, "ddp-rw")
        self.ctl("auth", "enable")
        self.auth = (user, password)

    def stop(self):
        for p in self.procs:
            if p is not None:
                p.kill()
        self.procs = [None] * self.size
        if self.dir:
            shutil.rmtree(self.dir, ignore_errors=True)
            self.dir = None

    def __enter__(self):
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc):
        self.stop()
        return False
