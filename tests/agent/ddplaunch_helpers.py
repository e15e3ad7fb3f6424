"""Shared pieces of the agent's multi-process tests: where ddplaunch is, a temporary directory
per test, writing worker scripts, reading what workers recorded."""

import json
import os
import shutil
import sys
import tempfile
import unittest

from processes import free_port, kill_group, port_open, run, spawn, wait_for  # noqa: F401  (re-exported)

BUILD_DIR = os.environ.get("DDPLAUNCH_BUILD_DIR", os.path.join(os.path.dirname(__file__), "..", "..", "build"))
DDPLAUNCH = os.path.join(BUILD_DIR, "bin", "ddplaunch")
PYTHON = sys.executable  # the Python ctest runs the tests on (DDPLAUNCH_PYTHON)


class LaunchTestCase(unittest.TestCase):
    """A test with its own temporary directory (removed afterwards) and a ddplaunch runner."""

    def setUp(self):
        if not os.path.exists(DDPLAUNCH):
            self.fail("ddplaunch not built: %s" % DDPLAUNCH)
        self.tmp = tempfile.mkdtemp(prefix="ddplaunch_test_")
        self.addCleanup(shutil.rmtree, self.tmp, True)
        self.out = os.path.join(self.tmp, "out")
        os.mkdir(self.out)

    def script(self, name, body, executable=False):
        """Writes a worker script into the test's directory; returns its path."""
        path = os.path.join(self.tmp, name)
        with open(path, "w") as f:
            if executable:
                f.write("#!%s\n" % PYTHON)
            f.write(body)
        if executable:
            os.chmod(path, 0o755)
        return path

    def start_rendezvous_daemon(self):
        """A ddp-rendezvous on a free loopback port, killed when the test ends; returns its port."""
        rendezvous = os.path.join(BUILD_DIR, "bin", "ddp-rendezvous")
        if not os.path.exists(rendezvous):
            self.fail("ddp-rendezvous not built: %s" % rendezvous)
        port = free_port()
        daemon = spawn([rendezvous, "--host", "127.0.0.1", "--port", str(port)], name="ddp-rendezvous")
        self.addCleanup(daemon.kill)
        self.daemon = daemon  # its log: daemon.output()
        wait_for(lambda: port_open(port) or daemon.poll() is not None, 15, "the daemon to listen")
        self.assertIsNone(daemon.poll(), daemon.describe())
        return port

    def launch(self, args, timeout=60, env=None):
        """Runs ddplaunch to completion (killed at `timeout`); returns processes.Result."""
        full_env = dict(os.environ)
        full_env.setdefault("PATH", "/usr/bin:/bin")
        full_env["TMPDIR"] = self.tmp  # ddplaunch's default log directory goes away with the test
        if env:
            full_env.update(env)
        result = run([DDPLAUNCH] + list(args), timeout=timeout, env=full_env, cwd=self.tmp)
        self.assertFalse(result.timed_out, result.describe())
        return result

    def spawn_launch(self, args, env=None):
        """Starts ddplaunch in the background; killed (whole group) when the test ends."""
        full_env = dict(os.environ)
        full_env["TMPDIR"] = self.tmp
        if env:
            full_env.update(env)
        proc = spawn([DDPLAUNCH] + list(args), env=full_env, cwd=self.tmp, name="ddplaunch")
        self.addCleanup(proc.kill)
        return proc

    def records(self, pattern_prefix=""):
        """The JSON records workers wrote into self.out, by file name."""
        out = {}
        for name in sorted(os.listdir(self.out)):
            if name.startswith(pattern_prefix) and name.endswith(".json"):
                with open(os.path.join(self.out, name)) as f:
                    out[name] = json.load(f)
        return out


def code_lines(path):
    """The file's lines after its module docstring (for diffs of example scripts)."""
    with open(path) as f:
        text = f.read()
    end = text.index('"""', 3) + 3
    return text[end:].splitlines()


def pid_alive(pid):
    """True while `pid` exists and is not a zombie."""
    try:
        with open("/proc/%d/stat" % pid) as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
        return state not in ("Z", "X")
    except (FileNotFoundError, ProcessLookupError):
        return False


def kill_pids(pids):
    """Cleanup: SIGKILL each pid's process group (workers lead their own groups)."""
    for pid in pids:
        kill_group(pid)


def main():
    unittest.main(verbosity=2)
