"""The environment check end to end: real ddplaunch "nodes" on 127.0.0.x join one real
ddp-rendezvous daemon on loopback; one node runs another interpreter (a /bin/sh wrapper around
/usr/bin/python3 whose `torch` is a fake package reporting 2.1.0+cu118) or another training
binary. Checked: the refused round reaches every ddplaunch as exit 3 with the side-by-side
message and no worker ever starts; warn and off let the job run; identical nodes run; a
mismatched node joining a running elastic job is refused alone; `ddplaunch --check_env` and
`ddp-rendezvous status` show the comparison; the interpreter probe runs once per cold cache.

Every worker writes OUT/started-<node>-<generation>-<local rank>.json first thing, so "no worker
ever started" is the absence of those files. Every process is killed in cleanup (its whole
process group); every wait has a deadline.
"""

import json
import os
import re
import shutil
import tempfile
import time
import unittest

import processes
from ddplaunch_helpers import BUILD_DIR, DDPLAUNCH, PYTHON, LaunchTestCase, pid_alive
from processes import free_port, run, spawn, wait_for

RENDEZVOUS = os.path.join(BUILD_DIR, "bin", "ddp-rendezvous")
# A join deadline long enough for a cold `import torch` probe on a loaded 2-core machine.
CONF = "heartbeat_interval=0.5,heartbeat_timeout=10,last_call_timeout=1,join_timeout=90"
DEADLINE = 120  # seconds any one ddplaunch may take here
FAKE_TORCH = "2.1.0+cu118"

WORKER = r'''
import json, os, sys, time
out = sys.argv[1]
env = {k: os.environ.get(k) for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
                                      "DDPLAUNCH_GENERATION", "TORCHELASTIC_RESTART_COUNT")}
node = os.environ.get("ENVCHECK_NODE", "?")
rec = {"node": node, "pid": os.getpid(), "env": env}
name = "started-%s-%s-%s.json" % (node, env["DDPLAUNCH_GENERATION"], env["LOCAL_RANK"])
with open(os.path.join(out, name + ".tmp"), "w") as f:
    json.dump(rec, f)
os.rename(os.path.join(out, name + ".tmp"), os.path.join(out, name))
if "--loop" in sys.argv:
    deadline = time.time() + 120
    while not os.path.exists(os.path.join(out, "stop")) and time.time() < deadline:
        time.sleep(0.05)
'''

# A --no_python worker: same effect as WORKER, as a shell script (two copies differ by one byte).
EXE_WORKER = '''#!/bin/sh
touch "$1/started-$ENVCHECK_NODE-$DDPLAUNCH_GENERATION-$LOCAL_RANK.json"
# variant %s
'''


