"""A supervisor that leaves nothing behind, through real processes:

- an agent SIGKILLed under workers that start grandchildren (a background child, a nested
  subshell's child, a `setsid` child, a double-forked `setsid` orphan) leaves no process behind;
  processes that left their process group are caught by the worker group's cgroup where the
  machine gives us one, and by the environment marker without one (DDPLAUNCH_NO_CGROUP=1);
- a job that ends normally leaves nothing behind either;
- a worker holds no descriptor of the agent's: only 0, 1 and 2 (--standalone, the embedded
  rendezvous, and a multi-node job on a loopback daemon);
- a console nobody reads does not cost a node its place in a multi-node job: the agent keeps
  heartbeating, drops what the console cannot take, counts it, and the job finishes.
"""

import json
import os
import signal
import subprocess
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ddplaunch_helpers import DDPLAUNCH, PYTHON, LaunchTestCase, main, pid_alive, wait_for  # noqa: E402
from test_multinode import CONF, MultiNodeTestCase  # noqa: E402
import processes  # noqa: E402
from processes import children  # noqa: E402

# Each worker starts grandchildren of every kind, records their pids, then waits for them.
FORKER = r"""#!/bin/bash
out="$OUT_DIR/$LOCAL_RANK"
sleep 777 & echo $! > "$out.bg"
( sleep 778 & echo $! > "$out.nested"; wait ) &
setsid sleep 779 & echo $! > "$out.setsid"
( setsid sleep 780 & echo $! > "$out.orphan" )
while [ ! -s "$out.nested" ]; do sleep 0.01; done  # the subshell writes it in its own time
echo $$ > "$out.worker"
cat /proc/self/cgroup > "$out.cgroup"
echo ready > "$out.tmp" && mv "$out.tmp" "$out.ready"
[ -n "$EXIT_AT_ONCE" ] && exit 0
wait
"""

KINDS_IN_GROUP = ("worker", "bg", "nested")
KINDS_OUTSIDE_GROUP = ("setsid", "orphan")  # a cgroup or the environment marker catch these


