"""A worker for the multi-node tests (tests/agent/test_multinode.py, tests/e2e/test_netns_elastic.py).

    mn_worker.py OUT_DIR [--loop] [--fail-if-env VAR] [--no-gloo]

On start it records its environment in OUT_DIR/start-g<generation>-r<rank>-p<pid>.json, joins
the Gloo group (MASTER_ADDR/PORT from ddplaunch) and all-reduces RANK+1, recording the sum in
OUT_DIR/done-g<generation>-r<rank>-p<pid>.json. Then:
- without --loop it exits 0;
- with --loop it waits (no collectives, so a dead peer never makes it fail) until the file
  OUT_DIR/stop exists, then exits 0;
- with --fail-if-env VAR and VAR set in its environment, local rank 0 exits 7 right after the
  all-reduce (so every worker of the round has started before the failure);
- with --loop --fail-on-file, local rank 0 of node MN_NODE exits 7 when OUT_DIR/fail-<MN_NODE>
  appears (it takes the file away first, so one file is one failure).
With --no-gloo it skips torch (tests that only check the environment; torch imports are slow
on a loaded machine); --fail-if-env then waits until every worker of its round has written its
start record instead.
"""

import json
import os
import sys
import time

out_dir = sys.argv[1]
loop = "--loop" in sys.argv
fail_var = sys.argv[sys.argv.index("--fail-if-env") + 1] if "--fail-if-env" in sys.argv else None
use_gloo = "--no-gloo" not in sys.argv
fail_on_file = "--fail-on-file" in sys.argv

KEYS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
        "ROLE_RANK", "MASTER_ADDR", "MASTER_PORT", "DDPLAUNCH_GENERATION",
        "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_RUN_ID", "MN_NODE")
env = {k: os.environ.get(k) for k in KEYS}
rank = int(env["RANK"])
gen = env["DDPLAUNCH_GENERATION"]
tag = "g%s-r%d-p%d" % (gen, rank, os.getpid())


def record(kind, payload):
    path = os.path.join(out_dir, "%s-%s.json" % (kind, tag))
    with open(path + ".tmp", "w") as f:
        json.dump(payload, f)
    os.replace(path + ".tmp", path)  # readers never see a torn file
    print("MNREC " + json.dumps(dict(payload, kind=kind)), flush=True)


record("start", {"env": env, "pid": os.getpid(), "time": time.time()})

world = int(env["WORLD_SIZE"])
if use_gloo:
    import datetime
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    record("done", {"env": env, "pid": os.getpid(), "sum": t.item(), "expected": world * (world + 1) / 2})
    # torch 2.x aborts at interpreter exit ("terminate called without an active exception") when
    # a Gloo group is still alive: end it first, as torch's documentation asks of every script.
    dist.destroy_process_group()
else:
    # A file barrier: every worker of this round has started (deadline: a broken test ends).
    deadline = time.monotonic() + 60
    prefix = "start-g%s-" % gen
    while (sum(1 for n in os.listdir(out_dir) if n.startswith(prefix) and n.endswith(".json")) < world
           and time.monotonic() < deadline):
        time.sleep(0.05)
    record("done", {"env": env, "pid": os.getpid()})

if fail_var and os.environ.get(fail_var) and env["LOCAL_RANK"] == "0":
    sys.exit(7)

if loop:
    stop = os.path.join(out_dir, "stop")
    deadline = time.monotonic() + 300  # never outlive a broken test by much
    trigger = os.path.join(out_dir, "fail-%s" % env["MN_NODE"])
    while not os.path.exists(stop) and time.monotonic() < deadline:
        if fail_on_file and env["LOCAL_RANK"] == "0":
            try:
                os.rename(trigger, trigger + ".taken-%d" % os.getpid())
                sys.exit(7)
            except FileNotFoundError:
                pass
        time.sleep(0.05)
sys.exit(0)
