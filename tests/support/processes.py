"""Helpers for multi-process tests: every wait has a deadline, every process is cleaned up.

    from processes import run, spawn, wait_for, kill_group, free_port

- ``run(cmd, timeout=...)`` runs a command to completion (killing its process group at the
  deadline) and returns a ``Result`` with returncode, stdout, stderr and ``timed_out``.
- ``spawn(cmd)`` starts a long-running process in its own process group with output captured
  to files; ``Proc.wait(timeout)``, ``Proc.output()``, ``Proc.kill()``. Use it as a context
  manager, or ``self.addCleanup(proc.kill)``, so it dies even when the test fails.
- ``wait_for(condition, timeout, what=...)`` polls a condition until true or raises
  ``TimeoutError`` naming what was awaited (no fixed sleeps in assertions).
- ``kill_group(pid)`` SIGKILLs a whole process group and reaps what it can.
- ``free_port(host)`` asks the kernel for a free TCP port on ``host``.
- ``children(ppid, comm=None)`` lists the pids whose parent is ``ppid`` (and whose command
  name is ``comm``), from /proc.
"""

import os
import signal
import socket
import subprocess
import tempfile
import time

__all__ = ["Result", "Proc", "run", "spawn", "wait_for", "kill_group", "free_port", "children"]


class Result:
    """The outcome of ``run``: returncode (None when killed at the deadline), stdout, stderr."""

    def __init__(self, cmd, returncode, stdout, stderr, timed_out):
        self.cmd = cmd
        self.returncode = returncode
        self.stdout = stdout
        self.stderr = stderr
        self.timed_out = timed_out

    def describe(self):
        """A paragraph for assertion messages: command, status and both outputs."""
        status = "timed out" if self.timed_out else "exit %s" % self.returncode
        return "%s -> %s\n--- stdout ---\n%s\n--- stderr ---\n%s" % (
            " ".join(map(str, self.cmd)), status, self.stdout, self.stderr)

    def check(self):
        """Returns self when the command exited 0; raises AssertionError with the outputs otherwise."""
        if self.timed_out or self.returncode != 0:
            raise AssertionError(self.describe())
        return self

    def __repr__(self):
        return "Result(returncode=%r, timed_out=%r)" % (self.returncode, self.timed_out)


def kill_group(pid, sig=signal.SIGKILL):
    """Sends ``sig`` to the process group led by ``pid``; a group already gone is not an error."""
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def run(cmd, timeout, env=None, cwd=None, input=None):
    """Runs ``cmd`` (a list) in its own process group; at ``timeout`` seconds the whole group is
    killed and the result says ``timed_out``. Output is captured as text."""
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE if input is not None else subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, cwd=cwd,
                            text=True, start_new_session=True)
    try:
        out, err = proc.communicate(input=input, timeout=timeout)
        return Result(cmd, proc.returncode, out, err, False)
    except subprocess.TimeoutExpired:
        kill_group(proc.pid)
        out, err = proc.communicate()
        return Result(cmd, None, out, err, True)
    finally:
        if proc.poll() is None:
            kill_group(proc.pid)
            proc.wait()


