"""The debugging path: `train` with no launcher variables, and bad environments."""
import unittest

import sdk_harness as h


class SingleProcessTest(unittest.TestCase):
    def test_the_single_process_path_trains_without_any_launcher_variables(self):
        results = h.run(1, ["--epochs", "3"], single=True)
        r = results[0]
        self.assertEqual(r.returncode, 0, r)
        self.assertIn("single process (no launcher variables), backend none", r.stdout)
        self.assertGreaterEqual(float(h.value(r.stdout, "final_accuracy")), 0.9)
        self.assertIn("samples/s", r.stdout)

    def test_a_partial_environment_exits_2_naming_the_missing_variables(self):
        results = h.run(1, ["--epochs", "1"], single=True, extra_env={"RANK": "0", "WORLD_SIZE": "2"})
        r = results[0]
        self.assertEqual(r.returncode, 2, r)
        self.assertIn("MASTER_ADDR, MASTER_PORT are missing", r.stderr)

    def test_a_rank_outside_the_world_exits_2(self):
        results = h.run(1, ["--epochs", "1"], single=True,
                        extra_env={"RANK": "3", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                                   "MASTER_PORT": "1"})
        self.assertEqual(results[0].returncode, 2, results[0])
        self.assertIn("RANK=3 is outside [0, WORLD_SIZE=2)", results[0].stderr)

    def test_a_bad_flag_exits_2(self):
        results = h.run(1, ["--batch-size", "0"], single=True)
        self.assertEqual(results[0].returncode, 2, results[0])


if __name__ == "__main__":
    unittest.main()
