"""--event_log: a job with one failure, its event logs (the agent's and the
daemon's) read back and matched to what happened: order, causes, ranks, generations. Also
torchrun's --event_log_handler values. Loopback only; every wait has a deadline."""

import json
import os
import unittest

from metrics_helpers import MetricsTestCase, wait_for


def read_events(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


class EventLogTest(MetricsTestCase):
    def test_a_job_with_one_failure_is_told_in_order_by_agent_and_daemon(self):
        daemon_log = os.path.join(self.tmp, "daemon-events.jsonl")
        agent_log = os.path.join(self.tmp, "agent-events.jsonl")
        self.start_daemon(["--event_log", daemon_log])
        # Attempt 0: rank 1 exits 7 at once, rank 0 waits and is stopped; attempt 1: both exit 0.
        self.exit_code_for(1, 0, 7)
        self.exit_code_for(0, 1, 0)
        self.exit_code_for(1, 1, 0)
        r = self.launch(self.job_args("ev1", max_restarts=1, extra=["--event_log=" + agent_log]), timeout=120)
        self.assertEqual(r.returncode, 0, r.describe())

        events = read_events(agent_log)
        self.assertTrue(all(e["job"] == "ev1" and e["node"] for e in events), events)
        times = [e["time"] for e in events]
        self.assertEqual(times, sorted(times))
        kinds = [(e["type"], e["generation"]) for e in events]
        # The two starts (and the two exits of attempt 1) may come in either rank order.
        self.assertEqual(kinds[:3], [("round", 1), ("worker_started", 1), ("worker_started", 1)], kinds)
        self.assertEqual(sorted(e["ranks"][0] for e in events[1:3]), [0, 1])
        failed = events[3]
        self.assertEqual((failed["type"], failed["cause"], failed["ranks"], failed["exit_code"], failed["generation"]),
                         ("worker_exited", "exit_code", [1], 7, 1))
        # The rendezvous's restart decision and the stopped worker's exit race: either order.
        stopped, restart = sorted(events[4:6], key=lambda e: e["type"] != "worker_exited")
        self.assertEqual((stopped["type"], stopped["cause"], stopped["ranks"], stopped["generation"]),
                         ("worker_exited", "stopped", [0], 1))
        self.assertEqual(stopped["signal"], 15)
        self.assertEqual((restart["type"], restart["cause"], restart["counted"]), ("restart", "worker_failure", True))
        self.assertEqual(events[6]["type"], "round")
        self.assertEqual(events[6]["generation"], 2)
        self.assertEqual(events[6]["ranks"], [0, 1])
        self.assertEqual(events[6]["restart_count"], 1)
        self.assertEqual([(e["type"], e["generation"]) for e in events[7:9]], [("worker_started", 2)] * 2)
        exits = events[9:11]
        self.assertEqual(sorted((e["type"], e["cause"], e["ranks"][0], e["generation"]) for e in exits),
                         [("worker_exited", "success", 0, 2), ("worker_exited", "success", 1, 2)])
        self.assertEqual((events[11]["type"], events[11]["cause"]), ("job_end", "succeeded"))
        self.assertEqual(len(events), 12, kinds)

        # The daemon saw the same story from its side.
        d = wait_for(lambda: (lambda ev: ev if any(e["type"] == "job_end" for e in ev) else None)(
            read_events(daemon_log)), 20, "the job's end in the daemon's event log")
        dk = [(e["type"], e["cause"], e["generation"]) for e in d]
        self.assertEqual(dk, [("round", "complete", 1), ("failure", "exit_code", 1), ("restart", "worker_failure", 1),
                              ("round", "complete", 2), ("job_end", "succeeded", 2)], dk)
        self.assertEqual(d[1]["ranks"], [1])
        self.assertEqual(d[1]["exit_code"], 7)
        self.assertGreaterEqual(d[3]["failure_to_restart_seconds"], 0)
        self.assertIn("formation_seconds", d[0])

    def test_a_failed_job_logs_the_same_failure_as_its_summary(self):
        agent_log = os.path.join(self.tmp, "agent-events.jsonl")
        self.start_daemon()
        self.exit_code_for(1, 0, 3)
        r = self.launch(self.job_args("ev2", extra=["--event_log=" + agent_log]), timeout=120)
        self.assertEqual(r.returncode, 1, r.describe())
        events = read_events(agent_log)
        failed = [e for e in events if e["type"] == "worker_exited" and e["cause"] == "exit_code"]
        self.assertEqual(len(failed), 1, events)
        self.assertEqual((failed[0]["ranks"], failed[0]["exit_code"]), ([1], 3))
        self.assertIn("exitcode  : 3", r.stderr)
        self.assertIn("rank      : 1", r.stderr)
        self.assertEqual((events[-1]["type"], events[-1]["cause"], events[-1]["exit_code"]), ("job_end", "failed", 1))

    def test_torchruns_event_log_handler_values(self):
        self.start_daemon()
        self.release()
        r = self.launch(self.job_args("ev3", nproc=1, extra=["--event_log_handler=console"]), timeout=120)
        self.assertEqual(r.returncode, 0, r.describe())
        lines = [json.loads(line) for line in r.stderr.splitlines() if line.startswith("{")]
        self.assertEqual([e["type"] for e in lines], ["round", "worker_started", "worker_exited", "job_end"])
        r = self.launch(self.job_args("ev4", nproc=1, extra=["--event_log_handler=null"]), timeout=120)
        self.assertEqual(r.returncode, 0, r.describe())
        self.assertNotIn('"type":"round"', r.stderr)
        r = self.launch(self.job_args("ev5", nproc=1, extra=["--event_log_handler=fancy"]), timeout=60)
        self.assertEqual(r.returncode, 2, r.describe())
        self.assertIn("--event_log_handler", r.stderr)
        self.assertIn("console", r.stderr)

    def test_an_event_log_that_cannot_be_opened_is_a_usage_error(self):
        self.start_daemon()
        r = self.launch(self.job_args("ev6", nproc=1, extra=["--event_log=/nonexistent/dir/events"]), timeout=60)
        self.assertEqual(r.returncode, 2, r.describe())
        self.assertIn("/nonexistent/dir/events", r.stderr)


if __name__ == "__main__":
    unittest.main(verbosity=2)
