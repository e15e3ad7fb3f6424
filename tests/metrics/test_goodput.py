"""The daemon's goodput account of a real job (docs/goodput.md): a real daemon, two real agents,
Python workers that step, save through ddplaunch.save and resume through ddplaunch.load; one worker
crashes once. Its categories add up to its wall time within 1%, the crash costs lost work and
recovery, the account shows in `status` (JSON and text) and on /metrics, and one agent of the
job, not both, prints the goodput line at the end."""

import json
import os
import re
import unittest

from metrics_helpers import CONF, PYTHON, MetricsTestCase, http_get, samples, wait_for

# Steps every 20 ms up to step 260; rank 0 saves every 50 steps (a 16 MB tensor: its snapshot is
# the save's stall), in the first attempt up to step 100 only; rank 1 exits 1 at step 140 of the
# first attempt. The workers do not wait for each other, so rank 0 goes on until it is stopped.
# The restarted round resumes from step 100: what the first round did after it (40 steps or more,
# 0.8 s) is done twice.
WORKER = r"""
import os, sys, time
import torch
import ddplaunch
out, ckpt = sys.argv[1], sys.argv[2]
rank, attempt = int(os.environ["RANK"]), int(os.environ["TORCHELASTIC_RESTART_COUNT"])
state = ddplaunch.load(ckpt)
step = int(state["step"]) if state else 0
open(os.path.join(out, "started-%d-%d" % (rank, attempt)), "w").close()
weights = torch.zeros(4 * 1024 * 1024)
while step < 260:
    step += 1
    time.sleep(0.02)
    ddplaunch.step(step)
    if step % 50 == 0 and (attempt > 0 or step <= 100):
        ddplaunch.save({"step": torch.tensor(step), "weights": weights}, ckpt, step=step)
    if rank == 1 and attempt == 0 and step == 140:
        sys.exit(1)
ddplaunch.wait_for_save()
"""


class GoodputTest(MetricsTestCase):
    def job(self, finished):
        for j in json.loads(self.status("--json"))["jobs"]:
            if j["job_id"] == "gp" and bool(j.get("finished")) == finished:
                return j
        return None

    def test_a_crash_costs_lost_work_and_recovery_and_the_categories_add_up(self):
        self.start_daemon()
        worker = self.script("worker.py", WORKER)
        ckpt = os.path.join(self.tmp, "ckpt")
        args = ["--nnodes=2", "--nproc_per_node=1", "--rdzv_backend=c10d", "--rdzv_endpoint=127.0.0.1:%d" % self.port,
                "--rdzv_id=gp", "--rdzv_conf", CONF, "--max_restarts=1", "--standby=off", "--shutdown_timeout=5",
                "--python", PYTHON, worker, self.out, ckpt]
        agents = [self.spawn_launch(args) for _ in range(2)]

        # While the second round trains: the account on /metrics, by category, and in status.
        def second_round():
            j = self.job(False)
            steps = [n.get("last_step", -1) for n in j["nodes"]] if j else []
            return j if j and j["generation"] == 2 and steps and min(steps) > 160 else None

        running = wait_for(lambda: second_round() or (any(a.poll() is not None for a in agents) and "ended"), 120,
                           "the second round to train")
        self.assertNotEqual(running, "ended", "\n".join(a.describe() for a in agents))
        self.assertEqual(running["goodput"]["restarts"], 1)
        status, _, body = http_get(self.metrics_port, "/metrics")
        self.assertEqual(status, 200)
        got = samples(body)
        for category in running["goodput"]["seconds"]:
            self.assertIn('ddp_rendezvous_goodput_seconds{category="%s",job="gp"}' % category, got)
        ratio = got['ddp_rendezvous_goodput_ratio{job="gp"}']
        self.assertTrue(0 < ratio < 1, ratio)

        for a in agents:
            self.assertEqual(a.wait(120), 0, a.describe())
        end = wait_for(lambda: self.job(True), 20, "the finished job in status")
        g = end["goodput"]
        print(json.dumps(g, indent=2))
        seconds = g["seconds"]
        self.assertAlmostEqual(sum(seconds.values()), g["wall_seconds"], delta=0.01 * g["wall_seconds"])
        self.assertEqual(g["restarts"], 1)
        # 40 steps of 20 ms or more were done twice; the steps are seen at most every 2 s.
        self.assertGreater(seconds["lost"], 0.4)
        self.assertLess(seconds["lost"], 0.6 * g["wall_seconds"])
        self.assertGreater(seconds["recovery"], 0)  # stopping, rendezvous, start-up, checkpoint load
        self.assertGreater(seconds["productive"], 0)
        self.assertEqual(seconds["hang"], 0)           # a crash, not a hang
        self.assertEqual(seconds["reduced_capacity"], 0)  # both rounds ran at MAX
        self.assertAlmostEqual(g["percent"], 100 * seconds["productive"] / g["wall_seconds"], delta=0.1)

        # One agent of the job says the line, the same as the daemon's and status's.
        lines = [line for a in agents for line in a.output().splitlines() if "job gp: goodput " in line]
        self.assertEqual(len(lines), 1, "\n".join(a.describe() for a in agents))
        self.assertIn("goodput %.1f%% of " % g["percent"], lines[0])
        self.assertRegex(lines[0], r"lost to 1 restart")
        self.assertIn("job gp: goodput %.1f%% of " % g["percent"], self.daemon.output())
        text = self.status()
        self.assertRegex(text, r"\n  goodput %s%% of [^\n]*lost to 1 restart" % re.escape("%.1f" % g["percent"]))


if __name__ == "__main__":
    unittest.main()
