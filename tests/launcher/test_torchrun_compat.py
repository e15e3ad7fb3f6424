"""The same command lines through ddplaunch and through the real torchrun of the test Python's
torch 2.x (the project venv's, scripts/python-env): each worker writes every variable its
launcher set, and the two sides must agree on every one, except the differences docs/cli.md
lists ("Differences from torchrun 2.x"), which are asserted to be exactly those."""
import json
import os
import socket
import subprocess
import sys
import tempfile
import unittest

BUILD = os.environ.get("DDPLAUNCH_BUILD_DIR", os.path.join(os.path.dirname(__file__), "..", "..", "build"))
DDPLAUNCH = os.path.abspath(os.path.join(BUILD, "bin", "ddplaunch"))
TORCHRUN = os.path.join(os.path.dirname(sys.executable), "torchrun")

# A worker: records the variables its launcher added (those not in BASE_KEYS) and its argv.
DUMP = """
import json, os, sys
base = set(os.environ["BASE_KEYS"].split(","))
record = {k: v for k, v in os.environ.items() if k not in base}
record["argv"] = sys.argv[1:]
attempt = record.get("TORCHELASTIC_RESTART_COUNT", "0")
with open(os.path.join(os.environ["OUT_DIR"], "env_%s_%s.json" % (attempt, os.environ["RANK"])), "w") as f:
    json.dump(record, f)
# A failing worker first waits (up to 60 s) for every worker of its attempt to have written its
# record: the launcher stops the others when it fails.
fail = os.environ.get("FAIL_RANK_ON_FIRST_ATTEMPT") == os.environ["RANK"] and attempt == "0"
code = 1 if fail else int(os.environ.get("WORKER_EXIT", "0"))
if code:
    import time
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and len([f for f in os.listdir(os.environ["OUT_DIR"])
            if f.startswith("env_%s_" % attempt)]) < int(os.environ["WORLD_SIZE"]):
        time.sleep(0.05)
sys.exit(code)
"""

# Differences on purpose (docs/cli.md, "Differences from torchrun 2.x"): name -> what differs.
ONLY_DDPLAUNCH = {"DDPLAUNCH_GENERATION", "NCCL_ASYNC_ERROR_HANDLING", "DDPLAUNCH_SUPERVISOR",
                  "DDPLAUNCH_PROGRESS_FILE", "DDPLAUNCH_PROGRESS_SLOT"}
# The environment's digest, for checkpoints' lineage: there when the check has software to
# digest (a Python worker's interpreter, or --env_lock), not for a bare executable.
ENV_DIGEST = {"DDPLAUNCH_ENV_FINGERPRINT", "DDPLAUNCH_ENV_CHECK"}
ONLY_TORCHRUN = set()
DIFFERENT_VALUE = {"TORCHELASTIC_USE_AGENT_STORE",   # torchrun "True", ddplaunch "False"
                   "PYTHONPATH"}                     # Python workers: + the ddplaunch helper's directory
PER_RUN = {"MASTER_PORT", "TORCHELASTIC_ERROR_FILE"}  # a port / a path of each run, compared apart


