#!/usr/bin/python3
"""An elastic PyTorch DDP job (CPU, Gloo) that saves and resumes its own checkpoints, written
the way the PyTorch elastic tutorials write one. Run it under ddplaunch (or torchrun), with
the project's Python (torch 2.x; `scripts/python-env` prints where it is), given by `--python`
or by PYTHON_EXEC as in the README:

    export PYTHON_EXEC=$(scripts/python-env)/bin/python3
    ddplaunch --nnodes=2:3 --nproc_per_node=2 --max_restarts=3 --rdzv_backend=c10d \\
        --rdzv_endpoint=head:29400 --rdzv_id=job1 \\
        scripts/elastic_ddp.py --checkpoint-dir /shared/ckpt

What it does, in the tutorials' terms:
- the launcher gives it RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT; it calls
  init_process_group("gloo") and wraps a small MLP classifier in DistributedDataParallel;
- rank 0 saves a "snapshot" (model, optimizer, epoch, global step, and how far into the epoch
  the job is) to --checkpoint-dir every --checkpoint-every steps and at the end of each epoch:
  torch.save to a temporary file in the same directory, then os.replace, so a crash never
  leaves a torn file behind;
- on every start, every rank loads the newest snapshot (if any) and continues from there,
  also when the number of workers changed: the epoch's shuffled order depends only on the
  seed and the epoch, and the samples already used in it are skipped, so no sample of an
  epoch is used twice or missed across a restart.

It prints (rank 0, on stdout) "[elastic_ddp] start: world W restart R generation G",
"[elastic_ddp] resumed from PATH at step S (epoch E, position P/N)" or
"[elastic_ddp] no checkpoint: starting at step 0", progress lines, and at the end
"[elastic_ddp] done: steps=S final_loss=L final_accuracy=A".
Exit codes: 0 trained; 1 error; 2 bad arguments.
"""

import argparse
import gc
import os
import re
import sys
import time
import weakref

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

try:  # record() writes the worker's error file for the launcher's failure summary
    from torch.distributed.elastic.multiprocessing.errors import record
except ImportError:  # pragma: no cover - older torch
    def record(fn):
        return fn

try:  # progress heartbeats under ddplaunch (hang detection; the next standbys start once the round is up)
    import ddplaunch
except ImportError:  # another launcher: nothing to report to
    ddplaunch = None

SNAPSHOT_RE = re.compile(r"^snapshot-(\d{9})\.pt$")


def say(message):
    """One line on stdout in one write: the ranks of a node may share it."""
    sys.stdout.write("[elastic_ddp] " + message + "\n")
    sys.stdout.flush()


def log(rank, message):
    if rank == 0:
        say(message)


def make_data(samples, features, classes, seed):
    """Deterministic synthetic classification data: identical on every rank and every start."""
    g = torch.Generator().manual_seed(seed + 1000003)
    centres = torch.randn(classes, features, generator=g) * 1.5
    targets = torch.randint(classes, (samples + 1024,), generator=g)
    inputs = centres[targets] + torch.randn(samples + 1024, features, generator=g)
    return (inputs[:samples], targets[:samples]), (inputs[samples:], targets[samples:])


def epoch_order(samples, seed, epoch):
    """The epoch's global sample order (what torch's DistributedSampler shuffles to)."""
    g = torch.Generator().manual_seed(seed + epoch)
    return torch.randperm(samples, generator=g).tolist()


