"""A process whose output lines are timestamped as they arrive: the benchmarks on the namespace
cluster (bench/recovery/run, bench/stragglers/run) split their figures by these times."""

import os
import signal
import subprocess
import threading
import time


class Stream:
    """A process whose output lines are timestamped (time.time()) as they arrive."""

    def __init__(self, cmd, name, env=None):
        self.name = name
        self.lines = []   # (t, line)
        self.lock = threading.Lock()
        self.popen = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      stdin=subprocess.DEVNULL, env=env, start_new_session=True)
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self):
        for raw in self.popen.stdout:
            t = time.time()
            with self.lock:
                self.lines.append((t, raw.decode(errors="replace").rstrip("\n")))

    def snapshot(self):
        with self.lock:
            return list(self.lines)

    def kill(self):
        try:
            os.killpg(self.popen.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            self.popen.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
