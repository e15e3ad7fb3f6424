"""Hung workers are found, shown and restarted; torch's file timer works; crash loops stop
Real processes on loopback; waits have deadlines, timings are measured, not slept."""

import glob
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ddplaunch_helpers import BUILD_DIR, PYTHON, LaunchTestCase, main, wait_for  # noqa: E402

# Two ranks, Gloo; each step all-reduces, then reports progress. On the first attempt rank 1
# blocks forever before the all-reduce of step 3, so both ranks stop making progress.
DDP_HANG = """
import time
STARTED = time.time()
import json, os, threading
import ddplaunch
import torch
import torch.distributed as dist

def block_forever():
    threading.Event().wait()

attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
rank = int(os.environ["RANK"])
with open(os.path.join(os.environ["OUT_DIR"], "start_%d_%d.json" % (attempt, rank)), "w") as f:
    json.dump({"started": STARTED}, f)
dist.init_process_group("gloo", init_method="env://")
for step in range(1, 6):
    if attempt == 0 and rank == 1 and step == 3:
        block_forever()
    t = torch.ones(1)
    dist.all_reduce(t)
    ddplaunch.step(step)
    with open(os.path.join(os.environ["OUT_DIR"], "step_%d_%d.json" % (attempt, rank)), "w") as f:
        json.dump({"step": step, "time": time.time()}, f)
ddplaunch.done()  # the teardown below is not a hang
dist.destroy_process_group()
"""

TIMER = """
import json, os, signal, sys, time
from torch.distributed.elastic.timer import FileTimerClient, configure, expires
attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
out = os.environ["OUT_DIR"]
path = os.environ["TORCHELASTIC_TIMER_FILE"]
if attempt == 0:
    # Hostile lines first: garbage, and a well-formed request that targets a process that is not
    # a worker (it must survive), then torch's own client.
    fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
    os.write(fd, b"garbage\\n" + b"x" * 9000 + b"\\n")
    os.write(fd, (json.dumps({"version": 1, "pid": int(os.environ["BYSTANDER"]), "scope_id": "evil",
                              "expiration_time": 1, "signal": 9}) + "\\n").encode())
    os.close(fd)
    configure(FileTimerClient(path, signal=signal.SIGKILL))
    with open(os.path.join(out, "armed.json"), "w") as f:
        json.dump({"time": time.time()}, f)
    with expires(after=1):
        time.sleep(120)
    sys.exit(5)  # not reached: the agent kills it
with open(os.path.join(out, "second.json"), "w") as f:
    json.dump({"attempt": attempt}, f)
"""

EXIT_AT_START = """
import os, sys
attempt = os.environ["TORCHELASTIC_RESTART_COUNT"]
open(os.path.join(os.environ["OUT_DIR"], "attempt_" + attempt), "w").close()
sys.exit(int(os.environ["EXIT_CODE"]))
"""

TRAIN = os.path.join(BUILD_DIR, "bin", "train")


def load(path):
    with open(path) as f:
        return json.load(f)


