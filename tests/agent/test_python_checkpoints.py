"""ddplaunch.save and ddplaunch.load (python/ddplaunch/checkpoints.py, docs/checkpoints.md): a
write returns before it is on disk and completes on SIGTERM and at exit; a writer killed with
SIGKILL in the middle of a write, a truncated file and a flipped byte each fall back to the
previous complete checkpoint, saying why; the lineage names what differs and strict refuses a
foreign environment with exit 3; the DDP template adopts them in three lines and resumes after a
killed worker under ddplaunch, and still runs under torchrun and alone; under ddplaunch a SIGTERM that
is not a failed round's becomes a checkpoint at the next checkpoint_due(), which the next launch
resumes from.

Writes are held at fixed points by the module's test hooks (never by timing); real processes are
killed for real; every wait has a deadline."""

import contextlib
import difflib
import glob
import io
import json
import os
import re
import shutil
import signal
import sys
import tempfile
import threading
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ddplaunch_helpers import DDPLAUNCH, PYTHON, code_lines, free_port, main, run, spawn, wait_for  # noqa: E402

SOURCE_DIR = os.path.abspath(os.environ.get("DDPLAUNCH_SOURCE_DIR", os.path.join(os.path.dirname(__file__), "..", "..")))
PYTHON_DIR = os.path.join(SOURCE_DIR, "python")
PLAIN = os.path.join(SOURCE_DIR, "examples", "restartable", "ddp_template.py")
TEMPLATE = os.path.join(SOURCE_DIR, "examples", "checkpoints", "ddp_template_checkpoints.py")
sys.path.insert(0, PYTHON_DIR)

import torch  # noqa: E402

import ddplaunch  # noqa: E402
from ddplaunch import checkpoints  # noqa: E402


def said(text):
    """The lines ddplaunch wrote to stderr (its prefix, any rank)."""
    return [line for line in text.splitlines() if line.startswith("ddplaunch")]


