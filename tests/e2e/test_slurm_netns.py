"""A 2-node job formed from Slurm's variables alone, on the namespace cluster.

Two node namespaces each run `ddplaunch WORKER OUT` with no flag at all, in the environment srun
gives one task per node of a 2-node step with 2 GPUs per node: SLURM_JOB_ID, SLURM_NNODES,
SLURM_NODEID, the node lists, SLURM_STEP_NUM_TASKS/NODES, SLURM_GPUS_ON_NODE, SLURM_STEP_GPUS and
CUDA_VISIBLE_DEVICES. ddplaunch must take the node count, the node's rank, the job id, the
rendezvous endpoint (the first host of the node list, hosted in-process by the agent there) and
2 workers per node from them, and say so on its start-up line. The workers (mn_worker.py) record
their environment and all-reduce over Gloo: a sum of 1+2+3+4 proves one world of 4.

The node list is written with Slurm's hostlist syntax over the cluster's addresses
(`10.213.0.[11-12]`), not host names: the namespaces share the host's /etc/hosts, in which their
names do not exist, and scripts/netns-cluster keeps no per-namespace hosts file. The parser's
handling of names (`gpu[01-04,07]`, `rack[1-2]-n[01-02]`, ...) is covered by
tests/launcher/slurm_test.cpp; a second test forms the job from lists of three other shapes
(`10.213.0.1[1-2]`, `10.213.0.[11,12]`, `10.213.0.11,10.213.0.[12]`), without torch. Needs root
and `ip netns`; skips with the reason otherwise.
"""

import json
import os
import shutil
import sys
import tempfile
import unittest

from cluster import Cluster
from processes import wait_all

BUILD_DIR = os.environ.get("DDPLAUNCH_BUILD_DIR") or os.path.join(
    os.path.dirname(os.path.abspath(__file__)), "..", "..", "build")
