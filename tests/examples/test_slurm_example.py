"""examples/slurm/train.sbatch: what can be checked without a Slurm cluster.

- It is valid bash; it asks for one task per node (#SBATCH and srun), and every ddplaunch flag
  it uses is one the built ddplaunch knows.
- Its requeue path works, run for real with stand-ins for Slurm's commands: a fake `srun` gives
  its command the variables srun sets for one task of a 1-node step and runs it (the real
  ddplaunch, with a fake `train` on PATH that checkpoints on SIGTERM); a fake `scontrol` records
  `requeue JOBID` and then does what Slurm does on requeue: SIGTERM to every process of the step.
  USR1 to the script (Slurm's --signal=B:USR1@180) must call `scontrol requeue`, the checkpoint
  must complete, and the script must exit with the step's status (128+15).
Slurm itself (sbatch, slurmstepd, KillWait) is not run here: see docs/slurm.md.
"""

import os
import re
import shutil
import signal
import sys
import tempfile
import unittest

from processes import run, spawn, wait_for

BUILD_DIR = os.environ.get("DDPLAUNCH_BUILD_DIR", "build")
SOURCE_DIR = os.environ.get("DDPLAUNCH_SOURCE_DIR") or os.path.abspath(
    os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
SBATCH = os.path.join(SOURCE_DIR, "examples", "slurm", "train.sbatch")
DDPLAUNCH = os.path.join(os.path.abspath(BUILD_DIR), "bin", "ddplaunch")

FAKE_SRUN = r"""#!/bin/bash
# srun for one task on a 1-node step: drop srun's own options, set what srun sets, run the task.
while [ $# -gt 0 ] && [ "${1#-}" != "$1" ]; do shift; done
export SLURM_NNODES=1 SLURM_NODEID=0 SLURM_PROCID=0 SLURM_LOCALID=0 SLURM_STEP_ID=0
export SLURM_STEP_NUM_NODES=1 SLURM_STEP_NUM_TASKS=1 SLURM_JOB_NODELIST=cn001 SLURM_STEP_NODELIST=cn001
echo $$ > "$FAKE_SLURM_DIR/task.pid"
exec "$@"
"""

FAKE_SCONTROL = r"""#!/bin/bash
# scontrol requeue JOBID: record it, then end the step as Slurm does (SIGTERM to all its processes).
echo "$*" >> "$FAKE_SLURM_DIR/scontrol.log"
kill -TERM "$(cat "$FAKE_SLURM_DIR/task.pid")" "$(cat "$FAKE_SLURM_DIR/train.pid")"
"""

FAKE_TRAIN = r"""#!%(python)s
# A training program that saves a checkpoint on SIGTERM, as worker_sdk's train does.
import os, signal, sys, time
args = sys.argv[1:]
directory = args[args.index("--checkpoint-dir") + 1]
term = []
signal.signal(signal.SIGTERM, lambda *a: term.append(1))
with open(os.path.join(os.environ["FAKE_SLURM_DIR"], "train.pid"), "w") as f:
    f.write(str(os.getpid()))
deadline = time.monotonic() + 60
while not term and time.monotonic() < deadline:
    time.sleep(0.02)
with open(os.path.join(directory, "checkpoint"), "w") as f:
    f.write("step 7")
sys.exit(128 + signal.SIGTERM)
"""


def ddplaunch_flags(script):
    """The flags given to ddplaunch in `script` (continuation lines joined), up to PROGRAM."""
    text = script.replace("\\\n", " ")
    flags = []
    for line in text.splitlines():
        words = line.split()
        if "ddplaunch" not in words or line.lstrip().startswith("#"):
            continue
        for word in words[words.index("ddplaunch") + 1:]:
            if not word.startswith("-"):
                break
            flags.append(word.split("=", 1)[0])
    return flags


class SlurmExampleTest(unittest.TestCase):
    def setUp(self):
        if not os.path.exists(DDPLAUNCH):
            self.fail("not built: %s" % DDPLAUNCH)
        with open(SBATCH) as f:
            self.script = f.read()

    def test_valid_bash_one_task_per_node_and_real_flags(self):
        run(["bash", "-n", SBATCH], timeout=30).check()
        self.assertIn("#SBATCH --ntasks-per-node=1", self.script)
        self.assertRegex(self.script, r"srun [^\n]*--ntasks-per-node=1")
        m = re.search(r"#SBATCH --signal=B:USR1@(\d+)", self.script)
        self.assertIsNotNone(m)
        self.assertGreater(int(m.group(1)), 30, "the requeue signal must come well before KillWait")
        help_text = run([DDPLAUNCH, "--help"], timeout=30).check().stdout
        flags = ddplaunch_flags(self.script)
        self.assertTrue(flags)
        for flag in flags:
            self.assertRegex(help_text, r"(^|[\s,])%s([\s,=]|$)" % re.escape(flag))
        for flag in ("--nnodes", "--node_rank", "--rdzv_id", "--rdzv_endpoint"):
            self.assertNotIn(flag, flags, "Slurm supplies %s; the example should not" % flag)

    def test_usr1_requeues_and_the_checkpoint_completes(self):
        tmp = tempfile.mkdtemp(prefix="ddp_sbatch_")
        self.addCleanup(shutil.rmtree, tmp, True)
        bin_dir = os.path.join(tmp, "bin")
        os.mkdir(bin_dir)
        for name, text in (("srun", FAKE_SRUN), ("scontrol", FAKE_SCONTROL),
                           ("train", FAKE_TRAIN % {"python": sys.executable})):
            path = os.path.join(bin_dir, name)
            with open(path, "w") as f:
                f.write(text)
            os.chmod(path, 0o755)
        checkpoints = os.path.join(tmp, "ckpt")
        env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "PET_"))}
        env.update(PATH=os.pathsep.join([bin_dir, os.path.dirname(DDPLAUNCH), env.get("PATH", "/usr/bin:/bin")]),
                   FAKE_SLURM_DIR=tmp, CHECKPOINT_DIR=checkpoints, HOME=tmp,
                   SLURM_JOB_ID="9876", SLURM_JOB_NAME="ddp-train", SLURM_NNODES="1")
        p = spawn(["bash", SBATCH], env=env, cwd=tmp, name="train.sbatch")
        self.addCleanup(p.kill)
        wait_for(lambda: os.path.exists(os.path.join(tmp, "train.pid")) or p.poll() is not None, 60,
                 "the training program to start")
        self.assertIsNone(p.poll(), p.describe())
        p.signal(signal.SIGUSR1)  # Slurm's --signal=B:USR1@180, to the batch shell only
        try:
            code = p.wait(60)
        except TimeoutError as e:
            self.fail(str(e))
        self.assertEqual(code, 128 + signal.SIGTERM, p.describe())
        with open(os.path.join(tmp, "scontrol.log")) as f:
            self.assertEqual(f.read().split(), ["requeue", "9876"])
        with open(os.path.join(checkpoints, "checkpoint")) as f:
            self.assertEqual(f.read(), "step 7")
        out = p.output()
        self.assertIn("time limit near: requeueing job 9876", out)
        self.assertIn("from Slurm:", out)
        self.assertIn("--rdzv_id=9876 (SLURM_JOB_ID)", out)
        self.assertNotIn("SIGKILL", out, p.describe())


if __name__ == "__main__":
    unittest.main()