def torch_major():
    try:
        import torch
    except ImportError:
        return None
    return int(torch.__version__.split(".")[0])


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class TorchrunCompat(unittest.TestCase):
    def setUp(self):
        reason = None
        if torch_major() is None or torch_major() < 2:
            reason = "%s has no torch 2.x (run scripts/setup: the project venv)" % sys.executable
        elif not os.path.exists(TORCHRUN):
            reason = "no torchrun beside %s" % sys.executable
        if reason:
            print("skipped: " + reason, file=sys.stderr)
            self.skipTest(reason)
        self.assertTrue(os.path.exists(DDPLAUNCH), "ddplaunch not built: %s" % DDPLAUNCH)
        self.tmp = tempfile.TemporaryDirectory(prefix="ddplaunch_compat_")
        self.addCleanup(self.tmp.cleanup)
        self.worker = os.path.join(self.tmp.name, "dump_env.py")
        with open(self.worker, "w") as f:
            f.write("#!%s\n%s" % (sys.executable, DUMP))
        os.chmod(self.worker, 0o755)
        with open(os.path.join(self.tmp.name, "dump_mod.py"), "w") as f:
            f.write(DUMP)

    def run_both(self, args, env=None, port=True):
        """Runs `LAUNCHER args` for both launchers at once; returns {name: (exit code, records)}."""
        procs = {}
        for name, launcher in (("torchrun", [TORCHRUN]), ("ddplaunch", [DDPLAUNCH])):
            out = os.path.join(self.tmp.name, name + "_" + str(len(os.listdir(self.tmp.name))))
            os.mkdir(out)
            # ddplaunch starts `python3` from PATH, torchrun its own sys.executable: the same one
            e = dict(os.environ, PYTHONPATH=self.tmp.name, **(env or {}))
            e["PATH"] = os.path.dirname(sys.executable) + os.pathsep + e.get("PATH", "")
            e["OUT_DIR"] = out
            e["BASE_KEYS"] = ",".join(list(e) + ["BASE_KEYS"])
            cmd = launcher + (["--master_port=%d" % free_port()] if port else []) + args
            procs[name] = (cmd, out, subprocess.Popen(cmd, env=e, cwd=self.tmp.name,
                                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                                      text=True, start_new_session=True))
        results = {}
        for name, (cmd, out, p) in procs.items():
            try:
                text, _ = p.communicate(timeout=180)
            finally:
                if p.poll() is None:
                    os.killpg(p.pid, 9)
                    p.wait()
            records = {}
            for f in sorted(os.listdir(out)):
                with open(os.path.join(out, f)) as fh:
                    records[f] = json.load(fh)
            results[name] = (p.returncode, records, " ".join(cmd) + "\n" + text[-3000:])
        return results

    def assert_same(self, results, expect_rc=0, files=None, digest=True):
        (trc, tr, tlog), (drc, dl, dlog) = results["torchrun"], results["ddplaunch"]
        self.assertEqual(trc, expect_rc, tlog)
        self.assertEqual(drc, expect_rc, dlog)
        self.assertEqual(sorted(tr), sorted(dl), "the same workers ran\n" + tlog + dlog)
        if files is not None:
            self.assertEqual(sorted(tr), files)
        for f in tr:
            t, d = tr[f], dl[f]
            with self.subTest(worker=f):
                only_ddplaunch = set(d) - set(t)
                self.assertEqual(only_ddplaunch & ENV_DIGEST, ENV_DIGEST if digest else set(),
                                 "the environment's digest and the check mode")
                if digest:
                    self.assertRegex(d["DDPLAUNCH_ENV_FINGERPRINT"], "^[0-9a-f]{64}$")
                    self.assertEqual(d["DDPLAUNCH_ENV_CHECK"], "strict")
                self.assertEqual(only_ddplaunch - ENV_DIGEST, ONLY_DDPLAUNCH, "variables only ddplaunch sets")
                self.assertEqual(set(t) - set(d), ONLY_TORCHRUN, "variables only torchrun sets")
                for key in set(t) & set(d) - DIFFERENT_VALUE - PER_RUN:
                    self.assertEqual(d[key], t[key], key)
                if "PYTHONPATH" in t:
                    self.assertTrue(d["PYTHONPATH"] == t["PYTHONPATH"] or
                                    d["PYTHONPATH"].startswith(t["PYTHONPATH"] + ":"), d["PYTHONPATH"])
                self.assertEqual((t["TORCHELASTIC_USE_AGENT_STORE"], d["TORCHELASTIC_USE_AGENT_STORE"]),
                                 ("True", "False"))
                # attempt_<restart count>/<local rank>/error.json under each launcher's log dir
                tail = "attempt_%s/%s/error.json" % (t["TORCHELASTIC_RESTART_COUNT"], t["LOCAL_RANK"])
                self.assertTrue(t["TORCHELASTIC_ERROR_FILE"].endswith(tail), t["TORCHELASTIC_ERROR_FILE"])
                self.assertTrue(d["TORCHELASTIC_ERROR_FILE"].endswith(tail), d["TORCHELASTIC_ERROR_FILE"])
        return tr

    def test_a_script_with_arguments(self):
        tr = self.assert_same(self.run_both(["--nproc_per_node=2", self.worker, "a b", "--lr", "0.1"]),
                              files=["env_0_0.json", "env_0_1.json"])
        self.assertEqual(tr["env_0_1.json"]["argv"], ["a b", "--lr", "0.1"])

    def test_no_python_executable_role_run_id_and_max_restarts(self):
        self.assert_same(self.run_both(["--nproc-per-node=3", "--no_python", "--role=trainer",
                                        "--rdzv_id=job7", "--max_restarts=2", self.worker, "x"]),
                         files=["env_0_%d.json" % r for r in range(3)], digest=False)  # nothing to digest

    def test_a_module_with_pet_variables(self):
        self.assert_same(self.run_both(["-m", "dump_mod", "--flag"],
                                       env={"PET_NPROC_PER_NODE": "2", "PET_MAX_RESTARTS": "1"}),
                         files=["env_0_0.json", "env_0_1.json"])

    def test_a_failed_worker_restarts_every_worker_with_the_restart_count(self):
        tr = self.assert_same(self.run_both(["--nproc_per_node=2", "--max_restarts=1",
                                             "--monitor_interval=0.1", self.worker],
                                            env={"FAIL_RANK_ON_FIRST_ATTEMPT": "1"}),
                              files=["env_0_0.json", "env_0_1.json", "env_1_0.json", "env_1_1.json"])
        self.assertEqual(tr["env_1_0.json"]["TORCHELASTIC_RESTART_COUNT"], "1")

    def test_a_worker_failing_with_no_restarts_left_fails_the_job_with_exit_1(self):
        self.assert_same(self.run_both(["--nproc_per_node=2", self.worker], env={"WORKER_EXIT": "3"}),
                         expect_rc=1, files=["env_0_0.json", "env_0_1.json"])


if __name__ == "__main__":
    unittest.main(verbosity=2)
