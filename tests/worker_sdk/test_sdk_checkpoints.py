"""Checkpoint fallback with real files: a corrupt newest checkpoint is skipped with a warning
that names it; with none valid, training starts fresh and says so."""
import glob
import os
import tempfile
import unittest

import sdk_harness as h

ARGS = ["--samples", "256", "--batch-size", "32", "--checkpoint-every", "4", "--log-every", "0"]


class CheckpointFallbackTest(unittest.TestCase):
    def train(self, ckpt, epochs):
        results = h.run(1, ARGS + ["--checkpoint-dir", ckpt, "--epochs", str(epochs)], single=True)
        self.assertEqual(results[0].returncode, 0, results[0])
        return results[0].stdout

    def test_a_corrupt_newest_checkpoint_is_skipped_with_a_warning_naming_it(self):
        with tempfile.TemporaryDirectory() as d:
            ckpt = os.path.join(d, "ckpt")
            self.train(ckpt, 1)  # 8 steps: checkpoints at 4 and 8
            files = sorted(glob.glob(os.path.join(ckpt, "ckpt-*.ddpckpt")))
            self.assertEqual([os.path.basename(f) for f in files],
                             ["ckpt-000000000004.ddpckpt", "ckpt-000000000008.ddpckpt"])
            with open(files[-1], "r+b") as f:
                f.seek(200)
                byte = f.read(1)
                f.seek(200)
                f.write(bytes([byte[0] ^ 0xFF]))
            out = self.train(ckpt, 2)
            self.assertIn("warning: skipping invalid checkpoint: checkpoint " + files[-1], out)
            self.assertIn("checksum mismatch", out)
            self.assertEqual(h.value(out, "resumed_from_step"), "4")
            self.assertEqual(h.value(out, "steps"), "16")

    def test_a_truncated_checkpoint_is_skipped(self):
        with tempfile.TemporaryDirectory() as d:
            ckpt = os.path.join(d, "ckpt")
            self.train(ckpt, 1)
            newest = sorted(glob.glob(os.path.join(ckpt, "ckpt-*.ddpckpt")))[-1]
            os.truncate(newest, os.path.getsize(newest) // 2)
            out = self.train(ckpt, 1)
            self.assertIn("truncated", out)
            self.assertIn(newest, out)
            self.assertEqual(h.value(out, "resumed_from_step"), "4")

    def test_with_no_valid_checkpoint_training_starts_fresh_and_says_so(self):
        with tempfile.TemporaryDirectory() as d:
            ckpt = os.path.join(d, "ckpt")
            self.train(ckpt, 1)
            for f in glob.glob(os.path.join(ckpt, "ckpt-*.ddpckpt")):
                os.truncate(f, 10)
            out = self.train(ckpt, 1)
            self.assertIn("no valid checkpoint in " + ckpt + " (2 invalid skipped); starting fresh", out)
            self.assertNotIn("resumed_from_step", out)
            self.assertEqual(h.value(out, "steps_this_run"), "8")

    def test_an_empty_directory_starts_fresh_and_says_so(self):
        with tempfile.TemporaryDirectory() as d:
            out = self.train(os.path.join(d, "new"), 1)
            self.assertIn("no checkpoint in", out)
            self.assertIn("starting fresh", out)


if __name__ == "__main__":
    unittest.main()
