"""The Python DDP baseline of bench/worker_sdk/run: the same MLP, optimizer, batch and data
access as build/bin/train, with torch.nn.parallel.DistributedDataParallel over Gloo on CPU, or
NCCL on the GPU LOCAL_RANK (optional 7th argument "nccl": scripts/gpu-check).
Started once per rank with RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT set."""
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DistributedSampler


def main():
    features, hidden, classes, batch, steps, samples = (int(a) for a in sys.argv[1:7])
    backend = sys.argv[7] if len(sys.argv) > 7 else "gloo"
    device = torch.device("cpu")
    if backend == "nccl":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    dist.init_process_group(backend)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(features, hidden), nn.ReLU(), nn.Linear(hidden, hidden),
                          nn.ReLU(), nn.Linear(hidden, classes)).to(device)
    ddp = DistributedDataParallel(model, device_ids=[device.index] if backend == "nccl" else None)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.01, momentum=0.9)
    inputs = torch.randn(samples, features).to(device)
    targets = torch.randint(classes, (samples,)).to(device)
    sampler = DistributedSampler(range(samples), seed=0)
    indices = list(sampler)
    warmup = 5  # as the SDK's kSteadyWarmupSteps: time steps warmup+1..steps
    start = None
    for step in range(steps):
        idx = torch.tensor(indices[step * batch:(step + 1) * batch], device=device)
        x, y = inputs.index_select(0, idx), targets.index_select(0, idx)
        optimizer.zero_grad()
        loss = F.cross_entropy(ddp(x), y)
        loss.backward()
        optimizer.step()
        loss.item()
        if step + 1 == warmup:
            start = time.perf_counter()
    elapsed = time.perf_counter() - start
    if dist.get_rank() == 0:
        print("steady_steps_per_s=%.3f" % ((steps - warmup) / elapsed))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
