"""The canonical PyTorch DDP training script, as the tutorials write it: env:// initialisation, a
DistributedDataParallel model, a DistributedSampler, rank 0 saving a checkpoint after each epoch
and every rank resuming from it. Runs under torchrun or ddplaunch; at a restart every worker
starts again from the last epoch's checkpoint.

This is examples/restartable/ddp_template.py with ddplaunch's checkpoints (docs/checkpoints.md):
three new lines replace five. ddplaunch.save writes on rank 0 only (no `if rank == 0`) and
returns at once, the file being written in the background, atomically and with a checksum;
ddplaunch.load returns the newest checkpoint that verifies, falling back past a damaged one, or
None. --checkpoint now names a directory (one file per epoch, the newest three kept).

For the tests, each rank records the samples of every step it completed (--record DIR); a rank
may kill itself at a given step (--die-at EPOCH:STEP:RANK), or every rank wait there until the
file DIR/go exists (--pause-at EPOCH:STEP), on the first attempt only.
"""
import argparse
import os
import signal
import time

import ddplaunch
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler


def record(args, rank, epoch, step, x):
    if args.record:
        with open(os.path.join(args.record, "rank%d-pid%d.txt" % (rank, os.getpid())), "a") as f:
            f.write("%d %s\n" % (epoch, " ".join(str(int(v)) for v in x[:, 0])))
    if os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        return
    if args.die_at == "%d:%d:%d" % (epoch, step, rank):
        os.kill(os.getpid(), signal.SIGKILL)
    if args.pause_at == "%d:%d" % (epoch, step):
        open(os.path.join(args.record, "paused-%d" % rank), "w").close()
        deadline = time.monotonic() + 120
        while not os.path.exists(os.path.join(args.record, "go")) and time.monotonic() < deadline:
            time.sleep(0.01)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--checkpoint", default="checkpoint.pt")
    parser.add_argument("--record", default="")
    parser.add_argument("--die-at", default="")
    parser.add_argument("--pause-at", default="")
    parser.add_argument("--samples", type=int, default=512)
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    samples = torch.arange(args.samples, dtype=torch.float32).unsqueeze(1)  # a sample's feature is its index
    dataset = TensorDataset(samples, torch.arange(args.samples) % 4)
    model = torch.nn.Sequential(torch.nn.Linear(1, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    ddp = DDP(model)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.001, momentum=0.9)
    sampler = DistributedSampler(dataset)
    loader = DataLoader(dataset, batch_size=8, sampler=sampler)

    start_epoch = 0
    if (state := ddplaunch.load(args.checkpoint)) is not None:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        start_epoch = state["epoch"] + 1

    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        for step, (x, y) in enumerate(loader, 1):
            optimizer.zero_grad()
            loss = torch.nn.functional.cross_entropy(ddp(x / args.samples), y)
            loss.backward()
            optimizer.step()
            record(args, rank, epoch, step, x)
        ddplaunch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "epoch": epoch}, args.checkpoint)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
