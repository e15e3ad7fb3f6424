"""What ddplaunch does in every Python worker before the user's script runs, with no change to
the script (docs/agent.md, "Python workers"). python/sitecustomize.py calls install() as the
interpreter starts (ddplaunch puts this directory on the workers' PYTHONPATH); a standby calls it
before it imports torch.

- Progress without code: once torch.optim is imported, every optimizer.step() is a heartbeat
  (torch's global optimizer step hook, torch 2.0 and later), so --hang_timeout, --standby and the
  progress metrics see the steps of a script that never imports ddplaunch. An explicit
  ddplaunch.step() wins: from the first one on, the optimizer no longer counts.
- Busy time per step, for --straggler: the time from the end of one optimizer step to the end of
  the next forward of a DistributedDataParallel model (a forward hook on each DDP model). It
  holds data loading, the forward and any no_sync() micro-batches, and none of the wait for
  slower peers in the gradient all-reduce, which happens in the backward after it. A rank
  whose busy time stays above the others' is the straggler the daemon names.
- A clean exit with Gloo: see _wait_for_idle_gloo_threads.

Nothing here imports torch or the ddplaunch package: the package reads the worker's progress
slot from the environment when it is first imported, which in a standby happens only after its
assignment; this module imports it at the first optimizer step.
"""

import atexit
import functools
import os
import sys
import time

_installed = False
_progress = None  # the ddplaunch package, imported at the first optimizer step
_BUSY_WEIGHT = 0.1      # the moving average's weight of a new step: about the last 10 steps count
_BUSY_WARMUP = 5        # measured steps left out first (allocations, caches, a first compile)
_busy = 0.0             # busy time per step (s), the moving average; 0.0 until measured
_busy_seen = 0          # measured steps, the warm-up included
_step_end = None        # time.perf_counter() when the last optimizer step ended
_forward_end = None     # when the last forward of a DDP model ended


def install():
    """Arms the optimizer hook and the exit guard. Idempotent; never raises."""
    global _installed
    if _installed:
        return
    _installed = True
    if "torch.optim.optimizer" in sys.modules:
        _register_step_hook(sys.modules["torch.optim.optimizer"])
    else:
        sys.meta_path.insert(0, _AfterImport("torch.optim.optimizer", _register_step_hook))
    if "torch.nn.parallel.distributed" in sys.modules:
        _time_ddp_forwards(sys.modules["torch.nn.parallel.distributed"])
    else:
        sys.meta_path.insert(0, _AfterImport("torch.nn.parallel.distributed", _time_ddp_forwards))
    # Registered before anything of the user's: atexit runs it last, after the user's handlers.
    atexit.register(_wait_for_idle_gloo_threads)


class _AfterImport:
    """Calls `then(module)` once the module `name` has been executed, whoever imports it. A meta
    path finder by its find_spec alone: importlib.abc costs tens of milliseconds to import, at
    every worker's start."""

    def __init__(self, name, then):
        self._name = name
        self._then = then

    def find_spec(self, fullname, path, target=None):
        if fullname != self._name:
            return None
        sys.meta_path.remove(self)  # once, and not for the lookup below
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            spec = find(fullname, path, target) if find else None
            if spec is not None:
                break
        else:
            return None
        loader = spec.loader
        exec_module = getattr(loader, "exec_module", None)
        if exec_module is None:
            return spec
        then = self._then

        def exec_then(module):
            exec_module(module)
            then(module)

        try:
            loader.exec_module = exec_then  # this spec's loader only
        except AttributeError:
            pass
        return spec


def _register_step_hook(optimizer_module):
    register = getattr(optimizer_module, "register_optimizer_step_post_hook", None)
    if register is None:
        # torch 1.x: only ddplaunch.step() reports steps. Said once, by the job's first rank.
        if os.environ.get("RANK") == "0" and os.environ.get("DDPLAUNCH_PROGRESS_FILE"):
            sys.stderr.write("ddplaunch (rank 0): this torch has no global optimizer step hook (torch 2.0 and "
                             "later have it): --hang_timeout and --standby see this job's steps only where it "
                             "calls ddplaunch.step()\n")
        return
    register(_on_optimizer_step)


