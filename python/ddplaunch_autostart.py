"""What ddplaunch does in every Python worker before the user's script runs, with no change to
the script (docs/agent.md, "Python workers"). python/sitecustomize.py calls install() as the
interpreter starts (ddplaunch puts this directory on the workers' PYTHONPATH); a standby calls it
before it imports torch.

- Progress without code: once torch.optim is imported, every optimizer.step() is a heartbeat
  (torch's global optimizer step hook, torch 2.0 and later), so --hang_timeout, --standby and the
  progress metrics see the steps of a script that never imports ddplaunch. An explicit
  ddplaunch.step() wins: from the first one on, the optimizer no longer counts.
- A clean exit with Gloo: see _wait_for_idle_gloo_threads.

Nothing here imports torch or the ddplaunch package: the package reads the worker's progress
slot from the environment when it is first imported, which in a standby happens only after its
assignment; this module imports it at the first optimizer step.
"""

import atexit
import os
import sys
import time

_installed = False
_progress = None  # the ddplaunch package, imported at the first optimizer step


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
