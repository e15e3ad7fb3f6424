"""Standby workers (docs/agent.md, "Standby workers").

Two halves:
- the bootstrap (python/ddplaunch_standby.py) on its own: the test plays the agent on a real
  socket pair, with a stub `torch` on PYTHONPATH (fast, and it shows when the preload ran);
  hostile, short and closed assignments end the standby without running the program, and a good
  one runs it as `python -u PROGRAM ARGS` (or -m, --run_path) would;
- ddplaunch --standby=on with real workers of the torch venv: a standby holds no round's
  environment, runs nothing of the user's before its assignment, becomes the next round's
  worker, dies with a SIGKILLed agent, and one that died before it was needed is replaced by a
  cold start.
"""

import datetime
import json
import os
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
import types
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ddplaunch_helpers import BUILD_DIR, PYTHON, LaunchTestCase, main, wait_for  # noqa: E402
from processes import children, free_port  # noqa: E402

SOURCE_DIR = os.environ.get("DDPLAUNCH_SOURCE_DIR",
                            os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
PYTHON_DIR = os.path.join(SOURCE_DIR, "python")
BOOTSTRAP = os.path.join(PYTHON_DIR, "ddplaunch_standby.py")
sys.path.insert(0, PYTHON_DIR)
import ddplaunch_standby  # noqa: E402

# Variables that belong to a round: a standby must hold none of them before its assignment.
ROUND_VARIABLES = ["RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
                   "ROLE_RANK", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT",
                   "TORCHELASTIC_ERROR_FILE", "DDPLAUNCH_GENERATION", "DDPLAUNCH_PROGRESS_SLOT",
                   "DDPLAUNCH_SUPERVISOR"]


def message(payload_obj=None, raw_payload=None, magic=b"DDPS", version=1, length=None):
    payload = raw_payload if raw_payload is not None else json.dumps(payload_obj).encode()
    return struct.pack("<4sII", magic, version, len(payload) if length is None else length) + payload


def read(path):
    with open(path) as f:
        return f.read()


def proc_environ(pid):
    with open("/proc/%d/environ" % pid, "rb") as f:
        entries = [e.decode(errors="replace") for e in f.read().split(b"\0") if e]
    return dict(e.split("=", 1) for e in entries if "=" in e)


def gone(pid):
    """True when `pid` has exited (no such process, or a zombie waiting for its reaper)."""
    try:
        stat = read("/proc/%d/stat" % pid)
    except OSError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] in ("Z", "X")


