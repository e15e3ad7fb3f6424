"""In-memory restart in a few lines (docs/restartable.md): a decorator for the training function,
one call after the checkpoint is loaded, and a sampler that resumes mid-epoch.

    import ddplaunch

    @ddplaunch.restartable
    def main():
        dist.init_process_group("gloo")
        ...
        sampler = ddplaunch.ResumableDistributedSampler(dataset, batch_size=32)
        ...
        start_epoch = ddplaunch.resume(start_epoch, model=model, optimizer=optimizer, sampler=sampler)
        for epoch in range(start_epoch, epochs):
            sampler.set_epoch(epoch)
            ...

When a peer fails or a node joins, the function's collective fails; `restartable` sees that the
agent abandoned the round, parks this process (its process group torn down), and calls the
function again in the same process for the next round. Its `resume` call then takes the newest
state any rank holds in memory (the model, the optimizer and the sampler's position of the
previous call, or what a rank that holds them sends), instead of what the checkpoint said. A
replacement rank receives it; nothing is read from disk. The sampler then skips exactly the
samples the job trained in that epoch, so that none is trained twice or skipped, at any world
size.

Under another launcher, without in-memory restart, or with a backend other than Gloo, the
function runs once, `resume` returns its first argument, and the sampler is a DistributedSampler.
"""

import functools
import math

import ddplaunch_standby  # installed beside this package: say()

from .restart import InMemoryRestart

__all__ = ["restartable", "resume", "ResumableDistributedSampler"]

_session = None  # the _Session of the restartable function that runs, if any


class _Session:
    """One restartable function's life in this process: the restart channel, the optimizer steps
    counted since the last resume, and what the last round trained (its model, optimizer and
    sampler), kept from a park to the next resume."""

    def __init__(self):
        self.restart = InMemoryRestart()
        self.steps = 0            # optimizer steps since the last resume, plus the step resumed at
        self.tracked = None       # {"model", "optimizer", "sampler"} of the running round
        self.held = None          # the same, of the round that was abandoned
        self._hook = None

    def count_steps(self):
        """Counts optimizer steps; False when this torch cannot (before 2.0)."""
        try:
            from torch.optim.optimizer import register_optimizer_step_post_hook
        except ImportError:
            return False

        def on_step(optimizer, args, kwargs):
            self.steps += 1

        self._hook = register_optimizer_step_post_hook(on_step)
        return True

    def stop_counting(self):
        if self._hook is not None:
            self._hook.remove()
            self._hook = None

    def held_step(self):
        return self.steps if self.held is not None else -1


def restartable(fn):
    """Runs `fn` and, each time the agent abandons its round (a peer failed, a node joined),
    parks this process and runs `fn` again for the next round. Its `torch.distributed` calls are
    those of a plain program; `dist.init_process_group` is watched while it runs (call it as
    `dist.init_process_group`, not through a name imported before). An error that is not a lost
    round is raised as without this decorator."""

    @functools.wraps(fn)
    def run(*args, **kwargs):
        global _session
        import torch.distributed as dist

        session = _Session()
        if not session.restart.enabled:
            return fn(*args, **kwargs)
        if not session.count_steps():
            ddplaunch_standby.say("ddplaunch.restartable needs torch 2.0 or later (its optimizer step hook); "
                                  "this worker is stopped and started again at a restart")
            session.restart.close()
            return fn(*args, **kwargs)
        plain_init = session.restart.plain_init = dist.init_process_group
        _session = session
        dist.init_process_group = session.restart.init_process_group
        try:
            while True:
                try:
                    result = fn(*args, **kwargs)
                    break
                except Exception as e:  # noqa: BLE001 - recoverable() tells a lost round from a bug
                    if not session.restart.recoverable(e):
                        raise
                    ddplaunch_standby.say("round abandoned (%s); parking with the state of step %d"
                                          % (type(e).__name__, session.steps))
                # Outside the handler: the failed call's frames, its DistributedDataParallel among
                # them, are gone before the next call builds its own. A call that failed before
                # its resume() leaves what the one before it held.
                if session.tracked is not None:
                    session.held, session.tracked = session.tracked, None
                session.restart.park(session.held_step())
        finally:
            dist.init_process_group = plain_init
            session.stop_counting()
            _session = None
        session.restart.close()
        return result

    return run


def _module(model):
    return getattr(model, "module", model)  # DistributedDataParallel holds the model it wraps


