"""In-memory restart, the agent's side (docs/agent.md, "In-memory
restart: the worker channel").

ddplaunch --in_memory_restart=on --no_python with a fake worker SDK program (inmem_worker.py)
that speaks the worker channel without torch. One node, two workers, one restart: rank 1 exits 1
in round 0. A healthy worker that parks keeps its pid and gets the new round's environment; one
that says it is restartable but never parks is stopped after the park deadline; one that writes
garbage on its channel is said, treated as not restartable, and stopped at the restart; a parked
worker is stopped with SIGTERM when ddplaunch is signalled, and an agent SIGKILLed while a worker
is parked leaves no process. Two nodes on a daemon: a node joining (a restart that is not a
failure) makes the running worker park and take the larger round. Every wait has a deadline.
"""

import json
import os
import signal
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ddplaunch_helpers import LaunchTestCase, main, pid_alive, wait_for  # noqa: E402
from test_multinode import CONF  # noqa: E402

SOURCE_DIR = os.environ.get("DDPLAUNCH_SOURCE_DIR",
                            os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
PYTHON_DIR = os.path.abspath(os.path.join(SOURCE_DIR, "python"))
WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "inmem_worker.py")


class InMemoryRestart(LaunchTestCase):
    def setUp(self):
        super().setUp()
        with open(WORKER) as f:
            self.worker = self.script("inmem_worker.py", f.read(), executable=True)

    def env(self, **extra):
        env = {"OUT_DIR": self.out, "INMEM_PYTHON_DIR": PYTHON_DIR, "INMEM_FAIL_RANK": "1"}
        env.update(extra)
        return env

    def args(self, *extra):
        return ["--in_memory_restart=on", "--nnodes=1", "--nproc_per_node=2", "--max_restarts=1",
                "--shutdown_timeout=60"] + list(extra) + ["--no_python", self.worker]

    def records(self):
        path = os.path.join(self.out, "records.jsonl")
        if not os.path.exists(path):
            return []
        with open(path) as f:
            return [json.loads(line) for line in f if line.strip()]

    def record(self, restart, rank):
        found = [r for r in self.records() if r["restart"] == restart and r["rank"] == rank]
        self.assertEqual(len(found), 1, self.records())
        return found[0]

    def assert_nothing_left(self):
        pids = {r["pid"] for r in self.records()}
        wait_for(lambda: not any(pid_alive(p) for p in pids), 30, "every worker to be gone")

    def test_a_parked_worker_keeps_its_pid_and_takes_the_new_rounds_environment(self):
        events = os.path.join(self.tmp, "events.jsonl")
        result = self.launch(self.args("--event_log=" + events), timeout=120, env=self.env())
        self.assertEqual(result.returncode, 0, result.describe())
        survivor0, survivor1 = self.record(0, 0), self.record(1, 0)
        self.assertEqual(survivor1["pid"], survivor0["pid"], "the healthy worker was restarted")
        self.assertEqual(survivor1["how"], "in_memory")
        self.assertEqual(survivor1["worker_fd"], survivor0["worker_fd"])
        self.assertNotEqual(survivor1["generation"], survivor0["generation"])
        failed0, failed1 = self.record(0, 1), self.record(1, 1)
        self.assertNotEqual(failed1["pid"], failed0["pid"], "the failed rank was not started fresh")
        self.assertEqual(failed1["how"], "cold")
        self.assertTrue(os.path.exists(os.path.join(self.out, "parked_%d" % survivor0["pid"])))
        self.assertNotIn("did not park", result.stderr)
        with open(events) as f:
            log = [json.loads(line) for line in f if line.strip()]
        parked = [e for e in log if e["type"] == "worker_parked"]
        self.assertEqual([(e["pid"], e["step"], e["local_rank"]) for e in parked], [(survivor0["pid"], 100, 0)], log)
        started = [e for e in log if e["type"] == "worker_started"]
        resumed = [e for e in started if e.get("in_memory")]
        self.assertEqual([(e["pid"], e["step"], e["standby"]) for e in resumed], [(survivor0["pid"], 100, False)], log)
        self.assertEqual(len(started), 4, log)
        self.assert_nothing_left()

    def test_a_worker_that_never_parks_is_stopped_after_the_park_deadline(self):
        result = self.launch(self.args(), timeout=120, env=self.env(INMEM_MODE_0="never_park"))
        self.assertEqual(result.returncode, 0, result.describe())
        stuck = self.record(0, 0)
        self.assertIn("worker 0 (pid %d) did not park within 10 s of the restart" % stuck["pid"], result.stderr)
        self.assertNotEqual(self.record(1, 0)["pid"], stuck["pid"])
        self.assert_nothing_left()

    def test_garbage_on_the_channel_is_said_and_the_worker_is_stopped_as_not_restartable(self):
        result = self.launch(self.args(), timeout=120, env=self.env(INMEM_MODE_0="garbage"))
        self.assertEqual(result.returncode, 0, result.describe())
        hostile = self.record(0, 0)
        self.assertIn("worker 0 (local rank 0, pid %d): its channel to the agent: bad magic" % hostile["pid"],
                      result.stderr)
        self.assertNotEqual(self.record(1, 0)["pid"], hostile["pid"], "a worker that broke its channel was kept")
        self.assertNotIn("did not park", result.stderr)
        self.assert_nothing_left()

    def test_a_sigkilled_agent_leaves_no_parked_worker_behind(self):
        hold = os.path.join(self.tmp, "hold")
        # The health check keeps the node out of the next round while the hold file exists, so the
        # survivor stays parked.
        for no_cgroup in ("0", "1"):
            with self.subTest(DDPLAUNCH_NO_CGROUP=no_cgroup):
                for name in os.listdir(self.out):
                    os.remove(os.path.join(self.out, name))
                if os.path.exists(hold):
                    os.remove(hold)
                proc = self.spawn_launch(self.args("--check_health", "test ! -e %s" % hold),
                                         env=self.env(INMEM_HOLD=hold, DDPLAUNCH_NO_CGROUP=no_cgroup))
                wait_for(lambda: any(n.startswith("parked_") for n in os.listdir(self.out)) or proc.poll() is not None,
                         60, "the survivor to park")
                self.assertIsNone(proc.poll(), proc.describe())
                survivor = self.record(0, 0)["pid"]
                self.assertTrue(pid_alive(survivor))
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait(30)
                self.assert_nothing_left()

    def test_a_signal_to_ddplaunch_stops_a_parked_worker_like_any_other(self):
        hold = os.path.join(self.tmp, "hold")
        proc = self.spawn_launch(self.args("--check_health", "test ! -e %s" % hold), env=self.env(INMEM_HOLD=hold))
        wait_for(lambda: any(n.startswith("parked_") for n in os.listdir(self.out)) or proc.poll() is not None,
                 60, "the survivor to park")
        self.assertIsNone(proc.poll(), proc.describe())
        wait_for(lambda: "health check failed" in proc.output() or proc.poll() is not None, 60,
                 "the node to stay out of the next round")
        survivor = self.record(0, 0)["pid"]
        self.assertTrue(pid_alive(survivor))
        proc.signal(signal.SIGTERM)
        self.assertEqual(proc.wait(60), 128 + signal.SIGTERM, proc.describe())
        self.assertNotIn("sending SIGKILL", proc.output())
        self.assert_nothing_left()

    def test_a_node_joining_makes_the_running_worker_park_and_take_the_larger_round(self):
        # Not a failure: only the restartable worker's own abandoned word tells it to park.
        port = self.start_rendezvous_daemon()
        env = self.env(INMEM_FAIL_RANK="-1", INMEM_FINISH_WORLD="2")

        def node():
            return self.spawn_launch(["--in_memory_restart=on", "--nnodes=1:2", "--nproc_per_node=1",
                                      "--rdzv_backend=c10d", "--rdzv_endpoint=127.0.0.1:%d" % port,
                                      "--rdzv_id=inmem-join", "--rdzv_conf", CONF, "--no_python", self.worker], env=env)

        a = node()
        wait_for(lambda: os.path.exists(os.path.join(self.out, "ready_0_0")) or a.poll() is not None, 60,
                 "node a's worker alone")
        self.assertIsNone(a.poll(), a.describe())
        alone = self.record(0, 0)
        self.assertEqual(alone["world"], 1)
        b = node()
        self.assertEqual(a.wait(60), 0, a.describe())
        self.assertEqual(b.wait(60), 0, b.describe())
        together = [r for r in self.records() if r["world"] == 2]
        self.assertEqual(sorted(r["rank"] for r in together), [0, 1], self.records())
        kept = [r for r in together if r["pid"] == alone["pid"]]
        self.assertEqual(len(kept), 1, "node a's worker was not kept: %s" % self.records())
        self.assertEqual(kept[0]["how"], "in_memory")
        self.assertEqual(kept[0]["restart"], 0)  # a membership change is not a failure restart
        self.assertNotIn("did not park", a.output())
        self.assert_nothing_left()


if __name__ == "__main__":
    main()
