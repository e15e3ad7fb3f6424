"""ddplaunch.checkpoint_due (python/ddplaunch/cadence.py, docs/checkpoints.md "How often"): the
Young/Daly interval sqrt(2 C M) from the measured save stall C and the job's MTBF estimate M,
within its bounds; the job's failure history kept in the checkpoint directory across processes
and launches; a worker killed under ddplaunch is a failure the next attempt counts.

The policy runs on a fake clock (no sleep decides anything); the history is carried by real
processes, one killed with SIGKILL, and by a real ddplaunch job whose worker is killed."""

import json
import math
import os
import re
import shutil
import sys
import tempfile
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ddplaunch_helpers import DDPLAUNCH, PYTHON, main, run  # noqa: E402

SOURCE_DIR = os.path.abspath(os.environ.get("DDPLAUNCH_SOURCE_DIR", os.path.join(os.path.dirname(__file__), "..", "..")))
PYTHON_DIR = os.path.join(SOURCE_DIR, "python")
sys.path.insert(0, PYTHON_DIR)

from ddplaunch import cadence  # noqa: E402
from ddplaunch.checkpoints import CheckpointError  # noqa: E402

HOUR = 3600.0


class Policy(unittest.TestCase):
    def test_the_interval_is_young_daly_of_the_stall_and_the_estimated_mtbf_within_bounds(self):
        # (stall C, failures, exposure s, prior MTBF s) -> (MTBF estimate, interval, bound), by hand:
        # M = (900 + exposure) / (900 / prior + failures); T = sqrt(2 C M) within
        # [max(10, 10 C) (at most 1 h), 1 h].
        table = [
            ((1.0, 0, 0.0, HOUR), (3600.0, math.sqrt(7200.0), None)),               # the prior alone: 84.9 s
            ((0.5, 3, 2700.0, HOUR), (3600.0 / 3.25, math.sqrt(3600.0 / 3.25), None)),  # 1107.7 s -> 33.3 s
            ((1.0, 10, 300.0, HOUR), (1200.0 / 10.25, 15.30, None)),               # a crash every 30 s
            ((1.0, 100, 3000.0, HOUR), (3900.0 / 100.25, 10.0, "lower")),          # sqrt(77.8) = 8.8 s < 10 s
            ((None, 0, 0.0, HOUR), (3600.0, 10.0, "lower")),                       # no save measured yet
            ((0.01, 0, 0.0, HOUR), (3600.0, 10.0, "lower")),                       # sqrt(72) = 8.5 s
            ((5.0, 30, 900.0, HOUR), (1800.0 / 30.25, 50.0, "lower")),             # 24.4 s < 10 C
            ((10.0, 0, 36000.0, HOUR), (147600.0, math.sqrt(2952000.0), None)),    # 10 h without a failure: 1718 s
            ((100.0, 0, 36000.0, HOUR), (147600.0, 3600.0, "upper")),              # 5433 s > 1 h
            ((1000.0, 1, 0.0, HOUR), (900.0 / 1.25, 3600.0, "lower")),             # 10 C above 1 h: 1 h
            ((1.0, 0, 0.0, 7200.0), (7200.0, 120.0, None)),                        # DDPLAUNCH_CHECKPOINT_MTBF=7200
            ((1.0, 1, 600.0, 86400.0), (1500.0 / (900.0 / 86400.0 + 1), None, None)),
        ]
        for (stall, failures, exposure, prior), (mtbf, interval, bound) in table:
            with self.subTest(stall=stall, failures=failures, exposure=exposure, prior=prior):
                d = cadence.decide(stall, failures, exposure, prior)
                self.assertAlmostEqual(d.mtbf, mtbf, places=6)
                if interval is None:
                    interval = math.sqrt(2 * stall * mtbf)
                self.assertAlmostEqual(d.interval, interval, places=2)
                self.assertEqual(d.bound, bound)

    def test_the_line_in_the_docs_is_what_it_says(self):
        with open(os.path.join(SOURCE_DIR, "docs", "checkpoints.md")) as f:
            doc = f.read()
        line = re.search(r"^ddplaunch: (checkpoint every .*)$", doc, re.M).group(1)
        # 3 failures in 40 min: M = (900 + 2400) / 3.25 = 1015 s, T = sqrt(2 * 0.8 * 1015) = 40.3 s
        self.assertEqual(cadence.describe(cadence.decide(0.8, 3, 2400.0)), line)

    def test_the_prior_comes_from_the_environment_and_a_bad_one_is_refused_clearly(self):
        self.assertEqual(cadence.prior_mtbf({}), HOUR)
        self.assertEqual(cadence.prior_mtbf({"DDPLAUNCH_CHECKPOINT_MTBF": "7200"}), 7200.0)
        for bad in ("abc", "0", "-5", "inf", "nan"):
            with self.subTest(value=bad), self.assertRaises(CheckpointError) as caught:
                cadence.prior_mtbf({"DDPLAUNCH_CHECKPOINT_MTBF": bad})
            self.assertIn("DDPLAUNCH_CHECKPOINT_MTBF=%r: the prior mean time between failures must be a positive "
                          "number of seconds" % bad, str(caught.exception))

    def test_a_new_launch_closes_the_last_counting_its_restarts_and_an_abnormal_end(self):
        def record(restarts, ended, run_id="job", start=100.0, seen=160.0):
            r = cadence.fresh(start, restarts, run_id)
            r["current"].update(seen=seen, ended=ended)
            return r

        # (record, now, restarts, run id) -> (failures, exposure at now + 10, launches before this one)
        table = [
            ((None, 1000.0, 0, "job"), (0, 10.0, 0)),                    # the first launch in this directory
            ((record(1, False), 1000.0, 2, "job"), (2, 910.0, 0)),       # a restart of the same launch
            ((record(2, False), 1000.0, 0, "job"), (3, 70.0, 1)),        # a relaunch after a crash: +1
            ((record(2, True), 1000.0, 0, "job"), (2, 70.0, 1)),         # after rank 0's normal exit: +0
            ((record(0, True), 1000.0, 0, None), (0, 70.0, 1)),          # no launcher: each process a launch
            ((record(1, False), 1000.0, 3, "other"), (2 + 3, 70.0, 1)),  # another run id: a new launch
            ((record(3, False), 1000.0, 1, "job"), (4 + 1, 70.0, 1)),    # its first round's rank 0 not seen
        ]
        for (previous, now, restarts, run_id), (failures, exposure, launches) in table:
            with self.subTest(previous=previous, restarts=restarts, run_id=run_id):
                r = cadence.advance(previous, now, restarts, run_id)
                self.assertEqual(cadence.failures_and_exposure(r, now + 10), (failures, exposure))
                self.assertEqual(r["past"]["launches"], launches)