class HangDetection(LaunchTestCase):
    def test_python_rank_blocked_before_allreduce_is_restarted_without_waiting_out_the_grace(self):
        # How fast is bench/hang's (bench/RESULTS.md); here, what makes it fast: the hung rank is
        # killed at the declaration (SIGABRT for its stacks, then SIGKILL), not sent SIGTERM and
        # waited for, so the next attempt starts long before a 60 s --shutdown_timeout would end.
        timeout = 3
        script = self.script("ddp_hang.py", DDP_HANG)
        proc = self.spawn_launch(["--nproc_per_node=2", "--max_restarts=1", "--hang_timeout=%d" % timeout,
                                  "--shutdown_timeout=60", script],
                                 env={"OUT_DIR": self.out})
        # The declaration is the agent's line; seen within the 20 ms polling of wait_for.
        wait_for(lambda: "made no progress for" in proc.stderr(), 120, "the hang to be declared")
        declared = time.time()
        self.assertEqual(proc.wait(120), 0, proc.describe())
        # Both ranks of the second attempt ran to the end.
        self.assertEqual(load(os.path.join(self.out, "step_1_0.json"))["step"], 5, proc.describe())
        self.assertEqual(load(os.path.join(self.out, "step_1_1.json"))["step"], 5, proc.describe())
        last_progress = max(load(p)["time"] for p in glob.glob(os.path.join(self.out, "step_0_*.json")))
        restarted = max(load(os.path.join(self.out, "start_1_%d.json" % rank))["started"] for rank in (0, 1))
        print("last progress -> declared %.2f s, declared -> every worker restarted %.2f s (hang_timeout %d s)"
              % (declared - last_progress, restarted - declared, timeout))
        self.assertGreaterEqual(declared - last_progress, timeout - 0.5, "declared before the timeout")
        self.assertLess(restarted - declared, 30, "the restart waited for the shutdown grace")

    def test_summary_names_the_hung_rank_and_shows_its_python_traceback(self):
        script = self.script("ddp_hang.py", DDP_HANG)
        r = self.launch(["--nproc_per_node=2", "--max_restarts=0", "--hang_timeout=3", "--tee=3", script],
                        timeout=180, env={"OUT_DIR": self.out})
        self.assertEqual(r.returncode, 1, r.describe())
        summary = r.stderr[r.stderr.find("FAILED"):]
        self.assertIn("rank 1 made no progress for", summary, r.describe())
        self.assertIn("(last step 2;", summary, r.describe())
        self.assertIn("block_forever", summary, r.describe())  # rank 1's faulthandler traceback
        self.assertIn("SIGABRT", summary, r.describe())

    def test_sdk_train_hung_at_a_step_is_stopped_with_its_step_and_phase(self):
        if not os.path.exists(TRAIN):
            self.skipTest("the worker SDK's train program is not built (DDPLAUNCH_BUILD_WORKER_SDK=OFF)")
        r = self.launch(["--nproc_per_node=2", "--max_restarts=0", "--hang_timeout=3", "--no_python", TRAIN,
                         "--epochs", "1", "--samples", "512", "--hang-at-step", "4", "--hang-rank", "1"],
                        timeout=240)
        self.assertEqual(r.returncode, 1, r.describe())
        summary = r.stderr[r.stderr.find("FAILED"):]
        self.assertIn("rank 1 made no progress for", summary, r.describe())
        self.assertIn("last step 4, phase --hang-at-step", summary, r.describe())

    def test_sdk_train_hang_restarts_and_the_second_attempt_finishes(self):
        if not os.path.exists(TRAIN):
            self.skipTest("the worker SDK's train program is not built (DDPLAUNCH_BUILD_WORKER_SDK=OFF)")
        r = self.launch(["--nproc_per_node=2", "--max_restarts=1", "--hang_timeout=3", "--no_python", TRAIN,
                         "--epochs", "1", "--samples", "512", "--hang-at-step", "4"],
                        timeout=240)
        self.assertEqual(r.returncode, 0, r.describe())
        self.assertIn("rank 0 made no progress for", r.stderr, r.describe())
        self.assertIn("restarting the workers", r.stderr, r.describe())


class MultiNodeHang(LaunchTestCase):
    """Two agents on one ddp-rendezvous daemon on loopback, one rank each."""

    def test_a_rank_hung_on_one_node_restarts_the_job_on_both(self):
        port = self.start_rendezvous_daemon()
        script = self.script("ddp_hang.py", DDP_HANG)
        conf = "heartbeat_interval=0.5,heartbeat_timeout=2,last_call_timeout=1,join_timeout=60"
        nodes = [self.spawn_launch(["--nnodes=2", "--nproc_per_node=1", "--rdzv_backend=c10d",
                                    "--rdzv_endpoint=127.0.0.1:%d" % port, "--rdzv_id=hang-mn", "--rdzv_conf", conf,
                                    "--max_restarts=1", "--hang_timeout=3", "--python", PYTHON, script],
                                   env={"OUT_DIR": self.out}) for _ in range(2)]
        codes = [n.wait(240) for n in nodes]
        both = "\n".join(n.describe() for n in nodes)
        self.assertEqual(codes, [0, 0], both)
        # Rank 1 blocked and rank 0 waits for it in the all-reduce: both stop beating at the same
        # step, and whichever node declares its rank first restarts the job on both.
        self.assertIn("made no progress for", both)
        self.assertIn("restarting the workers", nodes[0].stderr() + nodes[1].stderr())
        self.assertEqual(load(os.path.join(self.out, "step_1_0.json"))["step"], 5, both)
        self.assertEqual(load(os.path.join(self.out, "step_1_1.json"))["step"], 5, both)


