"""In-memory restart in a few lines (ddplaunch.restartable, docs/restartable.md): the canonical DDP
template adopts it with at most 5 changed lines, keeps its survivors' processes across a killed
rank, and trains every sample exactly once per epoch across the failure; it still runs under
torchrun. The resumable sampler's arithmetic is checked on its own, at a changed world size too.
Real processes, Gloo on loopback, deadlines on every wait."""

import collections
import difflib
import glob
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ddplaunch_helpers import PYTHON, LaunchTestCase, code_lines, main, run  # noqa: E402

SOURCE_DIR = os.path.abspath(os.environ.get("DDPLAUNCH_SOURCE_DIR", os.path.join(os.path.dirname(__file__), "..", "..")))
EXAMPLES = os.path.join(SOURCE_DIR, "examples", "restartable")
PLAIN = os.path.join(EXAMPLES, "ddp_template.py")
RESTARTABLE = os.path.join(EXAMPLES, "ddp_template_restartable.py")
HELPERS = os.path.join(SOURCE_DIR, "python")


def samples_per_epoch(record_dir):
    """{epoch: Counter(sample index -> times trained)} from every rank's records."""
    per = collections.defaultdict(collections.Counter)
    for path in glob.glob(os.path.join(record_dir, "*.txt")):
        with open(path) as f:
            for line in f:
                epoch, *indices = line.split()
                per[int(epoch)].update(int(i) for i in indices)
    return per


class Template(LaunchTestCase):
    def assert_every_sample_once(self, record_dir, epochs=3, samples=512, describe=""):
        per = samples_per_epoch(record_dir)
        self.assertEqual(sorted(per), list(range(epochs)), describe)
        for epoch, counts in per.items():
            twice = sorted(i for i, n in counts.items() if n > 1)
            missing = sorted(set(range(samples)) - set(counts))
            self.assertEqual((twice[:10], missing[:10]), ([], []), "epoch %d: trained twice, skipped\n%s"
                             % (epoch, describe))

    def test_the_template_adopts_it_with_at_most_five_changed_lines(self):
        diff = [line for line in difflib.unified_diff(code_lines(PLAIN), code_lines(RESTARTABLE), lineterm="", n=0)
                if line[:1] in "+-" and not line.startswith(("+++", "---"))]
        added = [line for line in diff if line.startswith("+")]
        print("\n".join(diff))
        self.assertLessEqual(len(added), 5, diff)
        # docs/restartable.md shows this very diff.
        with open(os.path.join(SOURCE_DIR, "docs", "restartable.md")) as f:
            doc = f.read()
        block = doc[doc.index("```diff\n") + len("```diff\n"):]
        self.assertEqual(block[:block.index("```")].splitlines(), diff)

    def test_a_killed_rank_is_replaced_the_survivor_keeps_its_process_and_no_sample_is_trained_twice(self):
        records = os.path.join(self.tmp, "records")
        os.mkdir(records)
        r = self.launch(["--nproc_per_node=2", "--max_restarts=1", "--python", PYTHON, RESTARTABLE,
                         "--record", records, "--die-at", "1:10:1",
                         "--checkpoint", os.path.join(self.tmp, "checkpoint.pt")], timeout=300)
        self.assertEqual(r.returncode, 0, r.describe())
        self.assertIn("the other workers park", r.stderr, r.describe())
        self.assertIn("received the state rank 0 sent", r.stderr, r.describe())
        self.assertEqual(len(glob.glob(os.path.join(records, "rank0-*.txt"))), 1, "rank 0 kept its process")
        self.assertEqual(len(glob.glob(os.path.join(records, "rank1-*.txt"))), 2, "rank 1 was replaced")
        self.assert_every_sample_once(records, describe=r.describe())

    def test_it_runs_unchanged_under_torchrun(self):
        records = os.path.join(self.tmp, "records")
        os.mkdir(records)
        torchrun = [PYTHON, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
        env = dict(os.environ, PYTHONPATH=HELPERS, TMPDIR=self.tmp)
        result = run(torchrun + [RESTARTABLE, "--record", records, "--checkpoint", os.path.join(self.tmp, "c.pt")],
                     timeout=300, env=env, cwd=self.tmp)
        self.assertFalse(result.timed_out, result.describe())
        self.assertEqual(result.returncode, 0, result.describe())
        self.assert_every_sample_once(records, describe=result.describe())


# The sampler alone: after k steps of batch B at world size W, the rest of the epoch's order is
# dealt out among the ranks of the next round, at the same or another world size.
SAMPLER = r"""
import json, sys
import torch
from torch.utils.data import TensorDataset
import ddplaunch

out = {}
batch = 4
for size, world_before, world_after, steps, drop_last in [(96, 2, 2, 3, False), (96, 2, 3, 4, False),
                                                          (98, 4, 2, 5, True), (99, 3, 3, 2, False)]:
    dataset = TensorDataset(torch.arange(size))
    def samplers(world):
        return [ddplaunch.ResumableDistributedSampler(dataset, batch_size=batch, num_replicas=world, rank=r, seed=7,
                                                      drop_last=drop_last) for r in range(world)]
    before = samplers(world_before)
    trained = []
    for s in before:
        s.set_epoch(1)
        trained += list(iter(s))[:steps * batch]
    position = before[0].position(steps)  # no step was counted when its iteration began
    whole = before[0]._order()
    rest, lengths = [], []
    after = samplers(world_after)
    for s in after:
        s.resume_at(position["epoch"], position["consumed"])
        s.set_epoch(position["epoch"])
        expected = len(s)
        mine = list(iter(s))
        lengths.append(expected == len(mine))
        rest += mine
    out["%d samples, world %d -> %d after %d steps%s" % (size, world_before, world_after, steps,
                                                          ", drop_last" if drop_last else "")] = {
        "position": position, "expected": {"epoch": 1, "consumed": steps * batch * world_before},
        "trained_is_the_head": sorted(trained) == sorted(whole[:len(trained)]),
        # The epoch's order, padded or cut for the new world size, each index once.
        "every_index_once": sorted(trained + rest) == sorted(after[0]._order()),
        "lengths_match": all(lengths)}
    s = samplers(world_after)[0]
    s.set_epoch(2)
    out["%d samples: the next epoch is whole" % size] = len(list(iter(s))) == len(s) == len(s._order()) // world_after
json.dump(out, sys.stdout)
"""


class Sampler(LaunchTestCase):
    def test_a_resumed_epoch_skips_exactly_what_was_trained_at_any_world_size(self):
        import json

        env = dict(os.environ, PYTHONPATH=HELPERS)
        result = subprocess.run([PYTHON, "-c", SAMPLER], capture_output=True, text=True, timeout=120, env=env)
        self.assertEqual(result.returncode, 0, result.stderr)
        out = json.loads(result.stdout)
        for name, row in out.items():
            if isinstance(row, bool):
                self.assertTrue(row, name)
                continue
            self.assertEqual(row["position"], row["expected"], name)
            self.assertTrue(row["trained_is_the_head"], name)
            self.assertTrue(row["every_index_once"], name)
            self.assertTrue(row["lengths_match"], name)


if __name__ == "__main__":
    main()