def cmdline(pid):
    try:
        with open("/proc/%d/cmdline" % pid, "rb") as f:
            return [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
    except OSError:
        return []


# ---- the assignment's Python decoder --------------------------------------------------------------


class AssignmentDecoder(unittest.TestCase):
    """python/ddplaunch_standby.py decode(): the same rules as contracts/standby_assignment.cpp's decoder."""

    def bad(self, data, words):
        with self.assertRaises(ddplaunch_standby.BadAssignment) as cm:
            ddplaunch_standby.decode(data)
        self.assertIn(words, str(cm.exception))

    def test_a_valid_assignment_decodes(self):
        env, cwd = ddplaunch_standby.decode(message({"env": {"RANK": "1", "X": "a=b"}, "cwd": "/tmp"}))
        self.assertEqual(env, {"RANK": "1", "X": "a=b"})
        self.assertEqual(cwd, "/tmp")

    def test_headers_that_lie_or_come_from_elsewhere_are_refused(self):
        self.bad(b"DDPS\x01", "short header")
        self.bad(message({"env": {}, "cwd": "/"}, magic=b"HTTP"), "bad magic")
        self.bad(message({"env": {}, "cwd": "/"}, version=2), "version 2")
        self.bad(message(raw_payload=b"{}", length=0), "payload length 0")
        self.bad(message(raw_payload=b"{}", length=0xFFFFFFFF), "outside")
        self.bad(message(raw_payload=b"{}", length=50), "header says 50")

    def test_payloads_of_the_wrong_shape_are_refused(self):
        self.bad(message(raw_payload=b"\xff\xfe"), "not JSON")
        self.bad(message(raw_payload=b"[" * 100000 + b"]" * 100000), "nested deeper")
        self.bad(message([1, 2]), "not a JSON object")
        self.bad(message({"env": {}}), "exactly the keys")
        self.bad(message({"env": {}, "cwd": "/", "argv": []}), "exactly the keys")
        self.bad(message({"env": [], "cwd": "/"}), "env is not an object")
        self.bad(message({"env": {}, "cwd": "relative"}), "absolute")
        self.bad(message({"env": {"RANK": 1}, "cwd": "/"}), "RANK is not a string")
        self.bad(message({"env": {"A=B": "x"}, "cwd": "/"}), "'='")
        self.bad(message({"env": {"": "x"}, "cwd": "/"}), "empty variable name")
        self.bad(message({"env": {"A": "x\0y"}, "cwd": "/"}), "NUL")


# ---- the bootstrap as a process, the test playing the agent ---------------------------------------

STUB_TORCH = """
import os, warnings
warnings.warn("the stub torch warns at import", FutureWarning)
# Written when the standby preloads torch, before any assignment: proves the preload ran first.
with open(os.path.join(os.environ["STUB_OUT"], "torch_imported_by_%d" % os.getpid()), "w") as f:
    f.write("1")
"""

PROGRAM = r"""
import json, os, sys
record = {"argv": sys.argv, "file": globals().get("__file__"), "path0": sys.path[0], "cwd": os.getcwd(),
          "name": __name__, "env": dict(os.environ), "torch": "torch" in sys.modules,
          "preloaded": "json" in sys.modules}
# The user's code ran: the marker the hostile-assignment tests look for.
with open(os.path.join(os.environ.get("MARK_DIR", "/nonexistent"), "ran"), "w") as f:
    f.write("1")
print(json.dumps(record))
sys.stderr.write("to stderr\n")
how = os.environ.get("HOW", "")
if how == "exit3":
    sys.exit(3)
if how == "raise":
    raise ValueError("raised by the script")
if how == "sigterm":
    import signal
    os.kill(os.getpid(), signal.SIGTERM)
"""


class EnvRendezvousProbe(unittest.TestCase):
    """The env:// rendezvous of a standby-made worker waits for rank 0's store to listen before
    torch connects (ddplaunch_standby._probe_before_env_rendezvous); torch's handler is faked."""

    def setUp(self):
        self.calls = []
        probe = self

        def torch_env_handler(url, **kwargs):
            probe.calls.append((url, kwargs, probe.listen_called.is_set()))
            yield ("store", 1, 2)
            raise RuntimeError("no re-rendezvous")

        self.fake = types.ModuleType("torch.distributed.rendezvous")
        self.fake._rendezvous_handlers = {"env": torch_env_handler}
        saved = sys.modules.get("torch.distributed.rendezvous")
        sys.modules["torch.distributed.rendezvous"] = self.fake
        self.addCleanup(lambda: sys.modules.__setitem__("torch.distributed.rendezvous", saved) if saved
                        else sys.modules.pop("torch.distributed.rendezvous", None))
        self.accepted = []  # bytes each connection to the master port carried, in order
        self.port = free_port()
        saved_env = dict(os.environ)
        self.addCleanup(lambda: (os.environ.clear(), os.environ.update(saved_env)))
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(self.port), RANK="1", WORLD_SIZE="2")
        os.environ.pop("TORCHELASTIC_USE_AGENT_STORE", None)

    def listen(self, delay=0.0):
        """Rank 0's store, listening `delay` seconds from now: records what each connection
        carried, in order, until one carries bytes (the test's own, which ends it)."""
        self.listen_called = threading.Event()

        def serve():
            threading.Event().wait(delay)
            with socket.socket() as srv:
                srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                srv.bind(("127.0.0.1", self.port))
                self.listen_called.set()  # before listen(): nothing can connect earlier
                srv.listen(8)
                srv.settimeout(60)
                while True:
                    conn, _ = srv.accept()
                    with conn:
                        conn.settimeout(30)
                        data = b""
                        while True:
                            chunk = conn.recv(64)
                            if not chunk:
                                break
                            data += chunk
                    self.accepted.append(data)
                    if data:
                        return
        t = threading.Thread(target=serve, daemon=True)
        t.start()
        return t

    def end_store(self, server):
        """Connects with bytes (ends the store) and returns what every connection carried."""
        wait_for(self.listen_called.is_set, 30, "the store to listen")
        with socket.create_connection(("127.0.0.1", self.port), timeout=30) as c:
            c.sendall(b"end")
        server.join(30)
        return self.accepted

    def rendezvous(self, url="env://"):
        ddplaunch_standby._probe_before_env_rendezvous()
        handler = self.fake._rendezvous_handlers["env"]
        return next(handler(url, timeout=datetime.timedelta(seconds=60)))

    def test_a_rank_other_than_0_connects_only_once_the_store_listens(self):
        server = self.listen(delay=0.1)
        self.assertEqual(self.rendezvous(), ("store", 1, 2))
        # torch's handler ran only once the store listened, after one probe that carried nothing.
        (url, kwargs, listened_before_torch), = self.calls
        self.assertEqual(url, "env://")
        self.assertEqual(kwargs["timeout"], datetime.timedelta(seconds=60))
        self.assertTrue(listened_before_torch)
        self.assertEqual(self.end_store(server), [b"", b"end"])

    def test_rank_0_and_the_agent_store_are_not_probed(self):
        for env, url in (({"RANK": "0"}, "env://"), ({"RANK": "1"}, "env://?rank=0&world_size=2"),
                         ({"TORCHELASTIC_USE_AGENT_STORE": "True"}, "env://")):
            with self.subTest(env=env, url=url):
                os.environ.update(env)
                self.calls.clear()
                self.accepted.clear()
                server = self.listen()
                self.assertEqual(self.rendezvous(url), ("store", 1, 2))
                self.assertEqual(len(self.calls), 1)
                self.assertEqual(self.end_store(server), [b"end"], "a probe connected")
                os.environ.pop("TORCHELASTIC_USE_AGENT_STORE", None)
                os.environ["RANK"] = "1"

    def test_without_torchs_handler_table_nothing_is_wrapped(self):
        del self.fake._rendezvous_handlers
        ddplaunch_standby._probe_before_env_rendezvous()  # no error, nothing to wrap
        self.assertFalse(hasattr(self.fake, "_rendezvous_handlers"))

    def test_the_probe_gives_up_at_its_deadline(self):
        self.assertFalse(ddplaunch_standby._master_store_listening("127.0.0.1", self.port, 0))


