"""The first hour without surprises, end to end with the real binaries: a wait shows
what it waits for (a progress line on a terminal, lines in a log) and each round's result; a
typo gets "did you mean"; an interpreter without torch is refused before any worker starts;
--check_env without PROGRAM compares only what does not depend on the program and gives a
verdict; runs without --rdzv_id keep their logs apart; the in-process rendezvous listens on the
endpoint's address only, and localhost:0 works as torch 2.x writes --standalone.

Every process is killed in cleanup; every wait has a deadline; nothing is asserted on timing.
"""

import json
import os
import re
import shutil
import socket
import subprocess
import unittest

import processes
from ddplaunch_helpers import BUILD_DIR, DDPLAUNCH, PYTHON, LaunchTestCase
from processes import free_port, spawn, wait_for

RENDEZVOUS = os.path.join(BUILD_DIR, "bin", "ddp-rendezvous")
DEADLINE = 120  # seconds any one ddplaunch may take here (2 shared cores, a cold torch import)

# Records that a worker started (the absence of the file proves none did).
MARK_WORKER = r'''
import os, sys
open(os.path.join(sys.argv[1], "started-%s" % os.environ["RANK"]), "w").close()
'''


def tcp_accepts(host, port, timeout=2.0):
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def non_loopback_addresses():
    """This machine's IPv4 addresses outside 127/8, from `ip -4 -o addr` (none when it has none)."""
    res = subprocess.run(["ip", "-4", "-o", "addr", "show"], capture_output=True, text=True, timeout=10)
    found = re.findall(r"\binet (\d+\.\d+\.\d+\.\d+)/", res.stdout)
    return [a for a in found if not a.startswith("127.")]


class ProgressInALog(LaunchTestCase):
    """stderr is a pipe here: progress comes as lines, and each round's result as one line."""

    def test_a_lone_node_says_how_many_joined_and_how_long_is_left_then_each_node_states_its_round(self):
        port = free_port()
        args = ["--nnodes=2", "--nproc_per_node=1", "--rdzv_backend=c10d", "--rdzv_endpoint=127.0.0.1:%d" % port,
                "--rdzv_id=progress", "--rdzv_conf=join_timeout=90,last_call_timeout=1",
                "--python", PYTHON, self.script("w.py", MARK_WORKER), self.out]
        first = self.spawn_launch(args)
        try:
            wait_for(lambda: "1 of 2 nodes joined; join_timeout in" in first.stderr() or first.poll() is not None,
                     DEADLINE, "the lone node's progress line")
        except TimeoutError as e:
            self.fail("%s\n%s" % (e, first.describe()))
        self.assertIsNone(first.poll(), first.describe())
        # The hosted server's own event log is not echoed by default.
        self.assertNotIn("rendezvous server:", first.stderr())
        second = self.spawn_launch(args)
        self.assertEqual(first.wait(DEADLINE), 0, first.describe())
        self.assertEqual(second.wait(DEADLINE), 0, second.describe())
        lines = []
        for proc in (first, second):
            found = re.findall(r"generation 1: this node is group rank (\d) of 2 \(rank (\d)\), world size 2, "
                               r"master 127\.0\.0\.1:\d+", proc.stderr())
            self.assertEqual(len(found), 1, proc.describe())
            lines.append(found[0])
        self.assertEqual(sorted(lines), [("0", "0"), ("1", "1")])
        # In a log, the countdown is not a line a second.
        waits = [l for l in first.stderr().splitlines() if "nodes joined" in l]
        self.assertLess(len(waits), 40, first.stderr())