class EnvCheckTestCase(LaunchTestCase):
    """A fingerprint cache per test class (the first real probe imports torch: seconds; later
    starts hit the cache), a daemon per test, and helpers to start nodes."""

    @classmethod
    def setUpClass(cls):
        cls.cache = tempfile.mkdtemp(prefix="ddplaunch_envcheck_cache_")
        cls.real_torch = None

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.cache, True)

    def setUp(self):
        super().setUp()
        for binary in (DDPLAUNCH, RENDEZVOUS):
            if not os.path.exists(binary):
                self.fail("not built: %s" % binary)
        self.job = "env-%s" % self.id().rsplit(".", 1)[-1][:40]
        self.worker = self.script("worker.py", WORKER)
        self.procs = []
        self.probe_log = os.path.join(self.tmp, "probes.log")

    # ---- pieces --------------------------------------------------------------------------

    def env(self, extra=None):
        env = {"DDPLAUNCH_CACHE_DIR": self.cache}
        env.update(extra or {})
        return env

    def other_interpreter(self):
        """A wrapper around /usr/bin/python3 whose `import torch` finds a fake torch reporting
        FAKE_TORCH (CPU build, like the real one here, so torch is the only breaking difference).
        It logs every interpreter probe (a `-c` run) to self.probe_log."""
        fake = os.path.join(self.tmp, "fake_site", "torch")
        os.makedirs(fake)
        with open(os.path.join(fake, "__init__.py"), "w") as f:
            f.write("__version__ = %r\n\nclass version:\n    cuda = None\n" % FAKE_TORCH)
        wrapper = os.path.join(self.tmp, "python-other")
        with open(wrapper, "w") as f:
            f.write('#!/bin/sh\n[ "$1" = "-c" ] && echo probe >> %s\n'
                    'PYTHONPATH=%s${PYTHONPATH:+:$PYTHONPATH} exec %s "$@"\n'
                    % (self.probe_log, os.path.dirname(fake), PYTHON))
        os.chmod(wrapper, 0o755)
        return wrapper

    def probes(self):
        if not os.path.exists(self.probe_log):
            return 0
        with open(self.probe_log) as f:
            return len(f.read().split())

    def start_daemon(self):
        self.port = free_port()
        self.daemon = spawn([RENDEZVOUS, "--host", "127.0.0.1", "--port", str(self.port)], name="ddp-rendezvous")
        self.addCleanup(self.daemon.kill)
        wait_for(lambda: processes.port_open(self.port) or self.daemon.poll() is not None, 15, "the daemon to listen")
        self.assertIsNone(self.daemon.poll(), self.daemon.describe())

    def start_node(self, name, nnodes, python=PYTHON, mode=None, program=None, loop=False, nproc=1):
        """Starts one ddplaunch node on 127.0.0.<name's digit> against the daemon."""
        addr = "127.0.0.%s" % name[-1]
        args = ["--nnodes=%s" % nnodes, "--nproc_per_node=%d" % nproc, "--rdzv_backend=c10d",
                "--rdzv_endpoint=127.0.0.1:%d" % self.port, "--rdzv_id=%s" % self.job, "--rdzv_conf", CONF,
                "--local_addr=%s" % addr, "--shutdown_timeout=5"]
        if mode:
            args.append("--env_check=%s" % mode)
        if program:
            args += ["--no_python", program, self.out]
        else:
            args += ["--python", python, self.worker, self.out] + (["--loop"] if loop else [])
        proc = self.spawn_launch(args, env=self.env({"ENVCHECK_NODE": name}))
        proc.node, proc.addr = name, addr
        self.procs.append(proc)
        return proc

    def wait_exit(self, procs, timeout=DEADLINE):
        try:
            return processes.wait_all(procs, timeout)
        except TimeoutError as e:
            self.fail("%s\n%s" % (e, self.describe()))

    def describe(self):
        parts = [p.describe() for p in self.procs]
        if getattr(self, "daemon", None):
            parts.append("--- daemon ---\n" + self.daemon.output())
        return "\n".join(parts)

    def started(self):
        """The worker start records so far."""
        recs = []
        for name in sorted(os.listdir(self.out)):
            if name.startswith("started-") and name.endswith(".json"):
                path = os.path.join(self.out, name)
                with open(path) as f:
                    text = f.read()
                recs.append(json.loads(text) if text.strip() else {"file": name})
        return recs

    def torch_version(self):
        """This machine's real torch version, from `ddplaunch --check_env` (warms the cache)."""
        if type(self).real_torch is None:
            r = self.launch(["--check_env", "--python", PYTHON, self.worker], timeout=DEADLINE, env=self.env())
            self.assertEqual(r.returncode, 0, r.describe())
            m = re.search(r"^\s+torch\s+(\S+)", r.stdout, re.M)
            self.assertIsNotNone(m, r.describe())
            type(self).real_torch = m.group(1)
        return type(self).real_torch

    def status(self, as_json=False):
        r = run([RENDEZVOUS, "status", "--endpoint", "127.0.0.1:%d" % self.port] + (["--json"] if as_json else []),
                timeout=20)
        self.assertEqual(r.returncode, 0, r.describe())
        return json.loads(r.stdout) if as_json else r.stdout


