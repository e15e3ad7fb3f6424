"""DDP across real processes over real Gloo: equivalence with one big batch, accuracy, and
the error when ranks build different models."""
import os
import struct
import subprocess
import tempfile
import time
import unittest

import sdk_harness as h


class DdpTest(unittest.TestCase):
    def test_two_workers_with_batch_b_match_one_process_with_batch_2b(self):
        with tempfile.TemporaryDirectory() as d:
            common = ["--samples", "512", "--epochs", "1", "--max-steps", "12", "--seed", "3",
                      "--log-every", "0", "--bucket-mb", "0.01"]  # several buckets
            two = h.run(2, common + ["--batch-size", "16", "--dump-params", os.path.join(d, "two")])
            for r in two:
                self.assertEqual(r.returncode, 0, r)
            one = h.run(1, common + ["--batch-size", "32", "--dump-params", os.path.join(d, "one")])
            self.assertEqual(one[0].returncode, 0, one[0])
            a, b = h.read_floats(os.path.join(d, "two")), h.read_floats(os.path.join(d, "one"))
            self.assertEqual(len(a), len(b))
            self.assertGreater(len(a), 1000)
            worst = max(abs(x - y) for x, y in zip(a, b))
            print("largest parameter difference: %g" % worst)
            self.assertLess(worst, 1e-5)
            self.assertEqual(h.value(two[0].stdout, "steps"), "12")

    def test_gradient_accumulation_with_no_sync_matches_one_big_batch(self):
        with tempfile.TemporaryDirectory() as d:
            common = ["--samples", "512", "--epochs", "1", "--max-steps", "8", "--seed", "4",
                      "--log-every", "0", "--bucket-mb", "0.01"]
            two = h.run(2, common + ["--batch-size", "8", "--accumulate", "2",
                                     "--dump-params", os.path.join(d, "two")])
            for r in two:
                self.assertEqual(r.returncode, 0, r)
            one = h.run(1, common + ["--batch-size", "32", "--dump-params", os.path.join(d, "one")])
            self.assertEqual(one[0].returncode, 0, one[0])
            a, b = h.read_floats(os.path.join(d, "two")), h.read_floats(os.path.join(d, "one"))
            worst = max(abs(x - y) for x, y in zip(a, b))
            print("largest parameter difference with accumulation: %g" % worst)
            self.assertLess(worst, 1e-5)

    def test_two_cpu_workers_reach_ninety_percent_accuracy_within_a_minute(self):
        start = time.monotonic()
        results = h.run(2, ["--epochs", "5"])
        elapsed = time.monotonic() - start
        for r in results:
            self.assertEqual(r.returncode, 0, r)
        accuracy = float(h.value(results[0].stdout, "final_accuracy"))
        print("accuracy %.4f in %.1f s" % (accuracy, elapsed))
        self.assertGreaterEqual(accuracy, 0.9)
        self.assertLess(elapsed, 60)
        self.assertIn("rank 0/2", results[0].stdout)
        self.assertEqual(results[1].stdout.count("[ddp]"), 0, "only rank 0 logs")

    def test_a_rank_that_computes_slower_reports_the_longer_busy_time(self):
        # The agent's progress board stood in for by a file of two zeroed 128-byte slots
        # (contracts/progress_slot.h): busy_us at offset 80 of each. Rank 1 sleeps 40 ms inside
        # each step before its all-reduces (DDP_TRAIN_SLOW_MS); rank 0 waits for it there, which
        # is not busy time.
        with tempfile.TemporaryDirectory() as d:
            board = os.path.join(d, "board")
            with open(board, "wb") as f:
                f.write(bytes(256))
            results = h.run(2, ["--samples", "512", "--epochs", "1", "--max-steps", "30", "--log-every", "0"],
                            extra_env={"DDPLAUNCH_PROGRESS_FILE": board},
                            rank_env={0: {"DDPLAUNCH_PROGRESS_SLOT": "0"},
                                      1: {"DDPLAUNCH_PROGRESS_SLOT": "1", "DDP_TRAIN_SLOW_MS": "40"}})
            for r in results:
                self.assertEqual(r.returncode, 0, r)
            with open(board, "rb") as f:
                data = f.read()
            fast, slow = (struct.unpack_from("<Q", data, 128 * rank + 80)[0] / 1e6 for rank in (0, 1))
            print("busy time per step: rank 0 %.1f ms, rank 1 (slowed by 40 ms) %.1f ms" % (fast * 1e3, slow * 1e3))
            self.assertGreaterEqual(slow, 0.040)
            self.assertGreater(fast, 0)
            self.assertLess(fast * 1.5, slow, "the slow rank's busy time is not above the default factor")

    def test_ranks_with_different_parameter_sets_fail_with_a_clear_error(self):
        # rank 1 builds a narrower model, so the workers are started with their own arguments
        port = h.free_port()
        procs = []
        with tempfile.TemporaryDirectory() as d:
            try:
                for rank, hidden in ((0, "64"), (1, "48")):
                    env = h.clean_env()
                    env.update({"RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": str(rank),
                                "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                                "MASTER_PORT": str(port)})
                    err = open(os.path.join(d, "err%d" % rank), "w+")
                    procs.append((subprocess.Popen([h.TRAIN, "--hidden", hidden, "--max-steps", "2"],
                                                   stdout=subprocess.DEVNULL, stderr=err, env=env,
                                                   start_new_session=True), err))
                for p, err in procs:
                    self.assertEqual(p.wait(timeout=60), 1)
                    err.seek(0)
                    text = err.read()
                    self.assertIn("parameter set", text)
                    self.assertIn("rank(s) 1 differs from rank 0", text)
            finally:
                for p, _ in procs:
                    if p.poll() is None:
                        p.kill()
                        p.wait()


if __name__ == "__main__":
    unittest.main()
