"""The metrics HTTP server through the real binaries: /metrics, /healthz, /readyz and the
dashboard's routes (/, /api/status, /api/events) of the daemon and of ddplaunch, values that follow a real job, and hostile clients (garbage, huge
heads, a slow client, a flood of idle connections) that neither stop the metrics nor the
rendezvous. Loopback only; every wait has a deadline."""

import json
import socket
import time
import unittest

from metrics_helpers import (PYTHON, RENDEZVOUS, WAITING_WORKER, MetricsTestCase, http_get, metrics_port_from, processes, raw_connection,
                             read_until_closed,
                             samples, wait_for)


class DaemonMetricsTest(MetricsTestCase):
    def test_metrics_healthz_readyz_and_errors(self):
        self.start_daemon()
        status, ctype, body = http_get(self.metrics_port, "/metrics")
        self.assertEqual(status, 200)
        self.assertEqual(ctype, "text/plain; version=0.0.4; charset=utf-8")
        self.assertIn("# TYPE ddp_rendezvous_rounds_total counter", body)
        self.assertIn("# TYPE ddp_rendezvous_round_formation_seconds histogram", body)
        s = samples(body)
        self.assertEqual(s["ddp_rendezvous_rounds_total"], 0)
        self.assertEqual(s['ddp_rendezvous_jobs{state="running"}'], 0)
        self.assertEqual(http_get(self.metrics_port, "/healthz")[0], 200)
        self.assertEqual(http_get(self.metrics_port, "/readyz")[0], 200)
        self.assertEqual(http_get(self.metrics_port, "/nope")[0], 404)
        self.assertEqual(http_get(self.metrics_port, "/metrics", method="POST")[0], 405)

    def test_values_follow_a_job_with_one_failure(self):
        self.start_daemon()
        self.exit_code_for(1, 0, 7)  # rank 1 fails in the first attempt; the restart succeeds
        self.release()
        r = self.launch(self.job_args("m1", max_restarts=1), timeout=120)
        self.assertEqual(r.returncode, 0, r.describe())

        def scraped():
            s = samples(http_get(self.metrics_port, "/metrics")[2])
            return s if s.get('ddp_rendezvous_jobs_ended_total{result="succeeded"}') == 1 else None
        s = wait_for(scraped, 20, "the job's end in the daemon's metrics")
        self.assertEqual(s["ddp_rendezvous_rounds_total"], 2)
        self.assertEqual(s['ddp_rendezvous_failures_total{cause="exit_code"}'], 1)
        self.assertEqual(s['ddp_rendezvous_restarts_total{cause="worker_failure",counted="true"}'], 1)
        self.assertEqual(s["ddp_rendezvous_round_formation_seconds_count"], 2)
        self.assertEqual(s['ddp_rendezvous_round_formation_seconds_bucket{le="+Inf"}'], 2)
        self.assertEqual(s["ddp_rendezvous_failure_to_restart_seconds_count"], 1)
        self.assertGreater(s["ddp_rendezvous_failure_to_restart_seconds_sum"], 0)

    def test_the_dashboard_and_its_routes_follow_a_job_with_one_failure(self):
        self.start_daemon()
        status, ctype, page = http_get(self.metrics_port, "/")
        self.assertEqual((status, ctype), (200, "text/html; charset=utf-8"))
        self.assertIn("/api/status", page)
        self.exit_code_for(1, 0, 7)
        self.release()
        r = self.launch(self.job_args("d1", max_restarts=1), timeout=120)
        self.assertEqual(r.returncode, 0, r.describe())

        def ended():
            events = json.loads(http_get(self.metrics_port, "/api/events")[2])["events"]
            return events if any(e["type"] == "job_end" and e["job"] == "d1" for e in events) else None
        events = wait_for(ended, 20, "the job's end in /api/events")
        types = [e["type"] for e in events if e["job"] == "d1"]
        for t in ("round", "failure", "restart", "job_end"):
            self.assertIn(t, types)
        restart = next(e for e in events if e["type"] == "restart")
        self.assertEqual((restart["cause"], restart["counted"]), ("worker_failure", True))
        self.assertIn("exited with code 7", restart["message"])
        api = json.loads(http_get(self.metrics_port, "/api/status")[2])
        cli = processes.run([RENDEZVOUS, "status", "--endpoint", "127.0.0.1:%d" % self.port, "--json"], timeout=30)
        self.assertEqual(cli.returncode, 0, cli.describe())
        mine = [j for j in json.loads(cli.stdout)["jobs"] if j["job_id"] == "d1"]
        shown = [j for j in api["jobs"] if j["job_id"] == "d1"]
        self.assertEqual(len(shown), 1)
        for key in ("state", "generation", "restarts_used", "max_restarts"):
            self.assertEqual(shown[0][key], mine[0][key], key)

    def test_bad_metrics_flags_are_refused_naming_them(self):
        r = processes.run([RENDEZVOUS, "--host", "127.0.0.1", "--port", "0", "--metrics_port", "0",
                           "--metrics_addr", "not-an-ip"], timeout=30)
        self.assertEqual(r.returncode, 2, r.describe())
        self.assertIn("--metrics_addr not-an-ip", r.stderr)
        r = processes.run([RENDEZVOUS, "--host", "127.0.0.1", "--port", "0", "--metrics_port", "70000"], timeout=30)
        self.assertEqual(r.returncode, 2, r.describe())
        self.start_daemon()  # its metrics port is taken now
        r = processes.run([RENDEZVOUS, "--host", "127.0.0.1", "--port", "0", "--metrics_port",
                           str(self.metrics_port)], timeout=30)
        self.assertEqual(r.returncode, 3, r.describe())
        self.assertIn("cannot serve metrics on 127.0.0.1:%d" % self.metrics_port, r.stderr)


