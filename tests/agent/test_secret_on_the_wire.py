"""A node's resume secret never crosses the wire in clear (docs/security.md, "Resume secrets").

A real job of two ddplaunch nodes talks to a real ddp-rendezvous through a relay that records
every byte both ways. The daemon is SIGKILLed and started again, so that every agent resumes its
round over a new connection. With a token, the secret the round carried and the one the resume
carried differ on the wire (each is sealed under its own connection's key), and the restarted
daemon still accepts the resumes: no worker restarts. Without a token (no key to seal with) the
two are the same value: the control that shows the capture would see a secret in clear.
"""

import json
import os
import signal
import socket
import struct
import threading

import processes
from processes import free_port, spawn, wait_for
import test_multinode
import test_rendezvous_restart as restart  # a module, so that its tests are not run again here

RENDEZVOUS = test_multinode.RENDEZVOUS


class Relay:
    """127.0.0.1:port -> 127.0.0.1:upstream, recording each connection's bytes both ways."""

    def __init__(self, upstream):
        self.upstream = upstream
        self.listener = socket.socket()
        self.listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(64)
        self.port = self.listener.getsockname()[1]
        self.streams = []  # [{"up": bytearray, "down": bytearray}] one per connection
        self.lock = threading.Lock()
        self.sockets = []
        self.closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while not self.closed:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            try:
                server = socket.create_connection(("127.0.0.1", self.upstream), timeout=5)
                server.settimeout(None)
            except OSError:  # the daemon is down: the agent sees a refused connection and retries
                client.close()
                continue
            stream = {"up": bytearray(), "down": bytearray()}
            with self.lock:
                self.streams.append(stream)
                self.sockets += [client, server]
            threading.Thread(target=self._pump, args=(client, server, stream["up"]), daemon=True).start()
            threading.Thread(target=self._pump, args=(server, client, stream["down"]), daemon=True).start()

    def _pump(self, src, dst, record):
        try:
            while True:
                data = src.recv(65536)
                if not data:
                    break
                with self.lock:
                    record += data
                dst.sendall(data)
        except OSError:
            pass
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def close(self):
        self.closed = True
        self.listener.close()
        with self.lock:
            for s in self.sockets:
                s.close()

    def messages(self, direction):
        """Every frame's JSON payload sent in `direction` ("up": agent -> daemon), all connections."""
        out = []
        with self.lock:
            streams = [bytes(s[direction]) for s in self.streams]
        for data in streams:
            at = 0
            while len(data) - at >= 4:  # a big-endian length, then JSON (docs/protocol.md)
                length = struct.unpack_from(">I", data, at)[0]
                if len(data) - at - 4 < length:
                    break
                out.append(json.loads(data[at + 4:at + 4 + length]))
                at += 4 + length
        return out


def secrets_by_rank(messages, kind):
    """{group rank: [secret values]} of the round or resume messages among `messages`."""
    found = {}
    for m in messages:
        if m.get("type") != kind:
            continue
        body = m["assignment"] if kind == "round" else m["resume"]
        assignment = body if kind == "round" else body["assignment"]
        found.setdefault(assignment["group_rank"], []).append(body["secret"])
    return found


class SecretOnTheWire(test_multinode.MultiNodeTestCase):
    # The daemon-restart scenario's helpers, not its tests.
    nodes_on = restart.RendezvousRestart.nodes_on
    wait_resumed = restart.RendezvousRestart.wait_resumed
    finish_and_check_unchanged = restart.RendezvousRestart.finish_and_check_unchanged

    def run_job_through_a_relay(self, token):
        extra, conf = [], restart.CONF
        if token:
            path = os.path.join(self.tmp, "token")
            with open(path, "w") as f:
                f.write("a-cluster-secret-for-the-capture\n")
            extra, conf = ["--token_file", path], restart.CONF + ",token_file=" + path
        port = free_port()

        def start_daemon():
            daemon = spawn([RENDEZVOUS, "--host", "127.0.0.1", "--port", str(port)] + extra, name="ddp-rendezvous")
            self.addCleanup(daemon.kill)
            wait_for(lambda: processes.port_open(port) or daemon.poll() is not None, 15, "the daemon to listen")
            self.assertIsNone(daemon.poll(), daemon.describe())
            return daemon

        daemon = start_daemon()
        relay = Relay(port)
        self.addCleanup(relay.close)
        nodes = self.nodes_on([relay.port], 2, conf=conf)
        gen, rs = self.wait_round(2, kind="start")
        daemon.signal(signal.SIGKILL)
        daemon.wait(10)
        start_daemon()
        self.wait_resumed(nodes)
        self.finish_and_check_unchanged(nodes, rs)
        rounds = secrets_by_rank(relay.messages("down"), "round")
        resumes = secrets_by_rank(relay.messages("up"), "resume")
        self.assertEqual(sorted(rounds), [0, 1], rounds)
        self.assertEqual(sorted(resumes), [0, 1], resumes)
        for up in relay.messages("up"):  # the resume's copy of the assignment stays at home
            if up.get("type") == "resume":
                self.assertNotIn("secret", up["resume"]["assignment"], up)
        return rounds, resumes

    def test_with_a_token_the_round_and_the_resume_carry_the_secret_sealed(self):
        rounds, resumes = self.run_job_through_a_relay(token=True)
        on_the_wire = [v for vs in list(rounds.values()) + list(resumes.values()) for v in vs]
        # Four different values for two secrets, each on its own connection...
        self.assertEqual(len(set(on_the_wire)), len(on_the_wire), (rounds, resumes))
        for value in on_the_wire:
            self.assertRegex(value, r"^[0-9a-f]{32,}$")
        # ...which the restarted daemon, which knew nothing of the job, took back as the same
        # secrets: a third node's resume with another secret would have been refused
        # (finish_and_check_unchanged: no worker was started again).

    def test_control_without_a_token_the_same_value_crosses_twice(self):
        rounds, resumes = self.run_job_through_a_relay(token=False)
        for rank in (0, 1):
            self.assertEqual(rounds[rank], resumes[rank], "the secret of rank %d in clear both ways" % rank)


if __name__ == "__main__":
    import unittest
    unittest.main()
