"""The etcd client (rendezvous/etcd.*) against a real 3-member etcd cluster on loopback
through tests/rendezvous/etcd_probe.cpp: put/range, a txn that compares
revisions, leases (grant, keepalive, expiry, revoke), a killed member, authentication."""

import http.server
import json
import os
import signal
import socket
import threading
import time
import unittest

from etcd_cluster import EtcdCluster
from processes import run, spawn, wait_for

PROBE = os.path.join(os.environ.get("DDPLAUNCH_BUILD_DIR", "build"), "bin", "rdzv_etcd_probe")


class EtcdClientTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        reason = EtcdCluster.unavailable_reason()
        if reason:
            raise unittest.SkipTest(reason)
        cls.etcd = EtcdCluster(members=3)
        cls.etcd.__enter__()

    @classmethod
    def tearDownClass(cls):
        cls.etcd.__exit__(None, None, None)

    def probe(self, *args, endpoints=None, user=None, timeout=3.0, ok=True):
        cmd = [PROBE, "--endpoints", ",".join(endpoints or self.etcd.endpoints), "--timeout", str(timeout)]
        if user:
            cmd += ["--user", user[0], "--password", user[1]]
        r = run(cmd + [str(a) for a in args], timeout=timeout + 10)
        self.assertFalse(r.timed_out, r.describe())
        self.assertIn(r.returncode, (0, 1), r.describe())
        out = json.loads(r.stdout)
        if ok:
            self.assertEqual(r.returncode, 0, r.describe())
        return out

    def test_put_then_range_reads_the_value_and_its_revisions(self):
        self.probe("put", "/t/put", "hello \x01 world")
        got = self.probe("get", "/t/put")
        self.assertEqual(len(got["kvs"]), 1)
        kv = got["kvs"][0]
        self.assertEqual(kv["value"], "hello \x01 world")
        self.assertGreater(kv["create_revision"], 0)
        self.assertEqual(kv["version"], 1)
        self.probe("put", "/t/put", "again")
        again = self.probe("get", "/t/put")["kvs"][0]
        self.assertEqual(again["version"], 2)
        self.assertGreater(again["mod_revision"], kv["mod_revision"])
        self.assertEqual(self.probe("get", "/t/absent")["kvs"], [])
        self.probe("put", "/t/pre/a", "1")
        self.probe("put", "/t/pre/b", "2")
        self.probe("put", "/t/prf", "3")
        self.assertEqual([kv["key"] for kv in self.probe("prefix", "/t/pre/")["kvs"]], ["/t/pre/a", "/t/pre/b"])

    def test_txn_creates_once_and_compares_the_mod_revision(self):
        first = self.probe("create", "/t/leader", "a")
        self.assertTrue(first["succeeded"])
        second = self.probe("create", "/t/leader", "b")
        self.assertFalse(second["succeeded"])
        self.assertEqual(second["current"][0]["value"], "a")  # the failure branch's range
        rev = second["current"][0]["mod_revision"]
        stale = self.probe("cas", "/t/leader", "c", rev - 1)
        self.assertFalse(stale["succeeded"])
        fresh = self.probe("cas", "/t/leader", "d", rev)
        self.assertTrue(fresh["succeeded"])
        self.assertEqual(self.probe("get", "/t/leader")["kvs"][0]["value"], "d")

    def test_a_lease_kept_alive_holds_its_key_and_an_abandoned_one_expires(self):
        lease = self.probe("grant", 2)
        self.assertGreater(lease["id"], 0)
        self.assertEqual(lease["ttl"], 2)
        self.assertTrue(self.probe("create", "/t/leased", "x", lease["id"])["succeeded"])
        self.assertEqual(self.probe("get", "/t/leased")["kvs"][0]["lease"], lease["id"])
        # Kept alive across more than its TTL: the key stays.
        start = time.monotonic()
        while time.monotonic() - start < 3.0:
            self.assertEqual(self.probe("keepalive", lease["id"])["ttl"], 2)
            time.sleep(0.5)
        self.assertEqual(len(self.probe("get", "/t/leased")["kvs"]), 1)
        # Abandoned: etcd deletes the key once the lease expires, and keepalive says TTL 0.
        wait_for(lambda: self.probe("get", "/t/leased")["kvs"] == [], 10, what="the leased key to expire")
        self.assertEqual(self.probe("keepalive", lease["id"])["ttl"], 0)
        # Revoke deletes at once.
        other = self.probe("grant", 30)
        self.probe("put", "/t/revoked", "y", other["id"])
        self.probe("revoke", other["id"])
        self.assertEqual(self.probe("get", "/t/revoked")["kvs"], [])

    def test_a_dead_or_silent_member_costs_one_attempt_and_the_others_answer(self):
        # A port that accepts and never answers, first in the list: the call moves on in time.
        silent = socket.socket()
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        self.addCleanup(silent.close)
        endpoints = ["http://127.0.0.1:%d" % silent.getsockname()[1]] + self.etcd.endpoints
        self.probe("put", "/t/failover", "1", endpoints=endpoints, timeout=4.0)
        # A dead member first in the list. Not etcd's leader: killing the leader would make the
        # others refuse writes until they elect another (1 s and more on a loaded machine), which
        # is etcd's election, not the client's failover that this test is about.
        victim = (self.etcd.leader() + 1) % 3
        order = [self.etcd.endpoints[victim]] + [e for i, e in enumerate(self.etcd.endpoints) if i != victim]
        self.etcd.kill(victim)
        try:
            for i in range(3):
                out = self.probe("put", "/t/failover", str(i), endpoints=order)
                self.assertNotEqual(out["endpoint"], order[0])
            self.assertEqual(self.probe("get", "/t/failover", endpoints=order)["kvs"][0]["value"], "2")
        finally:
            self.etcd.restart(victim)
        # Only dead members: an error naming them, within the deadline.
        dead = ["http://127.0.0.1:%d" % silent.getsockname()[1]]
        out = self.probe("get", "/t/failover", endpoints=dead, timeout=1.0, ok=False)
        self.assertIn(dead[0], out["error"])

    def hostile_endpoint(self, body):
        """An HTTP server on loopback that answers every POST with 200 and `body`."""
        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self):
                self.rfile.read(int(self.headers.get("Content-Length", 0)))
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass
        server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        self.addCleanup(server.server_close)
        self.addCleanup(server.shutdown)
        return "http://127.0.0.1:%d" % server.server_address[1]

    def test_an_endpoint_answering_garbage_is_passed_over_or_named_never_trusted(self):
        garbage = self.hostile_endpoint(b"<html>not etcd</html>")
        self.probe("put", "/t/hostile", "real", endpoints=[garbage] + self.etcd.endpoints)
        out = self.probe("get", "/t/hostile", endpoints=[garbage], timeout=1.0, ok=False)
        self.assertIn("answer is not JSON", out["error"])
        self.assertIn(garbage, out["error"])
        deep = self.hostile_endpoint(b"[" * 5000 + b"]" * 5000)
        out = self.probe("get", "/t/hostile", endpoints=[deep], timeout=1.0, ok=False)
        self.assertIn("deeper", out["error"])
        forged = self.hostile_endpoint(json.dumps({"kvs": [{"key": "!!not base64", "value": 5}]}).encode())
        out = self.probe("get", "/t/hostile", endpoints=[forged], timeout=1.0, ok=False)
        self.assertIn("bad answer", out["error"])
        huge = self.hostile_endpoint(b'{"kvs":[],"x":"' + b"a" * (5 << 20) + b'"}')
        out = self.probe("get", "/t/hostile", endpoints=[huge], timeout=2.0, ok=False)
        self.assertIn("larger than", out["error"])

    def watch(self, key, events, endpoints=None, timeout=3.0):
        """The probe's watch (a running process): it prints one JSON line per answer."""
        p = spawn([PROBE, "--endpoints", ",".join(endpoints or self.etcd.endpoints), "--timeout", str(timeout),
                   "watch", key, str(events)], name="watch")
        self.addCleanup(p.kill)
        return p

    def answers(self, p):
        return [json.loads(line) for line in p.stdout().splitlines() if line.startswith("{")]

    def test_a_watch_streams_the_puts_and_the_deletion_of_its_key_only(self):
        p = self.watch("/t/watched", 3)
        wait_for(lambda: any(a.get("created") for a in self.answers(p)) or p.poll() is not None, 10,
                 what="the watch to be created")
        self.probe("put", "/t/watched", "v1")
        self.probe("put", "/t/watched-not", "other key")
        lease = self.probe("grant", 30)
        self.probe("put", "/t/watched", "v2", lease["id"])
        self.probe("revoke", lease["id"])  # deletes the key, as the expiry of a leader's lease does
        self.assertEqual(p.wait(15), 0, p.describe())
        events = [e for a in self.answers(p) for e in a["events"]]
        self.assertEqual([(e["type"], e["key"], e["value"]) for e in events],
                         [("PUT", "/t/watched", "v1"), ("PUT", "/t/watched", "v2"), ("DELETE", "/t/watched", "")])
        self.assertLess(events[0]["mod_revision"], events[1]["mod_revision"])
        self.assertLess(events[1]["mod_revision"], events[2]["mod_revision"])

    def test_a_watch_ends_when_its_member_dies_naming_it(self):
        victim = (self.etcd.leader() + 1) % 3
        p = self.watch("/t/dies", 1, endpoints=[self.etcd.endpoints[victim]])
        wait_for(lambda: any(a.get("created") for a in self.answers(p)) or p.poll() is not None, 10,
                 what="the watch to be created")
        self.etcd.kill(victim)
        try:
            self.assertEqual(p.wait(15), 1, p.describe())
            self.assertIn(self.etcd.endpoints[victim], self.answers(p)[-1]["error"])
        finally:
            self.etcd.restart(victim)

    def test_a_watch_on_a_member_that_lost_its_cluster_leader_ends(self):
        # The request carries Grpc-Metadata-hasleader: etcd ends the stream of a member cut off
        # from the quorum instead of leaving it open and silent while it misses every change.
        watched = (self.etcd.leader() + 1) % 3
        p = self.watch("/t/no-leader", 1, endpoints=[self.etcd.endpoints[watched]])
        wait_for(lambda: any(a.get("created") for a in self.answers(p)) or p.poll() is not None, 10,
                 what="the watch to be created")
        others = [i for i in range(3) if i != watched]
        try:
            for i in others:
                self.etcd.stop_member(i)  # SIGSTOP: the watched member has no leader any more
            self.assertEqual(p.wait(30), 1, p.describe())
            self.assertIn(self.etcd.endpoints[watched], self.answers(p)[-1]["error"])
        finally:
            for i in others:
                self.etcd.stop_member(i, signal.SIGCONT)
            self.etcd.leader()  # the cluster agrees on a leader again before the next test

    def stream_endpoint(self, head, chunks, hold=False):
        """A fake etcd on loopback: every request is answered with `head` (status line and headers)
        then each of `chunks` as one HTTP chunk (b"" ends the body); then the connection is held open (`hold`) or
        closed. Counts the requests it got."""
        listener = socket.socket()
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        listener.settimeout(0.2)
        state = {"requests": 0, "stop": False}
        held = []

        def serve():
            while not state["stop"]:
                try:
                    conn, _ = listener.accept()
                except socket.timeout:
                    continue
                except OSError:
                    return
                conn.settimeout(5)
                data = b""
                try:
                    while b"\r\n\r\n" not in data:
                        more = conn.recv(4096)
                        if not more:
                            break
                        data += more
                    state["requests"] += 1
                    conn.sendall(head)
                    for c in chunks:
                        conn.sendall(b"%x\r\n%s\r\n" % (len(c), c) if c else b"0\r\n\r\n")
                except OSError:
                    pass
                if hold:
                    held.append(conn)
                else:
                    conn.close()
        t = threading.Thread(target=serve, daemon=True)
        t.start()

        def cleanup():
            state["stop"] = True
            t.join(5)
            listener.close()
            for c in held:
                c.close()
        self.addCleanup(cleanup)
        return "http://127.0.0.1:%d" % listener.getsockname()[1], state

    def test_hostile_watch_streams_end_the_watch_with_a_clear_error_never_a_crash(self):
        ok = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
        created = b'{"result":{"header":{"revision":"1"},"created":true}}\n'
        cases = [
            ([created, b"<html>not etcd</html>\n"], "not JSON", False),
            ([b'{"result":{"events":[{"kv":{"key":"eA=="}}]}}\n'], "did not start with \"created\"", False),
            ([created, b"[" * 5000 + b"\n"], "deeper", False),
            ([created, b'{"result":{"events":[{"type":"EXPIRE","kv":{"key":"eA=="}}]}}\n'], "neither PUT", False),
            ([created, b'{"result":{"events":[{"kv":{"key":"!!"}}]}}\n'], "not base64", False),
            ([created] + [b"a" * 65536] * 80, "larger than", True),  # 5 MiB and no newline
            ([created, b'{"result":{"canceled":true,"cancel_reason":"no"}}\n'], "canceled", True),
            ([created], "closed", False),
            ([], "not created in time", True),  # headers, then silence
        ]
        for chunks, expected, hold in cases:
            with self.subTest(expected=expected):
                endpoint, state = self.stream_endpoint(ok, chunks, hold=hold)
                p = self.watch("/t/hostile", 1, endpoints=[endpoint], timeout=1.0)
                self.assertEqual(p.wait(20), 1, p.describe())
                error = self.answers(p)[-1]["error"]
                self.assertIn(expected, error)
                self.assertIn(endpoint, error)
        # An error status: etcd's message, HTTP status and endpoint named; not retried forever.
        endpoint, state = self.stream_endpoint(
            b"HTTP/1.1 403 Forbidden\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n",
            [b'{"error":"permission denied","code":7}', b""])
        p = self.watch("/t/hostile", 1, endpoints=[endpoint], timeout=1.0)
        self.assertEqual(p.wait(20), 1, p.describe())
        out = self.answers(p)[-1]
        self.assertIn("HTTP 403: permission denied", out["error"])
        self.assertEqual(out["code"], 7)
        self.assertEqual(state["requests"], 1)

    def test_zz_authentication_with_an_etcd_user(self):
        # Last (zz): auth stays enabled for the rest of the cluster's life.
        self.etcd.enable_auth("ddp", "ddp-secret")
        out = self.probe("put", "/t/auth", "v", ok=False)  # no user: refused
        self.assertIn("error", out)
        out = self.probe("put", "/t/auth", "v", user=("ddp", "wrong"), ok=False)
        self.assertIn("authentication", out["error"])
        self.probe("put", "/t/auth", "v", user=("ddp", "ddp-secret"))
        self.assertEqual(self.probe("get", "/t/auth", user=("ddp", "ddp-secret"))["kvs"][0]["value"], "v")
        lease = self.probe("grant", 5, user=("ddp", "ddp-secret"))
        self.assertGreater(self.probe("keepalive", lease["id"], user=("ddp", "ddp-secret"))["ttl"], 0)
        # A watch authenticates too: without a user etcd refuses it, with one it streams.
        p = self.watch("/t/auth-watch", 1)
        self.assertEqual(p.wait(15), 1, p.describe())
        cmd = [PROBE, "--endpoints", ",".join(self.etcd.endpoints), "--user", "ddp", "--password", "ddp-secret",
               "watch", "/t/auth-watch", "1"]
        w = spawn(cmd, name="watch-auth")
        self.addCleanup(w.kill)
        wait_for(lambda: any(a.get("created") for a in self.answers(w)) or w.poll() is not None, 10,
                 what="the authenticated watch to be created")
        self.probe("put", "/t/auth-watch", "seen", user=("ddp", "ddp-secret"))
        self.assertEqual(w.wait(15), 0, w.describe())


if __name__ == "__main__":
    unittest.main(verbosity=2)