class StrictRefusal(EnvCheckTestCase):
    def assert_refused_everywhere(self, procs, line_pattern):
        codes = self.wait_exit(procs)
        self.assertEqual(codes, [3] * len(procs), self.describe())
        for p in procs:
            err = p.stderr()
            self.assertIn("environment mismatch between the job's nodes (--env_check=strict)", err, p.describe())
            self.assertRegex(err, line_pattern, p.describe())
            self.assertIn("--env_check=warn", err)
        self.assertEqual(self.started(), [], "a worker started although the round was refused")
        self.assertTrue(self.daemon.output().count("round refused"), self.daemon.output())

    def test_a_node_with_another_torch_refuses_the_round_on_every_node_and_starts_no_worker(self):
        torch = self.torch_version()
        other = self.other_interpreter()
        self.start_daemon()
        nodes = [self.start_node("n2", 3), self.start_node("n3", 3, python=other), self.start_node("n4", 3)]
        self.assert_refused_everywhere(
            nodes, r"node \S+ \(127\.0\.0\.3\) has torch %s; nodes \S+ \(127\.0\.0\.[24]\), \S+ \(127\.0\.0\.[24]\) have %s"
            % (re.escape(FAKE_TORCH), re.escape(torch)))
        self.assertEqual(self.probes(), 1, "one probe of the odd interpreter")

    def test_two_nodes_with_different_torch_are_both_refused(self):
        self.torch_version()
        other = self.other_interpreter()
        self.start_daemon()
        nodes = [self.start_node("n2", 2), self.start_node("n3", 2, python=other)]
        self.assert_refused_everywhere(
            nodes, r"node \S+ \(127\.0\.0\.[23]\) has torch \S+; node \S+ \(127\.0\.0\.[23]\) has \S+")

    def test_a_node_with_another_training_binary_refuses_the_round_and_starts_no_worker(self):
        exe_a = self.script("train_a", EXE_WORKER % "a")
        exe_b = self.script("train_b", EXE_WORKER % "b")  # one byte differs
        for exe in (exe_a, exe_b):
            os.chmod(exe, 0o755)
        self.start_daemon()
        nodes = [self.start_node("n2", 3, program=exe_a), self.start_node("n3", 3, program=exe_b),
                 self.start_node("n4", 3, program=exe_a)]
        self.assert_refused_everywhere(
            nodes, r"node \S+ \(127\.0\.0\.3\) has program sha256 [0-9a-f]{12}; "
                   r"nodes \S+ \(127\.0\.0\.[24]\), \S+ \(127\.0\.0\.[24]\) have [0-9a-f]{12}")


class WarnOffAndIdentical(EnvCheckTestCase):
    def run_job(self, nodes):
        codes = self.wait_exit(nodes)
        self.assertEqual(codes, [0] * len(nodes), self.describe())
        started = self.started()
        self.assertEqual(sorted(r["node"] for r in started), sorted(p.node for p in nodes), self.describe())
        return started

    def test_warn_logs_the_difference_and_the_job_runs(self):
        torch = self.torch_version()
        other = self.other_interpreter()
        self.start_daemon()
        nodes = [self.start_node("n2", 2, mode="warn"), self.start_node("n3", 2, python=other, mode="warn")]
        self.run_job(nodes)
        log = self.daemon.output()
        self.assertIn("environment differs (--env_check=warn)", log)
        self.assertIn("torch", log)
        self.assertIn(FAKE_TORCH, log)
        self.assertIn(torch, log)
        self.assertNotIn("round refused", log)

    def test_off_does_not_probe_and_the_job_runs(self):
        self.torch_version()
        other = self.other_interpreter()
        self.start_daemon()
        nodes = [self.start_node("n2", 2, mode="off"), self.start_node("n3", 2, python=other, mode="off")]
        self.run_job(nodes)
        self.assertEqual(self.probes(), 0, "--env_check=off must not probe the interpreter")
        self.assertNotIn("environment", self.daemon.output())

    def test_identical_nodes_pass_and_the_job_runs(self):
        self.torch_version()
        self.start_daemon()
        nodes = [self.start_node("n%d" % i, 3) for i in (2, 3, 4)]
        started = self.run_job(nodes)
        self.assertEqual({r["env"]["WORLD_SIZE"] for r in started}, {"3"})
        log = self.daemon.output()
        self.assertNotIn("environment", log)
        self.assertIn("round 1 complete", log)

    def test_the_interpreter_is_probed_once_on_a_cold_cache_and_not_on_a_warm_one(self):
        other = self.other_interpreter()
        self.start_daemon()
        cold = self.start_node("n2", 1, python=other)
        self.assertEqual(self.wait_exit([cold]), [0], self.describe())
        self.assertEqual(self.probes(), 1, "a cold start probes the interpreter exactly once")
        self.job += "-warm"
        warm = self.start_node("n3", 1, python=other)
        self.assertEqual(self.wait_exit([warm]), [0], self.describe())
        self.assertEqual(self.probes(), 1, "a warm start must not probe again")
        # Changing the interpreter file (an upgrade) invalidates the cache.
        os.utime(other, (time.time() + 5, time.time() + 5))
        self.job += "-touched"
        again = self.start_node("n4", 1, python=other)
        self.assertEqual(self.wait_exit([again]), [0], self.describe())
        self.assertEqual(self.probes(), 2, "a changed interpreter is probed again")


