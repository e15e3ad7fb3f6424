"""Progress heartbeats for Python workers run by ddplaunch (docs/worker-sdk.md, "Progress").

Every optimizer.step() of a worker is a heartbeat already, with no import (torch 2.0 and later;
python/ddplaunch_autostart.py). A script calls these to say more, or to count its own steps:

    import ddplaunch
    for batch in loader:
        train_step(batch)
        ddplaunch.step()                 # one heartbeat per completed step

    with ddplaunch.phase("checkpoint"):  # what the worker is doing, shown when it hangs
        save(...)
    ddplaunch.checkpoint(step)           # a checkpoint was saved (crash-loop detection)
    ddplaunch.done()                     # steps are over: teardown is not a hang

and in-memory restart (ddplaunch.InMemoryRestart, python/ddplaunch/restart.py): a healthy
worker keeps its process, model and optimizer across a restart; and checkpoints
(ddplaunch.save, ddplaunch.load, python/ddplaunch/checkpoints.py, docs/checkpoints.md) and
their cadence (ddplaunch.checkpoint_due, python/ddplaunch/cadence.py).

ddplaunch gives each worker a shared-memory slot (DDPLAUNCH_PROGRESS_FILE,
DDPLAUNCH_PROGRESS_SLOT); step() writes a counter there, no system call, well under a
microsecond. Under another launcher, or none, every function does nothing.
"""

import contextlib
import mmap
import os
import struct

__all__ = ["step", "phase", "checkpoint", "done", "enabled", "abandoned", "InMemoryRestart", "restartable", "resume",
           "ResumableDistributedSampler", "save", "load", "wait_for_save", "CheckpointError", "checkpoint_due",
           "checkpoint_interval"]

# The project's version (CMakeLists.txt's project(VERSION)); checkpoints record it.
__version__ = "0.1.0"

# For find_package(ddplaunch) in a C++ program, like torch.utils.cmake_prefix_path: the worker
# SDK's CMake package, which the wheel installs beside this file (docs/install.md, "pip"). A copy
# of this package that came with no wheel (a source tree) has none there.
cmake_prefix_path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "share", "cmake")

# The slot's layout: contracts/progress_slot.h in the ddplaunch sources (the Python side's one
# copy; tests/contracts/test_fixtures.py holds it to contracts/fixtures/progress_slot.bin).
_SLOT_SIZE = 128
_BEATS_OFFSET = 0
_STEP_OFFSET = 8
_CHECKPOINT_OFFSET = 16
_PHASE_OFFSET = 24
_PHASE_SIZE = 32
_ABANDONED_OFFSET = 56
_INTERVAL_OFFSET = 64  # checkpoint_interval_ms
_FINAL_OFFSET = 72
_BUSY_OFFSET = 80      # busy_us: busy time per step (python/ddplaunch_autostart.py measures it)
_STALL_OFFSET = 88     # checkpoint_stall_us: the steps' standstill for checkpoints so far (save())
_FIRST_OFFSET = 96     # first_step + 1 since the agent cleared the slot (0 = none yet)
_DONE_BEATS = 0xFFFFFFFFFFFFFFFF  # the worker finished its steps: not watched
_BEATS_WORD, _STEP_WORD, _CHECKPOINT_WORD = _BEATS_OFFSET // 8, _STEP_OFFSET // 8, _CHECKPOINT_OFFSET // 8

_words = None   # memoryview of the slot's beats, step and checkpoint as unsigned 64-bit words
_bytes = None   # memoryview of the slot's bytes
_beats = 0
_step = 0
_explicit = False  # step() was called: the optimizer's steps no longer count


_first = None  # memoryview of the slot's first_step word


def _open():
    global _words, _bytes, _first
    path = os.environ.get("DDPLAUNCH_PROGRESS_FILE")
    slot = os.environ.get("DDPLAUNCH_PROGRESS_SLOT")
    if not path or slot is None:
        return
    try:
        slot = int(slot)
        fd = os.open(path, os.O_RDWR | getattr(os, "O_CLOEXEC", 0))
    except (ValueError, OSError):
        return
    try:
        size = os.fstat(fd).st_size
        if slot < 0 or (slot + 1) * _SLOT_SIZE > size:
            return
        region = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    except (OSError, ValueError):
        return
    finally:
        os.close(fd)
    view = memoryview(region)[slot * _SLOT_SIZE:(slot + 1) * _SLOT_SIZE]
    _bytes = view
    _words = view[:_PHASE_OFFSET].cast("Q")
    _first = view[_FIRST_OFFSET:_FIRST_OFFSET + 8].cast("Q")


_open()


def enabled():
    """True when the agent watches this worker's progress."""
    return _words is not None


def step(n=None):
    """Reports a completed step: `n` is its number (default: one more than the last this function
    reported). From the first call on, optimizer.step() is no longer counted as a step."""
    global _step, _explicit
    if not _explicit:
        _explicit = True
        _step = 0
    if _words is None:
        return
    if n is None:
        _step += 1
    else:
        _step = int(n) & 0xFFFFFFFFFFFFFFFF  # stored unsigned; never an error in a training loop
    _write_step()


def _optimizer_step():
    """The heartbeat of one optimizer.step() (python/ddplaunch_autostart.py), until step() is
    called."""
    global _step
    if _explicit or _words is None:
        return
    _step += 1
    _write_step()