class Bootstrap(LaunchTestCase):
    """The standby bootstrap, run directly: the test is its agent."""

    def setUp(self):
        super().setUp()
        self.stub = os.path.join(self.tmp, "stub")
        os.mkdir(self.stub)
        with open(os.path.join(self.stub, "torch.py"), "w") as f:
            f.write(STUB_TORCH)
        self.prog_dir = os.path.join(self.tmp, "prog")
        os.mkdir(self.prog_dir)
        with open(os.path.join(self.prog_dir, "program.py"), "w") as f:
            f.write(PROGRAM)
        os.mkdir(os.path.join(self.prog_dir, "pkg"))
        with open(os.path.join(self.prog_dir, "pkg", "__init__.py"), "w") as f:
            f.write("")
        with open(os.path.join(self.prog_dir, "pkg", "mod.py"), "w") as f:
            f.write(PROGRAM)

    def start(self, mode="script", program="program.py", args=("a", "b c"), fd_value=None, preload=""):
        """Starts the bootstrap with one end of a socket pair; returns (process, our end)."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PYTHONPATH": self.stub + ":" + PYTHON_DIR,
               "STUB_OUT": self.out, "DDPLAUNCH_STANDBY_FD": str(theirs.fileno()) if fd_value is None else fd_value,
               "RANK_OF_NO_ROUND": "x"}
        proc = subprocess.Popen([PYTHON, "-u", BOOTSTRAP, mode, preload, program] + list(args), env=env,
                                cwd=self.prog_dir, pass_fds=(theirs.fileno(),), stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE)
        theirs.close()
        self.addCleanup(lambda: proc.poll() is None and proc.kill())
        self.addCleanup(ours.close)
        return proc, ours

    def wait_preloaded(self, proc):
        wait_for(lambda: os.path.exists(os.path.join(self.out, "torch_imported_by_%d" % proc.pid)) or
                 proc.poll() is not None, 60, "the standby to preload torch")

    def assigned_env(self, **extra):
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "RANK": "5", "MARK_DIR": self.out,
               "PYTHONPATH": self.stub}
        env.update(extra)
        return env

    def assign(self, ours, env, cwd=None, fds=None):
        """Sends an assignment with a fresh pipe for stdout and one for stderr; returns their read ends."""
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        data = message({"env": env, "cwd": cwd or self.prog_dir})
        socket.send_fds(ours, [data], [out_w, err_w] if fds is None else fds)
        os.close(out_w)
        os.close(err_w)
        ours.close()
        out, err = os.fdopen(out_r), os.fdopen(err_r)
        self.addCleanup(out.close)
        self.addCleanup(err.close)
        return out, err

    def finish(self, proc, timeout=60):
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
            self.fail("the standby did not end within %d s: %s %s" % (timeout, out, err))
        return proc.returncode, out.decode(), err.decode()

    def assert_not_run(self, proc, words, code=1):
        returncode, out, err = self.finish(proc)
        self.assertEqual(returncode, code, err)
        self.assertIn(words, err)
        self.assertNotIn("Traceback", err)
        self.assertFalse(os.path.exists(os.path.join(self.out, "ran")), "the program ran")

    def test_the_standby_says_it_is_ready_once_preloaded_and_before_any_assignment(self):
        proc, ours = self.start(preload="json")
        ours.settimeout(60)
        data = b""
        while len(data) < 12:
            chunk = ours.recv(64)
            self.assertTrue(chunk, "the standby closed its socket without a word")
            data += chunk
        magic, version, length = struct.unpack("<4sII", data[:12])
        while len(data) < 12 + length:
            data += ours.recv(64)
        self.assertEqual((magic, version), (b"DDPW", 1))
        self.assertEqual(json.loads(data[12:12 + length]), {"type": "standby_ready"})
        # Said after the preload (torch's stub left its mark), and nothing of the program ran.
        self.assertTrue(os.path.exists(os.path.join(self.out, "torch_imported_by_%d" % proc.pid)))
        self.assertFalse(os.path.exists(os.path.join(self.out, "ran")))
        out, err = self.assign(ours, self.assigned_env())
        returncode, _, stderr = self.finish(proc)
        self.assertEqual(returncode, 0, stderr + err.read())

    def test_a_good_assignment_runs_the_script_as_python_would(self):
        proc, ours = self.start()
        self.wait_preloaded(proc)
        # Waiting: preloaded, and nothing of the program's ran.
        self.assertIsNone(proc.poll())
        self.assertFalse(os.path.exists(os.path.join(self.out, "ran")))
        out, err = self.assign(ours, self.assigned_env())
        returncode, _, _ = self.finish(proc)
        self.assertEqual(returncode, 0)
        record = json.loads(out.read())
        # The import's warning reaches the worker's stderr, as it would in a cold worker, then the program's.
        text = err.read()
        self.assertIn("FutureWarning: the stub torch warns at import", text)
        self.assertTrue(text.endswith("to stderr\n"), text)
        # What `python -u program.py a "b c"` run in prog_dir gives.
        self.assertEqual(record["argv"], ["program.py", "a", "b c"])
        self.assertEqual(record["file"], os.path.join(self.prog_dir, "program.py"))
        self.assertEqual(record["path0"], os.path.realpath(self.prog_dir))
        self.assertEqual(record["name"], "__main__")
        self.assertEqual(record["cwd"], self.prog_dir)
        self.assertTrue(record["torch"], "torch was not preloaded")
        # The environment was replaced wholesale: the standby's own variables are gone.
        self.assertEqual(record["env"].get("RANK"), "5")
        self.assertNotIn("DDPLAUNCH_STANDBY_FD", record["env"])
        self.assertNotIn("RANK_OF_NO_ROUND", record["env"])

    def test_the_working_directory_comes_from_the_assignment(self):
        proc, ours = self.start(program=os.path.join(self.prog_dir, "program.py"))
        out, _ = self.assign(ours, self.assigned_env(), cwd=self.out)
        self.assertEqual(self.finish(proc)[0], 0)
        self.assertEqual(json.loads(out.read())["cwd"], self.out)

    def test_exit_codes_exceptions_and_signals_are_those_of_the_script(self):
        for how, expected in (("exit3", 3), ("raise", 1), ("sigterm", -signal.SIGTERM)):
            with self.subTest(how=how):
                proc, ours = self.start()
                _, err = self.assign(ours, self.assigned_env(HOW=how))
                returncode, _, _ = self.finish(proc)
                self.assertEqual(returncode, expected)
                text = err.read()
                if how == "raise":
                    self.assertIn("Traceback (most recent call last)", text)
                    self.assertIn("ValueError: raised by the script", text)
                    self.assertIn('program.py", line', text)
                    self.assertNotIn("ddplaunch_standby.py", text, "the bootstrap's frames are not the user's")

    def test_a_module_runs_as_python_dash_m_would(self):
        proc, ours = self.start(mode="module", program="pkg.mod", args=("x",))
        out, _ = self.assign(ours, self.assigned_env())
        self.assertEqual(self.finish(proc)[0], 0)
        record = json.loads(out.read())
        self.assertEqual(record["argv"], [os.path.join(self.prog_dir, "pkg", "mod.py"), "x"])
        self.assertEqual(record["name"], "__main__")
        self.assertEqual(record["path0"], self.prog_dir)

    def test_run_path_runs_as_ddplaunch_run_path_would(self):
        path = os.path.join(self.prog_dir, "program.py")
        proc, ours = self.start(mode="run_path", program=path, args=("y",))
        out, _ = self.assign(ours, self.assigned_env())
        self.assertEqual(self.finish(proc)[0], 0)
        record = json.loads(out.read())
        self.assertEqual(record["argv"], [path, "y"])
        self.assertEqual(record["path0"], "")
        self.assertEqual(record["name"], "__main__")

    def test_preload_imports_the_named_modules_and_says_which_failed(self):
        proc, ours = self.start(preload="json,no_such_module_here")
        out, err = self.assign(ours, self.assigned_env())
        self.assertEqual(self.finish(proc)[0], 0)
        self.assertTrue(json.loads(out.read())["preloaded"])
        self.assertIn("--preload: cannot import no_such_module_here", err.read())

    def test_a_socket_closed_before_an_assignment_ends_the_standby_without_running_anything(self):
        proc, ours = self.start()
        self.wait_preloaded(proc)
        ours.close()
        self.assert_not_run(proc, "closed", code=0)

    def test_hostile_or_short_assignments_end_the_standby_without_running_anything(self):
        cases = [
            ("short header", lambda s: socket.send_fds(s, [b"DDPS\x01"], [1, 2])),
            ("bad magic", lambda s: socket.send_fds(s, [message({"env": {}, "cwd": "/"}, magic=b"XXXX")], [1, 2])),
            ("payload ends after 2 of 100", lambda s: socket.send_fds(s, [message(raw_payload=b"{}", length=100)], [1, 2])),
            ("over the limit", lambda s: socket.send_fds(s, [message(raw_payload=b"{}", length=1 << 30)], [1, 2])),
            ("not a JSON object", lambda s: socket.send_fds(s, [message([1])], [1, 2])),
            ("nested deeper", lambda s: socket.send_fds(s, [message(raw_payload=b"[" * 5000 + b"]" * 5000)], [1, 2])),
            ("0 descriptors came", lambda s: s.sendall(message({"env": {"MARK_DIR": self.out}, "cwd": "/"}))),
            ("1 descriptors came", lambda s: socket.send_fds(s, [message({"env": {"MARK_DIR": self.out}, "cwd": "/"})], [1])),
        ]
        for words, send in cases:
            with self.subTest(words):
                proc, ours = self.start()
                send(ours)
                ours.close()
                self.assert_not_run(proc, words)

    def test_a_descriptor_that_is_not_a_socket_ends_the_standby_without_running_anything(self):
        for value, words in (("abc", "is not a descriptor number"), ("1", "is not a descriptor number"),
                             ("987", "is not a socket")):
            with self.subTest(value):
                proc, _ = self.start(fd_value=value)
                self.assert_not_run(proc, words)


# ---- ddplaunch --standby: what it accepts ----------------------------------------------------------


class StandbyFlags(LaunchTestCase):
    def test_a_program_not_run_by_python_starts_cold_with_a_line_under_standby_on(self):
        result = self.launch(["--standby=on", "--nproc_per_node=2", "--no_python", "/bin/true"])
        self.assertEqual(result.returncode, 0, result.describe())
        self.assertIn("--standby=on: PROGRAM is neither run by Python nor a program of the worker SDK that waits "
                      "for its assignment; its workers start cold", result.stderr)
        # auto says nothing: cold is what it means for such a program.
        result = self.launch(["--standby=auto", "--nproc_per_node=1", "--no_python", "/bin/true"])
        self.assertEqual(result.returncode, 0, result.describe())
        self.assertNotIn("standby", result.stderr)

    def test_bad_values_are_refused_with_exit_code_2(self):
        for args, words in ((["--standby=sometimes"], "accepted: off, on, auto"),
                            (["--standby=on", "--preload=numpy,bad-name"], "'bad-name' is not a Python module name")):
            with self.subTest(args=args):
                result = self.launch(args + ["--no_python", "/bin/true"])
                self.assertEqual(result.returncode, 2, result.describe())
                self.assertIn(words, result.stderr)

    def test_preload_without_a_standby_is_said(self):
        result = self.launch(["--preload=json", "--no_python", "/bin/true"])
        self.assertEqual(result.returncode, 0, result.describe())
        self.assertIn("--preload has no effect without a Python standby", result.stderr)


# ---- ddplaunch --standby=on with real workers ------------------------------------------------------

WORKER = r"""
import json, os, sys, time
gen, rank = os.environ["DDPLAUNCH_GENERATION"], os.environ["RANK"]
out = os.environ["OUT_DIR"]
# Every start of user code leaves its pid here first.
with open(os.path.join(out, "ran_%d" % os.getpid()), "w") as f:
    f.write(gen)