class FakeClock(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.mkdtemp(prefix="ddplaunch_cadence_")
        self.addCleanup(shutil.rmtree, self.tmp, True)
        self.now = 0.0
        self.lines = []

    def cadence(self, env=None):
        env = dict({"RANK": "0", "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_RUN_ID": "job"}, **(env or {}))
        return cadence.Cadence(self.tmp, clock=lambda: self.now, wall=lambda: 1e9 + self.now, env=env,
                               say=self.lines.append)

    def history(self):
        with open(os.path.join(self.tmp, "cadence.json")) as f:
            return json.load(f)

    def test_a_save_is_due_at_the_lower_bound_until_measured_then_at_the_interval(self):
        c = self.cadence()
        self.assertFalse(c.due())
        self.now = 9.99
        self.assertFalse(c.due())
        self.now = 10.0  # C unknown: the lower bound, 10 s after the first call
        self.assertTrue(c.due())
        c.saved(1.0)     # the save stalled the caller 1 s
        interval = math.sqrt(2 * 1.0 * (900 + 10.0) / 0.25)  # 85.3 s
        self.assertAlmostEqual(c.decision().interval, interval, places=6)
        # M grows with the exposure: at t = 99 s, T = sqrt(2 (900 + 99) / 0.25) = 89.4 s, not yet
        # 89 s since the save; at t = 100 s, T = 89.44 s <= 90 s: due.
        self.now = 99.0
        self.assertFalse(c.due())
        self.now = 100.0
        self.assertTrue(c.due())
        c.saved(3.0)  # the moving average: 0.7 * 1 + 0.3 * 3
        self.assertAlmostEqual(c.decision().stall, 1.6)
        self.assertAlmostEqual(self.history()["stall"], 1.6)

    def test_rank_0_says_the_interval_when_it_changes_twofold_and_an_in_memory_restart_is_a_failure(self):
        env = {"RANK": "0", "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_RUN_ID": "job"}
        c = self.cadence()
        c.env = env
        c.due()
        self.assertEqual(self.lines, [], "nothing said before the stall is measured")
        c.saved(1.0)
        c.due()
        self.assertEqual(self.lines, ["checkpoint every 85 s (save stall 1.00 s, MTBF estimate 60 min from 0 failures "
                                      "in 0 s and a prior of 60 min)"])
        self.now = 600.0
        c.due()
        self.assertEqual(len(self.lines), 1, "85 s -> 100 s: not said")
        env["TORCHELASTIC_RESTART_COUNT"] = "3"  # the same process, three rounds later
        self.assertEqual(c.decision().failures, 3)  # M = (900 + 600) / 3.25 = 462 s, T = sqrt(923) = 30.4 s
        self.assertEqual(self.lines[1], "checkpoint every 30 s (save stall 1.00 s, MTBF estimate 8 min from 3 "
                                        "failures in 10 min and a prior of 60 min)")
        self.assertEqual(self.history()["current"]["restarts"], 3)
        env["RANK"] = "1"  # another rank: it decides alike, says nothing and writes nothing
        env["TORCHELASTIC_RESTART_COUNT"] = "30"
        os.remove(os.path.join(self.tmp, "cadence.json"))
        self.assertEqual(c.decision().failures, 30)
        self.assertEqual(len(self.lines), 2)
        self.assertFalse(os.path.exists(os.path.join(self.tmp, "cadence.json")))

    def test_a_damaged_history_is_said_and_started_afresh(self):
        no_run_id = json.dumps({"format": 1, "past": {"launches": 0, "failures": 0, "exposure": 0},
                                "current": {"start": 0, "seen": 0, "restarts": 0, "ended": False}})
        for text in ("{not json", '{"format": 1, "past": 3}', '{"format": 99}', no_run_id):
            with self.subTest(text=text):
                with open(os.path.join(self.tmp, "cadence.json"), "w") as f:
                    f.write(text)
                self.lines.clear()
                c = self.cadence({"TORCHELASTIC_RESTART_COUNT": "2"})
                self.assertEqual(c.decision().failures, 2)
                self.assertEqual(len(self.lines), 1)
                self.assertRegex(self.lines[0], r"cadence\.json .*starting the job's failure history afresh")
                self.assertEqual(self.history()["current"]["restarts"], 2)

    def test_bad_environment_values_are_refused_clearly(self):
        for env, message in (({"TORCHELASTIC_RESTART_COUNT": "x"}, "TORCHELASTIC_RESTART_COUNT='x' is not a number"),
                             ({"RANK": "r"}, "RANK='r' is not a number"),
                             ({"DDPLAUNCH_CHECKPOINT_MTBF": "1h"}, "DDPLAUNCH_CHECKPOINT_MTBF='1h'")):
            with self.subTest(env=env), self.assertRaises(CheckpointError) as caught:
                self.cadence(env).due()
            self.assertIn(message, str(caught.exception))
        with self.assertRaises(CheckpointError):
            cadence.checkpoint_due(os.path.join(self.tmp, "cadence.json"))  # a file, not a directory


CHILD = r'''
import json, os, signal, sys
import ddplaunch
from ddplaunch import cadence
d, action = sys.argv[1], sys.argv[2]
ddplaunch.checkpoint_due(d)
if action == "save":
    import torch
    ddplaunch.save({"w": torch.zeros(1000)}, d)
    ddplaunch.wait_for_save()
print(json.dumps(cadence._for(d).decision()._asdict()), flush=True)
if action == "kill":
    os.kill(os.getpid(), signal.SIGKILL)
if action == "raise":
    raise RuntimeError("the training failed")
'''


class Processes(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.mkdtemp(prefix="ddplaunch_cadence_")
        self.addCleanup(shutil.rmtree, self.tmp, True)
        self.dir = os.path.join(self.tmp, "ckpt")
        self.script = os.path.join(self.tmp, "child.py")
        with open(self.script, "w") as f:
            f.write(CHILD)

    def child(self, action, restarts, run_id="job"):
        env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHELASTIC_", "DDPLAUNCH_"))}
        env.update(PYTHONPATH=PYTHON_DIR, RANK="0", TORCHELASTIC_RESTART_COUNT=str(restarts),
                   TORCHELASTIC_RUN_ID=run_id)
        r = run([PYTHON, self.script, self.dir, action], timeout=120, env=env, cwd=self.tmp)
        self.assertFalse(r.timed_out, r.describe())
        return r, json.loads(r.stdout.splitlines()[0])

    def test_the_history_carries_across_processes_and_launches(self):
        r, first = self.child("save", 0)
        self.assertEqual(r.returncode, 0, r.describe())
        self.assertEqual(first["failures"], 0)
        self.assertIsNotNone(first["stall"])
        self.assertIn("checkpoint every 10 s, the lower bound (save stall", r.stderr)  # a small state: C well under 1 s
        r, second = self.child("nothing", 2)  # the same launch, two restarts later: a new process
        self.assertEqual((r.returncode, second["failures"]), (0, 2), r.describe())
        self.assertEqual(second["stall"], first["stall"], "the stall measured by the first process")
        r, third = self.child("kill", 0)  # a relaunch after rank 0's normal exit: no failure more
        self.assertEqual((r.returncode, third["failures"]), (-9, 2), r.describe())
        r, fourth = self.child("raise", 0)  # after a launch killed: one more
        self.assertNotEqual(r.returncode, 0)
        self.assertEqual(fourth["failures"], 3, r.describe())
        r, fifth = self.child("nothing", 0)  # after an uncaught exception: one more
        self.assertEqual((r.returncode, fifth["failures"]), (0, 4), r.describe())
        with open(os.path.join(self.dir, "cadence.json")) as f:
            history = json.load(f)
        self.assertEqual(history["past"]["launches"], 3)
        self.assertTrue(history["current"]["ended"])


WORKER = r'''
import json, os, signal, sys, time
import ddplaunch, torch
d, out = sys.argv[1], sys.argv[2]
rank, attempt = int(os.environ["RANK"]), int(os.environ["TORCHELASTIC_RESTART_COUNT"])
ddplaunch.checkpoint_due(d)
if rank == 0:
    ddplaunch.save({"w": torch.zeros(1000)}, d)   # measures the save stall
    ddplaunch.wait_for_save()
    with open(os.path.join(out, "attempt%d.json" % attempt), "w") as f:
        json.dump({"interval": ddplaunch.checkpoint_interval(d)}, f)
elif attempt == 0:  # the first attempt loses rank 1 once rank 0 has decided
    deadline = time.monotonic() + 60
    while not os.path.exists(os.path.join(out, "attempt0.json")) and time.monotonic() < deadline:
        time.sleep(0.01)
    os.kill(os.getpid(), signal.SIGKILL)
'''


class UnderDDPlaunch(unittest.TestCase):
    def test_a_killed_worker_is_a_failure_that_the_next_attempt_counts(self):
        if not os.path.exists(DDPLAUNCH):
            self.fail("ddplaunch not built: %s" % DDPLAUNCH)
        tmp = tempfile.mkdtemp(prefix="ddplaunch_cadence_")
        self.addCleanup(shutil.rmtree, tmp, True)
        # The ddplaunch under test with this source tree's python/ as its helper (where an
        # installed ddplaunch looks first).
        prefix = os.path.join(tmp, "prefix")
        os.makedirs(os.path.join(prefix, "bin"))
        os.makedirs(os.path.join(prefix, "share", "ddplaunch"))
        shutil.copy2(DDPLAUNCH, os.path.join(prefix, "bin", "ddplaunch"))
        os.symlink(PYTHON_DIR, os.path.join(prefix, "share", "ddplaunch", "python"))
        script, out, ckpt = os.path.join(tmp, "worker.py"), os.path.join(tmp, "out"), os.path.join(tmp, "ckpt")
        os.mkdir(out)
        with open(script, "w") as f:
            f.write(WORKER)
        env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHELASTIC_", "DDPLAUNCH_", "PYTHONPATH"))}
        env["TMPDIR"] = tmp
        r = run([os.path.join(prefix, "bin", "ddplaunch"), "--nproc_per_node=2", "--max_restarts=1", "--standby=off",
                 "--python", PYTHON, script, ckpt, out], timeout=300, env=env, cwd=tmp)
        self.assertFalse(r.timed_out, r.describe())
        self.assertEqual(r.returncode, 0, r.describe())
        said = [line for line in r.stderr.splitlines() if re.search(r"ddplaunch \(rank 0\): checkpoint every", line)]
        self.assertEqual(len(said), 2, r.describe())
        self.assertRegex(said[0], r"from 0 failures in \d+ s and a prior of 60 min\)$")
        self.assertRegex(said[1], r"from 1 failure in \d+ s and a prior of 60 min\)$")
        self.assertEqual(sorted(os.listdir(out)), ["attempt0.json", "attempt1.json"])
        with open(os.path.join(ckpt, "cadence.json")) as f:
            history = json.load(f)
        self.assertEqual((history["past"]["launches"], history["current"]["restarts"], history["current"]["ended"]),
                         (0, 1, True))


if __name__ == "__main__":
    main()
