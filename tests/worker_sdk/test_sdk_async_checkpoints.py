"""Background checkpoint writes (`train --checkpoint-async`) with real processes: a SIGKILL in
the middle of a write resumes from the previous complete checkpoint with nothing lost beyond
it; SIGTERM during a write waits for it and the final checkpoint is complete; a write that
fails on the writer thread ends training as a failed synchronous save does.

A write is held in the middle by the SDK's test-only DDP_TEST_CHECKPOINT_PAUSE=STEP:GATE
(worker_sdk/include/ddp/checkpoint.h): with the file GATE present, the first write of a step
>= STEP (a periodic save due while the previous write is in flight is skipped, so which one is
not fixed) stops after the first bytes of its temporary file, creates GATE.reached holding that
file's path and waits for GATE to go."""
import glob
import os
import re
import signal
import tempfile
import unittest

import sdk_harness as h


def gate_env(d, step):
    gate = os.path.join(d, "gate")
    open(gate, "w").close()
    return gate, {"DDP_TEST_CHECKPOINT_PAUSE": "%d:%s" % (step, gate)}


def paused_write(gate):
    """(temporary file, step) of the write that the gate holds."""
    with open(gate + ".reached") as f:
        tmp = f.read().strip()
    return tmp, int(re.search(r"ckpt-(\d+)\.ddpckpt\.tmp\.", tmp).group(1))


def ckpt_file(ckpt, step):
    return os.path.join(ckpt, "ckpt-%012d.ddpckpt" % step)


def temporaries(ckpt):
    return glob.glob(os.path.join(ckpt, ".ckpt-*.tmp.*"))


