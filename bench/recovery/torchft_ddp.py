#!/usr/bin/python3
"""One TorchFT replica group of one worker for bench/recovery (variant torchft+python): the
MLP and synthetic data of scripts/elastic_ddp.py, trained the way torchft's train_ddp.py
trains (torchft.Manager, ProcessGroupGloo, torchft.Optimizer, a Lighthouse).

--ddp picks how gradients are averaged over the quorum:
  allreduce  (default) after backward, one Manager.allreduce of all gradients flattened into one
             tensor (DDP's single bucket for this model) and .wait(), which reports a failed
             collective to the Manager (the step is then not committed), as
             torchft.ddp.PureDistributedDataParallel does per gradient;
  ddp        torchft.ddp.DistributedDataParallel, as train_ddp.py. In torchft 0.2.0 its comm hook
             does not survive a failed Gloo allreduce: _ManagedWork.wait() catches the error but
             leaves its future unset, and the hook's `assert fut._fut` (torchft/ddp.py:76) raises
             AssertionError out of backward(), so a survivor of a peer's crash dies.

    TORCHFT_LIGHTHOUSE=http://HEAD:29510 python3 torchft_ddp.py --replica-id node1-0 [--batch-size 24]

Each process is a replica group of size 1 (as in train_ddp.py) and hosts the TCPStore its
Manager needs itself (no torchrun). The Manager advertises socket.gethostname() to its peers
(and so does its HTTP checkpoint transport), so run it where the hostname is the address the
others reach it at (bench/recovery/run uses a UTS namespace per node).

Prints, on stdout, "[torchft_ddp] start: replica R" once, then one line per step:
"[torchft_ddp] replica R step S participants P committed C" where S is the Manager's step after the
step (it only advances on a commit), P the replica groups in this step's quorum and C 1 when
the step was committed (0: the optimizer step was dropped, e.g. a peer died mid-allreduce).
"""

import argparse
import os
import socket
import sys
from datetime import timedelta

import torch
from torch.distributed import TCPStore

from torchft import DistributedDataParallel, Manager, Optimizer, ProcessGroupGloo


def make_data(samples, features, classes, seed):
    """The synthetic classification data of scripts/elastic_ddp.py."""
    g = torch.Generator().manual_seed(seed + 1000003)
    centres = torch.randn(classes, features, generator=g) * 1.5
    targets = torch.randint(classes, (samples,), generator=g)
    return centres[targets] + torch.randn(samples, features, generator=g), targets


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--replica-id", required=True, help="this replica group's name (unique per process)")
    p.add_argument("--batch-size", type=int, default=24)
    p.add_argument("--samples", type=int, default=4800)
    p.add_argument("--steps", type=int, default=10 ** 9, help="stop after this many committed steps")
    p.add_argument("--min-replicas", type=int, default=1, help="Manager min_replica_size")
    p.add_argument("--pg-timeout", type=float, default=5.0,
                   help="Gloo collective timeout, seconds (default 5, as train_ddp.py)")
    p.add_argument("--timeout", type=float, default=30.0,
                   help="Manager timeout (should_commit, checkpoint transfer), seconds (default 30, as train_ddp.py)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ddp", choices=("allreduce", "ddp"), default="allreduce",
                   help="gradient averaging (see above; default allreduce)")
    args = p.parse_args()
    if "TORCHFT_LIGHTHOUSE" not in os.environ:
        p.error("TORCHFT_LIGHTHOUSE (http://HOST:PORT of the Lighthouse) must be set")

    # The replica group's own store (torchrun would host it; a group of one needs no torchrun).
    # Peers of the quorum reach this store too (the PG of a quorum is made through one of them).
    host = socket.gethostname()
    store = TCPStore(host, 0, is_master=True, wait_for_workers=False)

    torch.manual_seed(args.seed)
    x, y = make_data(args.samples, 32, 4, args.seed)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(),
                                torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    inner = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)

    def load_state_dict(state):
        model.load_state_dict(state["model"])
        inner.load_state_dict(state["optim"])

    def state_dict():
        return {"model": model.state_dict(), "optim": inner.state_dict()}

    timeout = timedelta(seconds=args.timeout)
    manager = Manager(pg=ProcessGroupGloo(timeout=timedelta(seconds=args.pg_timeout)), load_state_dict=load_state_dict,
                      state_dict=state_dict, min_replica_size=args.min_replicas, rank=0, world_size=1,
                      store_addr=host, store_port=store.port, replica_id=args.replica_id,
                      timeout=timeout, quorum_timeout=timedelta(seconds=60),
                      connect_timeout=timedelta(seconds=30))
    ddp = DistributedDataParallel(manager, model) if args.ddp == "ddp" else model
    optimizer = Optimizer(manager, inner)
    print("[torchft_ddp] start: replica %s" % args.replica_id, flush=True)

    batches = torch.Generator().manual_seed(args.seed + sum(args.replica_id.encode()))
    while manager.current_step() < args.steps:
        idx = torch.randint(args.samples, (args.batch_size,), generator=batches)
        optimizer.zero_grad()   # starts the quorum for this step
        loss = torch.nn.functional.cross_entropy(ddp(x[idx]), y[idx])
        loss.backward()         # with --ddp ddp: gradients averaged over the quorum here
        if args.ddp == "allreduce":
            grads = [q.grad for q in model.parameters()]
            flat = torch.cat([g.reshape(-1) for g in grads])
            manager.allreduce(flat).wait()   # averaged over the quorum; a failure is reported
            for g, v in zip(grads, torch.split(flat, [g.numel() for g in grads])):
                g.copy_(v.view_as(g))
        before = manager.current_step()
        optimizer.step()        # commits (and steps) only when every participant succeeded
        committed = int(manager.current_step() > before)
        print("[torchft_ddp] replica %s step %d participants %d committed %d" % (
            args.replica_id, manager.current_step(), manager.num_participants(), committed), flush=True)
    manager.shutdown(wait=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
