"""The sample accounting that the fault-tolerance tests rely on catches what it must: a sample
skipped or repeated across a restart, a missing rank, and it discards the steps a failed
round made after its newest checkpoint (they are made again). Pure logic, no processes."""

import os
import sys
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from elastic_job import Round, committed_steps, sample_accounting  # noqa: E402

N = 24      # data set size
BATCH = 2   # per rank


def make_round(gen, world, epoch_order, start_step, steps, consumed=0, epoch=0):
    """A round of `world` ranks that makes `steps` steps from `consumed` of `epoch_order`
    (the sampler layout: rest[rank::world], batches from the front of each shard)."""
    r = Round(gen)
    r.world = world
    rest = epoch_order[consumed:]
    shards = [rest[k::world] for k in range(world)]
    for i in range(steps):
        for rank in range(world):
            r.records.append((world, rank, epoch, start_step + i, shards[rank][i * BATCH:(i + 1) * BATCH]))
    return r


class SampleAccountingTest(unittest.TestCase):
    order = list(range(N))

    def test_a_restart_at_another_world_size_uses_every_sample_once(self):
        a = make_round(1, 6, self.order, 0, 1)                  # positions 0..11
        b = make_round(2, 4, self.order, 1, 3, consumed=12)     # positions 12..23
        self.assertEqual(sample_accounting([a, b], N, 1), [])

    def test_steps_after_the_newest_checkpoint_of_a_failed_round_are_discarded(self):
        a = make_round(1, 4, self.order, 0, 2)                  # steps 0, 1 (positions 0..15)
        # The newest checkpoint was after step 0: round 2 makes step 1 again, from position 8.
        b = make_round(2, 4, self.order, 1, 2, consumed=8)      # steps 1, 2 (positions 8..23)
        self.assertEqual(sorted(committed_steps([a, b])), [0, 1, 2])
        self.assertEqual(sample_accounting([a, b], N, 1), [])

    def test_a_skipped_sample_is_reported(self):
        a = make_round(1, 6, self.order, 0, 1)
        b = make_round(2, 4, self.order, 1, 3, consumed=14)     # resumes 2 positions too late
        problems = sample_accounting([a, b], N, 1)
        self.assertEqual(len(problems), 1, problems)
        self.assertIn("2 samples missing", problems[0])

    def test_a_repeated_sample_is_reported(self):
        a = make_round(1, 6, self.order, 0, 1)
        b = make_round(2, 4, self.order, 1, 3, consumed=8)      # resumes 4 positions too early
        problems = sample_accounting([a, b], N, 1)
        self.assertTrue(any("used more than once" in p for p in problems), problems)

    def test_a_step_without_every_rank_is_reported(self):
        a = make_round(1, 6, self.order, 0, 2)
        del a.records[-1]                                       # rank 5 of step 1 missing
        problems = sample_accounting([a], N, 1)
        self.assertTrue(any("has records of ranks" in p for p in problems), problems)

    def test_an_epoch_without_records_is_reported(self):
        a = make_round(1, 6, self.order, 0, 2)
        problems = sample_accounting([a], N, 2)
        self.assertTrue(any(p.startswith("epoch 1: 24 samples missing") for p in problems), problems)


if __name__ == "__main__":
    unittest.main(verbosity=2)
