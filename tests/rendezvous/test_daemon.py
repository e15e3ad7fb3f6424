"""ddp-rendezvous as a process: serving, logging, status, signals and exit codes (loopback only)."""

import json
import os
import re
import signal
import socket
import struct
import subprocess
import tempfile
import time
import unittest

BIN = os.path.join(os.environ.get("DDPLAUNCH_BUILD_DIR", "build"), "bin", "ddp-rendezvous")


def frame(msg):
    data = json.dumps(msg).encode()
    return struct.pack(">I", len(data)) + data


def recv_msg(sock, timeout=5.0):
    sock.settimeout(timeout)
    def exact(n):
        buf = b""
        while len(buf) < n:
            chunk = sock.recv(n - len(buf))
            if not chunk:
                raise EOFError("closed")
            buf += chunk
        return buf
    (n,) = struct.unpack(">I", exact(4))
    return json.loads(exact(n))


def recv_type(sock, typ, timeout=5.0):
    deadline = time.time() + timeout
    while time.time() < deadline:
        m = recv_msg(sock, max(0.01, deadline - time.time()))
        if m["type"] == typ:
            return m
    raise TimeoutError(typ)


class Daemon:
    def __init__(self, *args):
        self.log = tempfile.NamedTemporaryFile("w+", delete=False)
        self.proc = subprocess.Popen([BIN, "--host", "127.0.0.1", "--port", "0", *args],
                                     stdout=self.log, stderr=subprocess.STDOUT)
        self.port = None
        deadline = time.time() + 10
        while time.time() < deadline and self.port is None:
            m = re.search(r"listening on 127\.0\.0\.1:(\d+)", self.text())
            if m:
                self.port = int(m.group(1))
            elif self.proc.poll() is not None:
                break
            else:
                time.sleep(0.02)
        if self.port is None:
            self.stop()
            raise AssertionError("daemon did not start: " + self.text())

    def text(self):
        with open(self.log.name) as f:
            return f.read()

    def wait_log(self, pattern, timeout=5.0):
        deadline = time.time() + timeout
        while time.time() < deadline:
            if re.search(pattern, self.text()):
                return True
            time.sleep(0.02)
        return False

    def stop(self):
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=10)
        os.unlink(self.log.name)


def status(port, *args):
    return subprocess.run([BIN, "status", "--endpoint", f"127.0.0.1:{port}", *args],
                          capture_output=True, text=True, timeout=30)


def join(port, job, host, token="", workers=2):
    s = socket.create_connection(("127.0.0.1", port), timeout=5)
    s.sendall(frame({"type": "hello", "protocol_version": 1, "job_id": job, "token": token}))
    assert recv_msg(s)["type"] == "welcome"
    node = {"job_id": job, "host": host, "local_world_size": workers, "min_nodes": 1, "max_nodes": 2,
            "master_port": 29500,
            "timeouts": {"last_call_timeout": 0.1, "heartbeat_timeout": 30, "join_timeout": 30}}
    s.sendall(frame({"type": "join", "node": node}))
    return s


class DaemonTest(unittest.TestCase):
    def setUp(self):
        self.token = tempfile.NamedTemporaryFile("w", delete=False)
        self.token.write("s3cret\n")
        self.token.close()
        self.daemon = Daemon("--token-file", self.token.name)
        self.addCleanup(self.daemon.stop)
        self.addCleanup(os.unlink, self.token.name)

    def test_status_shows_jobs_generation_nodes_and_restarts(self):
        r = status(self.daemon.port, "--token-file", self.token.name)
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertIn("no jobs", r.stdout)
        s = join(self.daemon.port, "train42", "nodeA", "s3cret", workers=4)
        self.addCleanup(s.close)
        a = recv_type(s, "round")["assignment"]
        self.assertEqual(a["generation"], 1)
        r = status(self.daemon.port, "--token-file", self.token.name, "--json")
        self.assertEqual(r.returncode, 0, r.stderr)
        job = json.loads(r.stdout)["jobs"][0]
        self.assertEqual(job["job_id"], "train42")
        self.assertEqual(job["state"], "running")
        self.assertEqual(job["generation"], 1)
        self.assertEqual(job["restarts_used"], 0)
        self.assertEqual(job["nodes"][0]["host"], "nodeA")
        self.assertEqual(job["nodes"][0]["workers"], 4)
        self.assertEqual(job["nodes"][0]["addr"], "127.0.0.1")
        text = status(self.daemon.port, "--token-file", self.token.name).stdout
        self.assertIn("job train42: running, generation 1", text)
        self.assertRegex(text, r"0\s+nodeA\s+127\.0\.0\.1\s+4\s+running")

    def test_status_with_a_wrong_token_exits_3_naming_the_token(self):
        r = status(self.daemon.port)
        self.assertEqual(r.returncode, 3)
        self.assertIn("token", r.stderr)

    def test_membership_events_are_logged_with_timestamps(self):
        a = join(self.daemon.port, "j", "hostA", "s3cret")
        recv_type(a, "round")
        b = join(self.daemon.port, "j", "hostB", "s3cret")
        recv_type(a, "restart")
        a.sendall(frame({"type": "join", "node": {"job_id": "j", "host": "hostA", "local_world_size": 2,
                                                    "min_nodes": 1, "max_nodes": 2}}))
        recv_type(b, "round")
        b.close()  # like a killed agent
        self.assertTrue(self.daemon.wait_log(r"lost: hostB"), self.daemon.text())
        a.close()
        self.assertTrue(self.daemon.wait_log(r"job j: no nodes left"), self.daemon.text())
        text = self.daemon.text()
        for event in ("join hostA", "round 1 complete", "restart after generation 1", "round 2 complete"):
            self.assertRegex(text, r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z job j: .*" + re.escape(event))

    def test_sigterm_stops_it_cleanly(self):
        s = join(self.daemon.port, "j", "hostA", "s3cret")
        self.addCleanup(s.close)
        self.daemon.proc.send_signal(signal.SIGTERM)
        self.assertEqual(self.daemon.proc.wait(timeout=10), 0)
        self.assertIn("stopping on SIGTERM", self.daemon.text())

    def test_a_taken_port_exits_3(self):
        r = subprocess.run([BIN, "--host", "127.0.0.1", "--port", str(self.daemon.port)],
                           capture_output=True, text=True, timeout=30)
        self.assertEqual(r.returncode, 3)
        self.assertIn(f"cannot listen on 127.0.0.1:{self.daemon.port}", r.stderr)

    def test_usage_errors_exit_2(self):
        for args, text in ((["--bogus"], "bogus"),
                           (["--token-file", "/nonexistent/token"], "cannot read --token-file"),
                           (["--host", "not-an-ip"], "not an IP address"),
                           (["status", "--endpoint", "127.0.0.1:notaport"], "port must be"),
                           (["status"], "endpoint")):
            r = subprocess.run([BIN, *args], capture_output=True, text=True, timeout=30)
            self.assertEqual(r.returncode, 2, args)
            self.assertIn(text, r.stderr + r.stdout, args)

    def test_status_of_nothing_listening_exits_3(self):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        s.close()
        r = status(port)
        self.assertEqual(r.returncode, 3)
        self.assertIn("Connection refused", r.stderr)


if __name__ == "__main__":
    unittest.main()