def _on_optimizer_step(optimizer, args, kwargs):
    global _progress
    if _progress is None:
        import ddplaunch
        _progress = ddplaunch
    _progress._optimizer_step()
    _measure_busy(time.perf_counter())


def _measure_busy(now):
    """At the end of an optimizer step: the busy time of the step, when a DDP forward ended since
    the last one (a second optimizer of the same iteration has none of its own and is skipped)."""
    global _busy, _busy_seen, _step_end
    if _step_end is not None and _forward_end is not None and _forward_end > _step_end:
        _busy_seen += 1
        if _busy_seen > _BUSY_WARMUP:
            sample = _forward_end - _step_end
            _busy = sample if _busy == 0.0 else _busy + _BUSY_WEIGHT * (sample - _busy)
            _progress._set_busy(_busy)
    _step_end = now


def _time_ddp_forwards(distributed_module):
    """Every DistributedDataParallel made from now on notes when its forward ends: its
    constructor is wrapped to register a forward hook as it returns (forward itself, and the
    gradient all-reduce, are left as they are)."""
    ddp_class = getattr(distributed_module, "DistributedDataParallel", None)
    if ddp_class is None:
        return
    plain_init = ddp_class.__init__

    @functools.wraps(plain_init)
    def init(self, *args, **kwargs):
        global _step_end, _forward_end, _busy_seen
        plain_init(self, *args, **kwargs)
        self.register_forward_hook(_on_ddp_forward)
        # A new model, a new round (an in-memory restart builds its DDP again): the time since
        # the last step is the restart's, and its first steps are a warm-up again.
        _step_end = _forward_end = None
        _busy_seen = 0

    ddp_class.__init__ = init


def _on_ddp_forward(module, args, output):
    global _forward_end
    _forward_end = time.perf_counter()


# The Gloo backend of torch 2.x frees a finished collective's work on its own worker thread, a
# moment after the caller saw it complete. If the interpreter has begun to finalize by then and
# the work holds the last reference to a tensor that Python let go of, that thread's GIL
# acquisition ends it with pthread_exit in the middle of a C++ destructor: "terminate called
# without an active exception", SIGABRT, a failed job after a successful run. destroy_process_group
# does not stop those threads while a DistributedDataParallel model still holds the group, which
# is the usual case. So, before the interpreter finalizes, wait (bounded) until every Gloo worker
# thread sits in its idle wait: an untimed condition-variable wait, which a thread enters only
# after it has freed its last work. Seen through /proc: no torch internals are touched.
_GLOO_WORKER_THREAD = "pt_gloo_runloop"
_SYS_FUTEX = "202"              # x86-64; elsewhere nothing is idle by this test and the wait is bounded
_FUTEX_WAIT_BITSET = 9          # glibc's pthread_cond_wait
_FUTEX_CMD_MASK = 0x7F
_GLOO_EXIT_WAIT = 2.0           # seconds at most: a thread stuck in a collective is not waited out


def _gloo_threads_busy():
    """The Gloo worker threads of this process that are not in their idle wait (thread ids)."""
    busy = []
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return busy
    for tid in tids:
        try:
            with open("/proc/self/task/%s/comm" % tid) as f:
                if f.read().strip() != _GLOO_WORKER_THREAD:
                    continue
            with open("/proc/self/task/%s/syscall" % tid) as f:
                fields = f.read().split()
        except OSError:
            continue  # gone, or not readable: nothing to wait for
        idle = (len(fields) > 4 and fields[0] == _SYS_FUTEX and
                int(fields[2], 16) & _FUTEX_CMD_MASK == _FUTEX_WAIT_BITSET and int(fields[4], 16) == 0)
        if not idle:
            busy.append(int(tid))
    return busy


def _wait_for_idle_gloo_threads(limit=_GLOO_EXIT_WAIT):
    """Waits until two looks in a row, a millisecond apart, find every Gloo worker thread idle, or
    `limit` seconds. Returns True when they were found idle (or there are none)."""
    if "torch.distributed" not in sys.modules:
        return True
    deadline = time.monotonic() + limit
    idle_looks = 0
    while idle_looks < 2:
        idle_looks = idle_looks + 1 if not _gloo_threads_busy() else 0
        if idle_looks < 2:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.001)  # lets a thread that waits for the GIL have it
    return True
