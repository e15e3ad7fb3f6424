"""What ddplaunch does in a Python worker with no change to the script (python/ddplaunch_autostart.py):
every optimizer.step() is a heartbeat, an explicit ddplaunch.step() wins without double counting,
an unmodified DDP script that hangs is found and restarted, a sitecustomize of the user's still
runs, the busy time per step of a slow rank shows in its progress slot, and a Gloo worker never aborts at exit because a Gloo thread frees a collective's work
while the interpreter finalizes. Real processes, Gloo on loopback, deadlines on every wait."""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ddplaunch_helpers import PYTHON, LaunchTestCase, main  # noqa: E402

# What the agent reads in a worker's progress slot (contracts/progress_slot.h), read by the worker
# itself at the end: beats (word 0) and step (word 1). The slot's size is the package's (the
# agent put it on the worker's path).
READ_SLOT = """
def read_slot():
    import mmap, struct
    from ddplaunch import _SLOT_SIZE
    fd = os.open(os.environ["DDPLAUNCH_PROGRESS_FILE"], os.O_RDONLY)
    region = mmap.mmap(fd, 0, mmap.MAP_SHARED, mmap.PROT_READ)
    os.close(fd)
    slot = int(os.environ["DDPLAUNCH_PROGRESS_SLOT"])
    return struct.unpack_from("<QQ", region, slot * _SLOT_SIZE)
"""

# A plain training loop: no ddplaunch import unless EXPLICIT=1, then one ddplaunch.step() per
# iteration after optimizer.step().
STEPS = """
import json, os
import torch
""" + READ_SLOT + """
explicit = os.environ.get("EXPLICIT") == "1"
if explicit:
    import ddplaunch
model = torch.nn.Linear(4, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
for i in range(7):
    model(torch.rand(8, 4)).sum().backward()
    optimizer.step()
    if explicit:
        ddplaunch.step()
beats, step = read_slot()
with open(os.path.join(os.environ["OUT_DIR"], "slot_%s.json" % os.environ["RANK"]), "w") as f:
    json.dump({"beats": beats, "step": step}, f)
"""

# The canonical Gloo DDP loop, not a line of ddplaunch in it. On the first attempt rank 1 blocks
# forever before its 10th step; rank 0 waits for it in DDP's all-reduce.
UNMODIFIED_HANG = """
import os, threading
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

def block_forever():
    threading.Event().wait()

attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
rank = int(os.environ["RANK"])
dist.init_process_group("gloo", init_method="env://")
model = DDP(torch.nn.Linear(4, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
for step in range(1, 21):
    if attempt == 0 and rank == 1 and step == 10:
        block_forever()
    loss = model(torch.rand(8, 4)).pow(2).mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
open(os.path.join(os.environ["OUT_DIR"], "finished_%d_%d" % (attempt, rank)), "w").close()
dist.destroy_process_group()
"""

