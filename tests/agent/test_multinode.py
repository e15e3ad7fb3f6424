"""Multi-node jobs on loopback ("Checked by": loopback tests): several real ddplaunch
processes on one machine join one ddp-rendezvous daemon on 127.0.0.1 and form one job.

Every worker is tests/agent/mn_worker.py: it records its environment (start-*.json), joins the
Gloo group and all-reduces (done-*.json), then exits or waits for OUT/stop. Every process is
killed in cleanup; every wait has a deadline; durations are printed, and only the issue's
promises (detection at once rather than after a collective timeout) are asserted, with margin.
"""

import json
import os
import signal
import socket
import sys
import time
import unittest

from ddplaunch_helpers import BUILD_DIR, PYTHON, LaunchTestCase, pid_alive
import processes
from processes import free_port, spawn, wait_for

RENDEZVOUS = os.path.join(BUILD_DIR, "bin", "ddp-rendezvous")
WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "mn_worker.py")
# Short deadlines for tests: a silent node is lost after 2 s; the first round waits 1 s for more.
CONF = "heartbeat_interval=0.5,heartbeat_timeout=2,last_call_timeout=1,join_timeout=30"
JOB_DEADLINE = 90  # seconds any one job may take here (2 shared cores, torch imports)


class MultiNodeTestCase(LaunchTestCase):
    """A daemon on a free loopback port and helpers to start ddplaunch "nodes" against it."""

    def setUp(self):
        super().setUp()
        if not os.path.exists(RENDEZVOUS):
            self.fail("ddp-rendezvous not built: %s" % RENDEZVOUS)
        self.job = "mn-%s" % self.id().rsplit(".", 1)[-1]
        self.port = None

    def start_daemon(self, extra=()):
        self.port = free_port()
        daemon = spawn([RENDEZVOUS, "--host", "127.0.0.1", "--port", str(self.port)] + list(extra),
                       name="ddp-rendezvous")
        self.addCleanup(daemon.kill)
        # Agents started before the daemon listens would host the server themselves.
        wait_for(lambda: processes.port_open(self.port) or daemon.poll() is not None, 15, "the daemon to listen")
        self.assertIsNone(daemon.poll(), daemon.describe())
        self.daemon = daemon
        return daemon

    def node_args(self, nnodes, nproc=2, conf=CONF, worker_args=(), extra=(), max_restarts=0):
        return (["--nnodes=%s" % nnodes, "--nproc_per_node=%d" % nproc, "--rdzv_backend=c10d",
                 "--rdzv_endpoint=127.0.0.1:%d" % self.port, "--rdzv_id=%s" % self.job,
                 "--rdzv_conf", conf, "--shutdown_timeout=5", "--max_restarts=%d" % max_restarts]
                + list(extra) + ["--python", PYTHON, WORKER, self.out] + list(worker_args))

    def start_node(self, name, nnodes, nproc=2, conf=CONF, worker_args=(), extra=(), max_restarts=0,
                   env=None):
        args = self.node_args(nnodes, nproc, conf, worker_args, extra, max_restarts)
        proc = self.spawn_launch(args, env=dict(env or {}, MN_NODE=name))
        proc.node = name
        return proc

    def recs(self, kind):
        """Every record of `kind` ("start" or "done") written so far, as dicts."""
        out = []
        for name in os.listdir(self.out):
            if name.startswith(kind + "-") and name.endswith(".json"):
                with open(os.path.join(self.out, name)) as f:
                    rec = json.load(f)
                rec["file_time"] = os.stat(os.path.join(self.out, name)).st_mtime
                out.append(rec)
        return out

    def by_generation(self, kind):
        gens = {}
        for r in self.recs(kind):
            gens.setdefault(int(r["env"]["DDPLAUNCH_GENERATION"]), []).append(r)
        return gens

    def wait_round(self, world, kind="done", after_gen=-1, timeout=JOB_DEADLINE):
        """Waits for a generation > after_gen where all `world` workers wrote `kind` with WORLD_SIZE
        == world; returns (generation, records)."""
        def ready():
            for gen, rs in sorted(self.by_generation(kind).items()):
                if gen > after_gen and len(rs) == world and all(
                        int(r["env"]["WORLD_SIZE"]) == world for r in rs):
                    return gen, rs
            return None
        try:
            return wait_for(ready, timeout, "a round of %d workers (%s records)" % (world, kind))
        except TimeoutError as e:
            raise AssertionError("%s\nrecords: %s\n%s" % (e, sorted(
                (int(r["env"]["DDPLAUNCH_GENERATION"]), r["env"]["WORLD_SIZE"], r["env"]["RANK"],
                 r["env"]["MN_NODE"]) for r in self.recs(kind)), self.describe_nodes()))

    def describe_nodes(self):
        return "\n".join(p.describe() for p in getattr(self, "nodes", []))

    def wait_exit(self, procs, timeout=JOB_DEADLINE):
        try:
            return processes.wait_all(procs, timeout)
        except TimeoutError as e:
            self.fail("%s\n%s" % (e, self.describe_nodes()))

    def stop_workers(self):
        with open(os.path.join(self.out, "stop"), "w"):
            pass

    def check_round(self, rs, nodes, nproc):
        """One round's records describe one consistent job of `nodes` x `nproc` workers."""
        world = nodes * nproc
        envs = [r["env"] for r in rs]
        self.assertEqual(sorted(int(e["RANK"]) for e in envs), list(range(world)), envs)
        self.assertEqual({e["WORLD_SIZE"] for e in envs}, {str(world)})
        self.assertEqual({e["GROUP_WORLD_SIZE"] for e in envs}, {str(nodes)})
        self.assertEqual({e["LOCAL_WORLD_SIZE"] for e in envs}, {str(nproc)})
        self.assertEqual(len({(e["MASTER_ADDR"], e["MASTER_PORT"]) for e in envs}), 1, envs)
        self.assertEqual(len({e["DDPLAUNCH_GENERATION"] for e in envs}), 1, envs)
        self.assertEqual(len({e["TORCHELASTIC_RESTART_COUNT"] for e in envs}), 1, envs)
        per_node = {}
        for e in envs:
            per_node.setdefault(e["MN_NODE"], []).append(e)
        self.assertEqual(len(per_node), nodes, envs)
        group_ranks = set()
        for node, es in per_node.items():
            self.assertEqual(len({e["GROUP_RANK"] for e in es}), 1, "one group rank per node: %s" % es)
            group_ranks.add(int(es[0]["GROUP_RANK"]))
            self.assertEqual(sorted(int(e["LOCAL_RANK"]) for e in es), list(range(nproc)))
            offsets = {int(e["RANK"]) - int(e["LOCAL_RANK"]) for e in es}
            self.assertEqual(len(offsets), 1, "RANK = offset + LOCAL_RANK on %s: %s" % (node, es))
        self.assertEqual(sorted(group_ranks), list(range(nodes)))
        if "sum" in rs[0]:
            for r in rs:
                self.assertEqual(r["sum"], r["expected"], "Gloo all-reduce: %s" % r)


