"""How often to checkpoint (docs/checkpoints.md, "How often"): ddplaunch.checkpoint_due(dir)
says when the next ddplaunch.save(..., dir) is due, at the Young/Daly interval sqrt(2 C M).

    for batch in loader:
        train_step(batch)
        if ddplaunch.checkpoint_due("ckpt"):
            ddplaunch.save(state(), "ckpt")

- C, the cost of a checkpoint: the time save() blocked the training thread (the host copy, and
  the wait for the previous write when it is still in flight), an exponential moving average
  over the saves, kept in the directory for the next process.
- M, the job's mean time between failures: a Gamma-Poisson estimate (PRIOR_WEIGHT_S + exposure)
  / (PRIOR_WEIGHT_S / prior MTBF + failures), from the job's history in the directory
  (cadence.json: its launches, the restarts of each, the time each ran). A failure is a restart
  of the workers (TORCHELASTIC_RESTART_COUNT, job-wide under ddplaunch and torchrun) or a
  relaunch after a launch that did not end by a normal exit of rank 0.
- The interval is bounded: at least max(10 s, 10 C) (checkpoints cost at most a tenth of the
  time), at most one hour.

The policy (mtbf_estimate, bounds, interval, advance) is pure; Cadence holds one directory's
state with its clocks and environment injectable (tests and bench/checkpoints/cadence.py drive
it on a simulated clock). Nothing here imports torch.
"""

import collections
import json
import math
import os
import sys
import time

from . import checkpoints

__all__ = ["checkpoint_due", "checkpoint_interval"]

RECORD = "cadence.json"
_FORMAT = 1
PRIOR_MTBF_S = 3600.0      # one failure an hour, until the job's own history says otherwise
PRIOR_WEIGHT_S = 900.0     # the prior weighs as much as 15 minutes of observation
MIN_INTERVAL_S = 10.0
MIN_INTERVAL_STALLS = 10.0  # and at least 10 C: checkpoints stall training at most a tenth of the time
MAX_INTERVAL_S = 3600.0
STALL_WEIGHT = 0.3          # a new save's stall in the moving average
MTBF_VARIABLE = "DDPLAUNCH_CHECKPOINT_MTBF"


# --- the policy --------------------------------------------------------------------------------

def prior_mtbf(env=None):
    """The prior MTBF in seconds: DDPLAUNCH_CHECKPOINT_MTBF when set, else one hour."""
    env = os.environ if env is None else env
    text = env.get(MTBF_VARIABLE)
    if text is None or text == "":
        return PRIOR_MTBF_S
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not math.isfinite(value) or value <= 0:
        raise checkpoints.CheckpointError("%s=%r: the prior mean time between failures must be a positive number "
                                          "of seconds (e.g. %s=7200 for two hours)"
                                          % (MTBF_VARIABLE, text, MTBF_VARIABLE))
    return value


def mtbf_estimate(failures, exposure_s, prior_mtbf_s=PRIOR_MTBF_S):
    """The posterior mean time between failures: a Gamma prior on the failure rate with mean
    1 / prior_mtbf_s and the weight of PRIOR_WEIGHT_S seconds of observation (shape
    PRIOR_WEIGHT_S / prior_mtbf_s pseudo-failures), updated by `failures` in `exposure_s`."""
    return (PRIOR_WEIGHT_S + max(0.0, exposure_s)) / (PRIOR_WEIGHT_S / prior_mtbf_s + max(0, failures))


def bounds(stall_s):
    """(lowest, highest) interval in seconds for a save stall of `stall_s`."""
    return min(max(MIN_INTERVAL_S, MIN_INTERVAL_STALLS * stall_s), MAX_INTERVAL_S), MAX_INTERVAL_S


def young_daly(stall_s, mtbf_s):
    return math.sqrt(2.0 * stall_s * mtbf_s)


Decision = collections.namedtuple("Decision", "interval stall mtbf failures exposure bound")
Decision.__doc__ = """The interval chosen (seconds), from the save stall (None: not measured yet),
the MTBF estimate, the failures and exposure it came from; bound: "lower", "upper" or None."""


def decide(stall_s, failures, exposure_s, prior_mtbf_s=PRIOR_MTBF_S):
    """The checkpoint interval for a save stall (None before the first save: taken as 0, which
    gives the lower bound, so that the first save comes soon and is measured)."""
    mtbf = mtbf_estimate(failures, exposure_s, prior_mtbf_s)
    c = stall_s or 0.0
    lo, hi = bounds(c)
    ideal = young_daly(c, mtbf)
    bound = "lower" if ideal < lo else "upper" if ideal > hi else None
    return Decision(min(max(ideal, lo), hi), stall_s, mtbf, failures, exposure_s, bound)