# The exit guard's promise, kept under the worst scheduling: every thread of the worker on one
# CPU and Gloo's worker threads at idle priority, so that after a collective completes its
# thread frees the work only when the main thread lets go of the CPU. The tensor's Python object
# is dropped first: then only the Gloo thread's reference keeps it, the case that aborts at exit.
# Then, with a peer that has not joined, a collective in flight keeps the wait from ending.
GLOO_EXIT = """
import json, os, time, weakref
import torch
import torch.distributed as dist
import ddplaunch_autostart as autostart

rank = int(os.environ["RANK"])
out = os.environ["OUT_DIR"]
dist.init_process_group("gloo", init_method="env://")
dist.all_reduce(torch.ones(1))  # the Gloo threads exist from here on
cpu = min(os.sched_getaffinity(0))
for tid in os.listdir("/proc/self/task"):
    os.sched_setaffinity(int(tid), {cpu})
    with open("/proc/self/task/%s/comm" % tid) as f:
        if f.read().strip() == "pt_gloo_runloop":
            os.sched_setscheduler(int(tid), os.SCHED_IDLE, os.sched_param(0))
held_by_gloo = freed = 0
for i in range(20):
    t = torch.ones(1000)
    dist.all_reduce(t)
    alive = weakref.ref(t)
    del t
    held_by_gloo += alive() is not None
    idle = autostart._wait_for_idle_gloo_threads(limit=30)
    freed += idle and alive() is None
record = {"rounds": 20, "held_by_gloo": held_by_gloo, "freed_when_idle": freed}
if rank == 0:
    work = dist.all_reduce(torch.ones(1), async_op=True)  # rank 1 joins only once told to
    record["idle_while_in_flight"] = autostart._wait_for_idle_gloo_threads(limit=0.5)
    open(os.path.join(out, "go"), "w").close()
    work.wait()
else:
    deadline = time.monotonic() + 60
    while not os.path.exists(os.path.join(out, "go")) and time.monotonic() < deadline:
        time.sleep(0.01)
    dist.all_reduce(torch.ones(1))
record["idle_after"] = autostart._wait_for_idle_gloo_threads(limit=30)
with open(os.path.join(out, "gloo_%d.json" % rank), "w") as f:
    json.dump(record, f)
dist.destroy_process_group()
"""

# The canonical Gloo DDP loop again, untouched: rank 1's data loading takes 40 ms a step. At the
# end each rank reads the busy time per step its slot holds (busy_us, offset 80).
UNMODIFIED_SLOW_RANK = """
import json, mmap, os, struct, time
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

rank = int(os.environ["RANK"])
dist.init_process_group("gloo", init_method="env://")
model = DDP(torch.nn.Linear(16, 4))
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
for step in range(30):
    if rank == 1:
        time.sleep(0.04)
    batch = torch.rand(8, 16)
    loss = model(batch).pow(2).mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
fd = os.open(os.environ["DDPLAUNCH_PROGRESS_FILE"], os.O_RDONLY)
region = mmap.mmap(fd, 0, mmap.MAP_SHARED, mmap.PROT_READ)
os.close(fd)
busy_us = struct.unpack_from("<Q", region, int(os.environ["DDPLAUNCH_PROGRESS_SLOT"]) * 128 + 80)[0]
with open(os.path.join(os.environ["OUT_DIR"], "busy_%d.json" % rank), "w") as f:
    json.dump({"busy": busy_us / 1e6}, f)
dist.destroy_process_group()
"""

# A standby runs it too, before it knows its rank: the file is named by the process.
THEIR_SITECUSTOMIZE = """
import os
open(os.path.join(os.environ["OUT_DIR"], "their_sitecustomize_%d" % os.getpid()), "w").close()
"""


class OptimizerSteps(LaunchTestCase):
    def run_steps(self, explicit):
        script = self.script("steps.py", STEPS)
        r = self.launch(["--nproc_per_node=2", "--python", PYTHON, script], timeout=180,
                        env={"OUT_DIR": self.out, "EXPLICIT": "1" if explicit else "0"})
        self.assertEqual(r.returncode, 0, r.describe())
        return self.records("slot_")

    def test_every_optimizer_step_is_a_heartbeat_without_an_import(self):
        for name, slot in self.run_steps(explicit=False).items():
            self.assertEqual(slot["step"], 7, name)
            self.assertEqual(slot["beats"], 7, name)

    def test_an_explicit_step_wins_and_nothing_is_counted_twice(self):
        records = self.run_steps(explicit=True)
        self.assertEqual(len(records), 2)
        for name, slot in records.items():
            self.assertEqual(slot["step"], 7, name)  # not 14: the optimizer's first beat is replaced

    def test_a_sitecustomize_on_the_users_pythonpath_still_runs_and_so_does_ours(self):
        theirs = os.path.join(self.tmp, "theirs")
        os.mkdir(theirs)
        with open(os.path.join(theirs, "sitecustomize.py"), "w") as f:
            f.write(THEIR_SITECUSTOMIZE)
        script = self.script("steps.py", STEPS)
        r = self.launch(["--nproc_per_node=1", "--python", PYTHON, script], timeout=180,
                        env={"OUT_DIR": self.out, "PYTHONPATH": theirs})
        self.assertEqual(r.returncode, 0, r.describe())
        self.assertTrue([n for n in os.listdir(self.out) if n.startswith("their_sitecustomize_")], r.describe())
        self.assertEqual(self.records("slot_")["slot_0.json"]["step"], 7, r.describe())


