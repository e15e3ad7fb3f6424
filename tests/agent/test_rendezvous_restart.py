"""The rendezvous may restart, crash or fail over without stopping a single worker.

Real ddplaunch processes on loopback against real ddp-rendezvous daemons that are SIGKILLed and
started again. Workers are tests/agent/mn_worker.py --loop --no-gloo: each writes a start
record (with its pid and TORCHELASTIC_RESTART_COUNT) and waits for OUT/stop. "No worker was
restarted" is checked by the records: one generation, the same pids, and those pids still
alive right before the stop. Every wait has a deadline; every process is killed in cleanup.
"""

import os
import signal
import sys
import time
import unittest

from ddplaunch_helpers import PYTHON, pid_alive
import processes
from processes import free_port, run, spawn, wait_for
from test_multinode import RENDEZVOUS, WORKER, MultiNodeTestCase

# A lost daemon is seen at once (closed connection); the restore grace period is
# heartbeat_timeout (2 s) after the first resume.
CONF = "heartbeat_interval=0.5,heartbeat_timeout=2,last_call_timeout=1,join_timeout=30"
WORKER_ARGS = ["--loop", "--no-gloo"]
DEADLINE = 60


class RendezvousRestart(MultiNodeTestCase):
    def start_daemon_on(self, port):
        daemon = spawn([RENDEZVOUS, "--host", "127.0.0.1", "--port", str(port)], name="ddp-rendezvous")
        self.addCleanup(daemon.kill)
        wait_for(lambda: processes.port_open(port) or daemon.poll() is not None, 15, "the daemon to listen")
        self.assertIsNone(daemon.poll(), daemon.describe())
        return daemon

    def nodes_on(self, endpoints, n, nnodes=None, conf=CONF, max_restarts=0, nproc=1):
        nodes = []
        for i in range(n):
            args = ["--nnodes=%s" % (nnodes or n), "--nproc_per_node=%d" % nproc, "--rdzv_backend=c10d",
                    "--rdzv_endpoint=%s" % ",".join("127.0.0.1:%d" % p for p in endpoints),
                    "--rdzv_id=%s" % self.job, "--rdzv_conf", conf, "--shutdown_timeout=5",
                    "--max_restarts=%d" % max_restarts, "--python", PYTHON, WORKER, self.out] + WORKER_ARGS
            proc = self.spawn_launch(args, env={"MN_NODE": "n%d" % i})
            proc.node = "n%d" % i
            nodes.append(proc)
        self.nodes = nodes
        return nodes

    def wait_resumed(self, nodes):
        try:
            wait_for(lambda: all("resumed generation" in p.stderr() for p in nodes), DEADLINE,
                     "every agent to resume")
        except TimeoutError as e:
            self.fail("%s\n%s" % (e, self.describe_nodes()))

    def finish_and_check_unchanged(self, nodes, rs):
        """Every original worker still runs, then the job ends with exit 0 and one generation."""
        pids = sorted(r["pid"] for r in rs)
        self.assertTrue(all(pid_alive(p) for p in pids), "a worker was restarted or died: %s" % pids)
        self.stop_workers()
        self.assertEqual(self.wait_exit(nodes, DEADLINE), [0] * len(nodes), self.describe_nodes())
        starts = self.recs("start")
        self.assertEqual(sorted(r["pid"] for r in starts), pids, "no worker was started again")
        self.assertEqual({r["env"]["TORCHELASTIC_RESTART_COUNT"] for r in starts}, {"0"})

    def test_daemon_sigkilled_and_restarted_after_2_s_no_worker_restarts(self):
        port = free_port()
        daemon = self.start_daemon_on(port)
        nodes = self.nodes_on([port], 3)
        gen, rs = self.wait_round(3, kind="start")
        daemon.signal(signal.SIGKILL)
        daemon.wait(10)
        time.sleep(2.0)  # the scenario: the daemon is away for 2 s (nothing asserted on time)
        back = time.monotonic()
        self.start_daemon_on(port)
        self.wait_resumed(nodes)
        print("\n[rendezvous-restart] daemon back -> 3 agents resumed: observed within %.2f s"
              % (time.monotonic() - back), file=sys.stderr)
        status = run([RENDEZVOUS, "status", "--endpoint", "127.0.0.1:%d" % port], timeout=20)
        self.assertEqual(status.returncode, 0, status.describe())
        self.assertIn("rebuilt from its agents' resumes", status.stdout, status.describe())
        for p in nodes:
            # The loss is said once, in the agent's own voice; later lines count the attempts.
            self.assertEqual(p.stderr().count("lost the rendezvous"), 1, p.describe())
            self.assertNotIn("[ddplaunch]", p.stderr(), p.describe())
        self.finish_and_check_unchanged(nodes, rs)

    def test_daemon_back_after_reconnect_timeout_every_node_exits_3_and_no_worker_survives(self):
        port = free_port()
        daemon = self.start_daemon_on(port)
        nodes = self.nodes_on([port], 3, conf=CONF + ",reconnect_timeout=3")
        gen, rs = self.wait_round(3, kind="start")
        daemon.signal(signal.SIGKILL)
        daemon.wait(10)
        codes = self.wait_exit(nodes, DEADLINE)
        self.assertEqual(codes, [3, 3, 3], self.describe_nodes())
        for p in nodes:
            self.assertIn("reconnect_timeout", p.stderr(), p.describe())
            self.assertIn("127.0.0.1:%d" % port, p.stderr(), p.describe())
        wait_for(lambda: not any(pid_alive(r["pid"]) for r in rs), 10, "every worker to be gone")
        # Coming back afterwards finds nobody to resume.
        self.start_daemon_on(port)

    def test_agents_fail_over_to_a_standby_daemon_while_the_first_stays_dead(self):
        p1, p2 = free_port(), free_port()
        first = self.start_daemon_on(p1)
        self.start_daemon_on(p2)
        nodes = self.nodes_on([p1, p2], 2)
        gen, rs = self.wait_round(2, kind="start")
        first.signal(signal.SIGKILL)
        first.wait(10)
        self.wait_resumed(nodes)
        for p in nodes:
            self.assertIn("at 127.0.0.1:%d" % p2, p.stderr(), p.describe())
        self.finish_and_check_unchanged(nodes, rs)

    def test_a_worker_killed_while_the_daemon_is_down_is_counted_exactly_once(self):
        port = free_port()
        daemon = self.start_daemon_on(port)
        nodes = self.nodes_on([port], 2, max_restarts=3)
        gen, rs = self.wait_round(2, kind="start")
        daemon.signal(signal.SIGKILL)
        daemon.wait(10)
        victim = rs[0]["pid"]
        os.kill(victim, signal.SIGKILL)
        wait_for(lambda: all("stopped the other workers" in p.stderr() or "was killed" in p.stderr()
                             for p in nodes if p.node == rs[0]["env"]["MN_NODE"]), DEADLINE,
                 "the agent to see its worker die")
        self.start_daemon_on(port)
        gen2, rs2 = self.wait_round(2, kind="start", after_gen=gen)
        self.assertEqual({r["env"]["TORCHELASTIC_RESTART_COUNT"] for r in rs2}, {"1"}, rs2)
        self.stop_workers()
        self.assertEqual(self.wait_exit(nodes, DEADLINE), [0, 0], self.describe_nodes())
        gens = self.by_generation("start")
        self.assertEqual(len(gens), 2, "exactly one restart: %s" % sorted(gens))

    def test_a_node_crashed_while_the_daemon_is_down_leaves_a_smaller_round(self):
        port = free_port()
        daemon = self.start_daemon_on(port)
        nodes = self.nodes_on([port], 3, nnodes="2:3")
        gen, rs = self.wait_round(3, kind="start")
        daemon.signal(signal.SIGKILL)
        daemon.wait(10)
        crashed = nodes[2]
        crashed.signal(signal.SIGKILL)
        crashed.wait(10)
        self.start_daemon_on(port)
        gen2, rs2 = self.wait_round(2, kind="start", after_gen=gen)
        self.assertEqual({r["env"]["MN_NODE"] for r in rs2}, {"n0", "n1"})
        self.assertEqual({r["env"]["TORCHELASTIC_RESTART_COUNT"] for r in rs2}, {"0"}, "a lost node is not counted")
        self.stop_workers()
        self.assertEqual(self.wait_exit(nodes[:2], DEADLINE), [0, 0], self.describe_nodes())

    def test_when_the_hosting_agent_dies_the_survivors_resume_at_the_next_endpoint(self):
        # No daemon: the first agent hosts the server on p1, the second a standby on p2.
        p1, p2 = free_port(), free_port()
        nodes = []
        nodes += self.nodes_on([p1, p2], 1, nnodes="2:3")
        wait_for(lambda: processes.port_open(p1), 15, "the first agent to host the rendezvous")
        second = self.nodes_on([p1, p2], 1, nnodes="2:3")[0]
        wait_for(lambda: processes.port_open(p2), 15, "the second agent to host a standby")
        third = self.nodes_on([p1, p2], 1, nnodes="2:3")[0]
        second.node, third.node = "n1", "n2"
        self.nodes = nodes + [second, third]
        # (MN_NODE is n0 for all three: tell them apart by their agents' pids below.)
        gen, rs = self.wait_round(3, kind="start")
        host = nodes[0]
        host.signal(signal.SIGKILL)
        host.wait(10)
        gen2, rs2 = self.wait_round(2, kind="start", after_gen=gen)
        self.assertEqual({r["env"]["TORCHELASTIC_RESTART_COUNT"] for r in rs2}, {"0"})
        self.stop_workers()
        self.assertEqual(self.wait_exit([second, third], DEADLINE), [0, 0], self.describe_nodes())
        for p in (second, third):
            self.assertIn("127.0.0.1:%d" % p2, p.stderr(), p.describe())


if __name__ == "__main__":
    unittest.main(verbosity=2)