record = {"pid": os.getpid(), "argv": sys.argv, "file": __file__, "path0": sys.path[0], "cwd": os.getcwd(),
          "name": __name__, "env": dict(os.environ), "torch": "torch" in sys.modules,
          "preloaded": "fractions" in sys.modules,
          "warm": [m for m in ("torch.distributed", "torch.nn.parallel", "torch._dynamo") if m in sys.modules]}
with open(os.path.join(out, "tmp_%s_%s" % (gen, rank)), "w") as f:
    json.dump(record, f)
os.rename(os.path.join(out, "tmp_%s_%s" % (gen, rank)), os.path.join(out, "run_%s_%s.json" % (gen, rank)))
if os.environ.get("EXIT_AT_ONCE"):
    sys.exit(0)
# One progress step (the round is up: the agent starts the next standbys), at once or once the
# file STEP_WHEN names exists; none with NO_STEP.
stepped = bool(os.environ.get("NO_STEP"))
while True:
    if not stepped and os.path.exists(os.path.join(out, os.environ.get("STEP_WHEN", ""))):
        import ddplaunch
        ddplaunch.step()
        stepped = True
    if os.path.exists(os.path.join(out, "fail_" + gen)) and rank == "1":
        sys.exit(3)
    if os.path.exists(os.path.join(out, "finish")):
        sys.exit(0)
    time.sleep(0.05)
