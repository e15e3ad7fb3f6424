"""Checkpoints for Python training scripts (docs/checkpoints.md): torch.save and torch.load with
atomic files, checksums, write-behind, fallback past a damaged file, and a lineage record.

    import ddplaunch

    if (state := ddplaunch.load("ckpt")) is not None:    # the newest valid checkpoint, or None
        model.load_state_dict(state["model"])
    ...
    ddplaunch.save({"model": model.state_dict(), "epoch": epoch}, "ckpt")   # returns at once

A checkpoint directory holds, per step S (12 digits):
- ckpt-S.pt: what torch.save wrote, renamed into place once complete and on disk;
- ckpt-S.json: its record (size, sha256, step, lineage), written after the data file, itself
  atomically: the record is the commit point. A data file without a record is an unfinished
  write and is never loaded.

Threads: save(), load() and wait_for_save() are called by the training thread; one background
thread writes at a time (_Writer). Only rank 0 (the RANK variable; 0 when unset) writes: with
DistributedDataParallel every rank holds the same state.
"""

import atexit
import copy
import hashlib
import json
import os
import re
import signal
import sys
import threading
import time

__all__ = ["save", "load", "wait_for_save", "CheckpointError"]

_FORMAT = 1
_NAME = re.compile(r"^ckpt-(\d+)\.(pt|json)$")
_TEMP = re.compile(r"^\.ckpt-\d+\.(pt|json)\.tmp-\d+$")
_HASH_CHUNK = 4 << 20

# Test seams: called by the writer thread at these points of a write, with the step ("start":
# before serialising; "written": the temporary file complete and synced; "renamed": the data
# file in place, its record not yet written). Tests use them to hold a write where it must be
# killed; None in production.
_hooks = {}


def _hook(name, step):
    call = _hooks.get(name)
    if call is not None:
        call(step)


class CheckpointError(Exception):
    """A checkpoint could not be saved or loaded: misuse (a path that is not a directory, a
    step that goes back), a failed write (reported by the next save() or wait_for_save()), or a
    file that verifies but that torch cannot read."""


# --- environment ---------------------------------------------------------------------------

def _rank():
    value = os.environ.get("RANK", "0")
    try:
        return int(value)
    except ValueError:
        raise CheckpointError("RANK=%r is not a number: checkpoints are written by rank 0 only" % value) from None


def _prefix():
    rank = os.environ.get("RANK")
    return "ddplaunch (rank %s): " % rank if rank is not None else "ddplaunch: "


def _say(message):
    sys.stderr.write(_prefix() + message + "\n")
    sys.stderr.flush()


def _directory(path):
    """The checkpoint directory as a string; a CheckpointError for a value that cannot be one."""
    if isinstance(path, bytes):
        path = os.fsdecode(path)
    if not isinstance(path, (str, os.PathLike)):
        raise CheckpointError("the checkpoint directory must be a path (str or os.PathLike), not %s"
                              % type(path).__name__)
    path = os.fspath(path)
    if not isinstance(path, str):
        path = os.fsdecode(path)
    if not path:
        raise CheckpointError("the checkpoint directory is an empty path")
    if os.path.exists(path) and not os.path.isdir(path):
        raise CheckpointError("%s is a file, not a checkpoint directory: ddplaunch.save and ddplaunch.load take "
                              "a directory, which holds one file per step (name a new directory)" % path)
    return path


# --- lineage ---------------------------------------------------------------------------------

_program = {}  # {"sha256": ..., "path": ...} of the main script, hashed once per process


def _program_sha256():
    """sha256 of the main script (sys.argv[0]) as it was at the first save or load; None when the
    program is not a file (python -c, an interactive session)."""
    if not _program:
        path = sys.argv[0] if sys.argv else ""
        digest = None
        if path and os.path.isfile(path):
            try:
                digest = _sha256_of(path)[1]
            except OSError:
                pass
        _program.update(sha256=digest, path=os.path.abspath(path) if digest else None)
    return _program["sha256"]


def _world_size():
    value = os.environ.get("WORLD_SIZE", "1")
    try:
        return int(value)
    except ValueError:
        return None


def _version():
    from . import __version__
    return __version__


