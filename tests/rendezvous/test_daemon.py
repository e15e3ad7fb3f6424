"""ddp-rendezvous as a process: serving, logging, status, signals and exit codes (loopback only)."""

import hashlib
import hmac
import json
import os
import re
import shutil
import signal
import socket
import struct
import subprocess
import tempfile
import time
import unittest

BIN = os.path.join(os.environ.get("DDPLAUNCH_BUILD_DIR", "build"), "bin", "ddp-rendezvous")
SOURCE = os.environ.get("DDPLAUNCH_SOURCE_DIR") or os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
with open(os.path.join(SOURCE, "rendezvous", "protocol.h")) as _f:
    PROTOCOL = int(re.search(r"kProtocolVersion = (\d+);", _f.read()).group(1))  # the one source


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
    def __init__(self, *args, env=None):
        self.log = tempfile.NamedTemporaryFile("w+", delete=False)
        self.proc = subprocess.Popen([BIN, "--host", "127.0.0.1", "--port", "0", *args],
                                     stdout=self.log, stderr=subprocess.STDOUT, env=env)
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


def proof(secret, role, server_nonce, client_nonce, job):
    text = f"ddplaunch-rdzv-2\n{role}\n{server_nonce}\n{client_nonce}\n{job}"
    return hmac.new(secret.encode(), text.encode(), hashlib.sha256).hexdigest()


def hello(sock, job, token="", role="hello"):
    """Answers the server's challenge like an agent; returns (server_nonce, client_nonce)."""
    challenge = recv_type(sock, "challenge")
    client_nonce = os.urandom(16).hex()
    msg = {"type": role, "protocol_version": PROTOCOL, "client_nonce": client_nonce,
           "proof": proof(token, role, challenge["nonce"], client_nonce, job) if token else ""}
    if job:
        msg["job_id"] = job
    sock.sendall(frame(msg))
    return challenge["nonce"], client_nonce


def node(job, host, workers=2, **extra):
    n = {"job_id": job, "host": host, "local_world_size": workers, "min_nodes": 1, "max_nodes": 2,
         "master_port": 29500,
         "timeouts": {"last_call_timeout": 0.1, "heartbeat_timeout": 30, "join_timeout": 30}}
    n.update(extra)
    return n


def join(port, job, host, token="", workers=2, **extra):
    s = socket.create_connection(("127.0.0.1", port), timeout=5)
    hello(s, job, token)
    assert recv_msg(s)["type"] == "welcome"
    s.sendall(frame({"type": "join", "node": node(job, host, workers, **extra)}))
    return s