class ProgressOnATerminal(LaunchTestCase):
    """A real terminal (tmux): one line redrawn in place, and Ctrl-C ends the wait cleanly."""

    def setUp(self):
        super().setUp()
        self.tmux = shutil.which("tmux")
        if self.tmux is None:
            self.skipTest("tmux is not installed (scripts/setup installs it)")
        self.socket = os.path.join(self.tmp, "tmux.sock")
        self.addCleanup(self.tmux_cmd, "kill-server")

    def tmux_cmd(self, *args):
        return subprocess.run([self.tmux, "-S", self.socket] + list(args), capture_output=True, text=True,
                              timeout=30)

    def pane(self):
        return self.tmux_cmd("capture-pane", "-p", "-t", "t").stdout

    def test_the_wait_is_one_line_counting_down_in_place_and_ctrl_c_exits_130(self):
        port = free_port()
        status_file = os.path.join(self.tmp, "status")
        ddplaunch = " ".join([DDPLAUNCH, "--nnodes=2", "--nproc_per_node=1", "--rdzv_backend=c10d",
                              "--rdzv_endpoint=127.0.0.1:%d" % port, "--rdzv_id=tty",
                              "--rdzv_conf=join_timeout=300", "--python", PYTHON,
                              self.script("w.py", MARK_WORKER), self.out])
        # The shell survives the Ctrl-C (a trap with a command; its child gets the default action).
        command = "trap : INT; TMPDIR=%s %s; echo \"exit=$?\" > %s; sleep 600" % (self.tmp, ddplaunch, status_file)
        r = self.tmux_cmd("new-session", "-d", "-s", "t", "-x", "200", "-y", "20", "sh", "-c", command)
        self.assertEqual(r.returncode, 0, r.stderr)
        countdown = re.compile(r"1 of 2 nodes joined; join_timeout in (\d+) s")
        seen = []

        def progressed():
            m = countdown.findall(self.pane())
            if m and (not seen or m[-1] != seen[-1]):
                seen.append(m[-1])
            return len(seen) >= 2

        try:
            wait_for(progressed, DEADLINE, "the progress line to count down", interval=0.2)
        except TimeoutError as e:
            self.fail("%s; pane:\n%s" % (e, self.pane()))
        pane = self.pane()
        # Redrawn in place: the countdown occupies one line of the pane, not one line per second.
        self.assertEqual(len(countdown.findall(pane)), 1, pane)
        self.assertGreater(int(seen[0]), int(seen[-1]), seen)
        self.tmux_cmd("send-keys", "-t", "t", "C-c")
        def exited():
            if not os.path.exists(status_file):
                return False
            with open(status_file) as f:
                return f.read().strip() != ""

        try:
            wait_for(exited, 60, "ddplaunch to exit after Ctrl-C")
        except TimeoutError as e:
            self.fail("%s; pane:\n%s" % (e, self.pane()))
        with open(status_file) as f:
            self.assertEqual(f.read().strip(), "exit=130", self.pane())  # 128 + SIGINT, docs/exit-codes.md
        pane = self.pane()
        self.assertIn("got SIGINT", pane)
        self.assertEqual(os.listdir(self.out), [], "no worker may start for a lone node")


class Typos(LaunchTestCase):
    def test_a_misspelt_flag_gets_the_closest_spelling_and_no_dashdash_hint(self):
        marker = os.path.join(self.tmp, "ran")
        r = self.launch(["--nprocs-per-node=2", "--no_python", "/usr/bin/touch", marker])
        self.assertEqual(r.returncode, 2, r.describe())
        self.assertIn("unknown option '--nprocs-per-node'; did you mean --nproc_per_node?", r.stderr)
        self.assertNotIn("'--' before", r.stderr)
        self.assertFalse(os.path.exists(marker))

    def test_a_rendezvous_host_that_does_not_resolve_is_said_plainly_in_the_first_line(self):
        # .invalid never resolves (RFC 2606). ddplaunch retries until join_timeout; the test ends it.
        proc = self.spawn_launch(["--nnodes=2", "--nproc_per_node=1", "--rdzv_backend=c10d",
                                  "--rdzv_endpoint=no-such-head.invalid:29400", "--rdzv_id=typo",
                                  "--rdzv_conf=join_timeout=300", "--no_python", "/bin/true"])
        wait_for(lambda: "does not resolve" in proc.stderr() or proc.poll() is not None, DEADLINE,
                 "the line about the host")
        proc.kill()
        lines = [line for line in proc.stderr().splitlines() if "rendezvous" in line]
        self.assertTrue(lines, proc.describe())
        self.assertTrue(lines[0].startswith("ddplaunch: the rendezvous host no-such-head.invalid does not resolve ("),
                        proc.describe())
        self.assertIn("check --rdzv_endpoint", lines[0])

    def test_an_unknown_word_keeps_the_dashdash_hint(self):
        r = self.launch(["--frobnicate", "x.py"])
        self.assertEqual(r.returncode, 2, r.describe())
        self.assertIn("put '--' before a PROGRAM", r.stderr)
        self.assertNotIn("did you mean", r.stderr)