def _lineage():
    return {"env_fingerprint": os.environ.get("DDPLAUNCH_ENV_FINGERPRINT") or None,
            "world_size": _world_size(),
            "program_sha256": _program_sha256(),
            "ddplaunch_version": _version()}


def _short(value):
    return value[:16] if isinstance(value, str) else str(value)


def _check_lineage(data_path, written):
    """Says on stderr each field in which the checkpoint's lineage differs from this process's.
    Raises SystemExit(3) when the environment fingerprints differ under DDPLAUNCH_ENV_CHECK=strict.
    A field unknown on either side (no fingerprint without an environment check, a program that
    is not a file) is not compared."""
    now = _lineage()
    written = written if isinstance(written, dict) else {}
    name = os.path.basename(data_path)
    if written.get("world_size") is not None and now["world_size"] is not None \
            and written["world_size"] != now["world_size"]:
        _say("checkpoint %s was written at world size %s; this job runs at world size %s: loading it (with "
             "DDP every rank holds the whole state)" % (name, written["world_size"], now["world_size"]))
    if written.get("program_sha256") and now["program_sha256"] and written["program_sha256"] != now["program_sha256"]:
        _say("checkpoint %s was written by another version of the program: sha256 of %s is %s now, %s then"
             % (name, os.path.basename(_program["path"]), _short(now["program_sha256"]),
                _short(written["program_sha256"])))
    if written.get("ddplaunch_version") and written["ddplaunch_version"] != now["ddplaunch_version"]:
        _say("checkpoint %s was written with ddplaunch %s; this is ddplaunch %s"
             % (name, written["ddplaunch_version"], now["ddplaunch_version"]))
    then_env, now_env = written.get("env_fingerprint"), now["env_fingerprint"]
    if then_env and now_env and then_env != now_env:
        if os.environ.get("DDPLAUNCH_ENV_CHECK") == "strict":
            _say("refusing to resume from checkpoint %s: it was written in another environment (fingerprint %s "
                 "then, %s now) and --env_check=strict is set; resume with the environment that wrote it, start "
                 "from a fresh checkpoint directory, or pass --env_check=warn"
                 % (data_path, _short(then_env), _short(now_env)))
            from . import _set_final
            _set_final()  # every restart would refuse the same way: the agent ends the job instead
            raise SystemExit(3)
        _say("checkpoint %s was written in another environment (fingerprint %s then, %s now): loading it "
             "(--env_check=strict would refuse)" % (name, _short(then_env), _short(now_env)))


# --- files -----------------------------------------------------------------------------------

def _sha256_of(path):
    """(size, hex sha256) of a file, read in 4 MiB chunks."""
    digest, size = hashlib.sha256(), 0
    with open(path, "rb") as f:
        while True:
            chunk = f.read(_HASH_CHUNK)
            if not chunk:
                return size, digest.hexdigest()
            size += len(chunk)
            digest.update(chunk)


