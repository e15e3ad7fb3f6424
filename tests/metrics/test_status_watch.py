"""`ddp-rendezvous status --watch` in a real terminal: tmux runs the command
in a pane; the test captures the pane, sees the table, sees it change as a job starts and ends,
sends C-c and sees a clean exit. Also: status defaults to localhost:29400 and shows a finished
job, marked, after its nodes left. Skipped with a printed reason without tmux."""

import json
import os
import shutil
import subprocess
import unittest
import uuid

from metrics_helpers import RENDEZVOUS, MetricsTestCase, processes, wait_for

TMUX = shutil.which("tmux")


class StatusWatchTest(MetricsTestCase):
    def setUp(self):
        super().setUp()
        if TMUX is None:
            print("SKIP: no tmux (apt-get install tmux; scripts/setup installs it)")
            self.skipTest("no tmux")
        # A private tmux server (its own socket): nothing of the user's sessions is touched.
        self.socket = os.path.join(self.tmp, "tmux.sock")
        self.session = "watch-" + uuid.uuid4().hex[:8]
        self.addCleanup(lambda: subprocess.run([TMUX, "-S", self.socket, "kill-server"], capture_output=True,
                                               timeout=10))

    def tmux(self, *args):
        return subprocess.run([TMUX, "-S", self.socket] + list(args), capture_output=True, text=True, timeout=10)

    def pane(self):
        return self.tmux("capture-pane", "-p", "-t", self.session).stdout

    def test_the_table_redraws_as_a_job_runs_and_ends_and_ctrl_c_exits_cleanly(self):
        self.start_daemon()
        command = "%s status --watch --interval 0.3 --endpoint 127.0.0.1:%d; echo WATCH-EXIT=$?; sleep 60" % (
            RENDEZVOUS, self.port)
        r = self.tmux("new-session", "-d", "-s", self.session, "-x", "160", "-y", "50", command)
        self.assertEqual(r.returncode, 0, r.stderr)
        wait_for(lambda: "no jobs" in self.pane(), 20, "the empty table in the pane")
        self.assertIn("Ctrl-C to stop", self.pane())

        job = self.spawn_launch(self.job_args("watched", extra=[]))
        wait_for(lambda: self.started(0, 0) and self.started(1, 0), 60, "both workers to start")
        screen = wait_for(lambda: (lambda p: p if "watched" in p and "running" in p else None)(self.pane()), 20,
                          "the running job in the pane")
        self.assertIn("HEARTBEAT", screen)
        self.assertRegex(screen, r"watched\s+running\s+1\s+0/0")
        self.assertRegex(screen, r"\n\s+0\s+\S+\s+running\s+\d+\.\d s")
        self.assertNotIn("(* finished", screen, "no legend for a mark the table does not show")
        self.release()
        self.assertEqual(job.wait(60), 0, job.describe())
        # The job ended and its node left: it stays listed, marked finished, with its end time.
        screen = wait_for(lambda: (lambda p: p if "succeeded*" in p else None)(self.pane()), 20,
                          "the finished job in the pane")
        self.assertRegex(screen, r"watched\s+succeeded\*\s+1\s+0/0\s+\S+\s+\d\d\d\d-\d\d-\d\d \d\d:\d\d:\d\d UTC")
        self.assertIn("(* finished: kept for a while", screen)

        print(screen)
        self.tmux("send-keys", "-t", self.session, "C-c")
        screen = wait_for(lambda: (lambda p: p if "WATCH-EXIT=" in p else None)(self.pane()), 20,
                          "the watch to exit after C-c")
        self.assertIn("WATCH-EXIT=0", screen)

    def test_watch_json_prints_one_document_per_line(self):
        self.start_daemon()
        proc = processes.spawn([RENDEZVOUS, "status", "--watch", "--json", "--interval", "0.2", "--endpoint",
                                "127.0.0.1:%d" % self.port], name="status --watch --json")
        self.addCleanup(proc.kill)
        wait_for(lambda: len(proc.stdout().splitlines()) >= 3, 20, "three JSON frames")
        proc.signal(2)
        self.assertEqual(proc.wait(20), 0, proc.describe())
        docs = [json.loads(line) for line in proc.stdout().splitlines()]
        self.assertTrue(all(d["jobs"] == [] and d["time"] > 0 for d in docs), docs)

    def test_status_defaults_to_localhost_29400(self):
        if processes.port_open(29400):
            print("SKIP: something listens on 29400 here; the default endpoint cannot be tried")
            self.skipTest("port 29400 in use")
        r = processes.run([RENDEZVOUS, "status", "--timeout", "5"], timeout=30)
        self.assertEqual(r.returncode, 3, r.describe())
        self.assertIn("localhost:29400", r.stderr)


if __name__ == "__main__":
    unittest.main(verbosity=2)