class JobFormation(MultiNodeTestCase):
    def form_job(self, nodes):
        self.start_daemon()
        self.nodes = [self.start_node("n%d" % i, "%d" % nodes) for i in range(nodes)]
        codes = self.wait_exit(self.nodes)
        self.assertEqual(codes, [0] * nodes, self.describe_nodes())
        gens = self.by_generation("done")
        self.assertEqual(len(gens), 1, "one round, no restarts: %s" % sorted(gens))
        (gen, rs), = gens.items()
        self.check_round(rs, nodes, 2)
        self.assertEqual(rs[0]["env"]["TORCHELASTIC_RESTART_COUNT"], "0")

    def test_two_ddplaunch_processes_form_one_job_with_a_working_gloo_group(self):
        self.form_job(2)

    def test_three_ddplaunch_processes_form_one_job_with_a_working_gloo_group(self):
        self.form_job(3)

    def test_four_ddplaunch_processes_form_one_job_with_a_working_gloo_group(self):
        self.form_job(4)


class LostNode(MultiNodeTestCase):
    def test_sigkill_of_one_agent_restarts_the_others_at_once_at_the_smaller_size(self):
        self.start_daemon()
        # heartbeat_timeout=30: a restart within seconds can only come from the closed connection.
        conf = "heartbeat_interval=1,heartbeat_timeout=30,last_call_timeout=1,join_timeout=30"
        self.nodes = [self.start_node("n%d" % i, "2:3", conf=conf, worker_args=["--loop"]) for i in range(3)]
        gen, rs = self.wait_round(6)
        self.check_round(rs, 3, 2)
        # Kill the node holding group rank 0 (its workers host the Gloo store: the hardest case).
        victim_name = next(r["env"]["MN_NODE"] for r in rs if r["env"]["RANK"] == "0")
        victim = next(p for p in self.nodes if p.node == victim_name)
        victim_workers = [r["pid"] for r in rs if r["env"]["MN_NODE"] == victim_name]
        survivors = [p for p in self.nodes if p is not victim]
        killed_at = time.time()
        os.kill(victim.pid, signal.SIGKILL)

        gen2, rs2 = self.wait_round(4, kind="start", after_gen=gen)
        restarted = min(r["time"] for r in rs2) - killed_at
        print("\n[multinode] SIGKILL of an agent -> first survivor worker started: %.3f s" % restarted,
              file=sys.stderr)
        # Detected through the closed connection at once (issue: within 1 s; asserted with margin
        # for a loaded 2-core machine), not after heartbeat_timeout or a collective timeout.
        self.assertLess(restarted, 5.0, "the survivors restarted late")
        gen2, rs2 = self.wait_round(4, kind="done", after_gen=gen)
        self.check_round(rs2, 2, 2)
        self.assertEqual({r["env"]["MN_NODE"] for r in rs2}, {p.node for p in survivors})
        # A lost node is a membership change, not a counted restart.
        self.assertEqual({r["env"]["TORCHELASTIC_RESTART_COUNT"] for r in rs2}, {"0"})
        # The survivors stopped their old workers before starting the new ones.
        old_survivor_workers = [r["pid"] for r in rs if r["env"]["MN_NODE"] != victim_name]
        self.assertFalse([p for p in old_survivor_workers if pid_alive(p)], "old workers still running")
        # No worker of the killed agent survives it (parent-death signal).
        wait_for(lambda: not any(pid_alive(p) for p in victim_workers), 10,
                 "the killed agent's workers to die")
        self.stop_workers()
        self.assertEqual(self.wait_exit(survivors), [0, 0], self.describe_nodes())
        self.assertIn("restarting the workers", survivors[0].stderr())

    def test_a_live_agent_dropped_for_silence_rejoins_when_it_wakes(self):
        # An agent that stalls past heartbeat_timeout (SIGSTOP here; a starved machine in real
        # life) is dropped by the daemon, which restarts the others without it. When it runs
        # again it hears the drop: it must rejoin like a node that lost its connection, not end
        # the job as if it had been refused (it used to exit 3 "refused: dropped by the ...").
        self.start_daemon()
        worker = ["--loop", "--no-gloo"]
        self.nodes = [self.start_node("n%d" % i, "1:2", nproc=1, worker_args=worker, max_restarts=1)
                      for i in range(2)]
        gen, rs = self.wait_round(2)
        survivor, sleeper = self.nodes
        sleeper_worker = next(r["pid"] for r in rs if r["env"]["MN_NODE"] == sleeper.node)
        os.kill(sleeper.pid, signal.SIGSTOP)
        try:
            gen2, rs2 = self.wait_round(1, kind="start", after_gen=gen)
            self.assertEqual([r["env"]["MN_NODE"] for r in rs2], [survivor.node])
            self.assertIn("no heartbeat", self.daemon.output())
        finally:
            os.kill(sleeper.pid, signal.SIGCONT)
        gen3, rs3 = self.wait_round(2, kind="start", after_gen=gen2)
        self.check_round(rs3, 2, 1)
        self.assertFalse(pid_alive(sleeper_worker), "the woken agent stopped its old worker first")
        self.assertIn("dropped this node", sleeper.stderr(), sleeper.describe())
        # Neither a lost node nor a newcomer is a counted restart.
        self.assertEqual({r["env"]["TORCHELASTIC_RESTART_COUNT"] for r in rs3}, {"0"})
        self.stop_workers()
        self.assertEqual(self.wait_exit(self.nodes), [0, 0], self.describe_nodes())

    def test_survivors_below_min_nodes_wait_until_join_timeout_then_exit_3(self):
        self.start_daemon()
        conf = "heartbeat_interval=0.5,heartbeat_timeout=2,last_call_timeout=1,join_timeout=3"
        worker = ["--loop", "--no-gloo"]
        self.nodes = [self.start_node("n%d" % i, "2:3", nproc=1, conf=conf, worker_args=worker)
                      for i in range(2)]
        gen, rs = self.wait_round(2)
        victim, survivor = self.nodes
        os.kill(victim.pid, signal.SIGKILL)
        killed_at = time.monotonic()
        code = self.wait_exit([survivor], timeout=60)[0]
        print("\n[multinode] 1 of MIN 2 nodes left: survivor exited %d after %.2f s (join_timeout 3 s)"
              % (code, time.monotonic() - killed_at), file=sys.stderr)
        self.assertEqual(code, 3, survivor.describe())
        self.assertIn("join_timeout", survivor.stderr(), survivor.describe())
        survivor_workers = [r["pid"] for r in rs if r["env"]["MN_NODE"] == survivor.node]
        self.assertFalse(any(pid_alive(p) for p in survivor_workers), "the survivor stopped its workers")
        self.assertFalse([r for r in self.recs("start") if int(r["env"]["DDPLAUNCH_GENERATION"]) > gen],
                         "no round below MIN nodes")