class Proc:
    """A long-running child in its own process group, output captured to temporary files.

    Owned by the test that spawned it; ``kill()`` (idempotent) ends the whole group and is
    safe to register with ``addCleanup``. Not thread-safe."""

    def __init__(self, cmd, env=None, cwd=None, name=None):
        self.cmd = list(cmd)
        self.name = name or os.path.basename(str(cmd[0]))
        self._out = tempfile.TemporaryFile(mode="w+b")
        self._err = tempfile.TemporaryFile(mode="w+b")
        self.popen = subprocess.Popen(self.cmd, stdin=subprocess.DEVNULL, stdout=self._out,
                                      stderr=self._err, env=env, cwd=cwd, start_new_session=True)
        self.pid = self.popen.pid

    def poll(self):
        return self.popen.poll()

    @property
    def returncode(self):
        return self.popen.returncode

    def wait(self, timeout):
        """Waits up to ``timeout`` seconds for exit; returns the exit status (negative: signal).
        Raises TimeoutError (the process keeps running) when it does not exit in time."""
        try:
            return self.popen.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise TimeoutError("%s (pid %d) still running after %.1f s\n%s"
                               % (self.name, self.pid, timeout, self.describe())) from None

    def signal(self, sig):
        """Sends ``sig`` to the process itself (not its group)."""
        if self.popen.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def kill(self):
        """SIGKILLs the process group and reaps the leader. Idempotent."""
        kill_group(self.pid)
        try:
            self.popen.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass

    def _read(self, f):
        # pread, never seek: the child writes through the same open file description, so moving
        # its offset (seek(0), read) while the child writes made the child's next line land at
        # offset 0, over the first lines of its output (a round's header went missing that way).
        fd = f.fileno()
        chunks, offset = [], 0
        while True:
            chunk = os.pread(fd, 1 << 20, offset)
            if not chunk:
                break
            chunks.append(chunk)
            offset += len(chunk)
        return b"".join(chunks).decode("utf-8", "replace")

    def stdout(self):
        return self._read(self._out)

    def stderr(self):
        return self._read(self._err)

    def output(self):
        """stdout and stderr, concatenated, for assertions that do not care which."""
        return self.stdout() + self.stderr()

    def describe(self):
        return "%s -> %s\n--- stdout ---\n%s\n--- stderr ---\n%s" % (
            " ".join(map(str, self.cmd)), self.popen.returncode, self.stdout(), self.stderr())

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.kill()
        return False

    def __del__(self):
        for f in (getattr(self, "_out", None), getattr(self, "_err", None)):
            if f is not None:
                f.close()


def spawn(cmd, env=None, cwd=None, name=None):
    """Starts ``cmd`` as a ``Proc``."""
    return Proc(cmd, env=env, cwd=cwd, name=name)


def wait_for(condition, timeout, what="condition", interval=0.02):
    """Calls ``condition()`` until it returns a true value, which is returned. Raises
    TimeoutError("timed out after T s waiting for WHAT") at the deadline. An exception from
    ``condition`` counts as false; the last one is named in the timeout message."""
    deadline = time.monotonic() + timeout
    last_error = None
    while True:
        try:
            value = condition()
            if value:
                return value
        except Exception as e:  # the condition may not be observable yet
            last_error = e
        if time.monotonic() >= deadline:
            detail = " (last error: %r)" % (last_error,) if last_error is not None else ""
            raise TimeoutError("timed out after %.1f s waiting for %s%s" % (timeout, what, detail))
        time.sleep(interval)


def wait_all(procs, timeout):
    """Waits for every process in `procs` under one shared deadline; returns their exit codes in
    order. Raises TimeoutError (from Proc.wait) for the first one still running at the deadline."""
    deadline = time.monotonic() + timeout
    return [p.wait(max(0.1, deadline - time.monotonic())) for p in procs]


def port_open(port, host="127.0.0.1"):
    """True when something accepts TCP connections on host:port (half a second to answer)."""
    try:
        with socket.create_connection((host, port), timeout=0.5):
            return True
    except OSError:
        return False


def free_port(host="127.0.0.1"):
    """A TCP port that was free on ``host`` a moment ago (the kernel picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def children(ppid, comm=None):
    """Pids of the processes whose parent is `ppid` (and whose command name is `comm`)."""
    out = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open("/proc/%s/stat" % name) as f:
                stat = f.read()
        except OSError:
            continue
        head, rest = stat.rsplit(")", 1)
        if int(rest.split()[1]) == ppid and (comm is None or head.split("(", 1)[1] == comm):
            out.append(int(name))
    return out


def started_as_standby(pid):
    """Whether `pid` was started as a standby (docs/agent.md, "Standby workers"): the kernel's copy
    of its environment at exec names DDPLAUNCH_STANDBY_FD, whether or not it became a worker since."""
    try:
        with open("/proc/%d/environ" % pid, "rb") as f:
            return any(v.startswith(b"DDPLAUNCH_STANDBY_FD=") for v in f.read().split(b"\0"))
    except OSError:
        return False