class AsyncCheckpointTest(unittest.TestCase):
    def test_a_kill_in_the_middle_of_a_background_write_resumes_from_the_previous_complete_checkpoint(self):
        with tempfile.TemporaryDirectory() as d:
            ckpt, log = os.path.join(d, "ckpt"), os.path.join(d, "samples.log")
            args = ["--samples", "512", "--batch-size", "16", "--epochs", "2", "--seed", "3",
                    "--checkpoint-every", "4", "--log-every", "0", "--sample-log", log]
            gate, env = gate_env(d, 8)
            with h.Workers(2, args + ["--checkpoint-dir", ckpt, "--checkpoint-async"], extra_env=env) as workers:
                h.wait_for(lambda: os.path.exists(gate + ".reached"), 60, "a write after step 4 to pause")
                tmp, paused = paused_write(gate)
                self.assertGreaterEqual(paused, 8)
                self.assertTrue(os.path.exists(tmp), tmp)
                self.assertIsNone(h.checkpoint_problem(ckpt_file(ckpt, 4)))
                self.assertLess(os.path.getsize(tmp), os.path.getsize(ckpt_file(ckpt, 4)))
                self.assertFalse(os.path.exists(ckpt_file(ckpt, paused)))
                self.assertTrue(all(r.returncode is None for r in workers.results()),
                                "no worker exits while a write is in flight")
                workers.kill()  # SIGKILL, mid-write
            self.assertEqual(temporaries(ckpt), [tmp], "the half-written temporary is all that is left")
            self.assertEqual(sorted(os.listdir(ckpt))[-1], os.path.basename(ckpt_file(ckpt, 4)))

            resumed = h.run(2, args + ["--checkpoint-dir", ckpt, "--checkpoint-async",
                                       "--dump-params", os.path.join(d, "resumed.params")],
                            restart_count=1)
            for r in resumed:
                self.assertEqual(r.returncode, 0, r)
            self.assertEqual(h.value(resumed[0].stdout, "resumed_from_step"), "4")
            self.assertEqual(h.value(resumed[0].stdout, "steps"), "32")
            self.assertEqual(temporaries(ckpt), [], "the leftover temporary is removed")
            self.assertIsNone(h.checkpoint_problem(ckpt_file(ckpt, 32)))

            # Nothing lost beyond step 4: every sample of both epochs used exactly once by the
            # steps that count, and the result bitwise equal to an uninterrupted synchronous run.
            kept = [e for e in h.read_sample_log(log)
                    if (e["attempt"] == 0 and e["step"] < 4) or e["attempt"] == 1]
            for epoch in (0, 1):
                used = sorted(i for e in kept if e["epoch"] == epoch for i in e["indices"])
                self.assertEqual(used, list(range(512)), "epoch %d" % epoch)
            clean = h.run(2, args[:-2] + ["--checkpoint-dir", os.path.join(d, "clean"),
                                          "--dump-params", os.path.join(d, "clean.params")])
            for r in clean:
                self.assertEqual(r.returncode, 0, r)
            with open(os.path.join(d, "resumed.params"), "rb") as a, open(os.path.join(d, "clean.params"), "rb") as b:
                resumed_bytes, clean_bytes = a.read(), b.read()
            self.assertGreater(len(clean_bytes), 1000)
            self.assertEqual(resumed_bytes, clean_bytes)

    def test_sigterm_during_a_background_write_waits_for_it_and_the_final_checkpoint_is_complete(self):
        with tempfile.TemporaryDirectory() as d:
            ckpt = os.path.join(d, "ckpt")
            args = ["--samples", "4096", "--batch-size", "8", "--epochs", "1000", "--checkpoint-every", "4",
                    "--log-every", "0", "--checkpoint-dir", ckpt, "--checkpoint-async"]
            gate, env = gate_env(d, 8)
            with h.Workers(2, args, extra_env=env) as workers:
                h.wait_for(lambda: os.path.exists(gate + ".reached"), 60, "a write after step 4 to pause")
                paused = paused_write(gate)[1]
                waiting = "waiting for the checkpoint write of step %d in flight" % paused
                workers.signal_all(signal.SIGTERM)
                h.wait_for(lambda: waiting in workers.results()[0].stdout, 60, "rank 0 to wait for the write")
                self.assertTrue(all(r.returncode is None for r in workers.results()),
                                "no worker exits while the write is in flight")
                os.remove(gate)
                results = workers.wait(timeout=60)
            for r in results:
                self.assertEqual(r.returncode, 143, r)
            out = results[0].stdout
            stopped_at = int(h.value(out, "steps"))
            self.assertGreater(stopped_at, paused)
            background = "saved checkpoint %s (step %d," % (ckpt_file(ckpt, paused), paused)
            final = "saved checkpoint %s (step %d," % (ckpt_file(ckpt, stopped_at), stopped_at)
            self.assertIn(background, out)
            self.assertIn(final, out)
            self.assertLess(out.index(waiting), out.index(background))
            self.assertLess(out.index(background), out.index(final))
            for step in (paused, stopped_at):
                self.assertIsNone(h.checkpoint_problem(ckpt_file(ckpt, step)), step)
            self.assertEqual(temporaries(ckpt), [])
            again = h.run(2, args + ["--max-steps", str(stopped_at + 2)], restart_count=1)
            for r in again:
                self.assertEqual(r.returncode, 0, r)
            self.assertEqual(int(h.value(again[0].stdout, "resumed_from_step")), stopped_at)

    def test_a_periodic_checkpoint_due_during_a_write_is_skipped_said_once_and_counted(self):
        with tempfile.TemporaryDirectory() as d:
            ckpt = os.path.join(d, "ckpt")
            args = ["--samples", "512", "--batch-size", "16", "--epochs", "1", "--checkpoint-every", "4",
                    "--log-every", "0", "--checkpoint-dir", ckpt, "--checkpoint-async", "--keep-last", "100"]
            gate, env = gate_env(d, 4)
            skipped = "checkpoint of step 8 skipped: the previous write is still in flight"
            with h.Workers(1, args, single=True, extra_env=env) as workers:
                # The final save waits for the write: by then every periodic save came and went.
                h.wait_for(lambda: "waiting for the checkpoint write of step 4" in workers.results()[0].stdout,
                           60, "the final save to wait for the write of step 4")
                os.remove(gate)
                results = workers.wait(timeout=60)
            out = results[0].stdout
            self.assertEqual(results[0].returncode, 0, results[0])
            self.assertIn(skipped, out)
            self.assertEqual(out.count(" skipped: "), 1, "said once")
            # 32 steps: the periodic saves of steps 8 to 32 came while step 4 was written; the
            # final save then waited for it and wrote step 32.
            self.assertEqual(h.value(out, "checkpoints_skipped"), "7")
            self.assertEqual(h.value(out, "checkpoints_saved"), "1")
            self.assertIn("7 periodic checkpoint(s) skipped while a write was in flight", out)
            self.assertEqual(sorted(os.listdir(ckpt)), [os.path.basename(ckpt_file(ckpt, s)) for s in (4, 32)])
            for step in (4, 32):
                self.assertIsNone(h.checkpoint_problem(ckpt_file(ckpt, step)), step)

    def test_a_failed_background_write_ends_training_as_a_failed_synchronous_save_does(self):
        with tempfile.TemporaryDirectory() as d:
            ckpt = os.path.join(d, "ckpt")
            args = ["--samples", "4096", "--batch-size", "8", "--epochs", "1000", "--checkpoint-every", "4",
                    "--log-every", "0"]
            gate, env = gate_env(d, 8)
            with h.Workers(1, args + ["--checkpoint-dir", ckpt, "--checkpoint-async"], single=True,
                           extra_env=env) as workers:
                h.wait_for(lambda: os.path.exists(gate + ".reached"), 60, "a write after step 4 to pause")
                os.rename(ckpt, ckpt + ".moved")  # the write's rename into place will fail
                os.remove(gate)
                failed = workers.wait(timeout=60)[0]
            self.assertEqual(failed.returncode, 1, failed)
            self.assertIn("train: error: rename checkpoint", failed.stderr)
            self.assertIn("No such file or directory", failed.stderr)

            blocked = os.path.join(d, "file")
            open(blocked, "w").close()
            sync = h.run(1, args + ["--checkpoint-dir", os.path.join(blocked, "ckpt")], single=True)[0]
            self.assertEqual(sync.returncode, failed.returncode, sync)
            self.assertIn("train: error: create checkpoint directory", sync.stderr)


if __name__ == "__main__":
    unittest.main()