def _fsync_dir(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _base(step):
    return "ckpt-%012d" % step


def _steps(path):
    """({step: record file}, {step: data file}) of a directory (missing: empty)."""
    records, data = {}, {}
    try:
        names = os.listdir(path)
    except FileNotFoundError:
        return records, data
    for name in names:
        m = _NAME.match(name)
        if m:
            (records if m.group(2) == "json" else data)[int(m.group(1))] = os.path.join(path, name)
    return records, data


def _write_json(path, record):
    """Writes `record` to `path` through a temporary file, fsync and rename: whole or absent."""
    directory, name = os.path.split(path)
    tmp = os.path.join(directory, ".%s.tmp-%d" % (name, os.getpid()))
    with open(tmp, "w") as f:
        json.dump(record, f, indent=1, sort_keys=True)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(directory)


def _remove(path):
    if path is None:
        return
    try:
        os.remove(path)
    except FileNotFoundError:
        pass


# --- the snapshot ------------------------------------------------------------------------------

def _snapshot(state):
    """A deep copy of `state` whose tensors are detached CPU copies: what save() hands to the
    writer, so that training may change the originals at once. Shared tensors stay shared."""
    import torch
    memo = {}

    def copy_of(obj):
        key = id(obj)
        if key in memo:
            return memo[key]
        if isinstance(obj, torch.Tensor):
            t = obj.detach()
            out = t.clone() if t.device.type == "cpu" else t.to("cpu")  # to("cpu") copies already
        elif isinstance(obj, dict):
            out = copy.copy(obj)  # keeps the type (OrderedDict) and its attributes (_metadata)
            for k, v in obj.items():
                out[k] = copy_of(v)
        elif isinstance(obj, list):
            out = [copy_of(v) for v in obj]
        elif isinstance(obj, tuple) and type(obj) is tuple:
            out = tuple(copy_of(v) for v in obj)
        else:
            out = copy.deepcopy(obj)
        memo[key] = out
        return out

    return copy_of(state)


# --- the writer ---------------------------------------------------------------------------------

class _Write:
    """One checkpoint write: a snapshot, where it goes, and its outcome."""

    def __init__(self, snapshot, path, step, keep):
        self.snapshot, self.path, self.step, self.keep = snapshot, path, step, keep
        self.lineage = _lineage()
        self.error = None
        self.thread = None

    def run(self):
        tmp = None
        try:
            import torch
            base = os.path.join(self.path, _base(self.step))
            record_path, data_path = base + ".json", base + ".pt"
            tmp = os.path.join(self.path, ".%s.pt.tmp-%d" % (_base(self.step), os.getpid()))
            _hook("start", self.step)
            with open(tmp, "wb") as f:
                torch.save(self.snapshot, f)
                f.flush()
                os.fsync(f.fileno())
            self.snapshot = None  # the memory goes back before the checksum pass
            size, digest = _sha256_of(tmp)
            _hook("written", self.step)
            os.replace(tmp, data_path)
            tmp = None
            _fsync_dir(self.path)
            _hook("renamed", self.step)
            _write_json(record_path, {"format": _FORMAT, "step": self.step, "file": os.path.basename(data_path),
                                      "size": size, "sha256": digest, "time": time.time(), "lineage": self.lineage})
            _report_progress(self.step)
            _prune(self.path, self.keep)
        except BaseException as e:  # noqa: B902 - the training thread hears of it at its next save
            self.error = e
            if tmp is not None:
                try:
                    _remove(tmp)
                except OSError:
                    pass
        finally:
            self.snapshot = None

    def describe(self):
        return "step %d to %s" % (self.step, self.path)


def _report_progress(step):
    """Tells ddplaunch's agent that a checkpoint of `step` exists (crash-loop detection)."""
    try:
        from . import checkpoint
        checkpoint(step)
    except Exception:  # noqa: B902 - a report never fails a checkpoint
        pass


def _prune(path, keep):
    """Keeps the `keep` newest committed checkpoints; removes older ones (record first: a data
    file without a record is never loaded), data files that have no record, and temporary files
    of writers that are gone. A file that cannot be removed is named on stderr; the checkpoint
    just written stands."""
    try:
        _remove_old(path, keep)
    except OSError as e:
        _say("cannot remove old checkpoints in %s: %s%s" % (path, e.strerror or e, ": " + e.filename if e.filename
                                                               else ""))


def _remove_old(path, keep):
    records, data = _steps(path)
    for step in _damaged.pop(path, ()):  # what load() skipped goes once a valid checkpoint is written
        _remove(records.pop(step, None))
        _remove(data.pop(step, None))
    committed = sorted(records)
    for step in committed[:-keep]:
        _remove(records[step])
        if step in data:
            _remove(data[step])
    for step, file in data.items():
        if step not in records:
            _remove(file)
    for name in os.listdir(path):
        if _TEMP.match(name) and not name.endswith("-%d" % os.getpid()):
            _remove(os.path.join(path, name))


_damaged = {}  # directory -> the steps whose records load() found damaged in this process
_lock = threading.RLock()  # guards _current (the training thread and the SIGTERM handler, in the same thread)
_current = None            # the _Write in flight or last finished, not yet waited for
_handlers_installed = False


def _wait(quiet=True):
    """Waits for the write in flight, if any, and returns it (None when there was none)."""
    global _current
    with _lock:
        write = _current
    if write is None:
        return None
    if write.thread.is_alive():
        if not quiet:
            _say("waiting for the checkpoint write of %s in flight" % write.describe())
        # _current still names the write while it is joined: a SIGTERM handled meanwhile (Python
        # runs handlers in this thread, during the join) waits for it too before the process ends.
        write.thread.join()
    with _lock:
        if _current is write:
            _current = None
    return write


def _raise_if_failed(write):
    if write is not None and write.error is not None:
        e = write.error
        detail = "%s: %s" % (type(e).__name__, e) if not isinstance(e, OSError) else \
            "%s%s" % (e.strerror or e, ": " + e.filename if e.filename else "")
        raise CheckpointError("the checkpoint write of %s failed: %s" % (write.describe(), detail)) from e


def _finish_at_exit():
    write = _wait(quiet=False)
    if write is not None and write.error is not None:
        try:
            _raise_if_failed(write)
        except CheckpointError as e:
            _say(str(e))


def _on_sigterm(previous):
    def handler(signum, frame):
        _finish_at_exit()
        if callable(previous):
            previous(signum, frame)
            return
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)
    return handler