def resume(start_epoch, model=None, optimizer=None, sampler=None):
    """Call once the process group exists and the checkpoint (if any) is loaded. Returns the epoch
    to start at: `start_epoch` when no rank holds a newer state in memory; else the epoch of the
    newest state a rank holds, loaded into `model`, `optimizer` and `sampler` (a
    ResumableDistributedSampler, which then starts that epoch where the job left it). Outside a
    restartable function, or without in-memory restart, returns `start_epoch`."""
    session = _session
    if session is None:
        return start_epoch
    held = session.held

    def state():
        return {"model": _module(held["model"]).state_dict() if held["model"] is not None else None,
                "optimizer": held["optimizer"].state_dict() if held["optimizer"] is not None else None,
                "position": held["sampler"].position(session.steps) if held["sampler"] is not None else None}

    step, received = session.restart.agree(session.held_step(), state)
    session.held = None
    session.tracked = {"model": model, "optimizer": optimizer, "sampler": sampler}
    if received is None:
        session.steps = 0
        if sampler is not None:
            sampler.started(0)
        return start_epoch
    if model is not None and received["model"] is not None:
        _module(model).load_state_dict(received["model"])
    if optimizer is not None and received["optimizer"] is not None:
        optimizer.load_state_dict(received["optimizer"])
    session.steps = step
    position = received["position"]
    if sampler is not None:
        sampler.started(step)
        if position is not None:
            sampler.resume_at(position["epoch"], position["consumed"])
    return position["epoch"] if position is not None else start_epoch


def _steps():
    return _session.steps if _session is not None else 0


def _sampler_class():
    from torch.utils.data.distributed import DistributedSampler

    class ResumableDistributedSampler(DistributedSampler):
        """A DistributedSampler (same arguments, plus `batch_size`: the DataLoader's, one batch per
        optimizer step) whose place in an epoch survives an in-memory restart. Each epoch's order
        is DistributedSampler's: the dataset permuted by seed + epoch, padded (or cut, with
        drop_last) to a multiple of the world size; rank r takes every world-size-th index from
        r. After k optimizer steps every rank has trained its first k x batch_size indices, which
        are exactly the first k x batch_size x world indices of that order; a resumed epoch skips
        them and deals out the rest among the new round's ranks, whatever their number."""

        def __init__(self, dataset, batch_size, **kwargs):
            super().__init__(dataset, **kwargs)
            if batch_size < 1:
                raise ValueError("batch_size must be >= 1, got %r" % (batch_size,))
            self.batch_size = int(batch_size)
            self._skip = 0               # indices of the epoch's order trained before this round
            self._skip_epoch = None      # the epoch they belong to
            self._iter_epoch = self.epoch
            self._iter_skip = 0
            self._iter_steps = 0         # optimizer steps counted when this epoch's iteration began
            self._base_steps = 0

        def started(self, steps):
            self._base_steps = steps
            self._iter_steps = steps

        def resume_at(self, epoch, consumed):
            self._skip_epoch, self._skip = int(epoch), int(consumed)
            self.epoch = self._iter_epoch = int(epoch)
            self._iter_skip = int(consumed)

        def set_epoch(self, epoch):
            super().set_epoch(epoch)
            if epoch != self._skip_epoch:
                self._skip_epoch, self._skip = None, 0

        def position(self, steps):
            """The epoch and how many indices of its order the job has trained, after `steps`
            optimizer steps."""
            world = self.num_replicas
            trained = self._iter_skip + (steps - self._iter_steps) * self.batch_size * world
            return {"epoch": self._iter_epoch, "consumed": min(trained, self._order_size())}

        def _order_size(self):
            n = len(self.dataset)
            if self.drop_last and n % self.num_replicas:
                return (n // self.num_replicas) * self.num_replicas
            return int(math.ceil(n / self.num_replicas)) * self.num_replicas

        def _order(self):
            import torch

            n = len(self.dataset)
            if self.shuffle:
                g = torch.Generator()
                g.manual_seed(self.seed + self.epoch)
                order = torch.randperm(n, generator=g).tolist()
            else:
                order = list(range(n))
            size = self._order_size()
            if size <= len(order):
                return order[:size]
            padding = size - len(order)
            repeats = int(math.ceil(padding / len(order)))
            return order + (order * repeats)[:padding]

        def _rest(self):
            skip = self._skip if self._skip_epoch == self.epoch else 0
            return skip, self._order()[skip:]

        def __iter__(self):
            skip, rest = self._rest()
            self._iter_epoch, self._iter_skip, self._iter_steps = self.epoch, skip, _steps()
            self._skip_epoch, self._skip = None, 0  # the next iteration of this epoch is a whole one
            return iter(rest[self.rank::self.num_replicas])

        def __len__(self):
            skip, rest = self._rest()
            return len(rest[self.rank::self.num_replicas])

    return ResumableDistributedSampler


def __getattr__(name):
    if name == "ResumableDistributedSampler":
        cls = _sampler_class()
        globals()[name] = cls
        return cls
    raise AttributeError(name)