class UnmodifiedScriptHang(LaunchTestCase):
    def test_a_hung_rank_of_an_unmodified_ddp_script_is_shown_and_the_job_restarted(self):
        script = self.script("unmodified.py", UNMODIFIED_HANG)
        r = self.launch(["--nproc_per_node=2", "--max_restarts=1", "--hang_timeout=5", "--python", PYTHON, script],
                        timeout=240, env={"OUT_DIR": self.out})
        self.assertEqual(r.returncode, 0, r.describe())
        self.assertIn("made no progress for", r.stderr, r.describe())
        self.assertIn("(last step 9;", r.stderr, r.describe())  # nine optimizer steps, then the hang
        # Each hung rank's stacks in one piece: one dump at a time, never interleaved.
        dumps = [d.split("Extension modules:")[0] for d in r.stderr.split("Fatal Python error: Aborted")[1:]]
        self.assertEqual(len(dumps), 2, r.describe())
        for dump in dumps:
            self.assertIn("Current thread", dump, r.describe())
            self.assertIn("(most recent call first):", dump, r.describe())
        self.assertEqual(sum("in block_forever" in d for d in dumps), 1, r.describe())  # rank 1's stack
        self.assertIn("restarting the workers", r.stderr, r.describe())
        for rank in (0, 1):
            self.assertTrue(os.path.exists(os.path.join(self.out, "finished_1_%d" % rank)), r.describe())


class BusyTime(LaunchTestCase):
    def test_an_unmodified_ddp_script_reports_the_slow_ranks_longer_busy_time(self):
        script = self.script("slow_rank.py", UNMODIFIED_SLOW_RANK)
        r = self.launch(["--nproc_per_node=2", "--python", PYTHON, script], timeout=240, env={"OUT_DIR": self.out})
        self.assertEqual(r.returncode, 0, r.describe())
        records = self.records("busy_")
        fast, slow = records["busy_0.json"]["busy"], records["busy_1.json"]["busy"]
        print("busy time per step: rank 0 %.1f ms, rank 1 (40 ms of data loading) %.1f ms" % (fast * 1e3, slow * 1e3))
        # Rank 0 waits for rank 1 in the backward's all-reduce, which is not busy time.
        self.assertGreaterEqual(slow, 0.040, r.describe())
        self.assertGreater(fast, 0, r.describe())
        self.assertLess(fast * 1.5, slow, "the slow rank's busy time is not above the default factor")


class GlooExit(LaunchTestCase):
    def test_at_exit_no_gloo_thread_still_holds_a_collectives_tensor(self):
        script = self.script("gloo_exit.py", GLOO_EXIT)
        r = self.launch(["--nproc_per_node=2", "--max_restarts=0", "--python", PYTHON, script], timeout=240,
                        env={"OUT_DIR": self.out})
        self.assertEqual(r.returncode, 0, r.describe())
        self.assertNotIn("terminate called", r.stderr, r.describe())
        records = self.records("gloo_")
        self.assertEqual(len(records), 2, r.describe())
        for name, record in records.items():
            print(name, json.dumps(record))
            self.assertEqual(record["freed_when_idle"], record["rounds"], name)
            self.assertTrue(record["idle_after"], name)
        self.assertFalse(records["gloo_0.json"]["idle_while_in_flight"], "a collective in flight is not idle")


if __name__ == "__main__":
    main()