def _install_handlers():
    """At exit and on SIGTERM, the write in flight completes first. The SIGTERM handler is put in
    place of the default action (then dies by SIGTERM as before) or in front of a Python handler
    (then calls it); an ignored SIGTERM or a handler set outside Python is left alone."""
    global _handlers_installed
    if _handlers_installed:
        return
    _handlers_installed = True
    atexit.register(_finish_at_exit)
    try:
        previous = signal.getsignal(signal.SIGTERM)
        if previous == signal.SIG_DFL or callable(previous):
            signal.signal(signal.SIGTERM, _on_sigterm(previous))
    except ValueError:  # not the main thread: the atexit wait still holds
        pass


# A stop at the next checkpoint (docs/checkpoints.md, "At a stop"). Once a script has called
# checkpoint_due() under ddplaunch, a SIGTERM that does not come from a failed round (a drain, a
# change of nodes without in-memory restart, ddplaunch itself stopped) no longer ends the worker
# at once: checkpoint_due() then says True, and rank 0's save() after it ends the worker by
# SIGTERM once its write is on disk. The other ranks go on: they end when the step after it finds
# rank 0 gone, or at the grace below, so that none leaves rank 0 alone in the collective of a
# step it has not checked yet. A grace of a few of its steps without that save, a second SIGTERM,
# or a round the agent abandoned (a peer failed: a step would not complete) end the worker as
# before. The handler only notes the request and starts the grace: what is said, is said by
# checkpoint_due(), outside it.
_STOP_GRACE_STEPS = 3     # the checks a stopping worker gets: this many of its longest step
_STOP_GRACE_MIN_S = 2.0
_STOP_GRACE_MAX_S = 20.0
_STOP_LAST_WORD_S = 1.0   # after the grace, this long for the main thread to run the handler
_stop_armed = False
_stop_previous = None     # the SIGTERM disposition before ours, which ends the worker
_stop_requested = None    # time.monotonic() of the SIGTERM, once one asked for a stop
_stop_said = False
_stop_timer = None
_stopping = False         # the worker is ending: the write in flight is being finished
_stop_saving = False      # rank 0's checkpoint_due() said True: its save is coming, the grace is off
_grace_sent = False       # the grace ran out and signalled the main thread
_last_check = None        # time.monotonic() of the last checkpoint_due()
_longest_gap = 0.0        # the longest time between two checkpoint_due() calls: about a step


def _checked():
    """checkpoint_due() was called: arms the stop at the first call, measures the steps between
    calls, and returns True when a stop asks for a checkpoint now."""
    global _last_check, _longest_gap, _stop_said
    now = time.monotonic()
    if _last_check is not None:
        _longest_gap = max(_longest_gap, now - _last_check)
    _last_check = now
    _arm_stop()
    if _stop_requested is None:
        return False
    if _rank() == 0:
        _save_coming()
    if not _stop_said:
        _stop_said = True
        _say("SIGTERM: stopping after this checkpoint" if _rank() == 0 else
             "SIGTERM: stopping once rank 0 has written its checkpoint")
    return True


def _arm_stop():
    global _stop_armed, _stop_previous
    if _stop_armed:
        return
    _stop_armed = True
    from . import enabled
    if not enabled():
        return  # another launcher, or none: SIGTERM stays what it was
    try:
        previous = signal.getsignal(signal.SIGTERM)
        if previous == signal.SIG_DFL or callable(previous):
            _stop_previous = previous
            signal.signal(signal.SIGTERM, _on_stop_request)
    except ValueError:  # not the main thread: SIGTERM stays what it was
        pass


