"""Replicated ddp-rendezvous daemons on a real 3-member etcd cluster (loopback).

Three replicas (`ddp-rendezvous --etcd=...`) elect one leader; followers answer agents with
not_leader naming it, and agents go there at once. When the leader is SIGKILLed, a follower
takes over once its lease expires (TTL 2 s here) and the agents resume with it: no worker is
restarted (the records of tests/agent/mn_worker.py: one generation, the same pids, alive until
the stop). Every wait has a deadline; etcd members, replicas and agents are killed in cleanup.
"""

import json
import os
import signal
import sys
import time
import unittest
import uuid

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "support"))

import processes
import test_rendezvous_restart as restart
from ddplaunch_helpers import pid_alive
from etcd_cluster import EtcdCluster
from processes import free_port, run, spawn, wait_for
from test_multinode import RENDEZVOUS, MultiNodeTestCase

TTL = 2


class EtcdFailover(MultiNodeTestCase):
    # The agents and checks of the single-daemon restart tests.
    nodes_on = restart.RendezvousRestart.nodes_on
    wait_resumed = restart.RendezvousRestart.wait_resumed
    finish_and_check_unchanged = restart.RendezvousRestart.finish_and_check_unchanged

    def setUp(self):
        super().setUp()
        self.start_etcd()

    def start_etcd(self):
        """A 3-member cluster stopped in cleanup, and a prefix of this test's own (skipped without etcd)."""
        self.etcd = EtcdCluster.started_for(self)
        self.prefix = "/ddp-test-%s/" % uuid.uuid4().hex[:8]

    def start_replicas(self, n=3, extra=(), ttl=TTL):
        ports, procs = [free_port() for _ in range(n)], []
        for port in ports:
            p = spawn([RENDEZVOUS, "--host", "127.0.0.1", "--port", str(port), "--etcd", ",".join(self.etcd.endpoints),
                       "--etcd_lease_ttl", str(ttl), "--etcd_prefix", self.prefix] + list(extra),
                      name="replica-%d" % port)
            self.addCleanup(p.kill)
            procs.append(p)
        for port, p in zip(ports, procs):
            wait_for(lambda: processes.port_open(port) or p.poll() is not None, 15, "replica %d to listen" % port)
            self.assertIsNone(p.poll(), p.describe())
        self.replicas = {**getattr(self, "replicas", {}), **dict(zip(ports, procs))}
        return ports

    def replica_view(self, port):
        r = run([RENDEZVOUS, "status", "--endpoint", "127.0.0.1:%d" % port, "--json", "--timeout", "3"], timeout=10)
        if r.returncode != 0:
            return None
        return json.loads(r.stdout)

    def agreed_leader(self, ports):
        """The port every live replica agrees leads (one leading, the others naming it), else None."""
        views = {p: self.replica_view(p) for p in ports}
        if any(v is None for v in views.values()):
            return None
        leading = [p for p, v in views.items() if v["replica"]["leading"]]
        if len(leading) != 1:
            return None
        name = "127.0.0.1:%d" % leading[0]
        if all(v["replica"]["leader"] == name for p, v in views.items() if p != leading[0]):
            return leading[0]
        return None

    def wait_leader(self, ports):
        try:
            return wait_for(lambda: self.agreed_leader(ports), 30, "one leader that every replica names")
        except TimeoutError as e:
            self.fail("%s\n%s" % (e, "\n".join(p.describe() for p in self.replicas.values())))

    def test_exactly_one_replica_leads_and_the_followers_name_it(self):
        ports = self.start_replicas()
        leader = self.wait_leader(ports)
        out = self.replicas[leader].stdout()
        self.assertIn("etcd: leading", out)
        for port in ports:
            if port != leader:
                self.assertIn("following: the leader is 127.0.0.1:%d" % leader, self.replicas[port].stdout())

    def test_a_malformed_leader_key_in_etcd_is_never_passed_to_agents(self):
        # Someone with write access to etcd puts garbage under the leader key (no lease: it stays).
        self.etcd.ctl("put", self.prefix + "leader", "evil\nhost:1")
        ports = self.start_replicas(1)
        proc = self.replicas[ports[0]]
        wait_for(lambda: "does not hold a HOST:PORT" in proc.stdout(), 20, "the bad value to be reported")
        view = self.replica_view(ports[0])
        self.assertEqual(view["replica"], {"leading": False, "leader": ""}, view)
        # An agent told "no leader" keeps trying (a failed attempt) instead of failing on a bad message.
        nodes = self.nodes_on(ports, 1, conf=restart.CONF + ",reconnect_timeout=3")
        self.etcd.ctl("del", self.prefix + "leader")
        self.wait_round(1, kind="start")
        self.stop_workers()
        self.assertEqual(self.wait_exit(nodes, 60), [0], self.describe_nodes())

    def test_bad_replica_flags_exit_2_and_say_what_is_wrong(self):
        etcd = ",".join(self.etcd.endpoints)
        cases = [(["--etcd", "ftp://127.0.0.1:2379"], "only http:// and https://"),
                 (["--etcd", "http://127.0.0.1:99999"], "expected http://HOST:PORT"),
                 (["--etcd", etcd, "--etcd_lease_ttl", "1"], "--etcd_lease_ttl"),
                 (["--etcd", etcd, "--etcd_user", "u"], "--etcd_password_file"),
                 (["--etcd", etcd, "--etcd_user", "u", "--etcd_password_file", "/nonexistent/pw"], "cannot read"),
                 (["--etcd", etcd, "--advertise", "no-port"], "--advertise")]
        for args, words in cases:
            r = run([RENDEZVOUS, "--host", "127.0.0.1", "--port", "0"] + args, timeout=20)
            self.assertEqual(r.returncode, 2, r.describe())
            self.assertIn(words, r.stderr, r.describe())

    def test_replicas_authenticate_as_an_etcd_user_and_a_wrong_password_never_leads(self):
        self.etcd.enable_auth("ddp", "replica-secret")
        good = os.path.join(self.out, "etcd-password")
        with open(good, "w") as f:
            f.write("replica-secret\n")
        bad = os.path.join(self.out, "etcd-wrong-password")
        with open(bad, "w") as f:
            f.write("guess\n")
        ports = self.start_replicas(2, extra=["--etcd_user", "ddp", "--etcd_password_file", good])
        leader = self.wait_leader(ports)
        [intruder] = self.start_replicas(1, extra=["--etcd_user", "ddp", "--etcd_password_file", bad])
        proc = self.replicas[intruder]
        wait_for(lambda: "authentication failed" in proc.stdout(), 20, "the wrong password to be reported")
        view = self.replica_view(intruder)
        self.assertFalse(view["replica"]["leading"], view)
        self.assertEqual(self.agreed_leader(ports), leader)

    def test_leader_sigkilled_the_job_resumes_with_the_new_leader_and_no_worker_restarts(self):
        ports = self.start_replicas()
        leader = self.wait_leader(ports)
        followers = [p for p in ports if p != leader]
        # Followers first: every agent is redirected to the leader at its first connection.
        nodes = self.nodes_on(followers + [leader], 2)
        gen, rs = self.wait_round(2, kind="start")
        for p in nodes:
            self.assertIn("is a follower replica; the leader is 127.0.0.1:%d: going there" % leader, p.stderr(),
                          p.describe())
        self.replicas[leader].signal(signal.SIGKILL)
        self.replicas[leader].wait(10)
        killed = time.monotonic()
        new_leader = self.wait_leader(followers)
        self.wait_resumed(nodes)
        print("\n[etcd-failover] leader SIGKILL -> every agent resumed with the new leader: observed within %.2f s "
              "(lease TTL %d s)" % (time.monotonic() - killed, TTL), file=sys.stderr)
        for p in nodes:
            self.assertRegex(p.stderr(), r"resumed generation \d+ .* at 127\.0\.0\.1:%d" % new_leader)
        view = self.replica_view(new_leader)
        self.assertEqual([j["job_id"] for j in view["jobs"]], [self.job], view)
        # Status on any replica names the new leader.
        follower = next(p for p in followers if p != new_leader)
        text = run([RENDEZVOUS, "status", "--endpoint", "127.0.0.1:%d" % follower], timeout=10)
        self.assertIn("replica: following; the leader is 127.0.0.1:%d" % new_leader, text.stdout, text.describe())
        text = run([RENDEZVOUS, "status", "--endpoint", "127.0.0.1:%d" % new_leader], timeout=10)
        self.assertIn("replica: leading", text.stdout, text.describe())
        self.finish_and_check_unchanged(nodes, rs)

    def test_an_etcd_member_killed_changes_nothing_for_the_job(self):
        # TTL 5 s (the default): the member killed may be etcd's raft leader, and the lease must
        # outlast etcd's own re-election (a TTL of 2 s leaves the leader 1.5 s to renew).
        ttl = 5
        ports = self.start_replicas(ttl=ttl)
        leader = self.wait_leader(ports)
        nodes = self.nodes_on([leader], 2)
        gen, rs = self.wait_round(2, kind="start")
        self.etcd.kill(0)  # the member every replica asks first
        time.sleep(1.5 * ttl)  # the scenario: a member down longer than a lease's life (nothing asserted on time)
        self.assertEqual(self.agreed_leader(ports), leader)
        out = self.replicas[leader].stdout()
        self.assertEqual(out.count("etcd: leading"), 1, out)
        self.assertNotIn("no longer the leader", out)
        for p in nodes:
            self.assertNotIn("lost the rendezvous", p.stderr(), p.describe())
        self.finish_and_check_unchanged(nodes, rs)

    def test_quorum_lost_the_leader_stops_serving_the_workers_wait_and_the_job_goes_on(self):
        ports = self.start_replicas()
        leader = self.wait_leader(ports)
        nodes = self.nodes_on(ports, 2)
        gen, rs = self.wait_round(2, kind="start")
        self.etcd.kill(0)
        self.etcd.kill(1)
        wait_for(lambda: "stepping down before it can expire" in self.replicas[leader].stdout(), 30,
                 "the leader to stop serving without quorum")
        wait_for(lambda: all("lost the rendezvous" in p.stderr() for p in nodes), 30, "the agents to notice")
        self.assertTrue(all(pid_alive(r["pid"]) for r in rs), "the workers keep running")
        self.etcd.restart(0)
        self.etcd.restart(1)
        self.wait_leader(ports)
        self.wait_resumed(nodes)
        self.finish_and_check_unchanged(nodes, rs)


if __name__ == "__main__":
    unittest.main(verbosity=2)
