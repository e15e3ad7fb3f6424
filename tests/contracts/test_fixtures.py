"""The golden fixtures (contracts/fixtures/, README.md there) read and written by the Python
package: python/ddplaunch_standby.py (the assignment's decoder, the worker channel's frames that
ddplaunch.InMemoryRestart sends) and python/ddplaunch/__init__.py (the progress slot).
tests/contracts/fixtures_test.cpp holds the C++ side to the same files, so a change of format on
either side fails the other's test."""

import importlib
import json
import os
import shutil
import sys
import tempfile
import unittest

SOURCE = os.environ.get("DDPLAUNCH_SOURCE_DIR") or os.path.abspath(
    os.path.join(os.path.dirname(__file__), "..", ".."))
FIXTURES = os.path.join(SOURCE, "contracts", "fixtures")
sys.path.insert(0, os.path.join(SOURCE, "python"))

import ddplaunch_standby  # noqa: E402

WORKER_FIXTURES = [
    ("worker_restartable.bin", {"type": "restartable", "value": True}),
    ("worker_parked.bin", {"type": "parked", "step": 1234}),
    ("worker_standby_ready.bin", {"type": "standby_ready"}),
]


def fixture(name):
    with open(os.path.join(FIXTURES, name), "rb") as f:
        return f.read()


def fresh_ddplaunch(slot_file):
    """The ddplaunch package imported anew with `slot_file` as its progress board, slot 0: it
    opens its slot when imported."""
    os.environ["DDPLAUNCH_PROGRESS_FILE"] = slot_file
    os.environ["DDPLAUNCH_PROGRESS_SLOT"] = "0"
    try:
        for name in [m for m in sys.modules if m == "ddplaunch" or m.startswith("ddplaunch.")]:
            del sys.modules[name]
        return importlib.import_module("ddplaunch")
    finally:
        del os.environ["DDPLAUNCH_PROGRESS_FILE"]
        del os.environ["DDPLAUNCH_PROGRESS_SLOT"]


class WorkerChannel(unittest.TestCase):
    def test_each_message_encodes_to_its_fixture(self):
        for name, message in WORKER_FIXTURES:
            with self.subTest(name):
                self.assertEqual(ddplaunch_standby.encode_frame(message), fixture(name))

    def test_each_fixture_has_the_header_and_payload_the_package_writes(self):
        header = ddplaunch_standby.FRAME_HEADER
        for name, message in WORKER_FIXTURES:
            with self.subTest(name):
                data = fixture(name)
                magic, version, length = header.unpack_from(data)
                self.assertEqual(magic, ddplaunch_standby.WORKER_MAGIC)
                self.assertEqual(version, ddplaunch_standby.WORKER_VERSION)
                self.assertEqual(length, len(data) - header.size)
                self.assertEqual(json.loads(data[header.size:]), message)

    def test_send_frame_writes_the_fixture(self):
        r, w = os.pipe()
        try:
            ddplaunch_standby.send_frame(w, {"step": 1234, "type": "parked"})
            self.assertEqual(os.read(r, 4096), fixture("worker_parked.bin"))
        finally:
            os.close(r)
            os.close(w)


class StandbyAssignment(unittest.TestCase):
    def test_the_assignment_fixture_decodes_to_its_environment_and_directory(self):
        env, cwd = ddplaunch_standby.decode(fixture("assignment.bin"))
        self.assertEqual(cwd, "/work/job")
        self.assertEqual(env, {"LANG": "C.UTF-8", "MASTER_ADDR": "10.0.0.1", "NOTE": "gr\u00fc\u00df",
                               "PATH": "/usr/bin:/bin", "RANK": "3"})

    def test_the_assignment_nested_one_level_too_deep_is_refused_by_the_depth_limit(self):
        with self.assertRaises(ddplaunch_standby.BadAssignment) as cm:
            ddplaunch_standby.decode(fixture("assignment_too_deep.bin"))
        self.assertIn("nested deeper", str(cm.exception))


class ProgressSlot(unittest.TestCase):
    def setUp(self):
        self.dir = tempfile.mkdtemp(prefix="ddp-contracts-")
        self.addCleanup(shutil.rmtree, self.dir)
        self.golden = fixture("progress_slot.bin")

    def slot_file(self, data):
        path = os.path.join(self.dir, "board")
        with open(path, "wb") as f:
            f.write(data)
        return path

    def test_the_package_reads_the_golden_slot(self):
        ddplaunch = fresh_ddplaunch(self.slot_file(self.golden))
        self.assertEqual(len(self.golden), ddplaunch._SLOT_SIZE)
        self.assertTrue(ddplaunch.enabled())
        self.assertEqual(list(ddplaunch._words), [7, 1234, 1200])
        self.assertEqual(ddplaunch._get_phase(), "forward/backward")
        self.assertTrue(ddplaunch.abandoned())
        self.assertEqual(ddplaunch._get_checkpoint_interval(), 90.5)
        self.assertTrue(ddplaunch._final())
        self.assertEqual(ddplaunch._get_busy(), 0.412)
        self.assertEqual(ddplaunch._bytes[ddplaunch._STALL_OFFSET:ddplaunch._STALL_OFFSET + 8].cast("Q")[0], 2500000)
        self.assertEqual(ddplaunch._bytes[ddplaunch._FIRST_OFFSET:ddplaunch._FIRST_OFFSET + 8].cast("Q")[0], 1229)

    def test_the_package_writes_the_golden_slot(self):
        path = self.slot_file(bytes(len(self.golden)))
        ddplaunch = fresh_ddplaunch(path)
        for n in range(1228, 1235):
            ddplaunch.step(n)
        ddplaunch.checkpoint(1200)
        ddplaunch._set_phase("forward/backward")
        ddplaunch._set_checkpoint_interval(90.5)
        ddplaunch._set_final()
        ddplaunch._set_busy(0.412)
        ddplaunch._add_checkpoint_stall(1.5)
        ddplaunch._add_checkpoint_stall(1.0)
        with open(path, "rb") as f:
            written = f.read()
        # The abandoned word is the agent's to write (agent/progress.h): all but it is the worker's.
        worker_part = ddplaunch._ABANDONED_OFFSET
        self.assertEqual(written[:worker_part], self.golden[:worker_part])
        self.assertEqual(written[worker_part:worker_part + 8], bytes(8))
        self.assertEqual(written[worker_part + 8:], self.golden[worker_part + 8:])
        self.assertFalse(ddplaunch.abandoned())


if __name__ == "__main__":
    unittest.main()
