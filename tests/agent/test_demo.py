"""The demo job (scripts/demo_ddp.py, README command 1) trains under ddplaunch: two Gloo DDP
workers, rank 0 prints a loss that falls."""

import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ddplaunch_helpers import PYTHON, LaunchTestCase, main  # noqa: E402

SOURCE_DIR = os.environ.get("DDPLAUNCH_SOURCE_DIR", os.path.join(os.path.dirname(__file__), "..", ".."))


class Demo(LaunchTestCase):
    def test_the_demo_ddp_script_trains_on_two_workers_and_its_loss_falls(self):
        script = os.path.join(SOURCE_DIR, "scripts", "demo_ddp.py")
        result = self.launch(["--nproc_per_node=2", "--python", PYTHON, script, "--steps", "200"], timeout=180)
        self.assertEqual(result.returncode, 0, result.describe())
        self.assertIn("training on 2 workers", result.stdout)
        self.assertNotIn("Warning", result.stderr, "the project's environment makes no worker warn")
        losses = [float(x) for x in re.findall(r"loss ([0-9.]+)", result.stdout)]
        self.assertEqual(len(losses), 4, result.describe())  # steps 50..200, printed once (rank 0)
        self.assertLess(losses[-1], losses[0] * 0.5, result.describe())


if __name__ == "__main__":
    main()