class ElasticLateJoiner(EnvCheckTestCase):
    def test_a_mismatched_node_joining_a_running_elastic_job_is_refused_and_the_job_goes_on(self):
        torch = self.torch_version()
        other = self.other_interpreter()
        self.start_daemon()
        good = [self.start_node("n2", "1:3", loop=True, nproc=2), self.start_node("n3", "1:3", loop=True, nproc=2)]

        def round_of_both():
            # n3 may join a moment after n2's first round of 2 workers: wait for the round of 4.
            by_gen = {}
            for r in self.started():
                by_gen.setdefault(r["env"]["DDPLAUNCH_GENERATION"], []).append(r)
            for gen, recs in by_gen.items():
                if len(recs) == 4 and {r["env"]["WORLD_SIZE"] for r in recs} == {"4"}:
                    return gen, recs
            return None
        try:
            gen, first = wait_for(round_of_both, DEADLINE, "both good nodes' workers to start in one round")
        except TimeoutError as e:
            self.fail("%s\n%s" % (e, self.describe()))
        pids = {r["pid"] for r in first}
        records_before = len(self.started())
        log_before = len(self.daemon.output())

        bad = self.start_node("n4", "1:3", python=other, loop=True, nproc=2)
        self.assertEqual(self.wait_exit([bad]), [3], self.describe())
        err = bad.stderr()
        self.assertRegex(err, r"node \S+ \(127\.0\.0\.4\) has torch %s; nodes \S+ \(127\.0\.0\.[23]\), "
                              r"\S+ \(127\.0\.0\.[23]\) have %s" % (re.escape(FAKE_TORCH), re.escape(torch)))
        # The running nodes were not disturbed: same workers, alive, no new generation.
        self.assertEqual(len(self.started()), records_before, "no worker of a new round: %s" % self.started())
        self.assertTrue(all(pid_alive(p) for p in pids), "the running workers were stopped")
        self.assertTrue(all(p.poll() is None for p in good), self.describe())
        status = self.status(as_json=True)
        job = next(j for j in status["jobs"] if j["job_id"] == self.job)
        self.assertEqual(job["state"], "running")
        self.assertEqual(str(job["generation"]), gen)
        self.assertEqual(len(job["nodes"]), 2)
        self.assertTrue(job["env"]["agree"], job)
        self.assertIn("refused", self.daemon.output()[log_before:])

        with open(os.path.join(self.out, "stop"), "w"):
            pass
        self.assertEqual(self.wait_exit(good), [0, 0], self.describe())
        later = self.daemon.output()[log_before:]
        self.assertNotIn("restart after generation", later)
        self.assertIn("succeeded (generation %s)" % gen, later)
        recs = self.started()
        self.assertEqual(len(recs), records_before, recs)
        self.assertEqual({r["env"]["TORCHELASTIC_RESTART_COUNT"] for r in recs}, {"0"})
        self.assertEqual(max(int(r["env"]["DDPLAUNCH_GENERATION"]) for r in recs), int(gen))


