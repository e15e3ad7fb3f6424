"""In-memory restart of worker-SDK programs (docs/worker-sdk.md,
"In-memory restart"): a worker whose peer failed keeps its process, model and optimizer, and a
replacement receives the state from it instead of reading a checkpoint.

One ddplaunch with two `train` workers. Once both make steps, the checkpoint directory is made
unreadable (a regular file takes its place: listing it fails, so a worker that tried to resume
from it would exit with an error) and rank 1 is SIGKILLed. The agent restarts the round; rank 0
parks and continues in the next one with the same pid; rank 1 starts fresh and receives rank 0's
state. The directory comes back once the new round makes steps, for the final checkpoint. The
job must end with exit 0, continue from the step it reached (no step before it made again but
the one in flight), and use every sample of every epoch exactly once.
Every process is killed in cleanup; every wait has a deadline.
"""

import os
import re
import signal
import shutil
import sys
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "e2e"))
from ddplaunch_helpers import BUILD_DIR, LaunchTestCase  # noqa: E402
from processes import wait_for  # noqa: E402
import elastic_job  # noqa: E402

TRAIN = os.path.join(BUILD_DIR, "bin", "train")
PID_RE = re.compile(r"^\[train\] rank (\d+) pid (\d+) generation (\d+)$", re.M)
SAMPLES, BATCH, EPOCHS = 1024, 16, 4   # 32 steps per epoch at 2 workers


class InMemoryRestart(LaunchTestCase):
    def rounds(self):
        """elastic_job.Round objects from the sample logs, by generation."""
        rounds = {}
        for name in os.listdir(self.out):
            m = re.match(r"^g(\d+)-r\d+\.log$", name)
            if not m:
                continue
            r = rounds.setdefault(int(m.group(1)), elastic_job.Round(int(m.group(1))))
            with open(os.path.join(self.out, name)) as f:
                for line in f:
                    rec = elastic_job.RECORD_RE.match(line.strip())
                    if rec:
                        idx = [int(i) for i in rec.group(6).split(",") if i]
                        r.records.append((int(rec.group(2)), int(rec.group(3)), int(rec.group(4)),
                                          int(rec.group(5)), idx))
        return [rounds[g] for g in sorted(rounds)]

    def steps_of(self, nth):
        """The steps recorded by the nth round (0: the first) so far."""
        rounds = self.rounds()
        return rounds[nth].steps if len(rounds) > nth else []

    def pids(self, output):
        """{(generation, rank): pid} from the workers' announcements."""
        return {(int(g), int(r)): int(p) for r, p, g in PID_RE.findall(output)}

    def test_a_survivor_keeps_its_process_and_a_replacement_receives_its_state(self):
        if not os.path.exists(TRAIN):
            self.skipTest("the worker SDK's train program is not built (DDPLAUNCH_BUILD_WORKER_SDK=OFF)")
        ckpt = os.path.join(self.out, "ckpt")
        os.makedirs(ckpt)
        proc = self.spawn_launch([
            "--standalone", "--nproc_per_node=2", "--max_restarts=2", "--in_memory_restart=on", "--no_python", TRAIN,
            "--epochs", str(EPOCHS), "--samples", str(SAMPLES), "--batch-size", str(BATCH), "--step-sleep", "0.05",
            "--checkpoint-dir", ckpt, "--sample-log", os.path.join(self.out, "g{generation}-r{rank}.log")])
        wait_for(lambda: len(self.steps_of(0)) >= 10 or proc.poll() is not None, 120, "the first round's steps")
        self.assertIsNone(proc.poll(), proc.output())
        g0 = self.rounds()[0].generation
        first = self.pids(proc.output())
        self.assertIn((g0, 0), first, proc.output())
        self.assertIn((g0, 1), first, proc.output())

        shutil.move(ckpt, ckpt + ".away")
        with open(ckpt, "w") as f:
            f.write("not a directory: a worker that reads checkpoints now fails\n")
        os.kill(first[(g0, 1)], signal.SIGKILL)
        wait_for(lambda: len(self.steps_of(1)) >= 10 or proc.poll() is not None, 120, "the next round's steps")
        os.unlink(ckpt)
        shutil.move(ckpt + ".away", ckpt)

        self.assertEqual(proc.wait(180), 0, proc.output())
        out = proc.output()
        pids = self.pids(out)
        rounds = self.rounds()
        self.assertEqual(len(rounds), 2, rounds)
        g1 = rounds[1].generation
        self.assertEqual(pids.get((g1, 0)), first[(g0, 0)], "rank 0 kept its process\n" + out)
        self.assertNotIn(pids.get((g1, 1)), (None, first[(g0, 1)]), "rank 1 is a new process\n" + out)
        self.assertIn("rank 1: received the state rank 0 sent", out)
        self.assertNotIn("resumed from " + ckpt, out)
        # The new round starts at the last step that completed: the step in flight when rank 1
        # died (recorded, completed on rank 0 or not), or the one after the last recorded step
        # when rank 0 saw the restart before it began that step.
        self.assertIn(rounds[0].steps[-1] - rounds[1].steps[0], (-1, 0, 1), rounds)
        self.assertEqual(elastic_job.sample_accounting(rounds, SAMPLES, EPOCHS), [], rounds)
        self.assertTrue(any(n.startswith("ckpt-") for n in os.listdir(ckpt)), "the final checkpoint")


if __name__ == "__main__":
    unittest.main(verbosity=2)