def _write_step():
    global _beats
    if _first[0] == 0:  # the round's first step (the agent cleared the slot): where it resumed
        _first[0] = (_step + 1) & 0xFFFFFFFFFFFFFFFF
    _words[_STEP_WORD] = _step
    _beats += 1
    _words[_BEATS_WORD] = _beats  # last: the agent sees the step with the beat


def abandoned():
    """True once the agent marked this worker's round as lost (a peer failed; with in-memory
    restart, the worker is asked to park): a step that needs the other ranks will not complete.
    False under another launcher, or none."""
    if _bytes is None:
        return False
    return struct.unpack_from("<Q", _bytes, _ABANDONED_OFFSET)[0] != 0


def done():
    """Says that this worker's steps are over: what follows (a final evaluation, saving,
    destroy_process_group, interpreter exit) may take any time without being taken for a hang.
    A later step() resumes watching. Called at exit too."""
    if _words is not None:
        _words[_BEATS_WORD] = _DONE_BEATS


def checkpoint(n=None):
    """Reports a saved checkpoint of step `n` (default: the last step reported)."""
    if _words is None:
        return
    _words[_CHECKPOINT_WORD] = (_step if n is None else int(n)) & 0xFFFFFFFFFFFFFFFF


def _set_phase(name):
    data = name.encode("ascii", "replace")[:_PHASE_SIZE - 1]
    _bytes[_PHASE_OFFSET:_PHASE_OFFSET + _PHASE_SIZE] = data + b"\0" * (_PHASE_SIZE - len(data))


def _get_phase():
    raw = bytes(_bytes[_PHASE_OFFSET:_PHASE_OFFSET + _PHASE_SIZE])
    return raw.split(b"\0", 1)[0].decode("ascii", "replace")


def _set_checkpoint_interval(seconds):
    """Reports the interval between checkpoints this worker chose (checkpoint_due), shown by
    `ddp-rendezvous status`. Nothing without an agent."""
    if _bytes is None:
        return
    millis = max(0, min(int(round(float(seconds) * 1000)), 0x7FFFFFFFFFFFFFFF))
    _bytes[_INTERVAL_OFFSET:_INTERVAL_OFFSET + 8].cast("q")[0] = millis


def _get_checkpoint_interval():
    """The reported interval in seconds; 0.0 when none was reported or without an agent."""
    if _bytes is None:
        return 0.0
    return _bytes[_INTERVAL_OFFSET:_INTERVAL_OFFSET + 8].cast("q")[0] / 1000.0


def _set_final():
    """Asks the agent to end the job at this worker's failure instead of restarting it: a
    restart would fail the same way (a checkpoint refused under a strict environment check)."""
    if _bytes is not None:
        _bytes[_FINAL_OFFSET:_FINAL_OFFSET + 8].cast("Q")[0] = 1


def _final():
    return _bytes is not None and _bytes[_FINAL_OFFSET:_FINAL_OFFSET + 8].cast("Q")[0] != 0


_stall_total = 0.0  # seconds save() has stood the caller still so far, in this process


def _add_checkpoint_stall(seconds):
    """Adds a save's stall to the slot's cumulative checkpoint_stall_us, which the daemon's
    goodput account counts as checkpoint time (docs/goodput.md). Nothing without an agent."""
    global _stall_total
    _stall_total += max(0.0, float(seconds))
    if _bytes is None:
        return
    _bytes[_STALL_OFFSET:_STALL_OFFSET + 8].cast("Q")[0] = max(0, min(int(round(_stall_total * 1e6)), 10 ** 13))


def _set_busy(seconds):
    """Reports this worker's busy time per step (the time it does not wait for its peers), which
    the daemon compares across nodes to find a straggler. Nothing without an agent."""
    if _bytes is None:
        return
    micros = max(0, min(int(round(float(seconds) * 1e6)), 0x7FFFFFFFFFFFFFFF))
    _bytes[_BUSY_OFFSET:_BUSY_OFFSET + 8].cast("Q")[0] = micros


def _get_busy():
    """The reported busy time per step in seconds; 0.0 when none was reported or without an agent."""
    if _bytes is None:
        return 0.0
    return _bytes[_BUSY_OFFSET:_BUSY_OFFSET + 8].cast("Q")[0] / 1e6


@contextlib.contextmanager
def phase(name):
    """Marks a section of the worker's work ("data", "forward", "checkpoint"): a hang report
    names the phase the rank was in. Nests; the outer phase comes back on exit."""
    if _bytes is None:
        yield
        return
    previous = _get_phase()
    _set_phase(str(name))
    try:
        yield
    finally:
        _set_phase(previous)


if _words is not None:
    import atexit
    atexit.register(done)


from .restart import InMemoryRestart  # noqa: E402 - uses abandoned() and enabled() above
from .wrapper import restartable, resume  # noqa: E402


_CHECKPOINT_NAMES = ("save", "load", "wait_for_save", "CheckpointError")


def __getattr__(name):
    # The sampler subclasses torch's DistributedSampler: torch is imported when it is first used.
    if name == "ResumableDistributedSampler":
        from . import wrapper
        return wrapper.ResumableDistributedSampler
    # Every worker imports this package (at its first optimizer step): the checkpoint module
    # loads when a script first names it.
    if name in _CHECKPOINT_NAMES:
        from . import checkpoints
        return getattr(checkpoints, name)
    if name in ("checkpoint_due", "checkpoint_interval"):
        from . import cadence
        return getattr(cadence, name)
    raise AttributeError("module 'ddplaunch' has no attribute %r" % name)
