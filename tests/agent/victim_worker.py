"""A worker for tests/agent/test_root_cause.py: every rank joins a Gloo group and all-reduces in a
loop; after the first all-reduce (so every worker is running) the rank named by VICTIM_RANK kills
itself with SIGKILL (VICTIM_RANK=-1: nobody does; the test kills a worker itself). Its peers then fail inside the next collective (exit 1 with a Gloo error):
a failure caused by the victim, which must never be reported as the root cause.

    victim_worker.py OUT_DIR
"""

import datetime
import os
import signal
import sys
import time

import torch
import torch.distributed as dist

out_dir = sys.argv[1]
rank = int(os.environ["RANK"])
victim = int(os.environ["VICTIM_RANK"])

dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
t = torch.ones(1)
dist.all_reduce(t)
with open(os.path.join(out_dir, "running-r%d-p%d" % (rank, os.getpid())), "w"):
    pass
if rank == victim:
    os.kill(os.getpid(), signal.SIGKILL)
deadline = time.monotonic() + 120  # a broken test ends
while time.monotonic() < deadline:
    dist.all_reduce(t)  # raises once the victim is gone
sys.exit(0)