class AgentMetricsTest(MetricsTestCase):
    def test_the_agent_serves_its_workers_and_is_ready_while_they_run(self):
        self.start_daemon()
        proc = self.spawn_launch(self.job_args("a1", extra=["--metrics_port=0"]))
        port = wait_for(lambda: metrics_port_from(proc.stderr(), "ddplaunch: metrics"), 30, "ddplaunch's metrics line")
        wait_for(lambda: self.started(0, 0) and self.started(1, 0), 60, "both workers to start")
        s = wait_for(lambda: (lambda s: s if s["ddp_agent_workers_running"] == 2 else None)(
            samples(http_get(port, "/metrics")[2])), 20, "2 running workers in the agent's metrics")
        self.assertEqual(s["ddp_agent_worker_starts_total"], 2)
        self.assertEqual(s["ddp_agent_generation"], 1)
        self.assertEqual(http_get(port, "/readyz")[0], 200)
        self.assertEqual(http_get(port, "/healthz")[0], 200)
        self.release()
        self.assertEqual(proc.wait(60), 0, proc.describe())

    def test_progress_reports_become_each_local_ranks_last_step_and_rate(self):
        self.start_daemon()
        proc = self.spawn_launch(self.job_args("a3", extra=["--metrics_port=0"]), env={"METRICS_TEST_STEPPING": "1"})
        port = wait_for(lambda: metrics_port_from(proc.stderr(), "ddplaunch: metrics"), 30, "ddplaunch's metrics line")

        def stepping(s):
            return all(s.get('ddp_agent_last_step{local_rank="%d"}' % lr, 0) >= 1 and
                       s.get('ddp_agent_steps_per_second{local_rank="%d"}' % lr, 0) > 0 for lr in (0, 1))
        # The agent samples the progress board about once a second: a rate needs two samples.
        s = wait_for(lambda: (lambda s: s if stepping(s) else None)(samples(http_get(port, "/metrics")[2])), 60,
                     "a last step and a positive rate of local ranks 0 and 1 in the agent's metrics")
        # Workers step every 20 ms: no more than 50 a second (and the sampled rate is not made up).
        self.assertLessEqual(s['ddp_agent_steps_per_second{local_rank="0"}'], 60, s)
        self.release()
        self.assertEqual(proc.wait(60), 0, proc.describe())

    def test_an_agent_without_a_hosted_rendezvous_says_where_the_dashboard_is(self):
        self.start_daemon()
        proc = self.spawn_launch(self.job_args("a4", extra=["--metrics_port=0"]))
        port = wait_for(lambda: metrics_port_from(proc.stderr(), "ddplaunch: metrics"), 30, "ddplaunch's metrics line")
        status, ctype, body = http_get(port, "/")
        self.assertEqual((status, ctype), (200, "text/plain; charset=utf-8"))
        self.assertIn("does not host the rendezvous server at 127.0.0.1:%d" % self.port, body)
        self.assertEqual(http_get(port, "/api/status")[0], 404)
        self.release()
        self.assertEqual(proc.wait(60), 0, proc.describe())

    def test_a_hosting_agent_serves_the_dashboard_of_its_rendezvous(self):
        worker = self.script("worker.py", WAITING_WORKER)
        proc = self.spawn_launch(["--standalone", "--nproc_per_node=1", "--metrics_port=0",
                                  "--python", PYTHON, worker, self.out])
        port = wait_for(lambda: metrics_port_from(proc.stderr(), "ddplaunch: metrics"), 30, "ddplaunch's metrics line")
        self.assertIn("dashboard of the hosted rendezvous", proc.stderr())
        wait_for(lambda: self.started(0, 0), 60, "the worker to start")
        status, ctype, _ = http_get(port, "/")
        self.assertEqual((status, ctype), (200, "text/html; charset=utf-8"))
        jobs = json.loads(http_get(port, "/api/status")[2])["jobs"]
        self.assertEqual([j["state"] for j in jobs], ["running"])  # --standalone names its job itself
        events = json.loads(http_get(port, "/api/events")[2])["events"]
        self.assertIn(("round", jobs[0]["job_id"]), [(e["type"], e["job"]) for e in events])
        self.assertGreater(events[0]["time"], 1e9)  # stamped
        self.release()
        self.assertEqual(proc.wait(60), 0, proc.describe())

    def test_an_agent_whose_metrics_port_is_taken_exits_2_naming_it(self):
        self.start_daemon()
        r = self.launch(self.job_args("a2", extra=["--metrics_port=%d" % self.metrics_port]), timeout=60)
        self.assertEqual(r.returncode, 2, r.describe())
        self.assertIn("--metrics_port", r.stderr)
        self.assertIn(str(self.metrics_port), r.stderr)