class Case(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.mkdtemp(prefix="ddplaunch_ckpt_")
        self.addCleanup(shutil.rmtree, self.tmp, True)
        self.dir = os.path.join(self.tmp, "ckpt")
        self.addCleanup(checkpoints._hooks.clear)
        self.addCleanup(ddplaunch.wait_for_save)

    def load(self, **kwargs):
        """ddplaunch.load(self.dir) in this process: (state, the lines it said). Lines on the
        lineage are left out: this program and its world size are not the writer's (Lineage
        tests them)."""
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            state = ddplaunch.load(self.dir, **kwargs)
        return state, [line for line in said(err.getvalue()) if " was written " not in line]

    def file(self, step, ext="pt"):
        return os.path.join(self.dir, "ckpt-%012d.%s" % (step, ext))

    def child(self, body, args=(), env=None, name="child.py"):
        """Starts `body` as a script of its own, with ddplaunch importable; killed at the end."""
        path = os.path.join(self.tmp, name)
        with open(path, "w") as f:
            f.write(body)
        full_env = dict(os.environ, PYTHONPATH=PYTHON_DIR)
        full_env.pop("RANK", None)
        full_env.update(env or {})
        proc = spawn([PYTHON, "-u", path] + [str(a) for a in args], env=full_env, cwd=self.tmp, name=name)
        self.addCleanup(proc.kill)
        return proc


class SaveAndLoad(Case):
    def test_a_state_comes_back_as_saved_with_its_record(self):
        shared = torch.randn(3, 4)
        state = {"model": {"w": shared, "tied": shared}, "optimizer": {"lr": 0.1, "moments": [torch.ones(2)]},
                 "epoch": 7, "name": "run-a"}
        self.assertEqual(ddplaunch.save(state, self.dir), 0)
        self.assertEqual(ddplaunch.save(state, self.dir), 1)  # one more than the newest
        ddplaunch.wait_for_save()
        loaded, lines = self.load()
        self.assertEqual(lines, [])
        self.assertTrue(torch.equal(loaded["model"]["w"], shared))
        self.assertIs(loaded["model"]["w"], loaded["model"]["tied"], "shared tensors stay shared")
        self.assertEqual((loaded["epoch"], loaded["name"], loaded["optimizer"]["lr"]), (7, "run-a", 0.1))
        with open(self.file(1, "json")) as f:
            record = json.load(f)
        self.assertEqual((record["step"], record["size"]), (1, os.path.getsize(self.file(1))))
        self.assertEqual(set(record["lineage"]), {"env_fingerprint", "world_size", "program_sha256",
                                                  "ddplaunch_version"})
        self.assertEqual(sorted(os.listdir(self.dir)), [os.path.basename(self.file(s, e))
                                                        for s in (0, 1) for e in ("json", "pt")], "no temporary left")
        self.assertEqual(ddplaunch.load(os.path.join(self.tmp, "none")), None, "no directory: a fresh start")

    def test_save_returns_before_the_write_and_the_write_holds_the_state_of_that_moment(self):
        release, started = threading.Event(), threading.Event()

        def hold(step):
            started.set()
            release.wait(60)

        checkpoints._hooks["start"] = hold
        weights = torch.zeros(1000)
        step = ddplaunch.save({"w": weights}, self.dir)
        # save() returned while its writer is held before writing a byte.
        self.assertTrue(started.wait(60), "the writer started")
        self.assertFalse(os.path.exists(self.file(step, "json")))
        self.assertFalse(os.path.exists(self.file(step)))
        weights += 1  # training goes on and changes the tensors in place
        release.set()
        ddplaunch.wait_for_save()
        loaded, _ = self.load()
        self.assertTrue(torch.equal(loaded["w"], torch.zeros(1000)), "the copy taken by save() was written")

    def test_one_write_at_a_time_and_none_is_dropped(self):
        seen = []  # (step, whether the previous step's record existed when this write started)
        checkpoints._hooks["start"] = lambda step: seen.append((step, os.path.exists(self.file(step - 1, "json"))))
        for step in range(3):
            ddplaunch.save({"v": step}, self.dir)
        ddplaunch.wait_for_save()
        self.assertEqual(seen, [(0, False), (1, True), (2, True)], "each write began after the previous committed")
        self.assertEqual(sorted(n for n in os.listdir(self.dir) if n.endswith(".json")),
                         [os.path.basename(self.file(s, "json")) for s in range(3)])

    def test_keep_prunes_older_checkpoints_and_leftovers_of_dead_writers(self):
        os.makedirs(self.dir)
        for leftover in (".ckpt-000000000099.pt.tmp-999999999", "ckpt-000000000098.pt"):
            with open(os.path.join(self.dir, leftover), "wb") as f:
                f.write(b"partial")
        for epoch in range(6):
            ddplaunch.save({"epoch": epoch}, self.dir, step=epoch * 10, keep=2)
        ddplaunch.wait_for_save()
        self.assertEqual(sorted(os.listdir(self.dir)), [os.path.basename(self.file(s, e))
                                                        for s in (40, 50) for e in ("json", "pt")])
        self.assertEqual(self.load()[0], {"epoch": 5})

    def test_ranks_other_than_0_write_nothing(self):
        os.environ["RANK"] = "1"
        self.addCleanup(os.environ.pop, "RANK")
        threads = threading.active_count()
        self.assertIsNone(ddplaunch.save({"w": torch.ones(1)}, self.dir))
        self.assertEqual(threading.active_count(), threads)
        self.assertFalse(os.path.exists(self.dir))

    def test_misuse_raises_a_checkpoint_error_that_says_what_to_do(self):
        path = os.path.join(self.tmp, "checkpoint.pt")
        torch.save({"w": 1}, path)
        for call in (lambda: ddplaunch.save({}, path), lambda: ddplaunch.load(path)):
            with self.assertRaisesRegex(ddplaunch.CheckpointError, "is a file, not a checkpoint directory"):
                call()
        with self.assertRaisesRegex(ddplaunch.CheckpointError, "keep=0"):
            ddplaunch.save({}, self.dir, keep=0)
        with self.assertRaisesRegex(ddplaunch.CheckpointError, "must be a path"):
            ddplaunch.load(3)
        ddplaunch.save({}, self.dir, step=5)
        for step in (4, 5):  # not even the same step: replacing it in place could lose it
            with self.assertRaisesRegex(ddplaunch.CheckpointError, "step %d is not newer than the newest checkpoint"
                                        % step):
                ddplaunch.save({}, self.dir, step=step)

    def test_a_failed_write_is_raised_by_the_next_call(self):
        def fail(step):
            raise OSError(28, "No space left on device")

        checkpoints._hooks["start"] = fail
        ddplaunch.save({"w": 1}, self.dir)
        with self.assertRaisesRegex(ddplaunch.CheckpointError, "write of step 0 .* failed: No space left on device"):
            ddplaunch.wait_for_save()

    def test_the_version_is_the_projects(self):
        with open(os.path.join(SOURCE_DIR, "CMakeLists.txt")) as f:
            version = re.search(r"project\(ddplaunch VERSION ([0-9.]+)", f.read()).group(1)
        self.assertEqual(ddplaunch.__version__, version)

    def test_import_ddplaunch_loads_neither_torch_nor_the_checkpoint_module(self):
        code = "import sys, ddplaunch; print(sorted(m for m in ('torch', 'ddplaunch.checkpoints') if m in sys.modules))"
        r = run([PYTHON, "-c", code], timeout=60, env=dict(os.environ, PYTHONPATH=PYTHON_DIR))
        self.assertEqual((r.returncode, r.stdout.strip()), (0, "[]"), r.describe())


class Damage(Case):
    def save_two(self):
        ddplaunch.save({"epoch": 1, "w": torch.ones(1000)}, self.dir)
        ddplaunch.save({"epoch": 2, "w": torch.ones(1000) * 2}, self.dir)
        ddplaunch.wait_for_save()

    def test_a_truncated_newest_checkpoint_falls_back_to_the_previous_one(self):
        self.save_two()
        size = os.path.getsize(self.file(1))
        os.truncate(self.file(1), size // 2)
        state, lines = self.load()
        self.assertEqual(state["epoch"], 1)
        self.assertEqual(len(lines), 2, lines)
        self.assertIn("skipping checkpoint %s: it is truncated: %d bytes, its record says %d"
                      % (self.file(1), size // 2, size), lines[0])
        self.assertIn("resuming from %s (step 0)" % self.file(0), lines[1])

    def test_a_flipped_byte_falls_back_and_none_valid_starts_fresh(self):
        self.save_two()
        with open(self.file(1), "r+b") as f:
            f.seek(os.path.getsize(self.file(1)) // 2)
            byte = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([byte[0] ^ 0x10]))
        state, lines = self.load()
        self.assertEqual(state["epoch"], 1)
        self.assertIn("skipping checkpoint %s: it is corrupt: its sha256 differs" % self.file(1), lines[0])
        with open(self.file(0, "json"), "w") as f:
            f.write('{"size": ')  # a record that does not parse
        state, lines = self.load()
        self.assertIsNone(state)
        self.assertIn("its record %s is unreadable" % os.path.basename(self.file(0, "json")), lines[1])
        self.assertIn("no valid checkpoint in %s (2 skipped): starting fresh" % self.dir, lines[2])

    def test_after_a_fallback_the_steps_go_on_from_the_valid_one_and_the_damaged_go(self):
        for epoch in range(4):
            ddplaunch.save({"epoch": epoch}, self.dir, step=epoch * 10)
        ddplaunch.wait_for_save()
        for step in (20, 30):
            os.truncate(self.file(step), 3)
        state, lines = self.load()
        self.assertEqual(state["epoch"], 1, lines)
        # A script that saves its own step count goes on from step 10 (the damaged 20 and 30 do
        # not make 11 "older than the newest"); the damaged are removed at that commit, so they
        # neither shadow it nor count towards keep (3: 0 went when 30 was written).
        self.assertEqual(ddplaunch.save({"epoch": 2}, self.dir, step=11), 11)
        ddplaunch.wait_for_save()
        self.assertEqual(sorted(os.listdir(self.dir)), [os.path.basename(self.file(s, e)) for s in (10, 11)
                                                        for e in ("json", "pt")])
        self.assertEqual(self.load(), ({"epoch": 2}, []))

    def test_a_writer_killed_in_the_middle_of_a_write_leaves_the_previous_checkpoint(self):
        body = """import os, sys, time, torch, ddplaunch
from ddplaunch import checkpoints
directory, point, marker = sys.argv[1:4]
ddplaunch.save({"epoch": 0, "w": torch.zeros(4)}, directory)
ddplaunch.wait_for_save()
def hold(step):
    open(marker, "w").close()
    time.sleep(120)
checkpoints._hooks[point] = hold
ddplaunch.save({"epoch": 1, "w": torch.ones(1 << 20)}, directory)
time.sleep(120)
"""
        # "written": the temporary file is complete; "renamed": the data file is in place, its
        # record (the commit) is not.
        for point in ("written", "renamed"):
            with self.subTest(point=point):
                shutil.rmtree(self.dir, True)
                marker = os.path.join(self.tmp, "held-" + point)
                proc = self.child(body, [self.dir, point, marker])
                wait_for(lambda: os.path.exists(marker) or proc.poll() is not None, 60, "the write to be held")
                self.assertIsNone(proc.poll(), proc.describe())
                names = sorted(os.listdir(self.dir))
                self.assertNotIn(os.path.basename(self.file(1, "json")), names)
                self.assertEqual(any(n.startswith(".ckpt-000000000001.pt.tmp-") for n in names), point == "written",
                                 names)
                proc.kill()
                self.assertEqual(proc.returncode, -signal.SIGKILL)
                state, lines = self.load()
                self.assertEqual(state["epoch"], 0)
                if point == "renamed":
                    self.assertEqual(len(lines), 2, lines)
                    self.assertIn("skipping checkpoint %s: it has no record" % self.file(1), lines[0])
                else:
                    self.assertEqual(lines, [], "a temporary file is not a checkpoint")
                # The next save goes on from the newest complete one and clears what was left.
                self.assertEqual(ddplaunch.save({"epoch": 1}, self.dir), 1)
                ddplaunch.wait_for_save()
                self.assertFalse([n for n in os.listdir(self.dir) if ".tmp-" in n])
                self.assertEqual(self.load(), ({"epoch": 1}, []))


HELD_WRITE = """import os, signal, sys, time, torch, ddplaunch
from ddplaunch import checkpoints
directory, marker, go, mode = sys.argv[1:5]
if mode == "chained":
    def own(signum, frame):
        sys.stderr.write("the script's own handler ran\\n")
        sys.exit(7)
    signal.signal(signal.SIGTERM, own)
def hold(step):
    open(marker, "w").close()
    deadline = time.monotonic() + 60
    while not os.path.exists(go) and time.monotonic() < deadline:
        time.sleep(0.01)
checkpoints._hooks["start"] = hold
ddplaunch.save({"w": torch.arange(10)}, directory, step=5)
if mode == "exit":
    sys.exit(0)
if mode == "second":  # a second save, waiting for the first write when SIGTERM comes
    open(marker + "-second", "w").close()
    ddplaunch.save({"w": torch.zeros(10)}, directory, step=6)
time.sleep(120)
"""


class Exit(Case):
    def test_sigterm_and_exit_complete_the_write_in_flight(self):
        # default: SIGTERM's default action, after the write; chained: the script's own SIGTERM
        # handler, after the write; exit: the interpreter's exit waits for it; second: SIGTERM
        # while the next save waits for the write, which the handler then waits for too.
        for mode, code in (("default", -signal.SIGTERM), ("chained", 7), ("exit", 0), ("second", -signal.SIGTERM)):
            with self.subTest(mode=mode):
                shutil.rmtree(self.dir, True)
                marker, go = os.path.join(self.tmp, "held-" + mode), os.path.join(self.tmp, "go-" + mode)
                proc = self.child(HELD_WRITE, [self.dir, marker, go, mode])
                wait_for(lambda: os.path.exists(marker) or proc.poll() is not None, 60, "the write to be held")
                if mode == "second":
                    wait_for(lambda: os.path.exists(marker + "-second") or proc.poll() is not None, 60,
                             "the second save")
                if mode != "exit":
                    proc.signal(signal.SIGTERM)
                wait_for(lambda: "waiting for the checkpoint write of step 5" in proc.stderr() or proc.poll() is not None,
                         60, "the process to wait for its write")
                self.assertIsNone(proc.poll(), "still there while its write is held\n" + proc.describe())
                open(go, "w").close()
                self.assertEqual(proc.wait(60), code, proc.describe())
                if mode == "chained":
                    self.assertIn("the script's own handler ran", proc.stderr())
                state, lines = self.load()
                self.assertEqual(lines, [])
                self.assertTrue(torch.equal(state["w"], torch.arange(10)), proc.describe())


LINEAGE = """import json, sys, torch, ddplaunch
mode, directory = sys.argv[1:3]
if mode == "save":
    ddplaunch.save({"w": torch.ones(3)}, directory)
else:
    state = ddplaunch.load(directory)
    print(json.dumps(None if state is None else state["w"].tolist()))
"""


class Lineage(Case):
    env = {"RANK": "0", "WORLD_SIZE": "2", "DDPLAUNCH_ENV_FINGERPRINT": "a" * 64}
    saved = None  # a directory with one checkpoint that train.py saved in the environment above

    def setUp(self):
        super().setUp()
        if Lineage.saved is None:
            saver = self.child(LINEAGE, ["save", self.dir], env=self.env, name="train.py")
            self.assertEqual(saver.wait(60), 0, saver.describe())
            Lineage.saved = tempfile.mkdtemp(prefix="ddplaunch_ckpt_lineage_")
            shutil.copytree(self.dir, os.path.join(Lineage.saved, "ckpt"))
        else:
            shutil.copytree(os.path.join(Lineage.saved, "ckpt"), self.dir)

    @classmethod
    def tearDownClass(cls):
        if cls.saved:
            shutil.rmtree(cls.saved, True)

    def load_in_child(self, program=LINEAGE, **env):
        proc = self.child(program, ["load", self.dir], env=dict(self.env, **env), name="train.py")
        proc.wait(60)
        return proc

    def test_every_difference_is_named_field_by_field(self):
        with open(self.file(0, "json")) as f:
            record = json.load(f)
        record["lineage"]["ddplaunch_version"] = "0.0.1"
        with open(self.file(0, "json"), "w") as f:
            json.dump(record, f)
        proc = self.load_in_child(LINEAGE + "# edited\n", WORLD_SIZE="3", DDPLAUNCH_ENV_FINGERPRINT="b" * 64)
        self.assertEqual((proc.returncode, proc.stdout().strip()), (0, "[1.0, 1.0, 1.0]"), proc.describe())
        lines = said(proc.stderr())
        self.assertEqual(len(lines), 4, lines)
        self.assertIn("written at world size 2; this job runs at world size 3: loading it", lines[0])
        self.assertIn("written by another version of the program: sha256 of train.py", lines[1])
        self.assertIn("written with ddplaunch 0.0.1; this is ddplaunch %s" % ddplaunch.__version__, lines[2])
        self.assertIn("written in another environment (fingerprint %s then, %s now): loading it"
                      % ("a" * 16, "b" * 16), lines[3])
        for line in lines:
            self.assertTrue(line.startswith("ddplaunch (rank 0): checkpoint ckpt-000000000000.pt was "), line)

    def test_strict_refuses_another_environment_with_exit_3_and_says_the_fix(self):
        proc = self.load_in_child(DDPLAUNCH_ENV_CHECK="strict", DDPLAUNCH_ENV_FINGERPRINT="b" * 64)
        self.assertEqual(proc.returncode, 3, proc.describe())
        self.assertEqual(proc.stdout(), "", "nothing was loaded")
        lines = said(proc.stderr())
        self.assertEqual(len(lines), 1, lines)
        for part in ("refusing to resume from checkpoint %s" % self.file(0), "written in another environment",
                     "resume with the environment that wrote it", "fresh checkpoint directory", "--env_check=warn"):
            self.assertIn(part, lines[0])
        # The same environment, or one that was not fingerprinted (no check ran), loads quietly.
        for fingerprint in ("a" * 64, ""):
            proc = self.load_in_child(DDPLAUNCH_ENV_CHECK="strict", DDPLAUNCH_ENV_FINGERPRINT=fingerprint)
            self.assertEqual((proc.returncode, said(proc.stderr())), (0, []), proc.describe())

    def test_another_world_size_loads_and_says_so_in_one_line(self):
        proc = self.load_in_child(WORLD_SIZE="1")
        self.assertEqual((proc.returncode, proc.stdout().strip()), (0, "[1.0, 1.0, 1.0]"), proc.describe())
        self.assertEqual(said(proc.stderr()), ["ddplaunch (rank 0): checkpoint ckpt-000000000000.pt was written at "
                                               "world size 2; this job runs at world size 1: loading it (with DDP "
                                               "every rank holds the whole state)"])


def epochs_trained(records):
    """{pid: sorted epochs} from the template's --record files."""
    out = {}
    for path in glob.glob(os.path.join(records, "*.txt")):
        pid = int(re.search(r"pid(\d+)", path).group(1))
        with open(path) as f:
            out[pid] = sorted({int(line.split()[0]) for line in f})
    return out


class Template(Case):
    def test_the_template_adopts_them_in_three_lines_shown_in_the_docs(self):
        diff = [line for line in difflib.unified_diff(code_lines(PLAIN), code_lines(TEMPLATE), lineterm="", n=0)
                if line[:1] in "+-" and not line.startswith(("+++", "---"))]
        print("\n".join(diff))
        self.assertLessEqual(len([line for line in diff if line.startswith("+")]), 3, diff)
        with open(os.path.join(SOURCE_DIR, "docs", "checkpoints.md")) as f:
            doc = f.read()
        block = doc[doc.index("```diff\n") + len("```diff\n"):]
        self.assertEqual(block[:block.index("```")].splitlines(), diff)

    def ddplaunch(self):
        """The ddplaunch under test, with this source tree's python/ as its Python helper: a copy of
        the binary in a prefix whose share/ddplaunch/python is that directory (where an installed
        ddplaunch looks first)."""
        if not os.path.exists(DDPLAUNCH):
            self.fail("ddplaunch not built: %s" % DDPLAUNCH)
        prefix = os.path.join(self.tmp, "prefix")
        if os.path.exists(os.path.join(prefix, "bin", "ddplaunch")):
            return os.path.join(prefix, "bin", "ddplaunch")
        os.makedirs(os.path.join(prefix, "bin"))
        os.makedirs(os.path.join(prefix, "share", "ddplaunch"))
        shutil.copy2(DDPLAUNCH, os.path.join(prefix, "bin", "ddplaunch"))
        os.symlink(PYTHON_DIR, os.path.join(prefix, "share", "ddplaunch", "python"))
        return os.path.join(prefix, "bin", "ddplaunch")

    def test_under_ddplaunch_a_killed_worker_resumes_from_the_checkpoint(self):
        records = os.path.join(self.tmp, "records")
        os.mkdir(records)
        env = dict(os.environ, TMPDIR=self.tmp)
        env.pop("PYTHONPATH", None)  # ddplaunch puts its own helper directory there
        # --standby=off: the restart is a cold start, which reads the checkpoint (and no standby
        # process imports torch beside the workers).
        r = run([self.ddplaunch(), "--nproc_per_node=2", "--max_restarts=1", "--standby=off", "--python", PYTHON, TEMPLATE,
                 "--record", records, "--die-at", "1:10:1", "--checkpoint", self.dir], timeout=300, env=env, cwd=self.tmp)
        self.assertFalse(r.timed_out, r.describe())
        self.assertEqual(r.returncode, 0, r.describe())
        per_pid = epochs_trained(records)
        self.assertEqual(len(per_pid), 4, "two workers, twice: %s\n%s" % (per_pid, r.describe()))
        # The first attempt trained epoch 0 and died in epoch 1; the second started at epoch 1,
        # from the checkpoint of epoch 0.
        self.assertEqual(sorted(per_pid.values()), [[0, 1], [0, 1], [1, 2], [1, 2]], r.describe())
        state, lines = self.load()
        self.assertEqual((state["epoch"], lines), (2, []))
        self.assertEqual(sorted(os.listdir(self.dir))[-2:], ["ckpt-000000000002.json", "ckpt-000000000002.pt"])

    def test_under_ddplaunch_the_checked_environment_is_the_lineage_and_strict_refuses_another(self):
        # The real agent's DDPLAUNCH_ENV_FINGERPRINT, not one set by hand: --env_lock is part of
        # the environment the check digests, so a new lock file is a new environment.
        lock = os.path.join(self.tmp, "requirements.txt")
        env = dict(os.environ, TMPDIR=self.tmp)
        env.pop("PYTHONPATH", None)

        def job(lock_text, epochs, *flags):
            with open(lock, "w") as f:
                f.write(lock_text)
            records = tempfile.mkdtemp(dir=self.tmp)
            r = run([self.ddplaunch(), "--nproc_per_node=2", "--standby=off", "--env_lock", lock, *flags,
                     "--python", PYTHON, TEMPLATE, "--record", records, "--epochs", str(epochs),
                     "--checkpoint", self.dir], timeout=300, env=env, cwd=self.tmp)
            self.assertFalse(r.timed_out, r.describe())
            return r, sorted(epochs_trained(records).values())

        r, trained = job("torch==2.15.0\n", 1)
        self.assertEqual((r.returncode, trained), (0, [[0], [0]]), r.describe())
        r, trained = job("torch==2.15.0\n", 2)  # the same environment: resumes without a word
        self.assertEqual((r.returncode, trained), (0, [[1], [1]]), r.describe())
        self.assertNotIn("another environment", r.stderr, r.describe())
        # Strict, the default: refused, nothing trained; and since every restart would refuse the
        # same way, the job ends at the first refusal instead of spending its restarts.
        r, trained = job("torch==2.16.0\n", 3, "--max_restarts=3")
        self.assertEqual(r.returncode, 1, r.describe())
        self.assertEqual(trained, [], r.describe())
        # One attempt: each of the two ranks refuses once.
        self.assertEqual(r.stderr.count("refusing to resume from checkpoint"), 2, r.describe())
        self.assertIn("it was written in another environment", r.stderr, r.describe())
        self.assertIn("said a restart would fail the same way", r.stderr, r.describe())
        self.assertRegex(r.stderr, "exit(ed with)? code:? 3|exitcode *: *3|exit code 3", r.describe())
        r, trained = job("torch==2.16.0\n", 3, "--env_check=warn")  # warn: resumes, and says so
        self.assertEqual((r.returncode, trained), (0, [[2], [2]]), r.describe())
        self.assertIn("was written in another environment", r.stderr, r.describe())

    def test_it_runs_unchanged_under_torchrun_and_alone(self):
        records = os.path.join(self.tmp, "records")
        os.mkdir(records)
        env = dict(os.environ, PYTHONPATH=PYTHON_DIR, TMPDIR=self.tmp)
        torchrun = [PYTHON, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
        r = run(torchrun + [TEMPLATE, "--record", records, "--epochs", "2", "--checkpoint", self.dir],
                timeout=300, env=env, cwd=self.tmp)
        self.assertFalse(r.timed_out, r.describe())
        self.assertEqual(r.returncode, 0, r.describe())
        self.assertEqual(sorted(epochs_trained(records).values()), [[0, 1], [0, 1]], r.describe())
        # One process, no launcher, one more epoch: it resumes from what two ranks wrote.
        shutil.rmtree(records)
        os.mkdir(records)
        alone = dict(env, RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
        r = run([PYTHON, TEMPLATE, "--record", records, "--epochs", "3", "--checkpoint", self.dir],
                timeout=300, env=alone, cwd=self.tmp)
        self.assertEqual(r.returncode, 0, r.describe())
        self.assertEqual(list(epochs_trained(records).values()), [[2]], r.describe())
        # (and, maybe, that it waits at exit for the write of its last epoch)
        self.assertEqual([line for line in said(r.stderr) if "waiting for the checkpoint write" not in line],
                         ["ddplaunch (rank 0): checkpoint ckpt-000000000001.pt was written at world size 2; this job "
                          "runs at world size 1: loading it (with DDP every rank holds the whole state)"], r.describe())



# A loop of steps that saves when checkpoint_due() says so (every 10 s at the least: never in
# these tests' first seconds, so that each checkpoint in them is the one written at a stop). Each
# rank writes the step it is at, and at start the step it starts from. No process group: rank 1
# ends at the stop's grace, as a rank whose next step does not find rank 0 gone would.
STOP_LOOP = """import os, sys, time, ddplaunch
from ddplaunch import checkpoints
directory, marks = sys.argv[1:3]
if os.environ.get("SLOW_WRITE"):  # a write that outlasts the stop's grace (2 s here)
    checkpoints._hooks["written"] = lambda step: time.sleep(float(os.environ["SLOW_WRITE"]))
rank = int(os.environ.get("RANK", "0"))
state = ddplaunch.load(directory)
start = state["step"] + 1 if state is not None else 0
with open(os.path.join(marks, "start_%d_%d" % (rank, os.getpid())), "w") as f:
    f.write(str(start))
step = start
while True:
    time.sleep(0.01)
    with open(os.path.join(marks, "at_%d.tmp" % rank), "w") as f:
        f.write(str(step))
    os.replace(os.path.join(marks, "at_%d.tmp" % rank), os.path.join(marks, "at_%d" % rank))
    if ddplaunch.checkpoint_due(directory):
        if os.environ.get("SLOW_SAVE_START") and rank == 0:  # work before save(): the first imports torch
            time.sleep(float(os.environ["SLOW_SAVE_START"]))
        ddplaunch.save({"step": step}, directory, step=step)
    step += 1
"""


class StopAtCheckpoint(Case):
    """A SIGTERM that is not a failure's (a drain, a change of nodes without in-memory restart,
    ddplaunch stopped) becomes a checkpoint at the script's next checkpoint_due()."""

    ddplaunch = Template.ddplaunch

    def setUp(self):
        super().setUp()
        self.marks = os.path.join(self.tmp, "marks")
        os.mkdir(self.marks)
        self.script = os.path.join(self.tmp, "stop_loop.py")
        with open(self.script, "w") as f:
            f.write(STOP_LOOP)

    def at(self, rank):
        try:
            with open(os.path.join(self.marks, "at_%d" % rank)) as f:
                return int(f.read())
        except (OSError, ValueError):
            return -1

    def steps_saved(self):
        names = os.listdir(self.dir) if os.path.isdir(self.dir) else []
        return sorted(int(m.group(1)) for m in map(re.compile(r"^ckpt-(\d+)\.json$").match, names) if m)

    def launch(self, **extra):
        env = dict(os.environ, TMPDIR=self.tmp, **extra)
        env.pop("PYTHONPATH", None)
        proc = spawn([self.ddplaunch(), "--nproc_per_node=2", "--standby=off", "--python", PYTHON, self.script,
                      self.dir, self.marks], env=env, cwd=self.tmp, name="ddplaunch")
        self.addCleanup(proc.kill)
        return proc

    def test_a_stopped_job_saves_at_its_next_check_and_the_next_launch_resumes_there(self):
        # The write takes 3 s, longer than the grace: the worker ends only once it is on disk.
        proc = self.launch(SLOW_WRITE="3")
        wait_for(lambda: self.at(0) >= 20 and self.at(1) >= 20 or proc.poll() is not None, 120, "20 steps")
        self.assertIsNone(proc.poll(), proc.describe())
        stopped_at = self.at(0)
        proc.signal(signal.SIGTERM)  # ddplaunch passes it on to its workers
        self.assertEqual(proc.wait(60), 128 + signal.SIGTERM, proc.describe())
        saved = self.steps_saved()
        self.assertEqual(len(saved), 1, "one checkpoint, the stop's: %s\n%s" % (saved, proc.describe()))
        self.assertGreaterEqual(saved[0], stopped_at, proc.describe())
        self.assertIn("SIGTERM: stopping after this checkpoint", proc.stderr(), proc.describe())
        self.assertIn("SIGTERM: stopping once rank 0 has written its checkpoint", proc.stderr(), proc.describe())
        self.assertIn("stopping: the checkpoint of step %d is being written" % saved[0], proc.stderr(), proc.describe())
        self.assertIn("waiting for the checkpoint write of step %d" % saved[0], proc.stderr(), proc.describe())

        again = self.launch()
        wait_for(lambda: len([n for n in os.listdir(self.marks) if n.startswith("start_")]) == 4 or
                 again.poll() is not None, 120, "the second launch's workers to start")
        starts = {}
        for name in os.listdir(self.marks):
            if name.startswith("start_"):
                with open(os.path.join(self.marks, name)) as f:
                    starts.setdefault(int(f.read()), []).append(name)
        self.assertEqual(sorted(starts), [0, saved[0] + 1], "%s\n%s" % (starts, again.describe()))
        again.kill()

    def test_rank_0_told_to_save_is_not_cut_short_by_the_grace_before_its_save_begins(self):
        # 3 s between checkpoint_due() and save() on rank 0, longer than the grace (2 s here): a
        # first save that imports torch on a loaded machine.
        proc = self.launch(SLOW_SAVE_START="3")
        wait_for(lambda: self.at(0) >= 20 and self.at(1) >= 20 or proc.poll() is not None, 120, "20 steps")
        self.assertIsNone(proc.poll(), proc.describe())
        stopped_at = self.at(0)
        proc.signal(signal.SIGTERM)
        self.assertEqual(proc.wait(60), 128 + signal.SIGTERM, proc.describe())
        saved = self.steps_saved()
        self.assertEqual(len(saved), 1, "one checkpoint, the stop's: %s\n%s" % (saved, proc.describe()))
        self.assertGreaterEqual(saved[0], stopped_at, proc.describe())
        self.assertIn("stopping: the checkpoint of step %d is being written" % saved[0], proc.stderr(), proc.describe())

    def test_outside_ddplaunch_or_in_a_failed_round_sigterm_ends_the_worker_at_once(self):
        board = os.path.join(self.tmp, "board")  # one progress slot whose round the agent abandoned
        with open(board, "wb") as f:
            f.write(bytes(56) + (1).to_bytes(8, "little") + bytes(64))
        for env in ({}, {"DDPLAUNCH_PROGRESS_FILE": board, "DDPLAUNCH_PROGRESS_SLOT": "0"}):
            with self.subTest(env=sorted(env)):
                shutil.rmtree(self.marks)
                os.mkdir(self.marks)
                proc = self.child(STOP_LOOP, [self.dir, self.marks], env=env)
                wait_for(lambda: self.at(0) >= 5 or proc.poll() is not None, 60, "5 steps")
                proc.signal(signal.SIGTERM)
                self.assertEqual(proc.wait(30), -signal.SIGTERM, proc.describe())
                self.assertEqual(self.steps_saved(), [], proc.describe())
                self.assertNotIn("SIGTERM: stopping", proc.stderr(), proc.describe())


if __name__ == "__main__":
    main()
