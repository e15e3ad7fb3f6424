"""`ddp-rendezvous status` shows what the workers report: each node's last step and last saved
checkpoint, and the checkpoint interval the workers' automatic cadence chose
(ddplaunch.checkpoint_due). A real daemon, a real agent, real Python workers with torch that save
through ddplaunch.save; the progress travels worker -> progress slot -> agent -> heartbeat ->
daemon -> status, in text and in JSON."""

import json
import os
import re
import unittest

from metrics_helpers import CONF, PYTHON, MetricsTestCase, wait_for

# Steps until OUT/release; saves once at step 5, then whenever checkpoint_due says so. The prior
# MTBF of one second puts the interval at its lower bound (10 s) whatever the save costs here.
SAVING_WORKER = r"""
import os, sys, time
import torch
import ddplaunch
out, ckpt = sys.argv[1], sys.argv[2]
step = 0
deadline = time.time() + 120
while not os.path.exists(os.path.join(out, "release")) and time.time() < deadline:
    step += 1
    ddplaunch.step(step)
    if step == 5 or ddplaunch.checkpoint_due(ckpt):
        ddplaunch.save({"step": torch.tensor(step)}, ckpt, step=step)
    time.sleep(0.02)
ddplaunch.wait_for_save()
"""


class StatusProgressTest(MetricsTestCase):
    def test_status_shows_the_last_step_checkpoint_and_the_workers_checkpoint_interval(self):
        self.start_daemon()
        worker = self.script("saving_worker.py", SAVING_WORKER)
        ckpt = os.path.join(self.tmp, "ckpt")
        job = self.spawn_launch(["--nnodes=1", "--nproc_per_node=2", "--rdzv_backend=c10d",
                                 "--rdzv_endpoint=127.0.0.1:%d" % self.port, "--rdzv_id=progress", "--rdzv_conf",
                                 CONF, "--standby=off", "--shutdown_timeout=5", "--python", PYTHON, worker,
                                 self.out, ckpt], env={"DDPLAUNCH_CHECKPOINT_MTBF": "1"})

        def reported():
            for j in json.loads(self.status("--json"))["jobs"]:
                node = j["nodes"][0] if j["job_id"] == "progress" and j["nodes"] else {}
                if j["job_id"] == "progress" and node.get("last_checkpoint", -1) >= 5 and j["checkpoint_interval"]:
                    return j
            return None

        doc = wait_for(lambda: reported() or (job.poll() is not None and "ended"), 90,
                       "status to show the job's checkpoint and interval")
        self.assertNotEqual(doc, "ended", job.describe())
        node = doc["nodes"][0]
        self.assertGreaterEqual(node["last_step"], node["last_checkpoint"])
        self.assertAlmostEqual(doc["checkpoint_interval"], 10.0, delta=0.01)
        self.assertAlmostEqual(node["checkpoint_interval"], 10.0, delta=0.01)

        text = self.status()
        print(text)
        self.assertIn("  checkpoints every 10 s (the workers' automatic cadence)\n", text)
        self.assertRegex(text, r"last_heartbeat\s+last_step\s+checkpoint\n")
        row = re.search(r"\n\s+0\s+\S+\s+127\.0\.0\.1\s+2\s+running\s+\d+\.\d s ago\s+(\d+)\s+(\d+)\n", text)
        self.assertIsNotNone(row, text)
        self.assertGreaterEqual(int(row.group(1)), int(row.group(2)))
        self.assertGreaterEqual(int(row.group(2)), 5)

        self.release()
        self.assertEqual(job.wait(60), 0, job.describe())
        # A finished job keeps the last that its node said.
        finished = wait_for(lambda: next((j for j in json.loads(self.status("--json"))["jobs"]
                                          if j["job_id"] == "progress" and j.get("finished")), None), 20,
                            "the finished job in status")
        self.assertGreaterEqual(finished["nodes"][0]["last_checkpoint"], 5)


if __name__ == "__main__":
    unittest.main()