def kill_all(pids):
    """SIGKILL to each of `pids` still there: what a test leaves behind when it fails. A process
    that exits between the look and the signal (the job is being torn down meanwhile) is gone, as
    wanted."""
    for pid in pids:
        if pid_alive(pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def read(path):
    with open(path) as f:
        return f.read()


class NothingLeftBehind(LaunchTestCase):
    def start_forkers(self, nproc=2, env=None):
        script = os.path.join(self.tmp, "forker.sh")
        with open(script, "w") as f:
            f.write(FORKER)
        os.chmod(script, 0o755)
        e = {"OUT_DIR": self.out}
        e.update(env or {})
        proc = self.spawn_launch(["--nproc_per_node=%d" % nproc, "--no_python", script], env=e)
        ready = lambda: all(os.path.exists(os.path.join(self.out, "%d.ready" % r)) for r in range(nproc))
        wait_for(lambda: ready() or proc.poll() is not None, 60, "the workers to start their grandchildren")
        pids = {}
        for r in range(nproc):
            for kind in KINDS_IN_GROUP + KINDS_OUTSIDE_GROUP:
                pids[(r, kind)] = int(read(os.path.join(self.out, "%d.%s" % (r, kind))))
        self.addCleanup(kill_all, pids.values())
        cgroups = [read(os.path.join(self.out, "%d.cgroup" % r)) for r in range(nproc)]
        return proc, pids, cgroups

    def cgroup_dir(self, cgroup_text):
        """The worker group's cgroup directory from a worker's /proc/self/cgroup, or None."""
        for line in cgroup_text.splitlines():
            if line.startswith("0::") and "/ddplaunch-" in line:
                rel = line[3:]
                with open("/proc/self/mountinfo") as f:
                    for m in f:
                        left, _, right = m.partition(" - ")
                        if right.startswith("cgroup2 "):
                            root, point = left.split()[3:5]
                            if root != "/" and rel.startswith(root):
                                rel = rel[len(root):]
                            return point + rel
        return None

    def check_all_gone(self, pids, cgroups, extra=()):
        in_cgroup = all(self.cgroup_dir(c) for c in cgroups)
        must_die = list(pids.values()) + list(extra)
        try:
            wait_for(lambda: not any(pid_alive(p) for p in must_die), 15, "every process of the job to die")
        except TimeoutError:
            alive = {k: p for k, p in pids.items() if pid_alive(p)}
            self.fail("survivors: %s" % alive)
        for c in cgroups if in_cgroup else ():
            d = self.cgroup_dir(c)
            wait_for(lambda: not os.path.exists(d), 15, "the cgroup %s to be removed" % d)

    def test_sigkilled_agent_leaves_no_grandchild_behind(self):
        proc, pids, cgroups = self.start_forkers()
        sentinels = children(proc.pid, "ddp-sentinel")
        self.assertEqual(len(sentinels), 1, "ddplaunch should have one sentinel child")
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
        self.check_all_gone(pids, cgroups, extra=sentinels)

    def test_sigkilled_agent_without_a_cgroup_leaves_no_grandchild_behind(self):
        proc, pids, cgroups = self.start_forkers(env={"DDPLAUNCH_NO_CGROUP": "1"})
        self.assertFalse([c for c in cgroups if self.cgroup_dir(c)], "DDPLAUNCH_NO_CGROUP=1 still made a cgroup")
        sentinels = children(proc.pid, "ddp-sentinel")
        self.assertEqual(len(sentinels), 1, "ddplaunch should have one sentinel child")
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
        self.check_all_gone(pids, cgroups, extra=sentinels)

    def test_workers_run_in_a_cgroup_of_their_own_when_the_machine_allows_it(self):
        proc, pids, cgroups = self.start_forkers(nproc=1)
        if self.cgroup_dir(cgroups[0]) is None:
            self.skipTest("no writable cgroup v2 here (worker's /proc/self/cgroup: %s)" % cgroups[0].strip())
        d = self.cgroup_dir(cgroups[0])
        members = {int(p) for p in read(os.path.join(d, "cgroup.procs")).split()}
        self.assertIn(pids[(0, "setsid")], members)
        self.assertIn(pids[(0, "orphan")], members)
        self.assertNotIn(proc.pid, members)

    def test_empty_cgroups_of_agents_that_are_gone_are_removed_by_the_next_agent(self):
        # What an agent and its sentinel SIGKILLed together leave: an empty ddplaunch-PID with no
        # process PID. A leftover whose PID lives (another agent's) and one that is not empty stay.
        proc, pids, cgroups = self.start_forkers(nproc=1, env={"EXIT_AT_ONCE": "1"})
        self.assertEqual(proc.wait(timeout=60), 0, proc.describe())
        d = self.cgroup_dir(cgroups[0])
        if d is None:
            self.skipTest("no writable cgroup v2 here (worker's /proc/self/cgroup: %s)" % cgroups[0].strip())
        parent = os.path.dirname(d)
        gone = subprocess.Popen(["true"])
        gone.wait()
        live = subprocess.Popen(["sleep", "120"])
        self.addCleanup(live.wait)
        self.addCleanup(live.kill)
        leftovers = {name: os.path.join(parent, "ddplaunch-%d" % pid)
                     for name, pid in (("gone", gone.pid), ("live", live.pid))}
        busy = os.path.join(parent, "ddplaunch-%d" % gone.pid) + "0"  # no such pid either, but a child
        for path in list(leftovers.values()) + [busy, os.path.join(busy, "inner")]:
            if not os.path.isdir(path):
                os.mkdir(path)
        self.addCleanup(lambda: [os.rmdir(p) for p in (os.path.join(busy, "inner"), busy, *leftovers.values())
                                 if os.path.isdir(p)])
        proc2, _, _ = self.start_forkers(nproc=1, env={"EXIT_AT_ONCE": "1"})
        self.assertEqual(proc2.wait(timeout=60), 0, proc2.describe())
        self.assertFalse(os.path.exists(leftovers["gone"]), "the empty cgroup of a gone agent was left")
        self.assertTrue(os.path.isdir(leftovers["live"]), "the cgroup of a live process was removed")
        self.assertTrue(os.path.isdir(busy), "a cgroup with a child cgroup cannot be removed")

    def test_a_job_that_ends_normally_leaves_nothing_behind(self):
        proc, pids, cgroups = self.start_forkers(env={"EXIT_AT_ONCE": "1"})
        self.assertEqual(proc.wait(timeout=60), 0, proc.describe())
        self.check_all_gone(pids, cgroups)

    def test_a_job_that_ends_normally_without_a_cgroup_leaves_nothing_behind(self):
        proc, pids, cgroups = self.start_forkers(env={"EXIT_AT_ONCE": "1", "DDPLAUNCH_NO_CGROUP": "1"})
        self.assertEqual(proc.wait(timeout=60), 0, proc.describe())
        self.check_all_gone(pids, cgroups)


class FailureSummaryTail(LaunchTestCase):
    """The agent side: no error file, so the summary shows the stderr tail."""

    def test_a_redirected_worker_without_an_error_file_is_summarised_with_its_stderr_tail(self):
        logs = os.path.join(self.tmp, "logs")
        result = self.launch(["--nproc_per_node=1", "--redirects=3", "--log_dir", logs, "--rdzv_id=tail",
                              "--no_python", "/bin/sh", "-c", "echo first >&2; echo the real cause >&2; exit 3"])
        self.assertEqual(result.returncode, 1, result.describe())
        stderr_log = os.path.join(logs, "tail", "attempt_0", "0", "stderr.log")
        self.assertIn("the last lines of its stderr (%s):" % stderr_log, result.stderr)
        self.assertIn("    the real cause", result.stderr)
        self.assertIn("  log_file  : %s" % stderr_log, result.stderr)

    def test_a_worker_killed_by_a_signal_is_reported_as_killed_by_it(self):
        result = self.launch(["--nproc_per_node=2", "--tee=2", "--no_python", "/bin/sh", "-c",
                              'if [ "$LOCAL_RANK" = 1 ]; then echo dying >&2; kill -9 $$; fi; sleep 30'])
        self.assertEqual(result.returncode, 1, result.describe())
        root = result.stderr.split("Root Cause")[1]
        self.assertIn("rank      : 1 (local_rank: 1)", root)
        self.assertIn("signal    : 9 (SIGKILL)", root)
        self.assertIn("    dying", root)


# A worker that records every descriptor it holds, and what each one is.
FD_LISTER = """
import json, os, sys
d = os.open("/proc/self/fd", os.O_RDONLY | os.O_DIRECTORY)
fds = {}
for name in os.listdir(d):
    if int(name) == d:
        continue
    try:
        fds[name] = os.readlink("/proc/self/fd/" + name)
    except OSError:
        pass
with open(os.path.join(sys.argv[1], "fds-%s.json" % os.environ["RANK"]), "w") as f:
    json.dump(fds, f)
"""

WAIT_FOR_STOP = """
import time
while not os.path.exists(os.path.join(sys.argv[1], "stop")):
    time.sleep(0.1)
"""


class NoDescriptorLeaks(MultiNodeTestCase):
    def check_fds(self, world):
        for rank in range(world):
            with open(os.path.join(self.out, "fds-%d.json" % rank)) as f:
                fds = json.load(f)
            self.assertEqual(sorted(fds), ["0", "1", "2"], "rank %d holds %s" % (rank, fds))
            self.assertFalse([v for v in fds.values() if v.startswith("socket:")], fds)

    def test_a_standalone_worker_holds_only_stdin_stdout_and_stderr(self):
        script = self.script("fds.py", FD_LISTER)
        result = self.launch(["--standalone", "--nproc_per_node=2", "--tee=3", "--python", PYTHON, script, self.out])
        self.assertEqual(result.returncode, 0, result.describe())
        self.check_fds(2)

    def test_every_descriptor_of_a_standalone_agent_is_close_on_exec(self):
        script = self.script("fds.py", FD_LISTER + WAIT_FOR_STOP)
        proc = self.spawn_launch(["--standalone", "--nproc_per_node=2", "--tee=3", "--python", PYTHON, script, self.out])
        wait_for(lambda: len([n for n in os.listdir(self.out) if n.startswith("fds-")]) == 2 or proc.poll() is not None,
                 60, "the workers to list their descriptors")
        self.assertIsNone(proc.poll(), proc.describe())
        inheritable = {}
        for name in os.listdir("/proc/%d/fd" % proc.pid):
            if int(name) < 3:
                continue
            try:
                with open("/proc/%d/fdinfo/%s" % (proc.pid, name)) as f:
                    flags = int([l for l in f if l.startswith("flags:")][0].split()[1], 8)
                target = os.readlink("/proc/%d/fd/%s" % (proc.pid, name))
            except OSError:
                continue  # closed meanwhile
            if not flags & os.O_CLOEXEC:
                inheritable[name] = target
        self.stop_workers()
        self.assertEqual(proc.wait(timeout=60), 0, proc.describe())
        self.assertEqual(inheritable, {}, "descriptors of ddplaunch without close-on-exec")
        self.check_fds(2)

    def test_a_single_node_worker_holds_only_stdin_stdout_and_stderr(self):
        script = self.script("fds.py", FD_LISTER)
        result = self.launch(["--nproc_per_node=2", "--python", PYTHON, script, self.out])
        self.assertEqual(result.returncode, 0, result.describe())
        self.check_fds(2)

    def test_a_multi_node_worker_holds_no_socket_of_its_agent(self):
        self.start_daemon()
        script = self.script("fds.py", FD_LISTER)
        nodes = []
        for name in ("a", "b"):
            args = ["--nnodes=2", "--nproc_per_node=2", "--rdzv_backend=c10d",
                    "--rdzv_endpoint=127.0.0.1:%d" % self.port, "--rdzv_id=%s" % self.job, "--rdzv_conf", CONF,
                    "--redirects=2", "--python", PYTHON, script, self.out]
            nodes.append(self.spawn_launch(args))
        self.nodes = nodes
        self.assertEqual(self.wait_exit(nodes), [0, 0], self.describe_nodes())
        self.check_fds(4)


# Prints far more than a pipe and the agent's console queue hold, then waits to be told to stop.
FLOODER = """
import json, os, sys, time
out, rank = sys.argv[1], os.environ["RANK"]
line = "x" * 200
for i in range(int(os.environ.get("LINES", "30000"))):
    print("line %d %s" % (i, line))
sys.stdout.flush()
with open(os.path.join(out, "printed-%s.json" % rank), "w") as f:
    json.dump({"generation": os.environ["DDPLAUNCH_GENERATION"], "node": os.environ["MN_NODE"]}, f)
while not os.path.exists(os.path.join(out, "stop")):
    time.sleep(0.1)
"""


class StalledConsole(MultiNodeTestCase):
    def test_a_console_nobody_reads_does_not_cost_the_node_its_place_in_the_job(self):
        self.start_daemon()
        script = self.script("flood.py", FLOODER)

        def args(name):
            return [DDPLAUNCH, "--nnodes=2", "--nproc_per_node=2", "--rdzv_backend=c10d",
                    "--rdzv_endpoint=127.0.0.1:%d" % self.port, "--rdzv_id=%s" % self.job, "--rdzv_conf", CONF,
                    "--tee=3", "--log_dir", os.path.join(self.tmp, "logs-" + name),
                    "--python", PYTHON, script, self.out]

        env = dict(os.environ, TMPDIR=self.tmp, MN_NODE="stalled")
        # Node "stalled": its stdout and stderr are pipes this test does not read (yet).
        stalled = subprocess.Popen(args("stalled"), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                   stderr=subprocess.PIPE, env=env, cwd=self.tmp, start_new_session=True)
        self.addCleanup(lambda: (processes.kill_group(stalled.pid), stalled.wait()))
        other = self.spawn_launch(args("other")[1:], env={"MN_NODE": "other"})
        self.nodes = [other]
        printed = lambda: len([n for n in os.listdir(self.out) if n.startswith("printed-")]) == 4
        wait_for(lambda: printed() or stalled.poll() is not None or other.poll() is not None, 120,
                 "all four workers to print their output")
        self.assertIsNone(stalled.poll(), "the stalled node exited early")
        # Now hold the console shut for three heartbeat timeouts (2 s each): an agent blocked on
        # its console would have stopped heartbeating and been dropped from the job by now.
        time.sleep(6)
        self.assertIsNone(stalled.poll())
        self.assertIsNone(other.poll(), other.describe())
        # Drain the stalled node's output from now on, and let the workers finish.
        drained = {"out": b"", "err": b""}
        readers = [threading.Thread(target=lambda k=k, s=s: drained.__setitem__(k, s.read()), daemon=True)
                   for k, s in (("out", stalled.stdout), ("err", stalled.stderr))]
        for t in readers:
            t.start()
        self.stop_workers()
        self.assertEqual(self.wait_exit([other]), [0], other.describe())
        self.assertEqual(stalled.wait(timeout=60), 0)
        for t in readers:
            t.join(timeout=30)
        # Nobody restarted: every worker printed in generation 1, the node kept its place.
        gens = set()
        for n in os.listdir(self.out):
            if n.startswith("printed-"):
                with open(os.path.join(self.out, n)) as f:
                    gens.add(json.load(f)["generation"])
        self.assertEqual(gens, {"1"})
        console = (drained["out"] + drained["err"]).decode("utf-8", "replace")
        self.assertIn("because the console did not keep up", console)
        # The log files hold everything the console could not.
        log = os.path.join(self.tmp, "logs-stalled", self.job, "attempt_0", "0", "stdout.log")
        with open(log) as f:
            self.assertEqual(sum(1 for _ in f), 30000)


if __name__ == "__main__":
    main()