"""


def warm_modules_of_torch():
    """The standby's warm modules that the workers' torch has (asked of PYTHON, their interpreter)."""
    return json.loads(subprocess.run(
        [PYTHON, "-c", "import importlib.util, json, sys; print(json.dumps([m for m in sys.argv[1:] "
         "if importlib.util.find_spec(m) is not None]))"] + ddplaunch_standby.WARM_MODULES,
        capture_output=True, text=True, check=True).stdout)


LOAD_DEADLINE = 240  # seconds for a standby to import torch on a loaded 2-core machine


class StandbyWorkers(LaunchTestCase):
    def start_job(self, nproc=2, extra=(), env=None, standby=("--standby=on",)):
        self.worker = self.script("worker.py", WORKER)
        proc = self.spawn_launch(list(standby) + ["--nproc_per_node=%d" % nproc, "--max_restarts=3",
                                  "--python", PYTHON] + list(extra) + [self.worker, "a1", "a two"],
                                 env=dict(env or {}, OUT_DIR=self.out))
        return proc

    def standby_pids(self, proc, workers):
        worker_pids = {w["pid"] for w in workers}
        return [p for p in children(proc.pid) if p not in worker_pids and
                any(a.endswith("ddplaunch_standby.py") for a in cmdline(p))]

    def run_record(self, gen, rank):
        path = os.path.join(self.out, "run_%s_%s.json" % (gen, rank))
        return json.loads(read(path)) if os.path.exists(path) else None

    def wait_round(self, proc, gen, nproc=2):
        wait_for(lambda: all(self.run_record(gen, r) for r in range(nproc)) or proc.poll() is not None,
                 LOAD_DEADLINE, "the workers of generation %s" % gen)
        self.assertIsNone(proc.poll(), proc.describe())
        return [self.run_record(gen, r) for r in range(nproc)]

    def waiting_standbys(self, proc, workers, nproc=2):
        """The standbys of `proc` (children running the bootstrap that are not workers), once
        `nproc` of them have loaded torch; {local rank from none: pid} as a sorted pid list."""

        def loaded():
            pids = self.standby_pids(proc, workers)
            if len(pids) != nproc:
                return None
            for p in pids:
                if "libtorch_cpu" not in read("/proc/%d/maps" % p):
                    return None
            return sorted(pids)

        return wait_for(lambda: loaded() or proc.poll() is not None, LOAD_DEADLINE, "%d standbys with torch loaded" % nproc)

    def ran_pids(self):
        return {int(n[4:]) for n in os.listdir(self.out) if n.startswith("ran_")}

    def test_standbys_wait_clean_run_nothing_and_become_the_next_rounds_workers(self):
        proc = self.start_job(extra=["--preload=fractions"])
        gen1 = self.wait_round(proc, 1)
        standbys = self.waiting_standbys(proc, gen1)
        self.assertIsInstance(standbys, list, proc.describe())
        for pid in standbys:
            env = proc_environ(pid)
            self.assertIn("DDPLAUNCH_STANDBY_FD", env)
            held = [v for v in ROUND_VARIABLES if v in env]
            self.assertEqual(held, [], "standby %d holds the round's variables %s" % (pid, held))
        # Loaded and waiting, they ran nothing of the user's.
        self.assertEqual(self.ran_pids() & set(standbys), set())
        self.assertEqual(self.ran_pids(), {w["pid"] for w in gen1})

        open(os.path.join(self.out, "fail_1"), "w").close()  # rank 1 exits 3: a restart
        gen2 = self.wait_round(proc, 2)
        warm = warm_modules_of_torch()
        self.assertEqual(sorted(w["pid"] for w in gen2), standbys, "the standbys did not become the workers")
        for rank, w in enumerate(gen2):
            self.assertEqual(w["argv"], [self.worker, "a1", "a two"])
            self.assertEqual(w["file"], self.worker)
            self.assertEqual(w["path0"], os.path.dirname(os.path.realpath(self.worker)))
            self.assertEqual(w["name"], "__main__")
            self.assertEqual(w["cwd"], self.tmp)
            self.assertTrue(w["torch"], "torch was not preloaded")
            self.assertTrue(w["preloaded"], "--preload=fractions was not imported")
            # What torch 2.x imports lazily on the way to a first step (an optimizer imports
            # torch._dynamo) came with the standby too; torch 1.x has no _dynamo.
            self.assertEqual(w["warm"], warm)
            self.assertEqual(w["env"]["RANK"], str(rank))
            self.assertEqual(w["env"]["DDPLAUNCH_GENERATION"], "2")
            self.assertEqual(w["env"]["TORCHELASTIC_RESTART_COUNT"], "1")
            self.assertNotIn("DDPLAUNCH_STANDBY_FD", w["env"])
            # The same variables as the last round's workers (values of the round aside).
            self.assertEqual(sorted(w["env"]), sorted(gen1[rank]["env"]))
        open(os.path.join(self.out, "finish"), "w").close()
        self.assertEqual(proc.wait(LOAD_DEADLINE), 0, proc.describe())

    def test_the_next_standbys_start_once_the_rounds_workers_report_a_step(self):
        # Started at once, their imports would compete with the new round's own start.
        proc = self.start_job(env={"STEP_WHEN": "step", "DDPLAUNCH_STANDBY_DELAY_MAX": "600"})
        gen1 = self.wait_round(proc, 1)
        # Two seconds with no step reported (the agent looks every 0.1 s): still no standby. (A check of
        # absence: on a slow machine it may pass without proving much, never fail wrongly.)
        time.sleep(2)
        self.assertEqual(self.standby_pids(proc, gen1), [], "standbys started before any step")
        open(os.path.join(self.out, "step"), "w").close()
        self.assertIsInstance(self.waiting_standbys(proc, gen1), list, proc.describe())
        open(os.path.join(self.out, "finish"), "w").close()
        self.assertEqual(proc.wait(LOAD_DEADLINE), 0, proc.describe())

    def test_by_default_the_first_round_starts_cold_and_its_standbys_once_it_has_stepped(self):
        # No --standby: 'auto'. The first round does not wait for standbys to load; the next
        # round's workers are the standbys started after the first step.
        proc = self.start_job(standby=(), env={"STEP_WHEN": "step", "DDPLAUNCH_STANDBY_DELAY_MAX": "600"})
        gen1 = self.wait_round(proc, 1)
        for w in gen1:
            self.assertFalse(w["torch"], "a worker of the first round came from a standby: %s" % w["pid"])
            self.assertNotIn("DDPLAUNCH_STANDBY_FD", proc_environ(w["pid"]))
        self.assertEqual(self.standby_pids(proc, gen1), [], "standbys started before any step")
        open(os.path.join(self.out, "step"), "w").close()
        standbys = self.waiting_standbys(proc, gen1)
        self.assertIsInstance(standbys, list, proc.describe())
        open(os.path.join(self.out, "fail_1"), "w").close()  # rank 1 exits 3: a restart
        gen2 = self.wait_round(proc, 2)
        self.assertEqual(sorted(w["pid"] for w in gen2), standbys, "the standbys did not become the workers")
        self.assertTrue(all(w["torch"] for w in gen2), gen2)
        open(os.path.join(self.out, "finish"), "w").close()
        self.assertEqual(proc.wait(LOAD_DEADLINE), 0, proc.describe())

    def test_by_default_a_job_that_ends_before_its_first_step_starts_no_standby(self):
        proc = self.start_job(standby=(), extra=["--event_log=" + os.path.join(self.out, "events.jsonl")],
                              env={"EXIT_AT_ONCE": "1"})
        self.assertEqual(proc.wait(LOAD_DEADLINE), 0, proc.describe())
        # Every process that ran user code is a worker of the first round, started cold.
        self.assertEqual(len(self.ran_pids()), 2, proc.describe())
        with open(os.path.join(self.out, "events.jsonl")) as f:
            started = [e for e in map(json.loads, f) if e["type"] == "worker_started"]
        self.assertEqual([e["standby"] for e in started], [False, False], started)

    def test_workers_that_report_no_step_get_their_next_standbys_after_standby_delay_max(self):
        proc = self.start_job(env={"NO_STEP": "1", "DDPLAUNCH_STANDBY_DELAY_MAX": "2"})
        gen1 = self.wait_round(proc, 1)
        self.assertIsInstance(self.waiting_standbys(proc, gen1), list, proc.describe())
        open(os.path.join(self.out, "finish"), "w").close()
        self.assertEqual(proc.wait(LOAD_DEADLINE), 0, proc.describe())

    def test_an_assigned_worker_gets_what_a_cold_worker_gets(self):
        self.script("worker.py", WORKER)
        records = {}
        for mode in ("off", "on"):
            for name in os.listdir(self.out):
                os.remove(os.path.join(self.out, name))
            result = self.launch(["--standby=" + mode, "--nproc_per_node=1", "--python", PYTHON, "worker.py", "z"],
                                 timeout=LOAD_DEADLINE, env={"OUT_DIR": self.out, "EXIT_AT_ONCE": "1"})
            self.assertEqual(result.returncode, 0, result.describe())
            records[mode] = self.run_record(1, 0)
        cold, warm = records["off"], records["on"]
        for key in ("argv", "file", "path0", "name", "cwd"):
            self.assertEqual(warm[key], cold[key], key)
        # Values that differ between two runs of a job: paths with a random part, the port.
        per_run = {"MASTER_PORT", "TORCHELASTIC_ERROR_FILE", "TORCHELASTIC_RUN_ID", "DDPLAUNCH_PROGRESS_FILE",
                   "DDPLAUNCH_SUPERVISOR"}
        self.assertEqual(sorted(warm["env"]), sorted(cold["env"]))
        self.assertEqual({k: v for k, v in warm["env"].items() if k not in per_run},
                         {k: v for k, v in cold["env"].items() if k not in per_run})
        self.assertFalse(cold["torch"])
        self.assertTrue(warm["torch"])

    def test_a_standby_worker_writes_to_its_log_files_and_the_prefixed_console(self):
        script = self.script("talk.py", "import sys\nprint('hello out')\nsys.stderr.write('hello err\\n')\n"
                                        "sys.exit(int(__import__('os').environ['RANK']) + 5)\n")
        logs = os.path.join(self.tmp, "logs")
        result = self.launch(["--standby=on", "--nproc_per_node=1", "--tee=3", "--log_dir", logs, "--rdzv_id=talk",
                              "--python", PYTHON, script], timeout=LOAD_DEADLINE)
        self.assertEqual(result.returncode, 1, result.describe())  # exit code 5: the job failed
        self.assertIn("[default0]:hello out", result.stdout)
        self.assertIn("[default0]:hello err", result.stderr)
        rank_dir = os.path.join(logs, "talk", "attempt_0", "0")
        self.assertIn("hello out", read(os.path.join(rank_dir, "stdout.log")))
        self.assertIn("hello err", read(os.path.join(rank_dir, "stderr.log")))
        # The failure summary names the worker's exit code, as for a cold worker.
        self.assertIn("exitcode  : 5", result.stderr)

    def test_a_sigkilled_agent_leaves_no_standby_behind(self):
        for no_cgroup in ("0", "1"):
            with self.subTest(DDPLAUNCH_NO_CGROUP=no_cgroup):
                for name in os.listdir(self.out):
                    os.remove(os.path.join(self.out, name))
                os.environ["DDPLAUNCH_NO_CGROUP"] = no_cgroup
                try:
                    proc = self.start_job()
                finally:
                    del os.environ["DDPLAUNCH_NO_CGROUP"]
                gen1 = self.wait_round(proc, 1)
                standbys = self.waiting_standbys(proc, gen1)
                self.assertIsInstance(standbys, list, proc.describe())
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait(timeout=30)
                everything = standbys + [w["pid"] for w in gen1]
                wait_for(lambda: all(gone(p) for p in everything), 30, "the standbys and workers to die")

    def test_a_standby_that_died_is_replaced_by_a_cold_start(self):
        proc = self.start_job()
        gen1 = self.wait_round(proc, 1)
        standbys = self.waiting_standbys(proc, gen1)
        self.assertIsInstance(standbys, list, proc.describe())
        victim = standbys[0]
        os.kill(victim, signal.SIGKILL)
        wait_for(lambda: "(pid %d) was killed by SIGKILL before it was needed" % victim in proc.output()
                 or proc.poll() is not None, 60, "the agent to see its standby die")
        open(os.path.join(self.out, "fail_1"), "w").close()
        gen2 = self.wait_round(proc, 2)
        pids2 = {w["pid"] for w in gen2}
        self.assertNotIn(victim, pids2)
        self.assertIn(standbys[1], pids2, "the surviving standby was not used")
        cold = (pids2 - {standbys[1]}).pop()
        self.assertNotIn(cold, standbys)
        self.assertFalse([a for a in cmdline(cold) if a.endswith("ddplaunch_standby.py")], "not a cold start")
        open(os.path.join(self.out, "finish"), "w").close()
        self.assertEqual(proc.wait(LOAD_DEADLINE), 0, proc.describe())
        self.assertNotIn("job failed", proc.output())


# ---- standbys of worker SDK programs (`train`) -------------------------------------------------------

TRAIN = os.path.join(BUILD_DIR, "bin", "train")
# A job of `train` small enough to finish in seconds once its process group exists.
TRAIN_ARGS = ["--epochs", "1", "--samples", "512", "--batch-size", "16", "--features", "8", "--hidden", "16",
              "--log-every", "4", "--checkpoint-every", "2"]


@unittest.skipUnless(os.path.exists(TRAIN), "the worker SDK's `train` is not built (DDPLAUNCH_BUILD_WORKER_SDK=OFF)")
class SdkStandby(LaunchTestCase):
    """An SDK program started as a standby loads, runs its own start-up, and waits inside the SDK
    (WorkerEnv::from_environment) for its assignment; the test plays the agent on a real socket
    pair, then ddplaunch does it for real."""

    def start_train(self, ours_fd=None, fd_value=None, args=()):
        ours, theirs = socket.socketpair()
        self.addCleanup(ours.close)
        before = os.pipe()  # the standby's own stdout: nothing may reach it
        env = {k: v for k, v in os.environ.items() if k not in ROUND_VARIABLES}
        env["DDPLAUNCH_STANDBY_FD"] = str(theirs.fileno()) if fd_value is None else fd_value
        proc = subprocess.Popen([TRAIN] + TRAIN_ARGS + list(args), env=env, cwd=self.out, stdout=before[1],
                                stderr=subprocess.PIPE, pass_fds=[theirs.fileno()])
        theirs.close()
        os.close(before[1])
        self.addCleanup(lambda: proc.poll() is None and proc.kill())
        return proc, ours, before[0]

    def finish(self, proc, before_fd, timeout=LOAD_DEADLINE):
        _, err = proc.communicate(timeout=timeout)
        with os.fdopen(before_fd, "rb") as f:
            early = f.read()
        return proc.returncode, err.decode(errors="replace"), early

    def test_an_assigned_sdk_program_runs_with_the_assignments_environment_directory_and_streams(self):
        proc, ours, before = self.start_train(args=["--checkpoint-dir", "ckpt"])
        work = os.path.join(self.tmp, "assigned-cwd")
        os.mkdir(work)
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        env = {"PATH": os.environ["PATH"], "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
               "TORCHELASTIC_RESTART_COUNT": "2"}
        data = message({"env": env, "cwd": work})
        socket.send_fds(ours, [data], [out_w, err_w])
        ours.close()
        os.close(out_w)
        os.close(err_w)
        code, standby_err, early = self.finish(proc, before)
        with os.fdopen(out_r, "rb") as f:
            out = f.read().decode(errors="replace")
        with os.fdopen(err_r, "rb") as f:
            err = f.read().decode(errors="replace")
        self.assertEqual(code, 0, out + err + standby_err)
        self.assertEqual(early, b"", "the standby wrote to its own stdout")
        # The header names the assigned environment (restart 2), on the assigned stdout.
        self.assertIn("[train] rank 0/1", out)
        self.assertIn("restart 2", out)
        # The relative --checkpoint-dir was made in the assigned working directory.
        self.assertTrue(os.listdir(os.path.join(work, "ckpt")), out + err)
        self.assertFalse(os.path.exists(os.path.join(self.out, "ckpt")))

    def test_a_closed_socket_ends_the_standby_with_0_and_a_bad_assignment_with_1_running_nothing(self):
        cases = [
            ("closed", None, 0, ""),
            ("garbage", b"GET / HTTP/1.0\r\n\r\n", 1, "bad assignment: bad magic"),
            ("deep", message(raw_payload=b"[" * 5000 + b"]" * 5000), 1, "nested deeper"),
            ("over the limit", message(raw_payload=b"{}", length=(4 << 20) + 1), 1, "payload length"),
            ("short", message({"env": {}, "cwd": "/"})[:-3], 1, "socket closed after"),
            ("no descriptors", message({"env": {}, "cwd": "/"}), 1, "0 descriptors"),
            ("relative cwd", message({"env": {}, "cwd": "x"}), 1, "cwd is not an absolute path"),
        ]
        for name, data, want_code, words in cases:
            with self.subTest(name):
                proc, ours, before = self.start_train(args=["--checkpoint-dir", "ckpt-" + name.replace(" ", "-")])
                if name == "no descriptors":
                    ours.sendall(data)
                elif data is not None:
                    socket.send_fds(ours, [data], [1, 2])
                ours.close()
                code, err, early = self.finish(proc, before)
                self.assertEqual(code, want_code, err)
                self.assertIn(words, err)
                self.assertEqual(early, b"")
                # Nothing of the round ran: no checkpoint directory, no training line.
                self.assertFalse(os.path.exists(os.path.join(self.out, "ckpt-" + name.replace(" ", "-"))), err)
                self.assertNotIn("[train]", err)

    def test_a_descriptor_that_is_not_a_socket_ends_the_standby(self):
        for value, words in (("99", "is not an open socket"), ("x1", "is not a descriptor number")):
            with self.subTest(value):
                proc, ours, before = self.start_train(fd_value=value)
                code, err, _ = self.finish(proc, before)
                self.assertEqual(code, 1, err)
                self.assertIn("DDPLAUNCH_STANDBY_FD", err)
                self.assertIn(words, err)

    def test_under_standby_on_the_next_rounds_workers_are_the_train_standbys(self):
        gen2, standbys, _, out = self.kill_rank_1_once_standbys_loaded(in_memory=False)
        self.assertEqual(sorted(e["pid"] for e in gen2), standbys, "the standbys did not become the workers")
        self.assertTrue(all(e["standby"] for e in gen2), gen2)
        self.assertIn("resumed from", out)

    def test_with_in_memory_restart_the_survivor_parks_and_the_standby_replaces_only_the_killed_rank(self):
        gen2, standbys, gen1, out = self.kill_rank_1_once_standbys_loaded(in_memory=True)
        by_rank = {e["local_rank"]: e for e in gen2}
        first = {e["local_rank"]: e["pid"] for e in gen1}
        self.assertEqual(by_rank[0]["pid"], first[0], "rank 0 kept its process: %s" % gen2)
        self.assertTrue(by_rank[0].get("in_memory"), gen2)
        self.assertIn(by_rank[1]["pid"], standbys, "a standby became rank 1: %s" % gen2)
        self.assertTrue(by_rank[1]["standby"], gen2)
        self.assertIn("rank 1: received the state rank 0 sent", out)

    def kill_rank_1_once_standbys_loaded(self, in_memory):
        """Runs `train` under --standby=on, SIGKILLs rank 1 once both standbys have loaded
        libtorch, waits for the job's exit 0; returns (the next round's worker_started events,
        the standbys' pids, the first round's events, ddplaunch's output)."""
        events = os.path.join(self.tmp, "events.jsonl")
        ckpt = os.path.join(self.tmp, "ckpt")
        # Rank 1 blocks before step 6 on the first attempt, so the round lasts until the test
        # kills it, once both standbys have loaded libtorch.
        proc = self.spawn_launch(["--standby=on", "--in_memory_restart=" + ("on" if in_memory else "off"),
                                  "--nproc_per_node=2", "--max_restarts=1", "--event_log=" + events,
                                  TRAIN] + TRAIN_ARGS + ["--checkpoint-dir", ckpt, "--hang-at-step", "6",
                                                          "--hang-rank", "1"])

        def started(generation):
            if not os.path.exists(events):
                return []
            with open(events) as f:
                return [e for e in map(json.loads, f) if e["type"] == "worker_started" and e["generation"] == generation]

        gen1 = wait_for(lambda: (len(started(1)) == 2 and started(1)) or proc.poll() is not None, LOAD_DEADLINE,
                        "the first round's workers")
        self.assertIsInstance(gen1, list, proc.describe())
        workers = {e["pid"] for e in gen1}

        def loaded():
            pids = [p for p in children(proc.pid) if p not in workers and cmdline(p)[:1] == [TRAIN]]
            if len(pids) != 2 or any("libtorch_cpu" not in read("/proc/%d/maps" % p) for p in pids):
                return None
            return sorted(pids)

        standbys = wait_for(lambda: loaded() or proc.poll() is not None, LOAD_DEADLINE, "2 train standbys, loaded")
        self.assertIsInstance(standbys, list, proc.describe())
        for pid in standbys:
            env = proc_environ(pid)
            self.assertIn("DDPLAUNCH_STANDBY_FD", env)
            self.assertEqual([v for v in ROUND_VARIABLES if v in env], [])
        wait_for(lambda: proc.poll() is not None or (os.path.isdir(ckpt) and any(n.startswith("ckpt-") for n in os.listdir(ckpt))),
                 LOAD_DEADLINE, "a checkpoint of the first round")
        self.assertIsNone(proc.poll(), proc.describe())
        os.kill(next(e["pid"] for e in gen1 if e["local_rank"] == 1), signal.SIGKILL)
        self.assertEqual(proc.wait(LOAD_DEADLINE), 0, proc.describe())
        return started(2), standbys, gen1, proc.output()