SOURCE_DIR = os.environ.get("DDPLAUNCH_SOURCE_DIR") or os.path.abspath(
    os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
DDPLAUNCH = os.path.join(BUILD_DIR, "bin", "ddplaunch")
WORKER = os.path.join(SOURCE_DIR, "tests", "agent", "mn_worker.py")
PYTHON = sys.executable  # the workers' interpreter, through $PYTHON_EXEC (no --python flag)
DEADLINE = 150  # seconds for the whole job here: 4 torch imports on 2 shared cores


def hostlist_of(addrs):
    """Slurm's hostlist of consecutive addresses a.b.c.N..M: `a.b.c.[N-M]`."""
    prefix = addrs[0].rsplit(".", 1)[0]
    lasts = [int(a.rsplit(".", 1)[1]) for a in addrs]
    assert all(a.rsplit(".", 1)[0] == prefix for a in addrs), addrs
    assert lasts == list(range(lasts[0], lasts[0] + len(lasts))), addrs
    return "%s.[%d-%d]" % (prefix, lasts[0], lasts[-1])


def slurm_task_env(node_id, nodelist, job_id):
    """The variables srun sets for the one task of node `node_id` in a 2-node step with
    --ntasks-per-node=1 and --gpus-per-node=2 (and nothing of the caller's Slurm or PET_)."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "PET_")) and k not in ("CUDA_VISIBLE_DEVICES", "TORCH_ELASTIC_SHUTDOWN_TIMEOUT")}
    env.update({
        "SLURM_JOB_ID": job_id, "SLURM_JOBID": job_id, "SLURM_STEP_ID": "0", "SLURM_STEPID": "0",
        "SLURM_NNODES": "2", "SLURM_JOB_NUM_NODES": "2", "SLURM_STEP_NUM_NODES": "2",
        "SLURM_NTASKS": "2", "SLURM_NPROCS": "2", "SLURM_STEP_NUM_TASKS": "2",
        "SLURM_TASKS_PER_NODE": "1(x2)", "SLURM_STEP_TASKS_PER_NODE": "1(x2)",
        "SLURM_NODEID": str(node_id), "SLURM_PROCID": str(node_id), "SLURM_LOCALID": "0",
        "SLURM_JOB_NODELIST": nodelist, "SLURM_NODELIST": nodelist, "SLURM_STEP_NODELIST": nodelist,
        "SLURM_GPUS_ON_NODE": "2", "SLURM_STEP_GPUS": "0,1", "SLURM_JOB_GPUS": "0,1",
        "CUDA_VISIBLE_DEVICES": "0,1",
        "PYTHON_EXEC": PYTHON,
    })
    return env


class SlurmNetnsTest(unittest.TestCase):
    def setUp(self):
        reason = Cluster.unavailable_reason()
        if reason:
            print("\n[netns] skipped: %s" % reason, file=sys.stderr)
            self.skipTest(reason)
        if not os.path.exists(DDPLAUNCH):
            self.fail("not built: %s" % DDPLAUNCH)
        self.tmp = tempfile.mkdtemp(prefix="ddp_slurm_netns_")
        self.addCleanup(shutil.rmtree, self.tmp, True)
        self.out = os.path.join(self.tmp, "out")
        os.mkdir(self.out)
        self.cluster = Cluster(nodes=2)
        self.addCleanup(self.cluster.down)
        self.cluster.up()

    def test_a_2_node_job_forms_from_slurm_variables_with_no_flags(self):
        addrs = [self.cluster.addr(1), self.cluster.addr(2)]
        nodelist = hostlist_of(addrs)
        job_id = "73%d" % os.getpid()
        procs = {}
        # The node of SLURM_NODEID=1 starts first: its rank must come from Slurm, not arrival order,
        # and it must wait for the first host's agent to start hosting the rendezvous.
        for node_id, node in ((1, 2), (0, 1)):
            env = dict(slurm_task_env(node_id, nodelist, job_id), MN_NODE="node%d" % node, TMPDIR=self.tmp)
            procs[node] = self.cluster.spawn(node, [DDPLAUNCH, WORKER, self.out], env=env, cwd=self.tmp,
                                             name="ddplaunch@node%d" % node)
        describe = lambda: "\n".join(p.describe() for p in procs.values())
        try:
            codes = wait_all([procs[1], procs[2]], DEADLINE)
        except TimeoutError as e:
            self.fail("%s\n%s" % (e, describe()))
        self.assertEqual(codes, [0, 0], describe())

        # The start-up line names what came from Slurm, on both nodes.
        for node, node_id in ((1, 0), (2, 1)):
            err = procs[node].stderr()
            line = next((l for l in err.splitlines() if "from Slurm:" in l), "")
            for part in ("--nnodes=2 (SLURM_NNODES)", "--node_rank=%d (SLURM_NODEID)" % node_id,
                         "--rdzv_id=%s (SLURM_JOB_ID)" % job_id, "--rdzv_backend=c10d",
                         "--rdzv_endpoint=%s:29400 (the first host of SLURM_STEP_NODELIST)" % addrs[0],
                         "--nproc_per_node=2 (GPUs from SLURM_GPUS_ON_NODE)", "--shutdown_timeout=25"):
                self.assertIn(part, line, "node%d:\n%s" % (node, err))
        self.assertIn("hosting the rendezvous server in-process", procs[1].stderr(), describe())

        records = []
        for name in sorted(os.listdir(self.out)):
            if name.startswith("done-") and name.endswith(".json"):
                with open(os.path.join(self.out, name)) as f:
                    records.append(json.load(f))
        envs = [r["env"] for r in records]
        self.assertEqual(len(records), 4, envs)
        self.assertEqual(sorted(int(e["RANK"]) for e in envs), [0, 1, 2, 3], envs)
        for r in records:
            e = r["env"]
            self.assertEqual(e["WORLD_SIZE"], "4", e)
            self.assertEqual(e["LOCAL_WORLD_SIZE"], "2", e)
            self.assertEqual(e["TORCHELASTIC_RUN_ID"], job_id, e)
            self.assertEqual(e["MASTER_ADDR"], addrs[0], e)  # the node of SLURM_NODEID=0
            self.assertEqual(r["sum"], r["expected"], r)
            self.assertEqual(r["expected"], 10.0, r)
            # SLURM_NODEID decides the group rank: node1 (id 0) holds ranks 0-1, node2 ranks 2-3.
            expected_group = 0 if e["MN_NODE"] == "node1" else 1
            self.assertEqual(e["GROUP_RANK"], str(expected_group), e)
            self.assertEqual(int(e["RANK"]) // 2, expected_group, e)

    def test_node_lists_of_several_shapes_name_the_same_first_host(self):
        # Without torch (mn_worker --no-gloo): only the rendezvous depends on the node list.
        addrs = [self.cluster.addr(1), self.cluster.addr(2)]
        prefix, last = addrs[0].rsplit(".", 1)[0], [a.rsplit(".", 1)[1] for a in addrs]
        self.assertEqual(last[0][:-1], last[1][:-1], addrs)  # e.g. 11 and 12: a shared leading digit
        shapes = ["%s.%s[%s-%s]" % (prefix, last[0][:-1], last[0][-1], last[1][-1]),  # 10.213.0.1[1-2]
                  "%s.[%s,%s]" % (prefix, last[0], last[1]),                          # 10.213.0.[11,12]
                  "%s,%s.[%s]" % (addrs[0], prefix, last[1])]                         # a.b.c.11,a.b.c.[12]
        for n, nodelist in enumerate(shapes):
            with self.subTest(nodelist=nodelist):
                out = os.path.join(self.tmp, "shape%d" % n)
                os.mkdir(out)
                job_id = "74%d%d" % (os.getpid(), n)
                procs = []
                for node_id, node in ((1, 2), (0, 1)):
                    env = dict(slurm_task_env(node_id, nodelist, job_id), MN_NODE="node%d" % node,
                               TMPDIR=self.tmp, SLURM_GPUS_ON_NODE="1", SLURM_STEP_GPUS="0",
                               SLURM_JOB_GPUS="0", CUDA_VISIBLE_DEVICES="0")
                    procs.append(self.cluster.spawn(node, [DDPLAUNCH, WORKER, out, "--no-gloo"], env=env,
                                                    cwd=self.tmp, name="ddplaunch@node%d" % node))
                try:
                    codes = wait_all(procs, DEADLINE)
                except TimeoutError as e:
                    self.fail("%s\n%s" % (e, "\n".join(p.describe() for p in procs)))
                self.assertEqual(codes, [0, 0], "\n".join(p.describe() for p in procs))
                self.assertIn("--rdzv_endpoint=%s:29400 (the first host of SLURM_STEP_NODELIST)" % addrs[0],
                              procs[1].stderr())
                envs = []
                for name in os.listdir(out):
                    if name.startswith("done-"):
                        with open(os.path.join(out, name)) as f:
                            envs.append(json.load(f)["env"])
                self.assertEqual(sorted((e["MN_NODE"], e["RANK"], e["WORLD_SIZE"]) for e in envs),
                                 [("node1", "0", "2"), ("node2", "1", "2")], envs)


if __name__ == "__main__":
    unittest.main()
