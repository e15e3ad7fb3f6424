"""The DDP template with in-memory restart (examples/restartable/ddp_template_restartable.py, four
lines from the canonical one) survives a node crash on the network-namespace cluster with exact
sample accounting.

A head node runs ddp-rendezvous; three nodes run `ddplaunch --nnodes=2:3 --nproc_per_node=1` with
the template. In epoch 1, after step 5, every rank waits (the template's --pause-at); the test
kills every process of node 3 and lets the others go on. The two survivors keep their processes,
park, and finish the job at world size 2 from memory: the rest of epoch 1 is dealt out among two
ranks instead of three. Every sample is trained exactly once in every epoch, counted from every
rank's record of the steps it completed, the crashed node's included.

Needs root and `ip netns` (skips with the reason otherwise).
"""

import collections
import glob
import os
import shutil
import sys
import tempfile
import time
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from elastic_job import DDPLAUNCH, PYTHON, RDZV_CONF, RDZV_PORT, RENDEZVOUS, SOURCE_DIR, start_cluster  # noqa: E402

TEMPLATE = os.path.join(SOURCE_DIR, "examples", "restartable", "ddp_template_restartable.py")
SAMPLES = 480  # a multiple of 8 x 2 x 3: no padding at world size 3 or 2
EPOCHS = 3


def wait_until(condition, timeout, what, procs=()):
    deadline = time.monotonic() + timeout
    while not condition():
        for p in procs:
            if p.poll() is not None:
                raise AssertionError("%s exited while waiting for %s:\n%s" % (p.name, what, p.describe()))
        if time.monotonic() >= deadline:
            raise AssertionError("timed out after %d s waiting for %s:\n%s"
                                 % (timeout, what, "\n".join(p.describe() for p in procs)))
        time.sleep(0.05)


class RestartableTemplateNodeCrash(unittest.TestCase):
    def setUp(self):
        self.cluster = start_cluster(self)
        self.shared = tempfile.mkdtemp(prefix="ddp-e2e-restartable-")
        self.addCleanup(shutil.rmtree, self.shared, True)
        self.records = os.path.join(self.shared, "records")
        os.mkdir(self.records)

    def test_survivors_of_a_node_crash_go_on_from_memory_and_train_every_sample_once(self):
        head = self.cluster.addr("head")
        endpoint = "%s:%d" % (head, RDZV_PORT)
        rendezvous = self.cluster.spawn("head", [RENDEZVOUS, "--host", head, "--port", RDZV_PORT],
                                        name="ddp-rendezvous")
        env = dict(os.environ)
        env.pop("TORCHELASTIC_RESTART_COUNT", None)
        agents = {}
        for node in (1, 2, 3):
            cmd = [DDPLAUNCH, "--nnodes=2:3", "--nproc_per_node=1", "--max_restarts=3", "--rdzv_backend=c10d",
                   "--rdzv_endpoint=" + endpoint, "--rdzv_id=restartable", "--rdzv_conf", RDZV_CONF,
                   "--shutdown_timeout=5", "--local_addr", self.cluster.addr(node), "--python", PYTHON, TEMPLATE,
                   "--epochs", EPOCHS, "--samples", SAMPLES, "--record", self.records, "--pause-at", "1:5",
                   "--checkpoint", os.path.join(self.shared, "checkpoint.pt")]
            agents[node] = self.cluster.spawn(node, cmd, env=env, name="ddplaunch@node%d" % node)
        everyone = [rendezvous] + list(agents.values())
        wait_until(lambda: len(glob.glob(os.path.join(self.records, "paused-*"))) == 3, 180,
                   "the three ranks to pause in epoch 1", everyone)
        self.cluster.crash(3)
        open(os.path.join(self.records, "go"), "w").close()
        for node in (1, 2):
            code = agents[node].wait(240)
            self.assertEqual(code, 0, "\n".join(p.describe() for p in everyone))
        log = "\n".join(agents[n].describe() for n in (1, 2))
        # Record files are named by rank and pid: three processes in all, so the two survivors
        # kept theirs from start to end (a rank may change with the world size); the crashed
        # node's recorded epoch 0 and the first 5 steps of epoch 1.
        files = sorted(os.path.basename(p) for p in glob.glob(os.path.join(self.records, "rank*.txt")))
        pids = {name.split("-pid")[1] for name in files}
        self.assertEqual(len(pids), 3, "%s\n%s" % (files, log))
        per_epoch = collections.defaultdict(collections.Counter)
        for path in glob.glob(os.path.join(self.records, "rank*.txt")):
            with open(path) as f:
                for line in f:
                    epoch, *indices = line.split()
                    per_epoch[int(epoch)].update(int(i) for i in indices)
        self.assertEqual(sorted(per_epoch), list(range(EPOCHS)), log)
        for epoch, counts in sorted(per_epoch.items()):
            twice = sorted(i for i, n in counts.items() if n > 1)
            missing = sorted(set(range(SAMPLES)) - set(counts))
            self.assertEqual((twice[:10], missing[:10]), ([], []),
                             "epoch %d: samples trained twice, samples skipped\n%s" % (epoch, log))


if __name__ == "__main__":
    unittest.main(verbosity=2)
