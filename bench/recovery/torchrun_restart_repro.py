#!/usr/bin/python3
"""The smallest reproduction of torch 2.x torchrun failing to restart a Gloo job (bench/RESULTS.md,
"torchrun 2.x does not restart a Gloo job"): one node, loopback, no network namespaces.

    bench/recovery/torchrun_restart_repro.py [PYTHON]     (PYTHON: a torch 2.x interpreter,
                                                            default the project venv's)

It runs `torchrun --standalone --nproc_per_node=2 --max_restarts=1` on itself twice: with
torchrun's defaults and with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1. Each worker makes a Gloo
process group; on attempt 0, rank 1 exits 1 after a barrier, so torchrun restarts the group
once. With the shared store (the default) the workers of attempt 1 are given the same
MASTER_ADDR:MASTER_PORT, find round 0's keys already in it and fail in Gloo's connectFullMesh
("Connection refused"); unshared, attempt 1 succeeds. Prints one line per run and each
worker's view of the store; exit 0 when it behaved as described, 1 otherwise.
"""

import os
import subprocess
import sys


def worker():
    import torch.distributed as dist
    attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    rank = int(os.environ["RANK"])
    where = "%s:%s" % (os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"])
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        # The agent hosts this store before the workers start; count what is already in it.
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False)
        print("[repro] attempt %d rank %d store %s: %d keys before init_process_group" % (
            attempt, rank, where, store.num_keys()), flush=True)
    dist.init_process_group("gloo")
    dist.barrier()
    print("[repro] attempt %d rank %d store %s: process group made" % (attempt, rank, where), flush=True)
    dist.barrier()
    return 1 if attempt == 0 and rank == 1 else 0


def main():
    py = sys.argv[1] if len(sys.argv) > 1 else os.path.expanduser(
        "~/.cache/ddplaunch/venv-torch-2.15.0-py311/bin/python3")
    torchrun = os.path.join(os.path.dirname(py), "torchrun")
    ok = True
    for disable in ("0", "1"):
        env = dict(os.environ, TORCH_DISABLE_SHARE_RDZV_TCP_STORE=disable, PYTHONUNBUFFERED="1")
        out = subprocess.run([torchrun, "--standalone", "--nproc_per_node=2", "--max_restarts=1",
                              "--monitor_interval=0.5", os.path.abspath(__file__)],
                             env=env, capture_output=True, text=True, timeout=300)
        text = out.stdout + out.stderr
        for line in text.splitlines():
            if line.startswith("[repro]") or "connectFullMesh failed" in line and line.startswith("RuntimeError"):
                print("  " + line[:200])
        refused = "connectFullMesh failed" in text
        print("TORCH_DISABLE_SHARE_RDZV_TCP_STORE=%s: torchrun exit %d, attempt 1 %s" % (
            disable, out.returncode, "failed in connectFullMesh" if refused else "made its process group"))
        expected_fail = disable == "0"
        ok = ok and (refused == expected_fail) and ((out.returncode != 0) == expected_fail)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(worker() if "TORCHELASTIC_RESTART_COUNT" in os.environ else main())