class HostileClientTest(MetricsTestCase):
    """Nothing a client sends stops the metrics server or the rendezvous next to it."""

    def still_serving(self):
        self.assertEqual(http_get(self.metrics_port, "/healthz")[0], 200)
        self.assertIsNone(self.daemon.poll(), self.daemon.describe())
        raw_connection(self.port).close()  # the rendezvous port still accepts

    def test_garbage_and_huge_heads_get_an_error_and_a_close(self):
        self.start_daemon()
        s = raw_connection(self.metrics_port)
        s.sendall(b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03garbage\r\n\r\n")
        self.assertTrue(read_until_closed(s, 10).startswith(b"HTTP/1.1 400 "))
        s.close()
        s = raw_connection(self.metrics_port)
        self.addCleanup(s.close)
        try:
            s.sendall(b"GET /metrics HTTP/1.1\r\nX-Big: " + b"a" * 200000 + b"\r\n\r\n")
        except (BrokenPipeError, ConnectionResetError):
            pass  # closed while we were still sending: also a refusal
        try:
            reply = read_until_closed(s, 10)
            self.assertTrue(reply.startswith(b"HTTP/1.1 431 "), reply[:80])
        except ConnectionResetError:
            pass
        self.still_serving()

    def test_a_slow_client_is_cut_off_at_the_deadline_while_others_are_served(self):
        self.start_daemon()
        slow = raw_connection(self.metrics_port)
        self.addCleanup(slow.close)
        slow.sendall(b"GET /metr")
        start = time.monotonic()
        closed = False
        # One byte every half second, never finishing: the server's 10 s request deadline ends it.
        for ch in b"ics HTTP/1.1\r\nX-Slow: " + b"a" * 100:
            try:
                slow.sendall(bytes([ch]))
            except (BrokenPipeError, ConnectionResetError):
                closed = True
                break
            slow.settimeout(0.5)
            try:
                if slow.recv(1) == b"":
                    closed = True
                    break
            except socket.timeout:
                pass
            self.assertEqual(http_get(self.metrics_port, "/healthz", timeout=5)[0], 200)  # others are served
            if time.monotonic() - start > 30:
                break
        elapsed = time.monotonic() - start
        self.assertTrue(closed, "the slow client was still connected after %.1f s" % elapsed)
        self.assertLess(elapsed, 25)
        print("slow client cut off after %.1f s (request deadline 10 s)" % elapsed)
        self.still_serving()

    def test_the_dashboard_routes_refuse_what_metrics_refuses(self):
        self.start_daemon()
        for path in ("/", "/api/status", "/api/events"):
            for method in ("POST", "PUT", "DELETE", "OPTIONS"):
                self.assertEqual(http_get(self.metrics_port, path, method=method)[0], 405, (method, path))
            # A body is refused before any route runs; so is a head over 8 KiB.
            s = raw_connection(self.metrics_port)
            s.sendall(("GET %s HTTP/1.1\r\nContent-Length: 5\r\n\r\nhello" % path).encode())
            self.assertTrue(read_until_closed(s, 10).startswith(b"HTTP/1.1 413 "), path)
            s.close()
            s = raw_connection(self.metrics_port)
            try:
                s.sendall(("GET %s HTTP/1.1\r\nX-Big: " % path).encode() + b"a" * 20000 + b"\r\n\r\n")
                reply = read_until_closed(s, 10)
                self.assertTrue(reply.startswith(b"HTTP/1.1 431 "), reply[:80])
            except (BrokenPipeError, ConnectionResetError):
                pass  # closed while we were still sending: also a refusal
            s.close()
            s = raw_connection(self.metrics_port)
            s.sendall(("GET %s\x00<script> HTTP/1.1\r\n\r\n" % path).encode())
            self.assertTrue(read_until_closed(s, 10).startswith(b"HTTP/1.1 400 "), path)
            s.close()
            # HEAD: the length of what GET sends, no body.
            s = raw_connection(self.metrics_port)
            s.sendall(("HEAD %s HTTP/1.0\r\n\r\n" % path).encode())
            head = read_until_closed(s, 10)
            s.close()
            self.assertTrue(head.startswith(b"HTTP/1.1 200 "), head[:80])
            self.assertTrue(head.endswith(b"\r\n\r\n"), head[-80:])
            self.assertIn(b"Content-Length: ", head)
        # A query string is ignored, a path below a route is not one.
        self.assertEqual(http_get(self.metrics_port, "/api/status?job=%3Cscript%3E")[0], 200)
        status, _, body = http_get(self.metrics_port, "/api/status/../../metrics")
        self.assertEqual(status, 404)
        self.still_serving()

    def test_a_flood_of_idle_connections_is_bounded(self):
        self.start_daemon()
        socks = []
        for _ in range(100):
            socks.append(raw_connection(self.metrics_port))
        # Past the 64 the server holds, new connections are closed at accept.
        refused = 0
        for s in socks[64:]:
            s.settimeout(5)
            try:
                refused += s.recv(1) == b""
            except ConnectionResetError:
                refused += 1
            except socket.timeout:
                pass
        self.assertGreaterEqual(refused, 30)
        for s in socks:
            s.close()
        wait_for(lambda: http_get(self.metrics_port, "/healthz", timeout=2)[0] == 200, 20,
                 "the metrics server to serve again once the idle clients left")
        self.still_serving()


if __name__ == "__main__":
    unittest.main(verbosity=2)