def fresh(now, restarts, run_id):
    return {"format": _FORMAT, "past": {"launches": 0, "failures": 0, "exposure": 0.0}, "stall": None,
            "current": {"run_id": run_id, "start": now, "seen": now, "restarts": restarts, "ended": False}}


def advance(record, now, restarts, run_id):
    """The history as a new process of the job finds it: the same launch when its restart count
    is higher than the launch's last (and its run id the same), else a new launch, which closes
    the current one (its restarts are failures, and so is its end unless rank 0 exited
    normally)."""
    if record is None:
        return fresh(now, restarts, run_id)
    current = record["current"]
    if run_id == current["run_id"] and restarts > current["restarts"]:
        current.update(restarts=restarts, seen=now, ended=False)
        return record
    past = record["past"]
    past["launches"] += 1
    past["failures"] += current["restarts"] + (0 if current["ended"] else 1)
    past["exposure"] += max(0.0, current["seen"] - current["start"])
    record["current"] = fresh(now, restarts, run_id)["current"]
    return record


def failures_and_exposure(record, now):
    current, past = record["current"], record["past"]
    return past["failures"] + current["restarts"], past["exposure"] + max(0.0, now - current["start"])


def _valid(record):
    try:
        past, current = record["past"], record["current"]
        ok = record.get("format") == _FORMAT and all(isinstance(past[k], (int, float)) and past[k] >= 0
                                                     for k in ("launches", "failures", "exposure"))
        ok = ok and isinstance(current["restarts"], int) and isinstance(current["ended"], bool)
        ok = ok and (current["run_id"] is None or isinstance(current["run_id"], str))
        ok = ok and all(isinstance(current[k], (int, float)) for k in ("start", "seen"))
        return ok and (record.get("stall") is None or isinstance(record["stall"], (int, float)))
    except (KeyError, TypeError, AttributeError):
        return False


def _human(seconds):
    if seconds < 120:
        return "%.0f s" % seconds
    if seconds < 7200:
        return "%.0f min" % (seconds / 60)
    return "%.1f h" % (seconds / 3600)


def describe(d, prior_mtbf_s=PRIOR_MTBF_S):
    """The line rank 0 prints when the interval changes."""
    bound = {"lower": ", the lower bound", "upper": ", the upper bound"}.get(d.bound, "")
    return "checkpoint every %s%s (save stall %.2f s, MTBF estimate %s from %d failure%s in %s and a prior of %s)" % (
        _human(d.interval), bound, d.stall or 0.0, _human(d.mtbf), d.failures, "" if d.failures == 1 else "s",
        _human(d.exposure), _human(prior_mtbf_s))


# --- one directory's state ------------------------------------------------------------------