def shard(order, consumed, rank, world):
    """This rank's samples of the rest of the epoch: rest[rank::world], the rest padded by
    repeating its head to a multiple of world (as DistributedSampler pads)."""
    rest = order[consumed:]
    if not rest:
        return []
    pad = (-len(rest)) % world
    rest = rest + (rest * (pad // len(rest) + 1))[:pad]
    return rest[rank::world]


def newest_snapshot(directory):
    """The newest snapshot that loads, or None. A file that fails to load (a disk problem) is
    reported and the next older one is tried."""
    names = sorted((n for n in os.listdir(directory) if SNAPSHOT_RE.match(n)), reverse=True)
    for name in names:
        path = os.path.join(directory, name)
        try:
            return path, torch.load(path, map_location="cpu")
        except Exception as e:  # noqa: BLE001 - any unreadable snapshot is skipped
            print("[elastic_ddp] cannot load %s (%s); trying an older one" % (path, e),
                  file=sys.stderr, flush=True)
    return None


def save_snapshot(directory, state, keep):
    """torch.save to a temporary file, then os.replace: readers see the old or the new file."""
    final = os.path.join(directory, "snapshot-%09d.pt" % state["step"])
    tmp = final + ".tmp.%d" % os.getpid()
    torch.save(state, tmp)
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, final)
    names = sorted(n for n in os.listdir(directory) if SNAPSHOT_RE.match(n))
    for old in names[:-keep]:
        try:
            os.remove(os.path.join(directory, old))
        except FileNotFoundError:
            pass
    return final


@record
def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint-dir", required=True, help="shared directory for snapshots")
    p.add_argument("--checkpoint-every", type=int, default=20, help="steps between snapshots (default 20)")
    p.add_argument("--keep", type=int, default=3, help="snapshots to keep (default 3)")
    p.add_argument("--epochs", type=int, default=5, help="epochs (default 5)")
    p.add_argument("--batch-size", type=int, default=32, help="samples per worker per step (default 32)")
    p.add_argument("--lr", type=float, default=0.05, help="SGD learning rate, momentum 0.9 (default 0.05)")
    p.add_argument("--samples", type=int, default=4800, help="training samples (default 4800)")
    p.add_argument("--features", type=int, default=32)
    p.add_argument("--classes", type=int, default=4)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-every", type=int, default=20, help="steps between progress lines (default 20)")
    p.add_argument("--step-delay", type=float, default=float(os.environ.get("ELASTIC_DDP_STEP_DELAY", "0")),
                   help="seconds to sleep in each step (stands in for a bigger model; default "
                        "$ELASTIC_DDP_STEP_DELAY or 0: a test makes one node slow with it)")
    args = p.parse_args()
    for name in ("checkpoint_every", "keep", "epochs", "batch_size", "samples"):
        if getattr(args, name) <= 0:
            p.error("--%s must be positive" % name.replace("_", "-"))
    os.makedirs(args.checkpoint_dir, exist_ok=True)

    # In-memory restart (ddplaunch.InMemoryRestart): when a peer fails or a node joins, this
    # process keeps its model and optimizer, parks, and goes on in the next round; a rank that
    # holds nothing receives the state from one that does. Under another launcher it is off, and
    # every round starts from the newest snapshot, as the tutorials do.
    restart = ddplaunch.InMemoryRestart() if ddplaunch is not None else None
    torch.manual_seed(args.seed)
    (x_train, y_train), (x_test, y_test) = make_data(args.samples, args.features, args.classes, args.seed)
    model = torch.nn.Sequential(torch.nn.Linear(args.features, args.hidden), torch.nn.ReLU(),
                                torch.nn.Linear(args.hidden, args.hidden), torch.nn.ReLU(),
                                torch.nn.Linear(args.hidden, args.classes))
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    # What this process holds: the step, epoch and position its model and optimizer are at
    # (held = -1: nothing yet, they are fresh).
    position = {"held": -1, "step": 0, "epoch": 0, "consumed": 0, "ddp": None}
    while True:
        try:
            train(args, restart, model, optimizer, position, x_train, y_train, x_test, y_test)
            break
        except Exception as e:  # noqa: BLE001 - recoverable() tells a lost round from a bug
            if restart is None or not restart.recoverable(e):
                raise
            say("pid %d: round abandoned at step %d (%s); parking" % (os.getpid(), position["held"],
                                                                     type(e).__name__))
        # Outside the handler: with the traceback gone, the old round's DistributedDataParallel
        # (its reducer's hooks on the parameters) is freed before the next round wraps the model.
        # Only if something still holds it, a full collection (~0.35 s with torch loaded).
        if position["ddp"] is not None and position["ddp"]() is not None:
            gc.collect()
        restart.park(position["held"])
    if restart is not None:
        restart.close()


def held_state(model, optimizer, position, world):
    return {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": position["step"],
            "epoch": position["epoch"], "consumed": position["consumed"], "world_size": world}


def train(args, restart, model, optimizer, position, x_train, y_train, x_test, y_test):
    if restart is not None:
        restart.init_process_group("gloo", init_method="env://")
    else:
        dist.init_process_group("gloo", init_method="env://")
    rank, world = dist.get_rank(), dist.get_world_size()
    log(rank, "start: world %d restart %s generation %s" % (
        world, os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"),
        os.environ.get("DDPLAUNCH_GENERATION", "-")))
    say("rank %d pid %d generation %s" % (rank, os.getpid(), os.environ.get("DDPLAUNCH_GENERATION", "-")))

    # Resume: from memory when a rank holds a step (in-memory restart), else every rank loads the
    # newest snapshot; they must all agree on which one.
    held, state = -1, None
    if restart is not None and restart.enabled:
        held, state = restart.agree(position["held"], lambda: held_state(model, optimizer, position, world))
    if state is not None:
        if held != position["held"]:  # received from the rank that holds the newest step
            model.load_state_dict(state["model"])
            optimizer.load_state_dict(state["optimizer"])
            position.update(step=state["step"], epoch=state["epoch"], consumed=state["consumed"])
        log(rank, "resumed from memory at step %d (epoch %d, position %d/%d, now world size %d)"
            % (position["step"], position["epoch"], position["consumed"], args.samples, world))
    else:
        found = newest_snapshot(args.checkpoint_dir)
        if found:
            path, state = found
            model.load_state_dict(state["model"])
            optimizer.load_state_dict(state["optimizer"])
            position.update(step=state["step"], epoch=state["epoch"], consumed=state["consumed"])
            log(rank, "resumed from %s at step %d (epoch %d, position %d/%d, written at world size %d, now %d)"
                % (path, position["step"], position["epoch"], position["consumed"], args.samples,
                   state["world_size"], world))
        else:
            log(rank, "no checkpoint: starting at step 0")
        step = position["step"]
        agreed = torch.tensor([step, -step])
        dist.all_reduce(agreed, op=dist.ReduceOp.MAX)
        if agreed[0].item() != -agreed[1].item():
            raise RuntimeError("ranks loaded different snapshots (steps %d..%d): every node must see the "
                               "same --checkpoint-dir" % (-agreed[1].item(), agreed[0].item()))
    position["held"] = position["step"]

    ddp_model = DDP(model)
    position["ddp"] = weakref.ref(ddp_model)
    loss_fn = torch.nn.CrossEntropyLoss()
    started = time.monotonic()
    steps_this_run = 0
    loss = torch.tensor(float("nan"))
    while position["epoch"] < args.epochs:
        epoch = position["epoch"]
        order = epoch_order(args.samples, args.seed, epoch)
        mine = shard(order, position["consumed"], rank, world)
        for begin in range(0, len(mine), args.batch_size):
            index = torch.tensor(mine[begin:begin + args.batch_size])
            optimizer.zero_grad()
            loss = loss_fn(ddp_model(x_train[index]), y_train[index])
            loss.backward()
            optimizer.step()
            if args.step_delay > 0:
                time.sleep(args.step_delay)
            step = position["step"] + 1
            consumed = min(args.samples, position["consumed"] + len(index) * world)
            position.update(step=step, consumed=consumed, held=step)
            steps_this_run += 1
            if ddplaunch is not None:
                ddplaunch.step(step)
            if step % args.log_every == 0:
                log(rank, "epoch %d step %d loss %.4f" % (epoch, step, loss.item()))
            if step % args.checkpoint_every == 0 and consumed < args.samples and rank == 0:
                saved = save_snapshot(args.checkpoint_dir, held_state(model, optimizer, position, world), args.keep)
                log(rank, "saved %s (step %d, epoch %d, position %d/%d)" % (saved, step, epoch,
                                                                           consumed, args.samples))
        position.update(epoch=epoch + 1, consumed=0)
        if rank == 0:
            saved = save_snapshot(args.checkpoint_dir, held_state(model, optimizer, position, world), args.keep)
            log(rank, "saved %s (step %d, end of epoch %d)" % (saved, position["step"], epoch))

    model.eval()
    with torch.no_grad():
        accuracy = (model(x_test).argmax(1) == y_test).float().mean().item()
    model.train()
    mean_loss = torch.tensor([loss.item() if steps_this_run else 0.0])
    dist.all_reduce(mean_loss)
    log(rank, "done: steps=%d steps_this_run=%d seconds=%.2f final_loss=%.4f final_accuracy=%.4f" % (
        position["step"], steps_this_run, time.monotonic() - started, mean_loss.item() / world, accuracy))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
