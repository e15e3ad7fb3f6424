"""ddplaunch inside a Slurm allocation, through the binary.

- Slurm ends a job (time limit, scancel, requeue) by sending SIGTERM to every process of the
  step at once, ddplaunch and its workers alike, and SIGKILL KillWait seconds later (30 s by
  default). Here a worker that checkpoints on SIGTERM gets SIGTERM together with ddplaunch, as
  slurmstepd sends it: the checkpoint must complete (ddplaunch waits for it, within its Slurm
  grace of 25 s) and ddplaunch exits 128+15 without killing anyone.
- Bad Slurm variables (a malformed node list, several tasks per node) exit 2 naming the
  variable, and start no worker.
"""

import os
import shutil
import signal
import sys
import tempfile
import unittest

from processes import run, spawn, wait_for

BUILD_DIR = os.environ.get("DDPLAUNCH_BUILD_DIR") or os.path.join(
    os.path.dirname(os.path.abspath(__file__)), "..", "..", "build")
DDPLAUNCH = os.path.join(BUILD_DIR, "bin", "ddplaunch")

# Writes its pid, then waits for SIGTERM; on SIGTERM it "checkpoints" (a write that takes a
# second, like a real one), marks the file complete and exits 0. A second SIGTERM during the
# checkpoint (Slurm's and ddplaunch's forwarded one) must not interrupt it.
WORKER = r"""
import os, signal, sys, time
out = sys.argv[1]
term = []
signal.signal(signal.SIGTERM, lambda signo, frame: term.append(time.monotonic()))
with open(os.path.join(out, "pid.tmp"), "w") as f:
    f.write(str(os.getpid()))
os.replace(os.path.join(out, "pid.tmp"), os.path.join(out, "pid"))
deadline = time.monotonic() + 120
while not term and time.monotonic() < deadline:
    time.sleep(0.02)
with open(os.path.join(out, "checkpoint"), "w") as f:
    f.write("partial")
    f.flush()
    time.sleep(1.0)
    f.write(" complete")
sys.exit(0)
"""


def slurm_env(**extra):
    """The caller's environment without Slurm or PET_ variables, plus one Slurm task's."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "PET_")) and k != "TORCH_ELASTIC_SHUTDOWN_TIMEOUT"}
    env.update({"SLURM_JOB_ID": "555", "SLURM_NNODES": "1", "SLURM_NODEID": "0",
                "SLURM_JOB_NODELIST": "cn[001]", "SLURM_STEP_NUM_NODES": "1",
                "SLURM_STEP_NUM_TASKS": "1", "PYTHON_EXEC": sys.executable})
    env.update(extra)
    return env


class SlurmBinaryTest(unittest.TestCase):
    def setUp(self):
        if not os.path.exists(DDPLAUNCH):
            self.fail("not built: %s" % DDPLAUNCH)
        self.tmp = tempfile.mkdtemp(prefix="ddp_slurm_bin_")
        self.addCleanup(shutil.rmtree, self.tmp, True)
        self.worker = os.path.join(self.tmp, "worker.py")
        with open(self.worker, "w") as f:
            f.write(WORKER)

    def test_slurm_sigterm_to_the_whole_step_lets_the_checkpoint_finish(self):
        p = spawn([DDPLAUNCH, self.worker, self.tmp], env=slurm_env(), cwd=self.tmp, name="ddplaunch")
        self.addCleanup(p.kill)
        pid_file = os.path.join(self.tmp, "pid")
        wait_for(lambda: os.path.exists(pid_file) or p.poll() is not None, 60, "the worker to start")
        self.assertIsNone(p.poll(), p.describe())
        with open(pid_file) as f:
            worker_pid = int(f.read())
        # What slurmstepd does at the time limit: SIGTERM to every process of the step.
        os.kill(worker_pid, signal.SIGTERM)
        p.signal(signal.SIGTERM)
        try:
            code = p.wait(60)
        except TimeoutError as e:
            self.fail(str(e))
        err = p.stderr()
        self.assertEqual(code, 128 + signal.SIGTERM, p.describe())
        with open(os.path.join(self.tmp, "checkpoint")) as f:
            self.assertEqual(f.read(), "partial complete", p.describe())
        self.assertIn("--shutdown_timeout=25 (5 s less than Slurm's default KillWait of 30 s)", err)
        self.assertIn("--rdzv_id=555 (SLURM_JOB_ID)", err)
        # No SIGKILL was needed ("... still runs N s after it was asked to stop; sending SIGKILL").
        self.assertNotIn("SIGKILL", err, p.describe())
        self.assertNotIn("killing", err.lower(), p.describe())

    def test_a_malformed_node_list_exits_2_naming_the_variable(self):
        env = slurm_env(SLURM_NNODES="2", SLURM_STEP_NUM_NODES="2", SLURM_STEP_NUM_TASKS="2",
                        SLURM_JOB_NODELIST="gpu[01-02")
        r = run([DDPLAUNCH, self.worker, self.tmp], timeout=30, env=env, cwd=self.tmp)
        self.assertEqual(r.returncode, 2, r.describe())
        self.assertIn("SLURM_JOB_NODELIST: malformed hostlist 'gpu[01-02' at position 4: '[' is never closed",
                      r.stderr)
        self.assertFalse(os.path.exists(os.path.join(self.tmp, "pid")), "a worker started")

    def test_several_tasks_per_node_exit_2_with_the_srun_option_to_use(self):
        env = slurm_env(SLURM_NNODES="2", SLURM_STEP_NUM_NODES="2", SLURM_STEP_NUM_TASKS="8",
                        SLURM_JOB_NODELIST="gpu[01-02]")
        r = run([DDPLAUNCH, self.worker, self.tmp], timeout=30, env=env, cwd=self.tmp)
        self.assertEqual(r.returncode, 2, r.describe())
        self.assertIn("srun started 8 tasks on 2 node(s)", r.stderr)
        self.assertIn("srun --ntasks-per-node=1", r.stderr)
        self.assertFalse(os.path.exists(os.path.join(self.tmp, "pid")), "a worker started")


if __name__ == "__main__":
    unittest.main()
