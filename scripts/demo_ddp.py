"""A real PyTorch DDP job on CPU with Gloo: learn y = sin(x0) + x1*x2 with a small MLP on
synthetic data. Run it under ddplaunch (or torchrun):

    build/bin/ddplaunch --nproc_per_node=2 --python /usr/bin/python3 scripts/demo_ddp.py [--steps N]

Each rank draws its own batches (seeded by its rank), DDP averages the gradients, rank 0 prints
the loss. It reads only the environment the launcher gives it (RANK, WORLD_SIZE, MASTER_ADDR,
MASTER_PORT, ...) and is decorated with @record, so a failure shows up in ddplaunch's summary.
"""

import argparse
import os
import time

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record
from torch.nn.parallel import DistributedDataParallel as DDP


def batch(generator, size):
    x = torch.rand(size, 3, generator=generator) * 4 - 2
    y = torch.sin(x[:, :1]) + x[:, 1:2] * x[:, 2:3]
    return x, y


@record
def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=400, help="optimizer steps (default 400)")
    parser.add_argument("--batch", type=int, default=256, help="batch size per rank (default 256)")
    parser.add_argument("--lr", type=float, default=0.01, help="Adam learning rate (default 0.01)")
    args = parser.parse_args()

    dist.init_process_group("gloo", init_method="env://")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)  # the same initial weights everywhere (DDP also broadcasts rank 0's)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(3, 64), torch.nn.Tanh(),
                                    torch.nn.Linear(64, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1)))
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    generator = torch.Generator().manual_seed(1000 + rank)
    if rank == 0:
        print("training on %d workers (restart %s), %d steps" % (
            world, os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"), args.steps))
    start = time.monotonic()
    for step in range(1, args.steps + 1):
        x, y = batch(generator, args.batch)
        loss = torch.nn.functional.mse_loss(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step % 50 == 0 or step == args.steps:
            mean = loss.detach().clone()
            dist.all_reduce(mean)
            mean /= world
            if rank == 0:
                print("step %4d  loss %.5f  (%.1f s)" % (step, mean.item(), time.monotonic() - start))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
