"""Signals sent to ddplaunch reach the workers and stop them; ddplaunch exits 128+N. When
ddplaunch itself is SIGKILLed, no worker survives it (parent-death signal)."""

import os
import signal
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ddplaunch_helpers import PYTHON, LaunchTestCase, kill_pids, main, pid_alive, wait_for  # noqa: E402

# Each worker writes its pid, records which signal it got, then exits the way an untouched
# Python process would (re-raising it with the default action).
SLEEPER = """
import os, signal, sys, time
out = os.environ["OUT_DIR"]
rank = os.environ["RANK"]
def on_signal(signo, frame):
    with open(os.path.join(out, "signal_%s" % rank), "w") as f:
        f.write(str(signo))
    if os.environ.get("IGNORE_TERM") != "1":
        signal.signal(signo, signal.SIG_DFL)
        os.kill(os.getpid(), signo)
for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
    signal.signal(s, on_signal)
tmp = os.path.join(out, "pid_%s.tmp" % rank)
with open(tmp, "w") as f:
    f.write(str(os.getpid()))
os.rename(tmp, os.path.join(out, "pid_%s" % rank))
while True:
    time.sleep(0.5)
"""


def read(path):
    with open(path) as f:
        return f.read()


class Signals(LaunchTestCase):
    def start(self, nproc=4, extra=(), env=None):
        script = self.script("sleeper.py", SLEEPER)
        e = {"OUT_DIR": self.out}
        e.update(env or {})
        proc = self.spawn_launch(["--nproc_per_node=%d" % nproc, "--python", PYTHON] + list(extra) + [script], env=e)
        pids = wait_for(lambda: self.worker_pids(nproc), timeout=60, what="%d workers to write their pids" % nproc)
        self.addCleanup(kill_pids, pids)
        return proc, pids

    def worker_pids(self, nproc):
        names = ["pid_%d" % r for r in range(nproc)]
        if not all(os.path.exists(os.path.join(self.out, n)) for n in names):
            return None
        return [int(read(os.path.join(self.out, n))) for n in names]

    def signal_received(self, rank):
        path = os.path.join(self.out, "signal_%d" % rank)
        return int(read(path)) if os.path.exists(path) else None

    def test_sigterm_is_forwarded_and_ddplaunch_exits_143_with_no_worker_left(self):
        proc, pids = self.start()
        proc.signal(signal.SIGTERM)
        self.assertEqual(proc.wait(timeout=30), 128 + signal.SIGTERM, proc.describe())
        for rank, pid in enumerate(pids):
            self.assertFalse(pid_alive(pid), "worker %d (pid %d) outlived ddplaunch" % (rank, pid))
            self.assertEqual(self.signal_received(rank), signal.SIGTERM)

    def test_sigint_is_forwarded_and_ddplaunch_exits_130(self):
        proc, pids = self.start(nproc=2)
        proc.signal(signal.SIGINT)
        self.assertEqual(proc.wait(timeout=30), 128 + signal.SIGINT, proc.describe())
        for rank, pid in enumerate(pids):
            self.assertFalse(pid_alive(pid))
            self.assertEqual(self.signal_received(rank), signal.SIGINT)

    def test_a_worker_ignoring_sigterm_is_killed_after_the_shutdown_timeout(self):
        proc, pids = self.start(nproc=2, extra=["--shutdown_timeout=1"], env={"IGNORE_TERM": "1"})
        proc.signal(signal.SIGTERM)
        self.assertEqual(proc.wait(timeout=30), 143, proc.describe())
        for pid in pids:
            self.assertFalse(pid_alive(pid))
        self.assertIn("sending SIGKILL", proc.stderr())

    def test_signals_to_handle_limits_which_signals_are_forwarded(self):
        proc, pids = self.start(nproc=2, extra=["--signals_to_handle=SIGHUP"])
        proc.signal(signal.SIGHUP)
        self.assertEqual(proc.wait(timeout=30), 128 + signal.SIGHUP, proc.describe())
        for rank in range(2):
            self.assertEqual(self.signal_received(rank), signal.SIGHUP)

    def test_sigkill_of_ddplaunch_leaves_no_worker_alive(self):
        proc, pids = self.start()
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
        wait_for(lambda: not any(pid_alive(p) for p in pids), timeout=10,
                 what="every worker of the SIGKILLed ddplaunch to die")


if __name__ == "__main__":
    main()
