"""`train --checkpoint-every=auto` with real processes: the Trainer checkpoints at the interval the
Python side's policy gives (python/ddplaunch/cadence.py), from the same history file, in the same
format, both ways: a history the Python side wrote is taken up, and the one `train` leaves is read
by the Python reader. A launch that crashed is a failure the next one counts. A bad
DDPLAUNCH_CHECKPOINT_MTBF or --checkpoint-every is refused clearly.

No timing is asserted: DDPLAUNCH_CHECKPOINT_MTBF=1 makes the interval its lower bound, 10 s, and
--step-sleep makes the first run last longer than that (a slower machine only makes it longer)."""
import glob
import os
import re
import struct
import sys
import tempfile
import unittest

import sdk_harness as h

SOURCE_DIR = os.path.abspath(os.environ.get("DDPLAUNCH_SOURCE_DIR", os.path.join(os.path.dirname(__file__), "..", "..")))
sys.path.insert(0, os.path.join(SOURCE_DIR, "python"))
from ddplaunch import cadence  # noqa: E402

ARGS = ["--samples", "256", "--batch-size", "32", "--log-every", "0", "--epochs", "1000", "--checkpoint-every=auto"]
MTBF = {"DDPLAUNCH_CHECKPOINT_MTBF": "1"}
SLOT_SIZE, INTERVAL_OFFSET = 128, 64  # contracts/progress_slot.h


def said(out):
    return [line for line in out.splitlines() if "checkpoint every" in line]


class AutoCadence(unittest.TestCase):
    def train(self, ckpt, extra, expect=0, rank_env=None):
        results = h.run(2, ARGS + ["--checkpoint-dir", ckpt] + extra, timeout=180, extra_env=MTBF, rank_env=rank_env)
        for r in results:
            self.assertEqual(r.returncode, expect, r)
        self.assertEqual(said(results[1].stdout + results[1].stderr), [], results[1])  # rank 0 speaks
        return results[0]

    def history(self, ckpt):
        lines = []
        reader = cadence.Cadence(ckpt, env={"RANK": "1"}, say=lines.append)  # rank 1: writes nothing
        record = reader._read()
        self.assertEqual(lines, [])
        self.assertIsNotNone(record)
        return record

    def test_checkpoints_at_the_lower_bound_with_the_python_sides_history(self):
        with tempfile.TemporaryDirectory() as d:
            ckpt = os.path.join(d, "ckpt")
            # A launch of the Python side measured a stall of 0.25 s and ended normally.
            py = cadence.Cadence(ckpt, env={"RANK": "0", "TORCHELASTIC_RESTART_COUNT": "0"}, say=print)
            py.saved(0.25)
            py.exited()

            # Each worker's progress slot, as an agent would map it: both report rank 0's interval.
            board = os.path.join(d, "progress")
            with open(board, "wb") as f:
                f.write(bytes(2 * SLOT_SIZE))
            slots = {rank: {"DDPLAUNCH_PROGRESS_FILE": board, "DDPLAUNCH_PROGRESS_SLOT": str(rank)} for rank in (0, 1)}

            # 240 steps of at least 50 ms: longer than the 10 s interval. The stall is known from
            # the history: the line comes at the first step, once (the interval stays 10 s).
            r = self.train(ckpt, ["--max-steps", "240", "--step-sleep", "0.05"], rank_env=slots)
            lines = said(r.stdout)
            self.assertEqual(len(lines), 1, r)
            self.assertRegex(lines[0], r"^\[ddp\] checkpoint every 10 s, the lower bound \(save stall 0\.25 s, MTBF "
                                       r"estimate 1 s from 0 failures in \d+ s and a prior of 1 s\)$")
            periodic = int(h.value(r.stdout, "checkpoints_saved"))
            self.assertGreaterEqual(periodic, 1, r)
            saved = re.findall(r"saved checkpoint (\S+) \(step (\d+),", r.stdout)
            self.assertEqual(len(saved), periodic + 1, r)  # and the final one
            self.assertLess(int(saved[0][1]), 240)
            for path in glob.glob(os.path.join(ckpt, "ckpt-*.ddpckpt")):
                self.assertIsNone(h.checkpoint_problem(path), path)
            with open(board, "rb") as f:
                data = f.read()
            self.assertEqual([struct.unpack_from("<Q", data, rank * SLOT_SIZE + INTERVAL_OFFSET)[0] for rank in (0, 1)],
                             [10000, 10000])  # milliseconds

            # cadence.json as the Python side reads it: one launch before this one, no failure,
            # this one ended normally, the stall moved by this run's save(s).
            record = self.history(ckpt)
            self.assertEqual((record["format"], record["past"]["launches"], record["past"]["failures"]), (1, 1, 0))
            self.assertEqual((record["current"]["restarts"], record["current"]["ended"]), (0, True))
            self.assertIsNone(record["current"]["run_id"])
            if periodic == 1:
                stall = float(h.value(r.stdout, "checkpoint_stall_s"))
                self.assertAlmostEqual(record["stall"], 0.7 * 0.25 + 0.3 * stall, places=4)
            self.assertNotEqual(record["stall"], 0.25)
            decision = cadence.Cadence(ckpt, env={"RANK": "1", "DDPLAUNCH_CHECKPOINT_MTBF": "1"}).decision()
            self.assertEqual((decision.interval, decision.failures), (10.0, 0))

            # A launch that crashes (exit 13 before its first step) did not end normally: the next
            # launch counts it as a failure and says so.
            self.train(ckpt, ["--max-steps", "250", "--crash-at-step", "240"], expect=13)
            r = self.train(ckpt, ["--max-steps", "250"])
            lines = said(r.stdout)
            self.assertEqual(len(lines), 1, r)
            self.assertRegex(lines[0], r"from 1 failure in \d+ s and a prior of 1 s\)$")
            record = self.history(ckpt)
            self.assertEqual((record["past"]["launches"], record["past"]["failures"], record["current"]["ended"]),
                             (3, 1, True))


class BadInput(unittest.TestCase):
    def refused(self, args, env, message):
        r = h.run(1, args, single=True, extra_env=env)[0]
        self.assertEqual(r.returncode, 2, r)
        self.assertIn(message, r.stderr)

    def test_a_bad_prior_or_flag_is_refused_clearly(self):
        with tempfile.TemporaryDirectory() as d:
            ckpt = os.path.join(d, "ckpt")
            self.refused(["--checkpoint-dir", ckpt, "--checkpoint-every=auto"], {"DDPLAUNCH_CHECKPOINT_MTBF": "1h"},
                         "train: error: DDPLAUNCH_CHECKPOINT_MTBF='1h': the prior mean time between failures must be "
                         "a positive number of seconds (e.g. DDPLAUNCH_CHECKPOINT_MTBF=7200 for two hours)")
            self.assertFalse(os.path.exists(os.path.join(ckpt, "cadence.json")))
        self.refused(["--checkpoint-every=auto"], {}, "train: error: Trainer: checkpoint_auto needs a checkpoint_dir")
        self.refused(["--checkpoint-every=often"], {}, "must be a number of steps or auto, not 'often'")


if __name__ == "__main__":
    unittest.main()
