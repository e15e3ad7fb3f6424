"""In-memory restart of Python programs (python/ddplaunch/restart.py, docs/agent.md
"In-memory restart").

Two halves:
- `ddplaunch.InMemoryRestart` on its own, the test playing the agent: a progress file and a
  socket pair per worker, two real Gloo ranks on loopback. Rank 1 stops taking part (it sleeps,
  as a peer behind a cut link would: no error ever reaches rank 0); once the test sets rank 0's
  abandoned word, rank 0's blocked all_reduce ends, it says `parked` with its step on the
  channel, takes the assignment the test sends (environment, directory, stdout and stderr) and
  goes on in a world of 1 as the same process. An error of the program's own is not taken for a
  lost round, and `close()` says restartable false.
- ddplaunch with scripts/elastic_ddp.py (which uses InMemoryRestart): a killed rank's peer keeps
  its pid and its model, the replacement receives the state (every snapshot is garbage by then:
  a rank that read one would say so), and a worker made from a standby parks as well.
Every process is killed in cleanup; every wait has a deadline.
"""

import importlib
import json
import os
import re
import signal
import socket
import struct
import subprocess
import sys
import textwrap
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from ddplaunch_helpers import PYTHON, LaunchTestCase, wait_for  # noqa: E402
from processes import free_port  # noqa: E402

SOURCE_DIR = os.environ.get("DDPLAUNCH_SOURCE_DIR", os.path.join(HERE, "..", ".."))
PYTHON_DIR = os.path.join(SOURCE_DIR, "python")
ELASTIC_DDP = os.path.join(SOURCE_DIR, "scripts", "elastic_ddp.py")
HEADER = struct.Struct("<4sII")
# The slot's layout as the Python package defines it (contracts/progress_slot.h; the package's
# one copy, held to the golden fixture by tests/contracts/test_fixtures.py).
sys.path.insert(0, PYTHON_DIR)
import ddplaunch  # noqa: E402  (reads no slot: this process has no DDPLAUNCH_PROGRESS_FILE)
sys.path.remove(PYTHON_DIR)
SLOT = ddplaunch._SLOT_SIZE
ABANDONED_OFFSET = ddplaunch._ABANDONED_OFFSET


def torch_or_skip(test):
    try:
        importlib.import_module("torch.distributed")
    except ImportError:
        test.skipTest("torch is not importable by %s" % PYTHON)


WORKER = textwrap.dedent("""
    import os, sys, time
    import torch, torch.distributed as dist
    import ddplaunch
    restart = ddplaunch.InMemoryRestart()
    print("enabled", restart.enabled, flush=True)
    restart.init_process_group("gloo")
    rank = dist.get_rank()
    x = torch.ones(1)
    dist.all_reduce(x)
    print("round 1 world", dist.get_world_size(), "sum", x.item(), flush=True)
    if os.environ.get("BUG") == "1":
        try:
            raise ValueError("a bug of the program's own")
        except ValueError as e:
            print("recoverable", restart.recoverable(e), flush=True)
            restart.close()
            # Both ranks leave the group together: a process that exits with a live Gloo group
            # while its peer closes the connections can die in torch's teardown (SIGABRT).
            dist.barrier()
            dist.destroy_process_group()
            sys.exit(3)
    if rank == 0 and os.environ.get("STALL") == "block":
        import threading
        threading.Event().wait(600)   # blocked, using no CPU: like a Gloo wait no shut socket ends
    if rank == 0 and os.environ.get("STALL") == "busy":
        end = time.monotonic() + 4    # computing: the lost round is seen at the next collective
        while time.monotonic() < end:
            pass
    if rank == 1:
        time.sleep(600)       # no longer takes part: rank 0 waits on it in vain
    step = 0
    try:
        while True:
            dist.all_reduce(x)
            step += 1
    except RuntimeError as e:
        print("blocked collective ended:", type(e).__name__, "recoverable", restart.recoverable(e), flush=True)
    restart.park(step)
    print("assigned pid", os.getpid(), "MARK", os.environ.get("MARK"), "cwd", os.getcwd(), flush=True)
    restart.init_process_group("gloo")
    held, state = restart.agree(step, lambda: {"step": step})
    y = torch.ones(1)
    dist.all_reduce(y)
    print("round 2 world", dist.get_world_size(), "held", held, "state", state, flush=True)
    restart.close()
    dist.destroy_process_group()
""")