# ---- an agent that starts joins once its standbys are ready -----------------------------------------

# A --preload module that blocks its standby's import until the test lets it go.
SLOW_MODULE = r"""
import os, time
out = os.environ["OUT_DIR"]
with open(os.path.join(out, "importing_%d" % os.getpid()), "w") as f:
    f.write("1")
deadline = time.monotonic() + 120
while not os.path.exists(os.path.join(out, "go")) and time.monotonic() < deadline:
    time.sleep(0.02)
"""


# The same, but it first writes garbage where the standby_ready frame belongs (user code runs in
# a standby's preload: the agent must take anything on that socket).
GARBAGE_MODULE = "import os\nos.write(int(os.environ['DDPLAUNCH_STANDBY_FD']), b'GARBAGE!' * 4)\n" + SLOW_MODULE


class JoinWhenReady(LaunchTestCase):
    """--standby: the agent joins its job only once its standbys have loaded (docs/agent.md,
    "Standby workers"), so a node coming back into a running job does not hold the others up
    while its workers load; at most DDPLAUNCH_STANDBY_READY_TIMEOUT seconds."""

    def start_job(self, env=None, module=SLOW_MODULE):
        port = self.start_rendezvous_daemon()
        self.script("slowmod.py", module)
        worker = self.script("worker.py", WORKER)
        full_env = {"OUT_DIR": self.out, "EXIT_AT_ONCE": "1",
                    "PYTHONPATH": self.tmp + os.pathsep + os.environ.get("PYTHONPATH", "")}
        full_env.update(env or {})
        return self.spawn_launch(["--standby=on", "--preload=slowmod", "--nnodes=1", "--nproc_per_node=1",
                                  "--rdzv_backend=c10d", "--rdzv_endpoint=127.0.0.1:%d" % port,
                                  "--rdzv_id=ready", "--python", PYTHON, worker], env=full_env)

    def importing(self):
        return [n for n in os.listdir(self.out) if n.startswith("importing_")]

    def joined(self):
        return "job ready: join" in self.daemon.output()

    def finish(self, proc):
        with open(os.path.join(self.out, "go"), "w") as f:
            f.write("1")
        self.assertEqual(proc.wait(LOAD_DEADLINE), 0, proc.describe())
        self.assertIsNotNone(self.run_record(), proc.describe())

    def run_record(self):
        path = os.path.join(self.out, "run_1_0.json")
        return json.loads(read(path)) if os.path.exists(path) else None

    def test_the_agent_joins_only_after_its_standby_said_it_is_ready(self):
        proc = self.start_job()
        wait_for(lambda: self.importing() or proc.poll() is not None, LOAD_DEADLINE, "the standby to import")
        self.assertIsNone(proc.poll(), proc.describe())
        # The standby is held in its preload: its agent has not joined (it joins at once without
        # standbys, before their interpreter has even started).
        self.assertFalse(self.joined(), self.daemon.output())
        self.finish(proc)
        self.assertTrue(self.joined(), self.daemon.output())
        self.assertNotIn("said they are ready", proc.stderr())

    def test_past_the_timeout_the_agent_joins_and_the_late_standby_still_becomes_the_worker(self):
        proc = self.start_job(env={"DDPLAUNCH_STANDBY_READY_TIMEOUT": "0.5"})
        wait_for(lambda: "said they are ready within 0.5 s" in proc.stderr() or proc.poll() is not None,
                 LOAD_DEADLINE, "the agent to give up waiting for its standby")
        self.assert_joined_and_the_held_standby_becomes_the_worker(proc)

    def test_garbage_instead_of_the_ready_frame_ends_the_wait_and_harms_nothing(self):
        proc = self.start_job(module=GARBAGE_MODULE)
        self.assert_joined_and_the_held_standby_becomes_the_worker(proc)

    def assert_joined_and_the_held_standby_becomes_the_worker(self, proc):
        """The agent joins without the standby's word; the standby, still importing torch or held
        in slowmod, has its assignment waiting and, once let go, is the worker (not a cold start)."""
        wait_for(lambda: self.joined() or proc.poll() is not None, LOAD_DEADLINE, "the join")
        wait_for(lambda: self.importing() or proc.poll() is not None, LOAD_DEADLINE, "the standby to import")
        self.assertIsNone(proc.poll(), proc.describe())
        self.assertIsNone(self.run_record(), "the worker ran before its standby had loaded")
        self.finish(proc)
        self.assertEqual(["importing_%d" % self.run_record()["pid"]], self.importing())

    def test_a_bad_timeout_is_refused_with_exit_code_2(self):
        result = self.launch(["--standby=on", "--nproc_per_node=1", "--python", PYTHON, self.script("w.py", "")],
                             env={"DDPLAUNCH_STANDBY_READY_TIMEOUT": "soon"})
        self.assertEqual(result.returncode, 2, result.describe())
        self.assertIn("DDPLAUNCH_STANDBY_READY_TIMEOUT=soon: not a number", result.stderr)
        result = self.launch(["--standby=on", "--nproc_per_node=1", "--python", PYTHON, self.script("w.py", "")],
                             env={"DDPLAUNCH_STANDBY_DELAY_MAX": "-1"})
        self.assertEqual(result.returncode, 2, result.describe())
        self.assertIn("DDPLAUNCH_STANDBY_DELAY_MAX=-1", result.stderr)


if __name__ == "__main__":
    main()