class FileTimer(LaunchTestCase):
    def run_timer(self, python):
        bystander = subprocess.Popen(["sleep", "120"])
        self.addCleanup(bystander.wait)
        self.addCleanup(bystander.kill)
        script = self.script("timer.py", TIMER)
        fifo = os.path.join(self.tmp, "timer.fifo")
        r = self.launch(["--nproc_per_node=1", "--max_restarts=1", "--python", python, script], timeout=180,
                        env={"OUT_DIR": self.out, "TORCHELASTIC_ENABLE_FILE_TIMER": "1",
                             "TORCHELASTIC_TIMER_FILE": fifo, "BYSTANDER": str(bystander.pid)})
        self.assertEqual(r.returncode, 0, r.describe())
        self.assertIn("(torch.distributed.elastic.timer) expired; sent SIGKILL", r.stderr, r.describe())
        self.assertIn("was killed by SIGKILL", r.stderr, r.describe())
        self.assertEqual(load(os.path.join(self.out, "second.json"))["attempt"], 1, r.describe())
        self.assertIn("ignored a timer request", r.stderr, r.describe())
        self.assertIn("is not one of this node's workers", r.stderr, r.describe())
        self.assertIsNone(bystander.poll(), "a request for a process that is not a worker was obeyed")
        self.assertFalse(os.path.exists(fifo), "the FIFO ddplaunch created is removed at exit")

    def test_torch_file_timer_client_of_the_test_python_kills_the_worker_and_the_group_restarts(self):
        self.run_timer(PYTHON)

    def test_torch_1_13_file_timer_client_of_debian_python_works_too(self):
        debian = "/usr/bin/python3"
        probe = subprocess.run([debian, "-c", "import torch.distributed.elastic.timer"], capture_output=True)
        if probe.returncode != 0:
            self.skipTest("Debian's python3 has no torch here")
        self.run_timer(debian)


HEALTH_WORKER = """
import os, time
attempt = os.environ["TORCHELASTIC_RESTART_COUNT"]
out = os.environ["OUT_DIR"]
open(os.path.join(out, "start_%s_%s" % (attempt, os.environ["LOCAL_RANK"])), "w").close()
if attempt == "0" and os.environ.get("RUN_FOREVER"):
    while True:
        time.sleep(1)
"""


class HealthCheck(LaunchTestCase):
    def health_args(self, healthy, script):
        return ["--nproc_per_node=1", "--max_restarts=1", "--check_health=test -e %s" % healthy,
                "--check_health_interval=0.2", script]

    def test_a_failing_check_keeps_the_node_out_and_it_joins_once_the_check_passes(self):
        healthy = os.path.join(self.tmp, "healthy")
        script = self.script("worker.py", HEALTH_WORKER)
        proc = self.spawn_launch(self.health_args(healthy, script), env={"OUT_DIR": self.out})
        wait_for(lambda: "stays out of the job" in proc.stderr(), 60, "the failed check to be said")
        self.assertIn("exited with code 1", proc.stderr(), proc.describe())
        self.assertEqual(os.listdir(self.out), [], "a worker started although the check failed")
        open(healthy, "w").close()
        self.assertEqual(proc.wait(60), 0, proc.describe())
        self.assertEqual(os.listdir(self.out), ["start_0_0"], proc.describe())
        self.assertIn("health check passes again", proc.stderr(), proc.describe())

    def test_a_check_failing_while_training_stops_the_workers_until_it_passes(self):
        healthy = os.path.join(self.tmp, "healthy")
        open(healthy, "w").close()
        script = self.script("worker.py", HEALTH_WORKER)
        proc = self.spawn_launch(self.health_args(healthy, script), env={"OUT_DIR": self.out, "RUN_FOREVER": "1"})
        wait_for(lambda: os.path.exists(os.path.join(self.out, "start_0_0")), 60, "the first worker")
        os.unlink(healthy)
        wait_for(lambda: "stays out of the job" in proc.stderr(), 60, "the node to leave")
        self.assertIn("this node leaves the round", proc.stderr(), proc.describe())
        self.assertFalse(os.path.exists(os.path.join(self.out, "start_1_0")), proc.describe())
        open(healthy, "w").close()
        self.assertEqual(proc.wait(60), 0, proc.describe())
        self.assertTrue(os.path.exists(os.path.join(self.out, "start_1_0")), proc.describe())


