"""Replicas watch the leader key (rendezvous/election.*, docs/etcd.md), on a real
3-member etcd cluster on loopback; nothing is mocked at the etcd boundary.

- With the watch, a follower learns of the leader key's deletion from the stream and campaigns
  at once (it logs the event; the takeover comes well within the TTL).
- A follower that redirects an agent to a leader whose port refuses connections (its process
  died: SIGKILL) revokes that leader's lease and takes over at once, long before the TTL; a
  leader that accepts connections is left leading.
- The watch is not needed for correctness: behind a proxy that refuses every watch, a follower
  still takes over by reading the key (and says the watch is unavailable); a stream cut in the
  middle is opened again.
Replicas run without agents (an agent's hello is sent by hand where one is needed): the election
is what is tested. Every wait has a deadline; etcd,
the proxy and the replicas are stopped in cleanup.
"""

import os
import select
import signal
import socket
import threading
import unittest
import uuid

from etcd_cluster import EtcdCluster
from processes import free_port, port_open, spawn, wait_for
from test_daemon import hello, recv_type

RENDEZVOUS = os.path.join(os.environ.get("DDPLAUNCH_BUILD_DIR", "build"), "bin", "ddp-rendezvous")
TTL = 2
LONG_TTL = 30  # reads every 30 s while the watch lives: a takeover within 15 s is the watch's


class EtcdProxy:
    """A TCP proxy on loopback in front of one etcd member. Each connection carries one HTTP
    request (the client opens one per call); connections whose request is POST /v3/watch are
    refused with HTTP 503 while `refuse_watches` is set, else piped through like every other, and
    cut() closes the watch connections open now. Threads; stopped by close()."""

    def __init__(self, upstream_port):
        self.upstream = upstream_port
        self.refuse_watches = False
        self.watches = []
        self.lock = threading.Lock()
        self.listener = socket.socket()
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(64)
        self.listener.settimeout(0.2)
        self.port = self.listener.getsockname()[1]
        self.stopping = False
        self.thread = threading.Thread(target=self._accept, daemon=True)
        self.thread.start()

    @property
    def endpoint(self):
        return "http://127.0.0.1:%d" % self.port

    def _accept(self):
        while not self.stopping:
            try:
                conn, _ = self.listener.accept()
            except socket.timeout:
                continue
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn):
        conn.settimeout(5)
        head = b""
        try:
            while b"\r\n\r\n" not in head:
                more = conn.recv(65536)
                if not more:
                    conn.close()
                    return
                head += more
        except OSError:
            conn.close()
            return
        is_watch = head.startswith(b"POST /v3/watch ")
        if is_watch and self.refuse_watches:
            body = b'{"error":"watches refused by the test proxy","code":14}'
            conn.sendall(b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
                         b"Content-Length: %d\r\nConnection: close\r\n\r\n%s" % (len(body), body))
            conn.close()
            return
        try:
            up = socket.create_connection(("127.0.0.1", self.upstream), timeout=5)
        except OSError:
            conn.close()
            return
        if is_watch:
            with self.lock:
                self.watches.append((conn, up))
        conn.settimeout(None)
        up.settimeout(None)
        try:
            up.sendall(head)
            pair = {conn: up, up: conn}
            while not self.stopping:
                readable, _, _ = select.select(list(pair), [], [], 0.2)
                for s in readable:
                    data = s.recv(65536)
                    if not data:
                        raise OSError("closed")
                    pair[s].sendall(data)
        except (OSError, ValueError):
            pass
        finally:
            for s in (conn, up):
                try:
                    s.close()
                except OSError:
                    pass

    def cut(self):
        """Closes every watch connection open now (both sides); returns how many."""
        with self.lock:
            cut, self.watches = self.watches, []
        for conn, up in cut:
            for s in (conn, up):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
        return len(cut)

    def close(self):
        self.stopping = True
        self.thread.join(5)
        self.listener.close()
        self.cut()