class Cadence:
    """The cadence of one checkpoint directory in this process. Rank 0 keeps the directory's
    history (cadence.json); other ranks read it and decide alike, but only rank 0's decision
    matters: it gates ddplaunch.save, which writes on rank 0 only."""

    def __init__(self, path, clock=time.monotonic, wall=time.time, env=None, say=None):
        self.path = path
        self.clock, self.wall = clock, wall
        self.env = os.environ if env is None else env
        self.say = say or checkpoints._say
        self.record = None
        self.restarts = None    # the restart count the record was last brought to
        self.started = None     # clock() of the first call: the reference before the first save
        self.last_save = None   # clock() at the end of the last save
        self.printed = None     # the interval last printed
        self.reported = None    # the interval last written to the progress slot (status shows it)
        self.crashed = False

    # the environment, read at each call: an in-memory restart changes it in place
    def _restarts(self):
        text = self.env.get("TORCHELASTIC_RESTART_COUNT", "0")
        try:
            return max(0, int(text))
        except ValueError:
            raise checkpoints.CheckpointError("TORCHELASTIC_RESTART_COUNT=%r is not a number" % text) from None

    def _writer(self):
        text = self.env.get("RANK", "0")
        try:
            return int(text) == 0
        except ValueError:
            raise checkpoints.CheckpointError("RANK=%r is not a number" % text) from None

    def _file(self):
        return os.path.join(self.path, RECORD)

    def _read(self):
        try:
            with open(self._file()) as f:
                record = json.load(f)
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as e:
            self.say("cannot read %s (%s): starting the job's failure history afresh" % (self._file(), e))
            return None
        if not _valid(record):
            self.say("%s is not a checkpoint cadence record: starting the job's failure history afresh" % self._file())
            return None
        return record

    def _write(self):
        """Rank 0 only: the record, atomically (a temporary file renamed); not synced, it is a
        hint whose loss costs a slightly wrong interval."""
        if not self._writer():
            return
        tmp = os.path.join(self.path, ".%s.tmp-%d" % (RECORD, os.getpid()))
        try:
            os.makedirs(self.path, exist_ok=True)
            with open(tmp, "w") as f:
                json.dump(self.record, f, indent=1, sort_keys=True)
                f.write("\n")
            os.replace(tmp, self._file())
        except OSError as e:
            self.say("cannot write %s: %s" % (self._file(), e.strerror or e))

    def _refresh(self):
        restarts = self._restarts()
        if self.record is None:
            self.started = self.clock()
            self.record = advance(self._read(), self.wall(), restarts, self.env.get("TORCHELASTIC_RUN_ID"))
            self.restarts = restarts
            self._write()
        elif restarts != self.restarts:  # this process went through an in-memory restart
            self.record = advance(self.record, self.wall(), restarts, self.env.get("TORCHELASTIC_RUN_ID"))
            self.restarts = restarts
            self._write()

    def decision(self):
        self._refresh()
        failures, exposure = failures_and_exposure(self.record, self.wall())
        prior = prior_mtbf(self.env)
        d = decide(self.record["stall"], failures, exposure, prior)
        if d.stall is not None and self._writer() and (self.printed is None or not
                                                       self.printed / 2 <= d.interval <= self.printed * 2):
            self.printed = d.interval
            self.say(describe(d, prior))
        if d.interval != self.reported:
            self.reported = d.interval
            _report_interval(d.interval)
        return d

    def due(self):
        interval = self.decision().interval
        since = self.last_save if self.last_save is not None else self.started
        return self.clock() - since >= interval

    def saved(self, stall_s, now=True):
        """save() returned after blocking the caller `stall_s` seconds (now: just now; else at
        some time before this process first asked about the directory)."""
        self._refresh()
        previous = self.record["stall"]
        self.record["stall"] = stall_s if previous is None else (1 - STALL_WEIGHT) * previous + STALL_WEIGHT * stall_s
        self.record["current"]["seen"] = self.wall()
        if now:
            self.last_save = self.clock()
        self._write()

    def exited(self):
        """At the interpreter's exit: a launch whose rank 0 exits normally ended; a relaunch
        after it is not a failure."""
        if self.record is None or self.crashed or not self._writer():
            return
        self.record["current"].update(seen=self.wall(), ended=True)
        self._write()


# --- the process's directories and the API ----------------------------------------------------

def _report_interval(seconds):
    from . import _set_checkpoint_interval
    _set_checkpoint_interval(seconds)


_cadences = {}
_pending_stalls = {}  # a save's stall in a directory not asked about yet
_hooks_installed = False


def _install_hooks():
    global _hooks_installed
    if _hooks_installed:
        return
    _hooks_installed = True
    previous = sys.excepthook

    def excepthook(*args):
        for cadence in _cadences.values():
            cadence.crashed = True
        previous(*args)

    sys.excepthook = excepthook
    import atexit
    atexit.register(lambda: [cadence.exited() for cadence in list(_cadences.values())])


_by_name = {}  # the `dir` a caller passes (a str) -> its Cadence: no file system call per step


def _for(dir):
    if isinstance(dir, str):
        cadence = _by_name.get(dir)
        if cadence is not None:
            return cadence
    path = os.path.abspath(checkpoints._directory(dir))
    cadence = _cadences.get(path)
    if cadence is None:
        _install_hooks()
        cadence = _cadences[path] = Cadence(path)
        if path in _pending_stalls:
            cadence.saved(_pending_stalls.pop(path), now=False)
    if isinstance(dir, str):
        _by_name[dir] = cadence
    return cadence


def _saved(dir, stall_s):
    """Called by save(): the stall of a save to `dir`."""
    path = os.path.abspath(dir)
    cadence = _cadences.get(path)
    if cadence is not None:
        cadence.saved(stall_s)
    else:
        previous = _pending_stalls.get(path)
        _pending_stalls[path] = stall_s if previous is None else \
            (1 - STALL_WEIGHT) * previous + STALL_WEIGHT * stall_s


def checkpoint_due(dir):
    """True when a checkpoint to `dir` is due: the time since this process's last save() to it
    (before the first one: since the first call) is at least checkpoint_interval(dir). Meant to
    gate ddplaunch.save(..., dir); cheap enough to call at every step. Under ddplaunch it also
    turns a stop into a checkpoint: after a SIGTERM (a drain, a change of nodes) it says True, and
    the save after it ends the worker once written (docs/checkpoints.md, "At a stop")."""
    if checkpoints._checked():
        return True
    return _for(dir).due()


def checkpoint_interval(dir):
    """The interval between checkpoints to `dir` that checkpoint_due uses now, in seconds."""
    return _for(dir).decision().interval