class SharedRestartBudget(MultiNodeTestCase):
    def test_a_failing_worker_on_one_node_restarts_every_node_and_spends_one_shared_budget(self):
        self.start_daemon()
        worker = ["--loop", "--no-gloo", "--fail-if-env", "MN_FAIL"]
        # Node n0's local rank 0 fails on every attempt (MN_FAIL reaches its workers' environment).
        self.nodes = [self.start_node("n0", "2", nproc=1, worker_args=worker, max_restarts=2,
                                      env={"MN_FAIL": "1"}),
                      self.start_node("n1", "2", nproc=1, worker_args=worker, max_restarts=2)]
        codes = self.wait_exit(self.nodes)
        self.assertEqual(codes, [1, 1], self.describe_nodes())
        # Start records: the failing worker waits until every worker of its round has started, but
        # the others may be stopped before they write their "done" record.
        gens = self.by_generation("start")
        counts = []
        for gen, rs in sorted(gens.items()):
            self.check_round(rs, 2, 1)
            counts.append(rs[0]["env"]["TORCHELASTIC_RESTART_COUNT"])
        self.assertEqual(counts, ["0", "1", "2"], "one shared restart count per round")
        failing = [r for r in gens[max(gens)]
                   if r["env"]["MN_NODE"] == "n0" and r["env"]["LOCAL_RANK"] == "0"]
        failing_rank = failing[0]["env"]["RANK"]
        host = socket.gethostname()
        for p in self.nodes:
            err = p.stderr()
            self.assertIn("host      : %s" % host, err, p.describe())
            self.assertRegex(err, r"rank      : %s \(local_rank: 0\)" % failing_rank, p.describe())
            self.assertIn("exitcode  : 7", err, p.describe())