class EtcdWatch(unittest.TestCase):
    def setUp(self):
        self.etcd = EtcdCluster.started_for(self)
        self.prefix = "/ddp-watch-%s/" % uuid.uuid4().hex[:8]

    def replica(self, etcd_endpoints, ttl=TTL):
        port = free_port()
        p = spawn([RENDEZVOUS, "--host", "127.0.0.1", "--port", str(port), "--etcd", ",".join(etcd_endpoints),
                   "--etcd_lease_ttl", str(ttl), "--etcd_prefix", self.prefix], name="replica-%d" % port)
        self.addCleanup(p.kill)
        self.__dict__.setdefault("replicas", []).append(p)
        wait_for(lambda: port_open(port) or p.poll() is not None, 15, "replica %d to listen" % port)
        self.assertIsNone(p.poll(), p.describe())
        return p

    def wait(self, condition, timeout, what):
        """wait_for, with every replica's output in the failure (what each said about its watch,
        its lease and its campaigns is the only record of a race between them)."""
        try:
            return wait_for(condition, timeout, what)
        except TimeoutError as e:
            raise AssertionError("%s\n%s" % (e, "\n".join(p.describe() for p in getattr(self, "replicas", []))))

    def leader_and_follower(self, a, b):
        def one_leads():
            leading = [p for p in (a, b) if "etcd: leading" in p.stdout()]
            if len(leading) != 1:
                return None
            follower = b if leading[0] is a else a
            return (leading[0], follower) if "etcd: following: the leader is" in follower.stdout() else None
        return self.wait(one_leads, 30, "one replica to lead and the other to follow it")

    def test_a_follower_campaigns_on_the_watched_deletion_of_the_leader_key(self):
        # TTL 30 s: while its watch lives the follower reads the key only every TTL, so a
        # takeover well within that comes from the watch. Either from the deletion event, or from
        # the one read the watch's creation asks for, when that read comes after the deletion
        # (SIGTERM follows "watching" at once here): both are the watch's doing. The leader is
        # stopped with SIGTERM: it revokes its lease, and etcd deletes the key at once.
        a, b = self.replica(self.etcd.endpoints, ttl=LONG_TTL), self.replica(self.etcd.endpoints, ttl=LONG_TTL)
        leader, follower = self.leader_and_follower(a, b)
        self.wait(lambda: "etcd: watching the leader key" in follower.stdout(), 15, "the follower's watch")
        leader.signal(signal.SIGTERM)
        self.wait(lambda: "etcd: leading" in follower.stdout() or follower.poll() is not None, LONG_TTL / 2,
                  "the follower to take over on the watched deletion (a read would come only after the TTL)")
        # The deletion came through the watch. Not asserted: that its line comes before "leading".
        # The watch thread queues its lines and the election thread says them when it next wakes,
        # so a campaign already under way (the creation's read) can say "leading" first.
        self.wait(lambda: "etcd: the leader key was deleted (watch, revision " in follower.stdout(), 15,
                  "the follower to say the watch saw the deletion")

    @staticmethod
    def port_of(replica):
        return int(replica.cmd[replica.cmd.index("--port") + 1])

    def redirect_an_agent(self, follower):
        """An agent's hello at `follower`: answered with its welcome, then not_leader naming the
        leader it follows."""
        with socket.create_connection(("127.0.0.1", self.port_of(follower)), timeout=5) as s:
            hello(s, "etcd-watch")
            recv_type(s, "welcome")
            return recv_type(s, "not_leader")["leader"]

    def test_a_follower_deposes_a_leader_whose_port_refuses_and_leaves_a_live_one_leading(self):
        # TTL 30 s: the lease of a SIGKILLed leader lives on for up to 30 s, and the follower reads
        # the key only every 30 s; a takeover within 15 s is the refused connection's doing.
        a, b = self.replica(self.etcd.endpoints, ttl=LONG_TTL), self.replica(self.etcd.endpoints, ttl=LONG_TTL)
        leader, follower = self.leader_and_follower(a, b)
        self.wait(lambda: "etcd: watching the leader key" in follower.stdout(), 15, "the follower's watch")
        named = self.redirect_an_agent(follower)
        self.assertEqual(named, "127.0.0.1:%d" % self.port_of(leader))
        self.wait(lambda: "etcd: an agent was redirected to the leader %s, which accepts connections" % named
                  in follower.stdout(), 15, "the follower to check the live leader")
        self.assertNotIn("etcd: leading", follower.stdout())
        self.assertNotIn("deposed", leader.stdout())
        leader.signal(signal.SIGKILL)
        leader.wait(10)
        # The agent that lost the leader comes to the follower, which checks again (at most once
        # every Election::kLeaderCheckGap): the first redirect after that gap finds the port
        # refusing.
        def took_over():
            if "etcd: leading" in follower.stdout() or follower.poll() is not None:
                return True
            self.redirect_an_agent(follower)
            return False
        self.wait(took_over, LONG_TTL / 2, "the follower to take over from the killed leader")
        self.assertIn("etcd: the leader %s refuses connections (nothing listens there: its process is gone): "
                      "revoked its lease" % named, follower.stdout())

    def test_without_a_watch_a_follower_still_takes_over_by_reading_the_key(self):
        proxy = EtcdProxy(self.etcd.client_ports[self.etcd.leader()])
        self.addCleanup(proxy.close)
        proxy.refuse_watches = True
        a, b = self.replica([proxy.endpoint]), self.replica([proxy.endpoint])
        leader, follower = self.leader_and_follower(a, b)
        self.wait(lambda: "etcd: the watch on the leader key ended" in follower.stdout(), 15,
                  "the follower to say the watch is unavailable")
        self.assertIn("HTTP 503", follower.stdout())
        self.assertIn("reading the key every 0.5 s", follower.stdout())
        leader.signal(signal.SIGKILL)
        self.wait(lambda: "etcd: leading" in follower.stdout() or follower.poll() is not None, 30,
                  "the follower to take over without a watch")
        self.assertNotIn("the leader key was deleted (watch", follower.stdout())

    def test_a_watch_cut_in_the_middle_is_opened_again_and_still_reports_the_deletion(self):
        proxy = EtcdProxy(self.etcd.client_ports[self.etcd.leader()])
        self.addCleanup(proxy.close)
        a, b = self.replica([proxy.endpoint], ttl=LONG_TTL), self.replica([proxy.endpoint], ttl=LONG_TTL)
        leader, follower = self.leader_and_follower(a, b)
        self.wait(lambda: "etcd: watching the leader key" in follower.stdout(), 15, "the follower's watch")
        # Only what the follower says after the cut counts: a watch that could not be set up at
        # the start (a loaded machine) also says "ended" before it says "watching".
        before = len(follower.stdout())
        self.wait(lambda: proxy.cut() > 0, 10, "a watch connection to cut")
        self.wait(lambda: follower.stdout().find("etcd: the watch on the leader key ended", before) >= 0, 15,
                  "the follower to see its watch cut")
        ended = follower.stdout().find("etcd: the watch on the leader key ended", before)
        self.wait(lambda: follower.stdout().find("etcd: watching the leader key", ended) > 0, 15,
                  "the watch to be opened again")
        leader.signal(signal.SIGTERM)  # revokes its lease: the key is deleted at once
        self.wait(lambda: "etcd: leading" in follower.stdout() or follower.poll() is not None, LONG_TTL / 2,
                  "the follower to take over on the watched deletion (a read would come only after the TTL)")
        # As in the test above, the line's order against "leading" is not the point.
        self.wait(lambda: follower.stdout().find("etcd: the leader key was deleted (watch, revision ", ended) > 0,
                  15, "the follower to say the reopened watch saw the deletion")


if __name__ == "__main__":
    unittest.main(verbosity=2)