def read_frame(sock):
    """One worker-channel frame (contracts/worker_channel.h) from `sock`: its JSON object."""
    def exactly(n, where):
        data = b""
        while len(data) < n:
            chunk = sock.recv(n - len(data))
            if not chunk:
                raise EOFError("the channel closed " + where)
            data += chunk
        return data
    magic, version, length = HEADER.unpack(exactly(HEADER.size, "between frames"))
    assert magic == b"DDPW" and version == 1 and 2 <= length <= 4096, (magic, version, length)
    return json.loads(exactly(length, "in a frame"))


class ParkingWithoutDdplaunch(LaunchTestCase):
    """The test is the agent: progress slots in a file, a channel per worker."""

    def setUp(self):
        super().setUp()
        torch_or_skip(self)
        self.board = os.path.join(self.tmp, "board")
        with open(self.board, "wb") as f:
            f.write(b"\0" * SLOT * 2)
        self.script_path = self.script("worker.py", WORKER)
        self.worker_fd = {}

    def start(self, rank, port, extra=None):
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        self.addCleanup(ours.close)
        env = dict(os.environ, PYTHONPATH=PYTHON_DIR, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                   RANK=str(rank), WORLD_SIZE="2", DDPLAUNCH_PROGRESS_FILE=self.board,
                   DDPLAUNCH_PROGRESS_SLOT=str(rank), DDPLAUNCH_WORKER_FD=str(theirs.fileno()),
                   PYTHONWARNINGS="ignore")
        env.update(extra or {})
        out = open(os.path.join(self.tmp, "rank%d.out" % rank), "w+")
        self.addCleanup(out.close)
        self.worker_fd[rank] = str(theirs.fileno())
        proc = subprocess.Popen([PYTHON, "-u", self.script_path], env=env, stdout=out, stderr=subprocess.STDOUT,
                                pass_fds=[theirs.fileno()], cwd=self.tmp, start_new_session=True)
        theirs.close()
        self.addCleanup(self.kill, proc)
        ours.settimeout(120)
        return proc, ours, out

    def kill(self, proc):
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()

    def text(self, out):
        out.flush()
        with open(out.name) as f:
            return f.read()

    def abandon(self, slot):
        with open(self.board, "r+b") as f:
            f.seek(slot * SLOT + ABANDONED_OFFSET)
            f.write(struct.pack("<Q", 1))

    def test_an_abandoned_round_ends_a_blocked_collective_and_the_worker_parks_and_goes_on(self):
        port = free_port()
        (p0, c0, out0), (p1, c1, out1) = self.start(0, port), self.start(1, port)
        self.assertEqual(read_frame(c0), {"type": "restartable", "value": True}, self.text(out0))
        self.assertEqual(read_frame(c1), {"type": "restartable", "value": True}, self.text(out1))
        wait_for(lambda: "round 1 world 2 sum 2.0" in self.text(out0), 60, "rank 0's first all_reduce")
        self.assertIsNone(p0.poll(), self.text(out0))

        self.abandon(0)
        parked = read_frame(c0)
        self.assertEqual(parked["type"], "parked", self.text(out0))
        self.assertIsInstance(parked["step"], int)
        self.assertGreaterEqual(parked["step"], 0)
        out = self.text(out0)
        self.assertIn("blocked collective ended: RuntimeError recoverable True", out)

        # The assignment: a world of 1 on a new port, a new directory and new stdout/stderr.
        with open(self.board, "r+b") as f:  # the agent zeroes the board before a round
            f.write(b"\0" * SLOT * 2)
        new_dir = os.path.join(self.tmp, "round2")
        os.mkdir(new_dir)
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PYTHONPATH": PYTHON_DIR, "MARK": "round2",
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "RANK": "0", "WORLD_SIZE": "1",
               "DDPLAUNCH_PROGRESS_FILE": self.board, "DDPLAUNCH_PROGRESS_SLOT": "0",
               "DDPLAUNCH_WORKER_FD": self.worker_fd[0]}
        out_r, out_w = os.pipe()
        payload = json.dumps({"env": env, "cwd": new_dir}).encode()
        socket.send_fds(c0, [struct.pack("<4sII", b"DDPS", 1, len(payload)) + payload], [out_w, out_w])
        os.close(out_w)
        with os.fdopen(out_r) as new_out:
            self.assertEqual(p0.wait(120), 0, self.text(out0))
            after = new_out.read()
        self.assertIn("assigned pid %d MARK round2 cwd %s" % (p0.pid, new_dir), after)
        self.assertIn("round 2 world 1 held %d state {'step': %d}" % (parked["step"], parked["step"]), after)
        self.assertEqual(read_frame(c0), {"type": "restartable", "value": False}, after)
        self.assertIsNone(p1.poll(), "rank 1 sleeps on: nothing of rank 0's parking killed it")

    def test_a_worker_blocked_where_the_shut_sockets_do_not_reach_gives_up_its_state(self):
        port = free_port()
        (p0, c0, out0), _ = self.start(0, port, {"STALL": "block"}), self.start(1, port)
        self.assertEqual(read_frame(c0), {"type": "restartable", "value": True}, self.text(out0))
        wait_for(lambda: "round 1 world 2 sum 2.0" in self.text(out0), 60, "rank 0's first all_reduce")
        self.abandon(0)
        # 2 s later, its main thread still waits and used no CPU: it says it cannot park, so
        # that the agent stops it at once instead of at the park deadline.
        self.assertEqual(read_frame(c0), {"type": "restartable", "value": False}, self.text(out0))
        self.assertIn("this process cannot park", self.text(out0))
        self.assertIsNone(p0.poll(), self.text(out0))

    def test_a_worker_busy_computing_when_the_round_is_lost_parks_at_its_next_collective(self):
        port = free_port()
        (_, c0, out0), _ = self.start(0, port, {"STALL": "busy"}), self.start(1, port)
        self.assertEqual(read_frame(c0), {"type": "restartable", "value": True}, self.text(out0))
        wait_for(lambda: "round 1 world 2 sum 2.0" in self.text(out0), 60, "rank 0's first all_reduce")
        self.abandon(0)
        # Its 4 s of computing use CPU: it is not taken for blocked, and parks once they end.
        parked = read_frame(c0)
        self.assertEqual(parked["type"], "parked", self.text(out0))
        self.assertNotIn("cannot park", self.text(out0))
        self.assertIn("blocked collective ended: RuntimeError recoverable True", self.text(out0))

    def test_an_error_of_the_programs_own_is_not_a_lost_round(self):
        port = free_port()
        (p0, c0, out0), (p1, c1, out1) = self.start(0, port, {"BUG": "1"}), self.start(1, port, {"BUG": "1"})
        for proc, channel, out in ((p0, c0, out0), (p1, c1, out1)):
            self.assertEqual(proc.wait(120), 3, self.text(out))
            self.assertIn("recoverable False", self.text(out))
            self.assertEqual(read_frame(channel), {"type": "restartable", "value": True})
            self.assertEqual(read_frame(channel), {"type": "restartable", "value": False})

    def test_without_a_channel_it_is_off_and_the_program_runs_as_plain_torch(self):
        port = free_port()
        env = {"DDPLAUNCH_WORKER_FD": "", "BUG": "1"}
        (p0, _, out0), (p1, _, out1) = self.start(0, port, env), self.start(1, port, env)
        for proc, out in ((p0, out0), (p1, out1)):
            self.assertEqual(proc.wait(120), 3, self.text(out))
            self.assertIn("enabled False", self.text(out))
            self.assertIn("round 1 world 2 sum 2.0", self.text(out))