class LateNode(MultiNodeTestCase):
    def test_a_late_node_is_absorbed_in_a_new_round_without_counting_a_restart(self):
        self.start_daemon()
        self.nodes = [self.start_node("n%d" % i, "2:3", worker_args=["--loop"], max_restarts=1)
                      for i in range(2)]
        gen, rs = self.wait_round(4)
        self.check_round(rs, 2, 2)
        self.nodes.append(self.start_node("n2", "2:3", worker_args=["--loop"], max_restarts=1))
        gen2, rs2 = self.wait_round(6, after_gen=gen)
        self.check_round(rs2, 3, 2)
        self.assertEqual({r["env"]["TORCHELASTIC_RESTART_COUNT"] for r in rs + rs2}, {"0"})
        # The old nodes keep their group ranks; the newcomer takes the next one.
        old = {r["env"]["MN_NODE"]: r["env"]["GROUP_RANK"] for r in rs}
        new = {r["env"]["MN_NODE"]: r["env"]["GROUP_RANK"] for r in rs2}
        for node, grank in old.items():
            self.assertEqual(new[node], grank)
        self.assertEqual(new["n2"], "2")
        self.stop_workers()
        self.assertEqual(self.wait_exit(self.nodes), [0, 0, 0], self.describe_nodes())

    def test_a_node_beyond_max_waits_as_a_standby_and_replaces_a_lost_node(self):
        self.start_daemon()
        worker = ["--loop", "--no-gloo"]
        self.nodes = [self.start_node("n%d" % i, "1:2", nproc=1, worker_args=worker) for i in range(2)]
        gen, rs = self.wait_round(2)
        standby = self.start_node("n2", "1:2", nproc=1, worker_args=worker)
        self.nodes.append(standby)
        wait_for(lambda: "is a spare: the round runs at MAX nodes" in self.daemon.output()
                 or standby.poll() is not None, 30, "the third node to be a spare")
        self.assertIsNone(standby.poll(), standby.describe())
        self.assertFalse([r for r in self.recs("start") if r["env"]["MN_NODE"] == "n2"],
                         "a standby starts no workers while the job runs at MAX")
        victim = self.nodes[0]
        os.kill(victim.pid, signal.SIGKILL)
        gen2, rs2 = self.wait_round(2, after_gen=gen)
        self.check_round(rs2, 2, 1)
        self.assertEqual({r["env"]["MN_NODE"] for r in rs2}, {"n1", "n2"})
        self.assertEqual({r["env"]["TORCHELASTIC_RESTART_COUNT"] for r in rs2}, {"0"})
        self.stop_workers()
        self.assertEqual(self.wait_exit(self.nodes[1:]), [0, 0], self.describe_nodes())