def expect_error(sock, code, timeout=5.0):
    """The next error message (its code checked), then the server closes the connection."""
    m = recv_type(sock, "error", timeout)
    assert m["code"] == code, m
    sock.settimeout(timeout)
    try:
        while sock.recv(65536):
            pass
    except ConnectionResetError:
        pass
    return m


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
        a.sendall(frame({"type": "join", "node": node("j", "hostA")}))
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
        bad_secrets = per_job_token_file("jobA secret extra-word\n")
        self.addCleanup(os.unlink, bad_secrets)
        no_secret = per_job_token_file("# only a comment\n")
        self.addCleanup(os.unlink, no_secret)
        for args, text in ((["--token_file", bad_secrets], "expected SECRET or JOB_ID SECRET"),
                           (["--token_file", no_secret], "holds no secret"),
                           (["--bogus"], "bogus"),
                           (["--token-file", "/nonexistent/token"], "cannot read the token file /nonexistent/token"),
                           (["--host", "not-an-ip"], "not an IP address"),
                           (["status", "--endpoint", "127.0.0.1:notaport"], "port must be"),
                           (["status", "--endpoint", "127.0.0.1:0"], "port 0 (a free port) cannot be connected to"),
                           (["status", "--endpoint", "fe80::1:29400"], "[ADDRESS]:PORT"),
                           (["status", "--interval", "0"], "--interval")):
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

    def test_the_secret_is_proven_both_ways_and_never_sent(self):
        s = socket.create_connection(("127.0.0.1", self.daemon.port), timeout=5)
        self.addCleanup(s.close)
        server_nonce, client_nonce = hello(s, "train", "s3cret")
        welcome = recv_type(s, "welcome")
        # The server proves it knows the secret too: a fake server cannot hand out MASTER_ADDR.
        self.assertEqual(welcome["proof"], proof("s3cret", "server", server_nonce, client_nonce, "train"))
        self.assertNotIn("s3cret", json.dumps(welcome))

    def test_without_the_secret_nothing_is_read_or_joined(self):
        for secret in ("", "guess"):
            s = socket.create_connection(("127.0.0.1", self.daemon.port), timeout=5)
            hello(s, "train", secret)
            self.assertIn("secret", expect_error(s, "bad_token")["message"])
            s.close()
            s = socket.create_connection(("127.0.0.1", self.daemon.port), timeout=5)
            hello(s, "", secret, role="status")
            expect_error(s, "bad_token")
            s.close()
        # A proof answering another connection's challenge is refused (no replay).
        a = socket.create_connection(("127.0.0.1", self.daemon.port), timeout=5)
        b = socket.create_connection(("127.0.0.1", self.daemon.port), timeout=5)
        self.addCleanup(a.close)
        self.addCleanup(b.close)
        recv_type(b, "challenge")
        nonce_a = recv_type(a, "challenge")["nonce"]
        b.sendall(frame({"type": "hello", "protocol_version": PROTOCOL, "job_id": "train", "client_nonce": "c",
                         "proof": proof("s3cret", "hello", nonce_a, "c", "train")}))
        expect_error(b, "bad_token")
        honest = join(self.daemon.port, "train", "honest", "s3cret")
        self.addCleanup(honest.close)
        self.assertEqual(recv_type(honest, "round")["assignment"]["group_rank"], 0)


def per_job_token_file(text):
    f = tempfile.NamedTemporaryFile("w", delete=False)
    f.write(text)
    f.close()
    return f.name


DDPLAUNCH = os.path.join(os.environ.get("DDPLAUNCH_BUILD_DIR", "build"), "bin", "ddplaunch")


class FakeServer:
    """A loopback listener that speaks the server's first half of the handshake and records what
    the real client sends; the test decides what it answers."""

    def __init__(self):
        self.listener = socket.socket()
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(4)
        self.listener.settimeout(30)
        self.port = self.listener.getsockname()[1]
        self.nonce = os.urandom(32).hex()
        self.raw = b""

    def accept_hello(self):
        conn, _ = self.listener.accept()
        conn.sendall(frame({"type": "challenge", "protocol_version": PROTOCOL, "nonce": self.nonce,
                            "magic": "ddp-rendezvous"}))
        conn.settimeout(30)
        while True:  # the client's greeting comes first, then its answer to the challenge
            (n,) = struct.unpack(">I", self._exact(conn, 4))
            msg = json.loads(self._exact(conn, n))
            if msg["type"] != "greeting":
                return conn, msg
            assert (msg["magic"], msg["protocol_version"]) == ("ddp-rendezvous", PROTOCOL), msg

    def _exact(self, conn, n):
        buf = b""
        while len(buf) < n:
            chunk = conn.recv(n - len(buf))
            if not chunk:
                raise EOFError("client closed")
            buf += chunk
        self.raw += buf
        return buf

    def close(self):
        self.listener.close()