def _save_coming():
    """Rank 0 was told to save: it is not stuck, and the save may take longer than the grace (the
    first one imports torch), so the grace no longer applies; ddplaunch's own shutdown timeout
    still bounds a script that never saves."""
    global _stop_saving
    _stop_saving = True
    if _stop_timer is not None:
        _stop_timer.cancel()


def _on_stop_request(signum, frame):
    global _stop_requested, _stop_timer
    from . import abandoned
    if _grace_sent and _stop_saving:
        return  # the grace's own signal, sent as rank 0 was told to save: the save goes on
    if _stop_requested is not None or abandoned():
        _stop_now()
        return
    _stop_requested = time.monotonic()
    grace = min(_STOP_GRACE_MAX_S, max(_STOP_GRACE_MIN_S, _STOP_GRACE_STEPS * _longest_gap))
    _stop_timer = threading.Timer(grace, _grace_over)
    _stop_timer.daemon = True
    _stop_timer.start()


def _grace_over():
    """On the timer's thread: the main thread runs the handler again when it can (a step that did
    not get to its check); one blocked in native code (a collective whose peer is gone) cannot,
    and the process ends without it."""
    global _grace_sent
    if _stop_saving:
        return
    _grace_sent = True
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(_STOP_LAST_WORD_S)
    if not _stopping and not _stop_saving:
        os._exit(128 + signal.SIGTERM)


def _stop_now():
    """Ends the worker as the SIGTERM disposition before ours would have, the write in flight on
    disk first (a SIGTERM meanwhile runs this again, which waits for the same write)."""
    global _stopping
    _stopping = True
    if _stop_timer is not None:
        _stop_timer.cancel()
    if threading.current_thread() is not threading.main_thread():
        os.kill(os.getpid(), signal.SIGTERM)  # the main thread's handler ends it
        return
    _on_sigterm(_stop_previous)(signal.SIGTERM, None)


def _stop_after_save(step):
    if _stop_requested is None:
        return
    _say("stopping: the checkpoint of step %d is being written" % step)
    _stop_now()


# --- the API -----------------------------------------------------------------------------------

def save(state, dir, step=None, keep=3):
    """Saves `state` (what torch.save takes: dicts of tensors and plain values) as a checkpoint of
    `step` in the directory `dir`, and returns the step once the state is copied: the writing
    happens in the background. `step` defaults to one more than the newest in `dir` (0 in an
    empty one) and may not be lower than it. After the write, only the `keep` newest complete
    checkpoints are kept.

    One write at a time: a save while the previous write is in flight waits for it, so that no
    state is dropped and at most one copy is held. A failed write raises CheckpointError from
    the next save() or wait_for_save(). On ranks other than 0 this does nothing and returns None.
    """
    global _current
    path = _directory(dir)
    if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
        raise CheckpointError("keep=%r: the number of checkpoints to keep must be an integer of at least 1" % (keep,))
    if step is not None and (isinstance(step, bool) or not isinstance(step, int) or step < 0):
        raise CheckpointError("step=%r: a checkpoint's step must be a non-negative integer" % (step,))
    if _rank() != 0:
        return None
    began = time.monotonic()
    _install_handlers()
    from . import phase
    with phase("checkpoint"):
        _raise_if_failed(_wait())
        try:
            os.makedirs(path, exist_ok=True)
        except OSError as e:
            raise CheckpointError("cannot create the checkpoint directory %s: %s" % (path, e.strerror or e)) from e
        records, _ = _steps(path)  # complete: the previous write has committed or failed
        for damaged in _damaged.get(path, ()):  # what load() skipped is not a checkpoint
            records.pop(damaged, None)
        newest = max(records, default=None)
        if step is None:
            step = 0 if newest is None else newest + 1
        elif newest is not None and step <= newest:
            # Not even the same step again: replacing a committed checkpoint in place would leave
            # a moment with neither the old nor the new one valid.
            raise CheckpointError("step %d is not newer than the newest checkpoint in %s (step %d): load() returns "
                                  "the highest step, so each save needs a higher one; save a higher step or use a "
                                  "fresh directory" % (step, path, newest))
        try:
            snapshot = _snapshot(state)
        except Exception as e:  # noqa: B902 - said as a checkpoint error, with its cause
            raise CheckpointError("cannot copy the state to save (step %d): %s: %s" % (step, type(e).__name__, e)) from e
        write = _Write(snapshot, path, step, keep)
        write.thread = threading.Thread(target=write.run, name="ddplaunch-checkpoint-writer", daemon=True)
        with _lock:
            _current = write
            write.thread.start()
    from . import cadence, _add_checkpoint_stall
    stall = time.monotonic() - began
    _add_checkpoint_stall(stall)
    try:
        cadence._saved(path, stall)  # the stall: what checkpoint_due weighs
    except Exception as e:  # noqa: B902 - the write is under way: said, not raised as its failure
        _say("checkpoint cadence: %s" % e)
    _stop_after_save(step)
    return step