class ThePythonThatHasTorch(LaunchTestCase):
    def stub_bin(self):
        """A directory whose python3 is an interpreter without torch (no site-packages)."""
        bindir = os.path.join(self.tmp, "bin")
        os.mkdir(bindir)
        stub = os.path.join(bindir, "python3")
        with open(stub, "w") as f:
            f.write('#!/bin/sh\nexec /usr/bin/python3 -S "$@"\n')
        os.chmod(stub, 0o755)
        return bindir, stub

    def test_a_first_python3_without_torch_is_refused_with_exit_2_before_any_worker_starts(self):
        bindir, stub = self.stub_bin()
        env = {"PATH": bindir + ":/usr/bin:/bin", "DDPLAUNCH_CACHE_DIR": os.path.join(self.tmp, "cache")}
        r = self.launch(["--nproc_per_node=2", self.script("w.py", MARK_WORKER), self.out], env=env,
                        timeout=DEADLINE)
        self.assertEqual(r.returncode, 2, r.describe())
        self.assertIn("the Python that would run the workers, %s (the first python3 on PATH), cannot import torch"
                      % stub, r.stderr)
        self.assertIn("--python=PATH", r.stderr)
        self.assertIn("PYTHON_EXEC", r.stderr)
        self.assertEqual(os.listdir(self.out), [], "a worker started")

    def test_check_env_with_that_python_exits_2_with_a_verdict(self):
        bindir, stub = self.stub_bin()
        env = {"PATH": bindir + ":/usr/bin:/bin", "DDPLAUNCH_CACHE_DIR": os.path.join(self.tmp, "cache")}
        r = self.launch(["--check_env"], env=env, timeout=DEADLINE)
        self.assertEqual(r.returncode, 2, r.describe())
        self.assertIn("verdict: this node cannot run the job: the Python that would run the workers", r.stdout)


class CheckEnvAgainstAJob(LaunchTestCase):
    def test_check_env_without_program_against_a_consistent_job_exits_0_with_a_verdict(self):
        port = free_port()
        daemon = spawn([RENDEZVOUS, "--host", "127.0.0.1", "--port", str(port)], name="ddp-rendezvous")
        self.addCleanup(daemon.kill)
        wait_for(lambda: processes.port_open(port) or daemon.poll() is not None, 15, "the daemon to listen")
        # Two agents of this host on one address: a job of 3 nodes that waits for its third.
        nodes = [self.spawn_launch(["--nnodes=3", "--nproc_per_node=1", "--rdzv_backend=c10d",
                                    "--rdzv_endpoint=127.0.0.1:%d" % port, "--rdzv_id=consistent",
                                    "--rdzv_conf=join_timeout=300", "--python", PYTHON,
                                    self.script("w.py", MARK_WORKER), self.out]) for _ in range(2)]

        def both_joined():
            r = processes.run([RENDEZVOUS, "status", "--endpoint", "127.0.0.1:%d" % port, "--json"], timeout=30)
            if r.returncode != 0:
                return False
            jobs = [j for j in json.loads(r.stdout)["jobs"] if j["job_id"] == "consistent"]
            return bool(jobs) and len(jobs[0]["nodes"]) == 2

        try:
            wait_for(both_joined, DEADLINE, "both nodes to join", interval=0.5)
        except TimeoutError as e:
            self.fail("%s\n%s" % (e, "\n".join(n.describe() for n in nodes)))
        r = self.launch(["--check_env", "--rdzv_endpoint=127.0.0.1:%d" % port, "--rdzv_id=consistent",
                         "--python", PYTHON], timeout=DEADLINE)
        self.assertEqual(r.returncode, 0, r.describe())
        self.assertIn("this node matches the 2 node(s) of job consistent", r.stdout)
        self.assertIn("verdict: this node can join job consistent", r.stdout)
        self.assertIn("the program's files were not compared", r.stdout)
        self.assertEqual(os.listdir(self.out), [])


    def test_agents_of_one_host_on_one_address_are_named_apart(self):
        port = free_port()
        daemon = spawn([RENDEZVOUS, "--host", "127.0.0.1", "--port", str(port)], name="ddp-rendezvous")
        self.addCleanup(daemon.kill)
        wait_for(lambda: processes.port_open(port) or daemon.poll() is not None, 15, "the daemon to listen")
        locks = []
        for word in ("a", "b", "a"):
            locks.append(os.path.join(self.tmp, "lock-%d" % len(locks)))
            with open(locks[-1], "w") as f:
                f.write("torch==%s\n" % word)
        # Two nodes of one host on one address, whose lock files differ; the job waits for a third.
        nodes = [self.spawn_launch(["--nnodes=3", "--nproc_per_node=1", "--rdzv_backend=c10d",
                                    "--rdzv_endpoint=127.0.0.1:%d" % port, "--rdzv_id=twins",
                                    "--rdzv_conf=join_timeout=300", "--env_lock", lock, "--no_python", "/bin/true"])
                 for lock in locks[:2]]

        def both_joined():
            r = processes.run([RENDEZVOUS, "status", "--endpoint", "127.0.0.1:%d" % port, "--json"], timeout=30)
            jobs = [j for j in json.loads(r.stdout)["jobs"] if j["job_id"] == "twins"] if r.returncode == 0 else []
            return bool(jobs) and len(jobs[0]["nodes"]) == 2

        try:
            wait_for(both_joined, DEADLINE, "both nodes to join", interval=0.5)
        except TimeoutError as e:
            self.fail("%s\n%s" % (e, "\n".join(n.describe() for n in nodes)))
        r = self.launch(["--check_env", "--rdzv_endpoint=127.0.0.1:%d" % port, "--rdzv_id=twins",
                         "--env_lock", locks[2], "--no_python"], timeout=DEADLINE)
        self.assertEqual(r.returncode, 3, r.describe())
        host = socket.gethostname()
        # The odd node and the one that matches this node each have a name of their own.
        self.assertRegex(r.stdout, r"node %s \(127\.0\.0\.1, joining, #\d\) has lock file sha256 \w+; "
                                   r"nodes this node, %s \(127\.0\.0\.1, joining, #\d\) have"
                         % (re.escape(host), re.escape(host)), r.describe())
        self.assertIn("verdict: this node cannot join job twins under --env_check=strict", r.stdout)