class OptionsAndRefusals(MultiNodeTestCase):
    def test_node_rank_is_honoured_with_c10d(self):
        self.start_daemon()
        # The node that asks for group rank 1 joins first: it still gets 1.
        first = self.start_node("asks1", "2", nproc=1, worker_args=["--no-gloo"], extra=["--node_rank=1"])
        wait_for(lambda: ": join " in self.daemon.output() or first.poll() is not None, 30,
                 "the first node to join")
        self.assertIsNone(first.poll(), first.describe())
        second = self.start_node("asks0", "2", nproc=1, worker_args=["--no-gloo"], extra=["--node_rank=0"])
        self.nodes = [first, second]
        self.assertEqual(self.wait_exit(self.nodes), [0, 0], self.describe_nodes())
        (gen, rs), = self.by_generation("done").items()
        self.check_round(rs, 2, 1)
        ranks = {r["env"]["MN_NODE"]: r["env"]["GROUP_RANK"] for r in rs}
        self.assertEqual(ranks, {"asks1": "1", "asks0": "0"})

    def test_the_first_agent_hosts_the_server_when_the_local_endpoint_is_free(self):
        self.port = free_port()  # no daemon: the first ddplaunch binds it, the second joins it
        first = self.start_node("host", "2", nproc=1)
        wait_for(lambda: "hosting the rendezvous server" in first.stderr() or first.poll() is not None, 30,
                 "the first agent to host the server")
        second = self.start_node("guest", "2", nproc=1)
        self.nodes = [first, second]
        self.assertEqual(self.wait_exit(self.nodes), [0, 0], self.describe_nodes())
        (gen, rs), = self.by_generation("done").items()
        self.check_round(rs, 2, 1)
        self.assertNotIn("hosting the rendezvous server", second.stderr())

    def test_standalone_hosts_a_loopback_server_and_runs_the_job(self):
        proc = self.spawn_launch(["--standalone", "--nproc_per_node=2", "--python", PYTHON, WORKER, self.out],
                                 env={"MN_NODE": "solo"})
        self.nodes = [proc]
        self.assertEqual(self.wait_exit([proc]), [0], proc.describe())
        (gen, rs), = self.by_generation("done").items()
        self.check_round(rs, 1, 2)
        self.assertEqual({r["env"]["MASTER_ADDR"] for r in rs}, {"127.0.0.1"})

    def test_an_unreachable_endpoint_exits_3_after_join_timeout(self):
        self.port = free_port()  # nothing listens there; is_host=false: do not host it either
        started = time.monotonic()
        result = self.launch(self.node_args("2", conf="join_timeout=2,is_host=false"), timeout=60)
        took = time.monotonic() - started
        print("\n[multinode] unreachable endpoint: gave up after %.2f s" % took, file=sys.stderr)
        self.assertEqual(result.returncode, 3, result.describe())
        self.assertIn("127.0.0.1:%d" % self.port, result.stderr, result.describe())
        self.assertLess(took, 30, "join_timeout=2 bounds the connection retries")
        self.assertEqual(self.recs("start"), [], "no worker starts without a rendezvous")

    def test_a_wrong_token_is_refused_with_exit_3(self):
        token = os.path.join(self.tmp, "token")
        with open(token, "w") as f:
            f.write("right-token\n")
        wrong = os.path.join(self.tmp, "wrong")
        with open(wrong, "w") as f:
            f.write("wrong-token\n")
        self.start_daemon(["--token-file", token])
        result = self.launch(self.node_args("1", conf="join_timeout=5,token_file=%s" % wrong), timeout=60)
        self.assertEqual(result.returncode, 3, result.describe())
        self.assertIn("token", result.stderr.lower(), result.describe())
        self.assertEqual(self.recs("start"), [])
        # The right token works against the same daemon.
        ok = self.launch(self.node_args("1", nproc=1, conf="join_timeout=5,token_file=%s" % token,
                                        worker_args=["--no-gloo"]),
                         timeout=JOB_DEADLINE)
        self.assertEqual(ok.returncode, 0, ok.describe())

    def test_an_unreadable_token_file_is_a_usage_error(self):
        self.port = free_port()
        missing = os.path.join(self.tmp, "no-such-token")
        result = self.launch(self.node_args("1", conf="join_timeout=2,token_file=%s" % missing), timeout=30)
        self.assertEqual(result.returncode, 2, result.describe())
        self.assertIn(missing, result.stderr)


if __name__ == "__main__":
    unittest.main(verbosity=2)