def wait_for_save():
    """Blocks until the checkpoint write in flight, if any, is on disk. Raises CheckpointError
    when it failed."""
    _raise_if_failed(_wait())


def _verify(record_path, data_path):
    """(record, None) when the record reads and the data file matches its size and sha256;
    (None, why) otherwise."""
    try:
        with open(record_path) as f:
            record = json.load(f)
        size, digest = int(record["size"]), str(record["sha256"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        return None, "its record %s is unreadable (%s)" % (os.path.basename(record_path), e)
    try:
        actual = os.path.getsize(data_path)
    except FileNotFoundError:
        return None, "it is missing (its record is there)"
    except OSError as e:
        return None, "it is unreadable (%s)" % (e.strerror or e)
    if actual != size:
        return None, "it is truncated: %d bytes, its record says %d" % (actual, size)
    try:
        _, actual_digest = _sha256_of(data_path)
    except OSError as e:
        return None, "it is unreadable (%s)" % (e.strerror or e)
    if actual_digest != digest:
        return None, "it is corrupt: its sha256 differs from its record's"
    return record, None


def load(dir, map_location="cpu", weights_only=None):
    """Returns the state of the newest checkpoint in `dir` whose record is there and whose file
    matches the record's size and sha256, loaded by torch.load(map_location=...). A newer one that
    does not is skipped with a line on stderr saying why. Returns None when `dir` holds no valid
    checkpoint (or does not exist): a fresh start.

    Every field in which the checkpoint's lineage differs from this job is named on stderr; with
    DDPLAUNCH_ENV_CHECK=strict, a checkpoint written in another environment is refused
    (SystemExit(3)). `weights_only` is passed to torch.load when given (torch's default otherwise).
    """
    path = _directory(dir)
    _raise_if_failed(_wait())  # this process's own write in flight comes first
    records, data = _steps(path)
    if not records and not data:
        return None
    skipped = []
    newest_record = max(records, default=-1)
    for step in sorted(data, reverse=True):
        if step > newest_record:
            _say("skipping checkpoint %s: it has no record (its write did not finish)" % data[step])
            skipped.append(data[step])
    for step in sorted(records, reverse=True):
        data_path = os.path.join(path, _base(step) + ".pt")
        record, why = _verify(records[step], data_path)
        if record is None:
            _say("skipping checkpoint %s: %s" % (data_path, why))
            skipped.append(data_path)
            _damaged.setdefault(path, set()).add(step)
            continue
        _check_lineage(data_path, record.get("lineage"))
        import torch
        kwargs = {"map_location": map_location}
        if weights_only is not None:
            kwargs["weights_only"] = weights_only
        try:
            state = torch.load(data_path, **kwargs)
        except Exception as e:  # noqa: B902 - the file is what was written: the reader is at fault
            raise CheckpointError("checkpoint %s matches its checksum but torch.load cannot read it: %s: %s%s"
                                  % (data_path, type(e).__name__, str(e).strip().splitlines()[0] if str(e).strip()
                                     else "", "" if weights_only is not None else
                                     " (if it holds objects other than tensors and plain values and you trust "
                                     "this directory, pass weights_only=False)")) from e
        if skipped:
            _say("resuming from %s (step %d), the newest valid checkpoint" % (data_path, step))
        return state
    if skipped:
        _say("no valid checkpoint in %s (%d skipped): starting fresh" % (path, len(skipped)))
    return None