class LogsPerRun(LaunchTestCase):
    def test_two_runs_without_rdzv_id_into_one_log_dir_keep_separate_files(self):
        logs = os.path.join(self.tmp, "logs")
        for word in ("first", "second"):
            r = self.launch(["--nproc_per_node=1", "--redirects=3", "--log_dir", logs, "--no_python",
                             "/bin/echo", word])
            self.assertEqual(r.returncode, 0, r.describe())
        runs = sorted(os.listdir(logs))
        self.assertEqual(len(runs), 2, runs)
        contents = []
        for run in runs:
            self.assertTrue(run.startswith("none_"), runs)
            with open(os.path.join(logs, run, "attempt_0", "0", "stdout.log")) as f:
                contents.append(f.read())
        self.assertEqual(sorted(contents), ["first\n", "second\n"])

    def test_the_summary_names_the_failed_ranks_log_files_under_tee(self):
        logs = os.path.join(self.tmp, "logs")
        r = self.launch(["--nproc_per_node=1", "--tee=3", "--log_dir", logs, "--no_python",
                         "/bin/sh", "-c", "echo out; echo err >&2; exit 4"])
        self.assertEqual(r.returncode, 1, r.describe())
        (run,) = os.listdir(logs)
        for stream in ("stdout", "stderr"):
            self.assertIn("  log_file  : %s" % os.path.join(logs, run, "attempt_0", "0", stream + ".log"), r.stderr)


class BindWhatWasAsked(LaunchTestCase):
    def test_a_loopback_endpoint_is_not_reachable_on_another_address(self):
        port = free_port()
        args = ["--nnodes=2", "--nproc_per_node=1", "--rdzv_backend=c10d", "--rdzv_endpoint=127.0.0.1:%d" % port,
                "--rdzv_id=bind", "--rdzv_conf=join_timeout=300", "--python", PYTHON,
                self.script("w.py", MARK_WORKER), self.out]
        node = self.spawn_launch(args)
        # The line is written by the agent's console thread after the port opened: wait for both.
        try:
            wait_for(lambda: (processes.port_open(port) and "listening on 127.0.0.1" in node.stderr())
                     or node.poll() is not None, DEADLINE, "the hosted server and its line")
        except TimeoutError as e:
            self.fail("%s\n%s" % (e, node.describe()))
        self.assertIsNone(node.poll(), node.describe())
        # 127.0.0.2 is this machine too (127/8), but not the address the endpoint names; a server
        # bound to every address (0.0.0.0) would accept there.
        self.assertFalse(tcp_accepts("127.0.0.2", port), "the server listens beyond 127.0.0.1")
        # And on this machine's own non-loopback addresses (those of its interfaces), where other
        # hosts would reach it.
        for addr in non_loopback_addresses():
            self.assertFalse(tcp_accepts(addr, port), "the server is reachable on %s" % addr)
        self.assertTrue(tcp_accepts("127.0.0.1", port))

    def test_localhost_port_0_hosts_the_rendezvous_on_a_free_port_as_torch_2_standalone_does(self):
        r = self.launch(["--nnodes=1", "--nproc_per_node=2", "--rdzv_backend=c10d", "--rdzv_endpoint=localhost:0",
                         "--python", PYTHON, self.script("w.py", MARK_WORKER), self.out], timeout=DEADLINE)
        self.assertEqual(r.returncode, 0, r.describe())
        self.assertRegex(r.stderr, r"hosting the rendezvous server in-process on localhost:\d+ \(port 0")
        self.assertEqual(sorted(os.listdir(self.out)), ["started-0", "started-1"])

    def test_port_0_on_another_host_is_refused_with_exit_2(self):
        r = self.launch(["--nnodes=2", "--nproc_per_node=1", "--rdzv_backend=c10d", "--rdzv_endpoint=10.255.255.1:0",
                         "--rdzv_id=x", "--no_python", "/bin/true"])
        self.assertEqual(r.returncode, 2, r.describe())
        self.assertIn("port 0", r.stderr)


if __name__ == "__main__":
    unittest.main(verbosity=2)
