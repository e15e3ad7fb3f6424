"""Crash, restart and resume with real processes: bitwise equality at the same world size,
exactly-once sample use across a world-size change, SIGTERM saving."""
import os
import signal
import tempfile
import unittest

import sdk_harness as h


class ResumeTest(unittest.TestCase):
    def test_a_run_crashed_at_step_k_and_resumed_ends_bitwise_equal_to_an_uninterrupted_run(self):
        with tempfile.TemporaryDirectory() as d:
            args = ["--samples", "512", "--batch-size", "16", "--epochs", "2", "--seed", "5",
                    "--checkpoint-every", "5", "--log-every", "0"]
            crashed_dir, clean_dir = os.path.join(d, "crashed"), os.path.join(d, "clean")
            first = h.run(2, args + ["--checkpoint-dir", crashed_dir, "--crash-at-step", "22"])
            for r in first:
                self.assertEqual(r.returncode, 13, r)
            self.assertIn("--crash-at-step 22", first[0].stdout)
            resumed = h.run(2, args + ["--checkpoint-dir", crashed_dir, "--crash-at-step", "22",
                                       "--dump-params", os.path.join(d, "resumed.params")],
                            restart_count=1)
            for r in resumed:
                self.assertEqual(r.returncode, 0, r)
            self.assertEqual(h.value(resumed[0].stdout, "resumed_from_step"), "20")
            self.assertEqual(h.value(resumed[0].stdout, "steps"), "32")
            clean = h.run(2, args + ["--checkpoint-dir", clean_dir,
                                     "--dump-params", os.path.join(d, "clean.params")])
            for r in clean:
                self.assertEqual(r.returncode, 0, r)
            self.assertNotIn("resumed_from_step", clean[0].stdout)
            with open(os.path.join(d, "resumed.params"), "rb") as a, open(os.path.join(d, "clean.params"), "rb") as b:
                resumed_bytes, clean_bytes = a.read(), b.read()
            self.assertGreater(len(clean_bytes), 1000)
            self.assertEqual(resumed_bytes, clean_bytes)

    def test_async_checkpoints_are_the_bytes_of_sync_ones_and_resume_like_them(self):
        with tempfile.TemporaryDirectory() as d:
            args = ["--samples", "512", "--batch-size", "16", "--epochs", "2", "--seed", "5",
                    "--checkpoint-every", "5", "--log-every", "0", "--keep-last", "100"]
            dirs = {mode: os.path.join(d, mode) for mode in ("sync", "async")}
            sync = h.run(2, args + ["--checkpoint-dir", dirs["sync"],
                                    "--dump-params", os.path.join(d, "clean.params")])
            # The writer thread's copy of the parameters starts late, so every step after a save
            # finds it unfinished: its bytes are still those of the saved step only if that step's
            # update waits for the copy.
            background = h.run(2, args + ["--checkpoint-dir", dirs["async"], "--checkpoint-async"],
                               extra_env={"DDP_TEST_CHECKPOINT_COPY_DELAY_MS": "150"})
            for r in sync + background:
                self.assertEqual(r.returncode, 0, r)
            # A periodic save that comes while the previous write is in flight is skipped, so the
            # background run may hold fewer files; the first one and the final one it always has.
            sync_files, async_files = set(os.listdir(dirs["sync"])), set(os.listdir(dirs["async"]))
            self.assertLessEqual(async_files, sync_files)
            self.assertIn("ckpt-000000000005.ddpckpt", async_files)
            self.assertIn("ckpt-000000000032.ddpckpt", async_files)
            for name in async_files:
                with open(os.path.join(dirs["sync"], name), "rb") as a, open(os.path.join(dirs["async"], name), "rb") as b:
                    self.assertEqual(a.read(), b.read(), name)

            # Both directories cut back to the newest checkpoint the background thread wrote (the
            # final one is synchronous), as if the job had died after it: each resumes from that
            # step and ends bitwise equal to the uninterrupted run.
            newest = max(int(n[5:17]) for n in async_files if n != "ckpt-000000000032.ddpckpt")
            for mode, directory in dirs.items():
                for name in os.listdir(directory):
                    if int(name[5:17]) > newest:
                        os.remove(os.path.join(directory, name))
                params = os.path.join(d, mode + ".params")
                resumed = h.run(2, args + ["--checkpoint-dir", directory, "--dump-params", params]
                                + (["--checkpoint-async"] if mode == "async" else []), restart_count=1)
                for r in resumed:
                    self.assertEqual(r.returncode, 0, r)
                self.assertEqual(int(h.value(resumed[0].stdout, "resumed_from_step")), newest, mode)
                self.assertEqual(h.value(resumed[0].stdout, "steps"), "32")
                with open(params, "rb") as a, open(os.path.join(d, "clean.params"), "rb") as b:
                    resumed_bytes, clean_bytes = a.read(), b.read()
                self.assertGreater(len(clean_bytes), 1000)
                self.assertEqual(resumed_bytes, clean_bytes, mode)

    def test_checkpointed_at_three_workers_and_resumed_at_two_uses_each_sample_exactly_once(self):
        with tempfile.TemporaryDirectory() as d:
            log = os.path.join(d, "samples.log")
            args = ["--samples", "240", "--batch-size", "4", "--epochs", "1", "--seed", "9",
                    "--checkpoint-every", "4", "--checkpoint-dir", os.path.join(d, "ckpt"),
                    "--sample-log", log, "--log-every", "0", "--crash-at-step", "6"]
            first = h.run(3, args)
            for r in first:
                self.assertEqual(r.returncode, 13, r)
            second = h.run(2, args, restart_count=1)
            for r in second:
                self.assertEqual(r.returncode, 0, r)
            resumed_from = int(h.value(second[0].stdout, "resumed_from_step"))
            self.assertEqual(resumed_from, 4)
            self.assertIn("written at world size 3, now 2", second[0].stdout)
            entries = h.read_sample_log(log)
            # Steps after the checkpoint that the crashed attempt ran are redone by the
            # resumed one: the epoch consists of attempt 0 before the checkpoint + attempt 1.
            kept = [e for e in entries if (e["attempt"] == 0 and e["step"] < resumed_from)
                    or e["attempt"] == 1]
            self.assertTrue(any(e["attempt"] == 0 and e["step"] >= resumed_from for e in entries),
                            "the crashed attempt ran past its last checkpoint")
            self.assertEqual({e["world"] for e in kept if e["attempt"] == 0}, {3})
            self.assertEqual({e["world"] for e in kept if e["attempt"] == 1}, {2})
            used = sorted(i for e in kept if e["epoch"] == 0 for i in e["indices"])
            self.assertEqual(used, list(range(240)))

    def test_sigterm_finishes_the_step_saves_and_the_next_start_resumes_there(self):
        with tempfile.TemporaryDirectory() as d:
            log = os.path.join(d, "samples.log")
            ckpt = os.path.join(d, "ckpt")
            args = ["--samples", "4096", "--batch-size", "8", "--epochs", "1000",
                    "--checkpoint-dir", ckpt, "--sample-log", log, "--log-every", "0"]
            with h.Workers(2, args) as workers:
                h.wait_for(lambda: os.path.exists(log) and len(h.read_sample_log(log)) >= 10,
                           60, "10 logged steps")
                workers.signal_all(signal.SIGTERM)
                results = workers.wait(timeout=60)
            for r in results:
                self.assertEqual(r.returncode, 143, r)
            self.assertIn("SIGTERM", results[0].stdout)
            stopped_at = int(h.value(results[0].stdout, "steps"))
            self.assertGreaterEqual(stopped_at, 5)
            logged = max(e["step"] for e in h.read_sample_log(log)) + 1
            self.assertEqual(logged, stopped_at, "every rank stopped after the same step")
            again = h.run(2, args + ["--max-steps", str(stopped_at + 3)], restart_count=1)
            for r in again:
                self.assertEqual(r.returncode, 0, r)
            self.assertEqual(int(h.value(again[0].stdout, "resumed_from_step")), stopped_at)
            self.assertEqual(int(h.value(again[0].stdout, "steps_this_run")), 3)


if __name__ == "__main__":
    unittest.main()