class CheckEnvAndStatus(EnvCheckTestCase):
    def test_check_env_prints_the_table_and_exits_0(self):
        r = self.launch(["--check_env", "--python", PYTHON, self.worker], timeout=DEADLINE, env=self.env())
        self.assertEqual(r.returncode, 0, r.describe())
        for label in ("CPU architecture", "OS", "glibc", "GPUs", "Python", "torch", "CUDA (torch)", "NCCL",
                      "cuDNN", "program", "CUDA_VISIBLE_DEVICES", "NCCL_* settings"):
            self.assertRegex(r.stdout, r"(?m)^  %s\s{2,}\S" % re.escape(label), r.describe())
        self.assertIn(self.worker, r.stdout)
        self.assertEqual(self.started(), [], "--check_env must not start a worker")

    def test_check_env_says_plainly_when_the_interpreter_has_no_torch_and_exits_2(self):
        bare = os.path.join(self.tmp, "python-bare")
        with open(bare, "w") as f:  # -S: no site-packages, so `import torch` fails
            f.write('#!/bin/sh\nexec %s -S "$@"\n' % PYTHON)
        os.chmod(bare, 0o755)
        r = self.launch(["--check_env", "--python", bare, self.worker], timeout=DEADLINE, env=self.env())
        # This node cannot run the job, so --check_env says so and exits 2.
        self.assertEqual(r.returncode, 2, r.describe())
        self.assertIn("verdict: this node cannot run the job: the Python that would run the workers, %s" % bare,
                      r.stdout)
        self.assertRegex(r.stdout, r"(?m)^  torch\s+not installed \(ModuleNotFoundError", r.describe())
        self.assertNotIn("CUDA (torch)", r.stdout, "no CUDA/NCCL/cuDNN rows without torch")

    def test_check_env_against_a_job_and_status_show_where_nodes_differ(self):
        torch = self.torch_version()
        other = self.other_interpreter()
        self.start_daemon()
        nodes = [self.start_node("n2", 2, mode="warn", loop=True), self.start_node("n3", 2, python=other, mode="warn",
                                                                                 loop=True)]
        try:
            wait_for(lambda: len(self.started()) == 2, DEADLINE, "the warn job's workers to start")
        except TimeoutError as e:
            self.fail("%s\n%s" % (e, self.describe()))

        text = self.status()
        self.assertIn("job %s: running" % self.job, text)
        self.assertIn("environment: the 2 nodes DIFFER (breaks a job", text)
        self.assertRegex(text, r"torch (%s|%s)" % (re.escape(FAKE_TORCH), re.escape(torch)))
        env = next(j for j in self.status(as_json=True)["jobs"] if j["job_id"] == self.job)["env"]
        self.assertEqual((env["agree"], env["breaking"], env["checked_nodes"]), (False, True, 2), env)

        # This node (the real interpreter) against the job: the odd one is the wrapper node.
        r = self.launch(["--check_env", "--rdzv_endpoint=127.0.0.1:%d" % self.port, "--rdzv_id=%s" % self.job,
                         "--local_addr=127.0.0.5", "--python", PYTHON, self.worker], timeout=DEADLINE, env=self.env())
        self.assertIn("Environment of this node", r.stdout)
        self.assertRegex(r.stdout, r"node \S+ \(127\.0\.0\.3\) has torch %s; nodes this node, \S+ \(127\.0\.0\.2\) have %s"
                         % (re.escape(FAKE_TORCH), re.escape(torch)), r.describe())
        self.assertEqual(r.returncode, 3, "a breaking difference makes --check_env exit 3: " + r.describe())

        with open(os.path.join(self.out, "stop"), "w"):
            pass
        self.assertEqual(self.wait_exit(nodes), [0, 0], self.describe())

    def test_check_env_against_a_job_of_matching_nodes_says_so(self):
        self.torch_version()
        self.start_daemon()
        nodes = [self.start_node("n2", 2, loop=True), self.start_node("n3", 2, loop=True)]
        try:
            wait_for(lambda: len(self.started()) == 2, DEADLINE, "the job's workers to start")
        except TimeoutError as e:
            self.fail("%s\n%s" % (e, self.describe()))
        self.assertIn("environment: the 2 nodes agree", self.status())
        r = self.launch(["--check_env", "--rdzv_endpoint=127.0.0.1:%d" % self.port, "--rdzv_id=%s" % self.job,
                         "--python", PYTHON, self.worker], timeout=DEADLINE, env=self.env())
        self.assertEqual(r.returncode, 0, r.describe())
        self.assertIn("this node matches the 2 node(s) of job %s" % self.job, r.stdout)
        with open(os.path.join(self.out, "stop"), "w"):
            pass
        self.assertEqual(self.wait_exit(nodes), [0, 0], self.describe())


if __name__ == "__main__":
    unittest.main(verbosity=2)