# A Python worker with no optimizer and no ddplaunch.step(): it reports nothing. It waits for the
# test to say it may end (a file), at most 120 s.
NO_STEPS = """
import os, time
go = os.path.join(os.environ["OUT_DIR"], "go")
deadline = time.monotonic() + 120
while not os.path.exists(go) and time.monotonic() < deadline:
    time.sleep(0.05)
"""


class NothingToWatch(LaunchTestCase):
    """--hang_timeout with nothing to watch says so, once."""

    def test_a_program_that_is_neither_python_nor_an_sdk_program_is_said_at_start(self):
        r = self.launch(["--nproc_per_node=1", "--hang_timeout=5", "--no_python", "/bin/true"], timeout=60)
        self.assertEqual(r.returncode, 0, r.describe())
        line = "--hang_timeout: /bin/true is not run by Python, so it is watched only if it reports its steps"
        self.assertEqual(r.stderr.count(line), 1, r.describe())

    def test_an_sdk_program_is_not_said(self):
        if not os.path.exists(TRAIN):
            self.skipTest("the worker SDK's train program is not built (DDPLAUNCH_BUILD_WORKER_SDK=OFF)")
        r = self.launch(["--nproc_per_node=1", "--hang_timeout=30", "--no_python", TRAIN, "--epochs", "1",
                         "--samples", "64"], timeout=120)
        self.assertEqual(r.returncode, 0, r.describe())
        self.assertNotIn("is not run by Python", r.stderr, r.describe())

    def test_a_python_worker_that_reports_no_step_is_said_once_after_the_timeout(self):
        script = self.script("no_steps.py", NO_STEPS)
        proc = self.spawn_launch(["--nproc_per_node=2", "--hang_timeout=1", "--python", PYTHON, script],
                                 env={"OUT_DIR": self.out})
        wait_for(lambda: "no worker has reported a step" in proc.stderr() or proc.poll() is not None, 90,
                 "the line that nothing reports")
        open(os.path.join(self.out, "go"), "w").close()
        self.assertEqual(proc.wait(120), 0, proc.describe())
        self.assertEqual(proc.stderr().count("--hang_timeout: no worker has reported a step in 1 s, and a worker is "
                                             "watched only from its first step: a step is an optimizer.step()"), 1,
                         proc.describe())


class CrashLoops(LaunchTestCase):
    def test_restarts_without_progress_end_the_job(self):
        script = self.script("exit_at_start.py", EXIT_AT_START)
        r = self.launch(["--nproc_per_node=1", "--max_restarts=10", "--crash_loop_limit=2", script],
                        timeout=120, env={"OUT_DIR": self.out, "EXIT_CODE": "1"})
        self.assertEqual(r.returncode, 1, r.describe())
        self.assertEqual(sorted(os.listdir(self.out)), ["attempt_0", "attempt_1", "attempt_2"], r.describe())
        self.assertIn("2 restart(s) in a row made no progress", r.stderr, r.describe())
        self.assertIn("FAILED", r.stderr, r.describe())

    def test_a_no_restart_exit_code_ends_the_job_at_once(self):
        script = self.script("exit_at_start.py", EXIT_AT_START)
        r = self.launch(["--nproc_per_node=2", "--max_restarts=5", "--no_restart_exit_codes=3,4", script],
                        timeout=120, env={"OUT_DIR": self.out, "EXIT_CODE": "3"})
        self.assertEqual(r.returncode, 1, r.describe())
        self.assertEqual(sorted(os.listdir(self.out)), ["attempt_0"], r.describe())
        self.assertIn("which --no_restart_exit_codes lists: not restarting", r.stderr, r.describe())

    def test_a_bad_exit_code_list_is_refused(self):
        r = self.launch(["--no_restart_exit_codes=3,x", "--nproc_per_node=1", "/bin/true"], timeout=30)
        self.assertEqual(r.returncode, 2, r.describe())
        self.assertIn("'x' is not an exit code", r.stderr, r.describe())


if __name__ == "__main__":
    main()