class ClientProofTest(unittest.TestCase):
    """The real clients (ddplaunch, ddp-rendezvous status) against a fake server."""

    def setUp(self):
        self.secret = "correct horse battery staple " + os.urandom(8).hex()
        self.token = per_job_token_file(self.secret + "\n")
        self.addCleanup(os.unlink, self.token)
        self.fake = FakeServer()
        self.addCleanup(self.fake.close)

    def test_status_proves_the_secret_without_sending_it(self):
        proc = subprocess.Popen([BIN, "status", "--endpoint", f"127.0.0.1:{self.fake.port}", "--token_file",
                                 self.token, "--timeout", "20"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True)
        try:
            conn, hello_msg = self.fake.accept_hello()
            self.assertEqual(hello_msg["type"], "status")
            self.assertEqual(hello_msg["proof"], proof(self.secret, "status", self.fake.nonce,
                                                       hello_msg["client_nonce"], ""))
            self.assertNotIn(self.secret.encode(), self.fake.raw)
            conn.sendall(frame({"type": "status_reply", "status": {"jobs": []}}))
            out, err = proc.communicate(timeout=30)
            self.assertEqual(proc.returncode, 0, err)
            self.assertIn("no jobs", out)
            conn.close()
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()

    def test_an_agent_refuses_a_server_that_cannot_prove_the_secret(self):
        if not os.path.exists(DDPLAUNCH):
            self.skipTest("ddplaunch is not built")
        proc = subprocess.Popen([DDPLAUNCH, "--nnodes=1:2", "--nproc_per_node=1", "--rdzv_backend=c10d",
                                 f"--rdzv_endpoint=127.0.0.1:{self.fake.port}", "--rdzv_id=victim",
                                 "--rdzv_conf", f"join_timeout=20,token_file={self.token}", "--env_check=off",
                                 "--no_python", "/bin/true"],
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            conn, hello_msg = self.fake.accept_hello()
            self.assertEqual((hello_msg["type"], hello_msg["job_id"]), ("hello", "victim"))
            self.assertEqual(hello_msg["proof"], proof(self.secret, "hello", self.fake.nonce,
                                                       hello_msg["client_nonce"], "victim"))
            self.assertNotIn(self.secret.encode(), self.fake.raw)
            # A fake server without the secret answers welcome with a made-up proof.
            conn.sendall(frame({"type": "welcome", "protocol_version": PROTOCOL, "proof": "00" * 32}))
            out, _ = proc.communicate(timeout=60)
            self.assertEqual(proc.returncode, 3, out)
            self.assertIn("could not prove it knows this job's secret", out)
            conn.close()
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


class SecretsTest(unittest.TestCase):
    def test_a_job_secret_admits_that_job_only_and_its_status_shows_that_job_only(self):
        path = per_job_token_file("# per-job secrets\njobA secretA\njobB secretB\n")
        self.addCleanup(os.unlink, path)
        daemon = Daemon("--token_file", path)
        self.addCleanup(daemon.stop)
        a = join(daemon.port, "jobA", "hostA", "secretA")
        self.addCleanup(a.close)
        recv_type(a, "round")
        b = join(daemon.port, "jobB", "hostB", "secretB")
        self.addCleanup(b.close)
        recv_type(b, "round")
        s = socket.create_connection(("127.0.0.1", daemon.port), timeout=5)
        hello(s, "jobB", "secretA")  # jobA's secret does not open jobB
        expect_error(s, "bad_token")
        s.close()
        s = socket.create_connection(("127.0.0.1", daemon.port), timeout=5)
        hello(s, "jobC", "secretA")  # no cluster secret: an unknown job is refused
        expect_error(s, "bad_token")
        s.close()
        secret_a = per_job_token_file("secretA\n")
        self.addCleanup(os.unlink, secret_a)
        r = status(daemon.port, "--token_file", secret_a, "--job", "jobA", "--json")
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertEqual([j["job_id"] for j in json.loads(r.stdout)["jobs"]], ["jobA"])
        r = status(daemon.port, "--token_file", secret_a, "--job", "jobB")
        self.assertEqual(r.returncode, 3)
        self.assertIn("bad_token", r.stderr)

    def test_the_token_file_may_come_from_the_environment(self):
        path = per_job_token_file("clusterwide\n")
        self.addCleanup(os.unlink, path)
        env = dict(os.environ, DDPLAUNCH_RDZV_TOKEN_FILE=path)
        daemon = Daemon(env=env)
        self.addCleanup(daemon.stop)
        self.assertIn("(token required)", daemon.text())
        r = subprocess.run([BIN, "status", "--endpoint", f"127.0.0.1:{daemon.port}"], env=env,
                           capture_output=True, text=True, timeout=30)
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertEqual(status(daemon.port).returncode, 3)

    def test_listening_beyond_loopback_without_a_secret_warns_loudly(self):
        quiet = Daemon()
        self.addCleanup(quiet.stop)
        self.assertNotIn("WARNING", quiet.text())
        unshare = shutil.which("unshare")
        if unshare is None or os.geteuid() != 0:
            self.skipTest("needs root and unshare(1) to listen on 0.0.0.0 inside a private network namespace")
        # In a network namespace of its own, 0.0.0.0 reaches nobody: the test exposes nothing.
        log = tempfile.NamedTemporaryFile("w+", delete=False)
        self.addCleanup(os.unlink, log.name)
        proc = subprocess.Popen([unshare, "-n", BIN, "--host", "0.0.0.0", "--port", "0"],
                                stdout=log, stderr=subprocess.STDOUT)
        try:
            deadline = time.time() + 10
            text = ""
            while time.time() < deadline and "WARNING" not in text:
                time.sleep(0.02)
                with open(log.name) as f:
                    text = f.read()
            self.assertIn("WARNING: listening on 0.0.0.0 with no secret", text)
            self.assertIn("token_file", text)
        finally:
            proc.kill()
            proc.wait(timeout=10)


class HostileClientTest(unittest.TestCase):
    """Each attack of the threat model (docs/security.md) against a daemon without a secret (the
    worst case): the attacker is refused or contained, the daemon keeps running and an honest
    client is still served."""

    def setUp(self):
        self.daemon = Daemon()
        self.addCleanup(self.daemon.stop)

    def assert_still_serves(self):
        self.assertIsNone(self.daemon.proc.poll(), "the daemon died: " + self.daemon.text())
        job = "honest-" + os.urandom(4).hex()
        s = join(self.daemon.port, job, "honest", max_nodes=1)
        self.addCleanup(s.close)
        a = recv_type(s, "round")["assignment"]
        self.assertEqual((a["group_rank"], a["world_size"]), (0, 2))
        r = status(self.daemon.port, "--json")
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertIn(job, [j["job_id"] for j in json.loads(r.stdout)["jobs"]])

    def attacker(self, job="victim"):
        s = socket.create_connection(("127.0.0.1", self.daemon.port), timeout=5)
        self.addCleanup(s.close)
        hello(s, job)
        recv_type(s, "welcome")
        return s

    def test_a_fingerprint_nested_150000_deep_is_refused(self):
        s = self.attacker()
        deep = "{\"a\":" * 150000 + "1" + "}" * 150000
        payload = ('{"type":"join","node":{"job_id":"victim","host":"x","fingerprint":' + deep + '}}').encode()
        self.assertLess(len(payload), 1 << 20)
        s.sendall(struct.pack(">I", len(payload)) + payload)
        self.assertIn("deeper than", expect_error(s, "bad_json")["message"])
        self.assert_still_serves()

    def test_fingerprints_of_different_shapes_neither_abort_status_nor_the_round(self):
        a = self.attacker()
        a.sendall(frame({"type": "join", "node": node("victim", "a", fingerprint={"a": 1}, max_nodes=3,
                                                      min_nodes=2)}))
        b = self.attacker()
        b.sendall(frame({"type": "join", "node": node("victim", "b", fingerprint={"a": {"b": [1]}},
                                                      max_nodes=3, min_nodes=2)}))
        r = status(self.daemon.port, "--json")  # compares the two fingerprints
        self.assertEqual(r.returncode, 0, r.stderr)
        # The last-call timer completes (or refuses) the round: either way the daemon lives.
        m = recv_msg(a)
        while m["type"] not in ("round", "error"):
            m = recv_msg(a)
        c = self.attacker()
        c.sendall(frame({"type": "join", "node": node("victim", "c", fingerprint=[1])}))
        self.assertIn("fingerprint", expect_error(c, "bad_join")["message"])
        self.assert_still_serves()

    def test_a_local_world_size_of_2147483647_is_refused_before_any_round(self):
        a = self.attacker("wide")
        a.sendall(frame({"type": "join", "node": node("wide", "a", workers=2147483647, min_nodes=2)}))
        self.assertIn("local_world_size", expect_error(a, "bad_join")["message"])
        for workers in (4096, 4096):  # the largest allowed: the sum still fits
            s = self.attacker("wide")
            s.sendall(frame({"type": "join", "node": node("wide", "n", workers=workers, min_nodes=2)}))
        self.assertEqual(recv_type(s, "round")["assignment"]["world_size"], 8192)
        self.assert_still_serves()

    def test_oversized_job_ids_and_host_names_are_refused(self):
        s = socket.create_connection(("127.0.0.1", self.daemon.port), timeout=5)
        self.addCleanup(s.close)
        hello(s, "j" * 100000)
        self.assertIn("job_id", expect_error(s, "bad_message")["message"])
        a = self.attacker("hosts")
        a.sendall(frame({"type": "join", "node": node("hosts", "h" * 100000)}))
        self.assertIn("host", expect_error(a, "bad_join")["message"])
        b = self.attacker("hosts")
        b.sendall(frame({"type": "join", "node": node("hosts", "h", addr="a" * 300)}))
        self.assertIn("addr", expect_error(b, "bad_join")["message"])
        self.assert_still_serves()

    def test_a_huge_failure_message_is_truncated_with_a_marker_and_the_node_kept(self):
        a = self.attacker("fails")
        a.sendall(frame({"type": "join", "node": node("fails", "a", max_nodes=1, max_restarts=1)}))
        recv_type(a, "round")
        a.sendall(frame({"type": "failure", "failure": {"host": "a", "rank": 0, "exit_code": 1,
                                                         "error_file_message": "E" * 900000}}))
        restart = recv_type(a, "restart")
        self.assertIn("[truncated by the rendezvous server]", restart["reason"])
        self.assertLess(len(restart["reason"]), 8192)
        a.sendall(frame({"type": "join", "node": node("fails", "a", max_nodes=1, max_restarts=1)}))
        self.assertEqual(recv_type(a, "round")["assignment"]["restart_count"], 1)  # still a member
        self.assert_still_serves()

    def test_a_node_asking_for_another_policy_is_refused_naming_both_values(self):
        a = self.attacker("policy")
        a.sendall(frame({"type": "join", "node": node("policy", "a", max_restarts=3)}))
        b = self.attacker("policy")
        b.sendall(frame({"type": "join", "node": node("policy", "b", max_restarts=100)}))
        m = expect_error(b, "policy_mismatch")["message"]
        self.assertIn("--max_restarts 100", m)
        self.assertIn("3", m)
        c = self.attacker("policy")
        c.sendall(frame({"type": "join", "node": node("policy", "c", max_restarts=3,
                                                      timeouts={"last_call_timeout": 0.1, "heartbeat_timeout": 1,
                                                                "join_timeout": 30})}))
        m = expect_error(c, "policy_mismatch")["message"]
        self.assertIn("heartbeat_timeout 1 s", m)
        self.assertIn("30 s", m)
        self.assert_still_serves()

    def test_server_messages_and_garbage_types_from_a_client_are_refused(self):
        for bad in ({"type": "round", "assignment": {}}, {"type": "hello", "protocol_version": PROTOCOL, "job_id": "x"},
                    {"type": "join", "node": "not an object"}, {"type": "failure", "failure": {"rank": "zero"}}):
            s = self.attacker()
            s.sendall(frame(bad))
            recv_type(s, "error")
        self.assert_still_serves()

    def test_greetings_of_another_protocol_or_version_or_twice_are_refused(self):
        for bad, code in (({"type": "greeting", "protocol_version": PROTOCOL, "magic": "redis"}, "bad_message"),
                          ({"type": "greeting", "protocol_version": 2, "magic": "ddp-rendezvous"}, "version_mismatch"),
                          ({"type": "greeting", "magic": "ddp-rendezvous"}, "bad_message")):
            s = socket.create_connection(("127.0.0.1", self.daemon.port), timeout=5)
            self.addCleanup(s.close)
            s.sendall(frame(bad))
            expect_error(s, code)
        s = socket.create_connection(("127.0.0.1", self.daemon.port), timeout=5)
        self.addCleanup(s.close)
        good = {"type": "greeting", "protocol_version": PROTOCOL, "magic": "ddp-rendezvous"}
        s.sendall(frame(good) + frame(good))
        self.assertIn("got \"greeting\"", expect_error(s, "bad_message")["message"])
        self.assert_still_serves()


def python_with_http_server():
    """The interpreter that runs this test (any python has http.server)."""
    import sys
    return sys.executable or "/usr/bin/python3"


class OtherServiceTest(unittest.TestCase):
    """A client that reached some other service on the endpoint names it at once (exit 3),
    instead of waiting out join_timeout or reporting a frame of 1213486160 bytes."""

    def start_http_server(self):
        proc = subprocess.Popen([python_with_http_server(), "-u", "-m", "http.server", "--bind", "127.0.0.1", "0"],
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                cwd=tempfile.gettempdir())
        def stop():
            proc.kill()
            proc.wait(timeout=10)
            proc.stdout.close()
        self.addCleanup(stop)
        line = proc.stdout.readline()  # "Serving HTTP on 127.0.0.1 port 41234 (...) ..." (bounded by stop())
        m = re.search(r"port (\d+)", line)
        if not m:
            self.fail("http.server did not start: " + line)
        return int(m.group(1))

    def run_bounded(self, args, deadline_s):
        """Runs a client; it must have exited within deadline_s (else the test fails)."""
        proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            out, _ = proc.communicate(timeout=deadline_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, _ = proc.communicate()
            self.fail(f"{args[0]} was still running after {deadline_s} s: {out}")
        return proc.returncode, out

    def test_status_against_an_http_server_names_it_within_5_s(self):
        port = self.start_http_server()
        rc, out = self.run_bounded([BIN, "status", "--endpoint", f"127.0.0.1:{port}", "--timeout", "30"], 5)
        self.assertEqual(rc, 3, out)
        self.assertIn(f"127.0.0.1:{port} is not a ddp-rendezvous server (it answered '", out)
        self.assertIn("<!DOCTYPE HTML>", out)  # http.server's error page, quoted
        self.assertNotIn("exceeds the limit", out)

    def test_an_agent_against_an_http_server_exits_3_within_5_s(self):
        if not os.path.exists(DDPLAUNCH):
            self.skipTest("ddplaunch is not built")
        port = self.start_http_server()
        rc, out = self.run_bounded([DDPLAUNCH, "--nnodes=2", "--nproc_per_node=1", "--rdzv_backend=c10d",
                                    f"--rdzv_endpoint=127.0.0.1:{port}",
                                    "--rdzv_id=j", "--rdzv_conf=join_timeout=60", "--env_check=off", "--no_python",
                                    "/bin/true"], 5)
        self.assertEqual(rc, 3, out)
        self.assertIn(f"127.0.0.1:{port} is not a ddp-rendezvous server (it answered '", out)

    def test_a_silent_service_is_named_with_its_port(self):
        silent = socket.socket()
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)  # the kernel completes connections; nobody ever answers
        self.addCleanup(silent.close)
        port = silent.getsockname()[1]
        rc, out = self.run_bounded([BIN, "status", "--endpoint", f"127.0.0.1:{port}", "--timeout", "2"], 30)
        self.assertEqual(rc, 3, out)
        self.assertIn(f"127.0.0.1:{port} accepted the connection but sent no ddp-rendezvous challenge", out)
        if os.path.exists(DDPLAUNCH):
            rc, out = self.run_bounded([DDPLAUNCH, "--nnodes=2", "--nproc_per_node=1", "--rdzv_backend=c10d",
                                        f"--rdzv_endpoint=127.0.0.1:{port}", "--rdzv_id=j",
                                        "--rdzv_conf=join_timeout=4", "--env_check=off", "--no_python", "/bin/true"],
                                       60)
            self.assertEqual(rc, 3, out)
            self.assertIn(f"127.0.0.1:{port} accepted the connection but sent no ddp-rendezvous challenge", out)

    def test_a_server_of_an_older_protocol_is_named_as_such(self):
        fake = FakeServer()
        self.addCleanup(fake.close)
        proc = subprocess.Popen([BIN, "status", "--endpoint", f"127.0.0.1:{fake.port}", "--timeout", "20"],
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            conn, _ = fake.listener.accept()
            self.addCleanup(conn.close)
            conn.sendall(frame({"type": "challenge", "protocol_version": 2, "nonce": fake.nonce}))  # version 2
            out, _ = proc.communicate(timeout=30)
            self.assertEqual(proc.returncode, 3, out)
            self.assertIn(f"127.0.0.1:{fake.port} is a ddp-rendezvous server of protocol version 2; this program "
                          f"speaks version {PROTOCOL}", out)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()

    def test_a_refused_connection_names_host_and_port(self):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        s.close()
        r = subprocess.run([BIN, "status", "--endpoint", f"127.0.0.1:{port}"], capture_output=True, text=True,
                           timeout=30)
        self.assertEqual(r.returncode, 3)
        self.assertIn(f"127.0.0.1:{port}: Connection refused", r.stderr)


class TlsTest(unittest.TestCase):
    """TLS (docs/security.md) with a throwaway CA made by the openssl CLI."""

    @classmethod
    def setUpClass(cls):
        if not shutil.which("openssl"):
            raise unittest.SkipTest("no openssl command to make test certificates")
        cls.dir = tempfile.mkdtemp(prefix="ddp_tls_")

        def openssl(*args):
            subprocess.run(["openssl", *args], cwd=cls.dir, check=True, capture_output=True, timeout=60)

        key = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
        for ca in ("ca", "other_ca"):
            openssl("req", "-x509", *key, "-keyout", ca + ".key", "-out", ca + ".pem", "-days", "2",
                    "-subj", "/CN=ddplaunch test " + ca)
        for name, san in (("server", "IP:127.0.0.1,DNS:localhost"), ("client", "DNS:client"),
                          ("elsewhere", "DNS:elsewhere.example")):
            openssl("req", *key, "-keyout", name + ".key", "-out", name + ".csr", "-subj", "/CN=" + name)
            with open(os.path.join(cls.dir, name + ".ext"), "w") as f:
                f.write("subjectAltName=%s\n" % san)
            openssl("x509", "-req", "-in", name + ".csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
                    "-out", name + ".pem", "-days", "2", "-extfile", name + ".ext")

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.dir, ignore_errors=True)

    def path(self, name):
        return os.path.join(self.dir, name)

    def tls_daemon(self, cert="server", *extra):
        d = Daemon("--tls_cert", self.path(cert + ".pem"), "--tls_key", self.path(cert + ".key"), *extra)
        self.addCleanup(d.stop)
        return d

    def test_status_over_tls_checks_the_servers_certificate(self):
        d = self.tls_daemon()
        self.assertIn("(TLS)", d.text())
        r = status(d.port, "--tls_ca", self.path("ca.pem"))
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertIn("no jobs", r.stdout)
        r = status(d.port, "--tls_ca", self.path("other_ca.pem"))
        self.assertEqual(r.returncode, 3, r.stderr)
        self.assertIn(f"127.0.0.1:{d.port}: the server's certificate is not trusted", r.stderr)
        # The CA may also come from the environment.
        r = subprocess.run([BIN, "status", "--endpoint", f"127.0.0.1:{d.port}"], capture_output=True, text=True,
                           timeout=30, env=dict(os.environ, DDPLAUNCH_RDZV_TLS_CA=self.path("ca.pem")))
        self.assertEqual(r.returncode, 0, r.stderr)

    def test_a_certificate_for_another_host_is_refused(self):
        d = self.tls_daemon("elsewhere")
        r = status(d.port, "--tls_ca", self.path("ca.pem"))
        self.assertEqual(r.returncode, 3, r.stderr)
        self.assertIn("not trusted", r.stderr)

    def test_plaintext_and_tls_peers_refuse_each_other_clearly(self):
        d = self.tls_daemon()
        r = status(d.port)
        self.assertEqual(r.returncode, 3, r.stderr)
        self.assertIn(f"127.0.0.1:{d.port} refused the connection: this rendezvous server speaks TLS only", r.stderr)
        if os.path.exists(DDPLAUNCH):  # an agent without tls_ca is refused at once too (exit 3)
            r = self.run_agent(d.port, "")
            self.assertEqual(r.returncode, 3, r.stdout + r.stderr)
            self.assertIn("speaks TLS only", r.stdout + r.stderr)
        plain = Daemon()
        self.addCleanup(plain.stop)
        r = status(plain.port, "--tls_ca", self.path("ca.pem"))
        self.assertEqual(r.returncode, 3, r.stderr)
        self.assertIn(f"127.0.0.1:{plain.port}", r.stderr)
        self.assertRegex(r.stderr, "does not speak TLS|closed the connection during the TLS handshake")
        # Both daemons still serve their own kind.
        self.assertEqual(status(d.port, "--tls_ca", self.path("ca.pem")).returncode, 0)
        self.assertEqual(status(plain.port).returncode, 0)

    def test_client_certificates_when_the_server_requires_them(self):
        d = self.tls_daemon("server", "--tls_client_ca", self.path("ca.pem"))
        r = status(d.port, "--tls_ca", self.path("ca.pem"))
        self.assertEqual(r.returncode, 3, r.stderr)
        r = status(d.port, "--tls_ca", self.path("ca.pem"), "--tls_cert", self.path("client.pem"), "--tls_key",
                   self.path("client.key"))
        self.assertEqual(r.returncode, 0, r.stderr)

    def test_garbage_and_silence_on_a_tls_port_do_not_stop_the_daemon(self):
        d = self.tls_daemon()
        junk = socket.create_connection(("127.0.0.1", d.port), timeout=5)
        self.addCleanup(junk.close)
        junk.sendall(b"\x16\x03\x01\xff\xff" + os.urandom(4096))
        silent = socket.create_connection(("127.0.0.1", d.port), timeout=5)
        self.addCleanup(silent.close)
        r = status(d.port, "--tls_ca", self.path("ca.pem"))
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertIsNone(d.proc.poll())

    def test_unusable_certificate_files_are_usage_errors(self):
        r = subprocess.run([BIN, "--port", "0", "--tls_cert", self.path("missing.pem"), "--tls_key",
                            self.path("server.key")], capture_output=True, text=True, timeout=30)
        self.assertEqual(r.returncode, 2, r.stderr)
        self.assertIn("missing.pem", r.stderr)
        r = subprocess.run([BIN, "--port", "0", "--tls_cert", self.path("server.pem"), "--tls_key",
                            self.path("client.key")], capture_output=True, text=True, timeout=30)
        self.assertEqual(r.returncode, 2, r.stderr)
        self.assertIn("--tls_key=" + self.path("client.key"), r.stderr)  # not the key of server.pem

    def run_agent(self, port, conf):
        """A one-node job through the daemon at `port`, with `conf` in --rdzv_conf (join_timeout 30 unless set)."""
        if "join_timeout" not in conf:
            conf = ",".join(c for c in ("join_timeout=30", conf) if c)
        return subprocess.run([DDPLAUNCH, "--nnodes=1", "--nproc_per_node=2", "--rdzv_backend=c10d",
                               f"--rdzv_endpoint=127.0.0.1:{port}", "--rdzv_id=tls-job",
                               "--rdzv_conf", conf, "--env_check=off", "--no_python",
                               "/bin/true"], capture_output=True, text=True, timeout=120)

    def test_an_agent_with_tls_never_hosts_a_plaintext_server_and_standalone_ignores_tls(self):
        if not os.path.exists(DDPLAUNCH):
            self.skipTest("ddplaunch is not built")
        free = socket.socket()
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
        free.close()
        # Without TLS this agent would host the rendezvous itself and succeed; with it, it waits
        # for a ddp-rendezvous --tls_cert that never comes.
        r = self.run_agent(port, "join_timeout=3,tls_ca=" + self.path("ca.pem"))
        self.assertEqual(r.returncode, 3, r.stdout + r.stderr)
        self.assertNotIn("hosting the rendezvous server in-process", r.stdout + r.stderr)
        r = subprocess.run([DDPLAUNCH, "--standalone", "--nproc_per_node=2", "--env_check=off", "--no_python",
                            "/bin/true"], capture_output=True, text=True, timeout=120,
                           env=dict(os.environ, DDPLAUNCH_RDZV_TLS_CA=self.path("ca.pem")))
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)

    def test_a_job_runs_over_tls_and_a_wrong_ca_fails_it_with_exit_3(self):
        if not os.path.exists(DDPLAUNCH):
            self.skipTest("ddplaunch is not built")
        d = self.tls_daemon()
        r = self.run_agent(d.port, "tls_ca=" + self.path("ca.pem"))
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
        r = self.run_agent(d.port, "tls_ca=" + self.path("other_ca.pem"))
        self.assertEqual(r.returncode, 3, r.stdout + r.stderr)
        self.assertIn("the server's certificate is not trusted", r.stdout + r.stderr)


if __name__ == "__main__":
    unittest.main()