PID_RE = re.compile(r"^\[elastic_ddp\] rank (\d+) pid (\d+) generation (\d+)$", re.M)
RESUMED_RE = re.compile(r"^\[elastic_ddp\] resumed from memory at step (\d+) ", re.M)
STEP_RE = re.compile(r"^\[elastic_ddp\] epoch \d+ step (\d+) ", re.M)
DONE_RE = re.compile(r"^\[elastic_ddp\] done: steps=(\d+) steps_this_run=(\d+) ", re.M)
SAMPLES, BATCH, EPOCHS = 2560, 32, 3   # 40 steps per epoch at 2 workers


class PythonJobUnderDdplaunch(LaunchTestCase):
    def setUp(self):
        super().setUp()
        torch_or_skip(self)
        self.ckpt = os.path.join(self.out, "ckpt")
        os.makedirs(self.ckpt)

    def start_job(self, extra=()):
        return self.spawn_launch(["--standalone", "--nproc_per_node=2", "--max_restarts=3"] + list(extra) +
                                 [ELASTIC_DDP, "--checkpoint-dir", self.ckpt, "--epochs", str(EPOCHS),
                                  "--samples", str(SAMPLES), "--batch-size", str(BATCH), "--log-every", "1",
                                  "--step-delay", "0.05"])

    def pids(self, output):
        """{(generation, rank): pid} from the workers' announcements."""
        return {(int(g), int(r)): int(p) for r, p, g in PID_RE.findall(output)}

    def last_step(self, output):
        steps = STEP_RE.findall(output)
        return int(steps[-1]) if steps else 0

    def spoil_checkpoints(self):
        """Every snapshot written so far becomes garbage: a rank that tried to resume from one
        would say "cannot load" (the script then tries older ones, and starts at step 0)."""
        for name in os.listdir(self.ckpt):
            if name.startswith("snapshot-"):
                with open(os.path.join(self.ckpt, name), "wb") as f:
                    f.write(b"spoiled by the test: a rank that reads this did not get the state from memory\n")

    def kill_rank(self, proc, generation, rank, then_generation):
        """SIGKILLs `rank` of `generation` with the snapshots spoiled; returns the pids of
        `then_generation` once its rank 0 made 5 steps past the resume."""
        self.spoil_checkpoints()
        before = self.last_step(proc.output())
        victim = self.pids(proc.output())[(generation, rank)]
        os.kill(victim, signal.SIGKILL)

        def resumed():
            out = proc.output()
            ranks = {r for (g, r) in self.pids(out) if g == then_generation}
            return ranks == {0, 1} and len(RESUMED_RE.findall(out)) >= then_generation - 1 and \
                self.last_step(out) >= before + 5
        wait_for(lambda: resumed() or proc.poll() is not None, 120, "generation %d's steps" % then_generation)
        self.assertIsNone(proc.poll(), proc.output())
        out = proc.output()
        resumed_at = int(RESUMED_RE.findall(out)[-1])
        self.assertIn(resumed_at - before, (-1, 0, 1), "the new round starts where the old one was\n" + out)
        return self.pids(out)

    def finish(self, proc):
        self.assertEqual(proc.wait(240), 0, proc.output())
        out = proc.output()
        done = DONE_RE.findall(out)
        self.assertEqual(len(done), 1, out)
        self.assertEqual(int(done[0][0]), EPOCHS * SAMPLES // (BATCH * 2), "every epoch's steps, once\n" + out)
        self.assertNotIn("resumed from " + self.ckpt, out)
        self.assertNotIn("cannot load", out)
        return out

    def test_a_survivor_keeps_its_process_and_a_replacement_receives_its_state(self):
        proc = self.start_job()
        wait_for(lambda: self.last_step(proc.output()) >= 10 or proc.poll() is not None, 120, "the first steps")
        self.assertIsNone(proc.poll(), proc.output())
        first = self.pids(proc.output())
        pids = self.kill_rank(proc, 1, 1, 2)
        self.assertEqual(pids[(2, 0)], first[(1, 0)], "rank 0 kept its process\n" + proc.output())
        self.assertNotEqual(pids[(2, 1)], first[(1, 1)])
        out = self.finish(proc)
        self.assertIn("ddplaunch (rank 1): received the state rank 0 sent", out)
        self.assertIn("round abandoned at step", out)

    def test_a_worker_made_from_a_standby_parks_too(self):
        proc = self.start_job(["--standby=on"])
        wait_for(lambda: self.last_step(proc.output()) >= 10 or proc.poll() is not None, 120, "the first steps")
        self.assertIsNone(proc.poll(), proc.output())
        first = self.pids(proc.output())
        second = self.kill_rank(proc, 1, 1, 2)
        self.assertEqual(second[(2, 0)], first[(1, 0)], proc.output())
        # Rank 1 of generation 2 came from a standby; now its peer dies and it must park.
        third = self.kill_rank(proc, 2, 0, 3)
        self.assertEqual(third[(3, 1)], second[(2, 1)], "the standby-made rank 1 kept its process\n" + proc.output())
        self.assertNotEqual(third[(3, 0)], second[(2, 0)])
        out = self.finish(proc)
        self.assertIn("ddplaunch (rank 0): received the state rank 1 sent", out)


if __name__ == "__main__":
    unittest.main(verbosity=2)
