"""ddp-rendezvous speaks systemd's readiness protocol (Type=notify) by itself.

The test plays systemd: it binds a unix datagram socket, starts the daemon with NOTIFY_SOCKET
naming it (a path, and an abstract name written '@name'), and reads the datagrams. READY=1 must
come only once the port accepts connections (a connection made right on receipt succeeds);
SIGTERM brings STOPPING=1 and exit 0. With WATCHDOG_USEC set (WatchdogSec=), keep-alives
(WATCHDOG=1) follow. A NOTIFY_SOCKET that cannot be used is logged and the daemon serves on. Loopback only; every wait has a deadline.
"""

import os
import shutil
import signal
import socket
import tempfile
import unittest

from processes import free_port, spawn, wait_for

BIN = os.path.join(os.environ.get("DDPLAUNCH_BUILD_DIR", "build"), "bin", "ddp-rendezvous")
DEADLINE = 20.0


def fields(datagram):
    """{'READY': '1', 'STATUS': '...'} from 'READY=1\\nSTATUS=...'."""
    return dict(line.split("=", 1) for line in datagram.decode().split("\n") if line)


class SystemdNotifyTest(unittest.TestCase):
    def setUp(self):
        if not os.path.exists(BIN):
            self.fail("not built: %s" % BIN)
        self.tmp = tempfile.mkdtemp(prefix="ddp_notify_")
        self.addCleanup(shutil.rmtree, self.tmp, True)

    def listen(self, address):
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.addCleanup(sock.close)
        sock.bind(address)
        sock.settimeout(DEADLINE)
        return sock

    def start(self, notify_socket, port):
        env = dict(os.environ, NOTIFY_SOCKET=notify_socket)
        p = spawn([BIN, "--host", "127.0.0.1", "--port", str(port)], env=env, name="ddp-rendezvous")
        self.addCleanup(p.kill)
        return p

    def check_ready_then_stopping(self, sock, notify_socket):
        port = free_port()
        p = self.start(notify_socket, port)
        try:
            datagram = sock.recv(4096)
        except socket.timeout:
            self.fail("no datagram within %.0f s\n%s" % (DEADLINE, p.describe()))
        # On receipt, the port must already accept connections (systemd starts dependants now).
        with socket.create_connection(("127.0.0.1", port), timeout=5):
            pass
        message = fields(datagram)
        self.assertEqual(message.get("READY"), "1", datagram)
        self.assertEqual(message.get("STATUS"), "listening on 127.0.0.1:%d" % port, datagram)
        self.assertIsNone(p.poll(), p.describe())

        p.signal(signal.SIGTERM)
        try:
            self.assertEqual(fields(sock.recv(4096)).get("STOPPING"), "1")
        except socket.timeout:
            self.fail("no STOPPING=1 after SIGTERM\n%s" % p.describe())
        self.assertEqual(p.wait(DEADLINE), 0, p.describe())

    def test_ready_after_the_port_listens_and_stopping_on_sigterm_path_socket(self):
        path = os.path.join(self.tmp, "notify")
        self.check_ready_then_stopping(self.listen(path), path)

    def test_ready_and_stopping_on_an_abstract_socket(self):
        name = "ddp-notify-test-%d" % os.getpid()
        self.check_ready_then_stopping(self.listen("\0" + name), "@" + name)

    def test_watchdog_keepalives_come_at_half_the_interval_systemd_asks_for(self):
        path = os.path.join(self.tmp, "notify")
        sock = self.listen(path)
        env = dict(os.environ, NOTIFY_SOCKET=path, WATCHDOG_USEC="200000")  # WatchdogSec=0.2
        p = spawn([BIN, "--host", "127.0.0.1", "--port", str(free_port())], env=env, name="ddp-rendezvous")
        self.addCleanup(p.kill)
        seen = []
        try:
            while seen.count("WATCHDOG") < 3:
                seen += [k for k in fields(sock.recv(4096)) if k in ("READY", "WATCHDOG")]
        except socket.timeout:
            self.fail("got %s, not READY and 3 watchdog keep-alives within %.0f s\n%s"
                      % (seen, DEADLINE, p.describe()))
        self.assertEqual(seen[0], "READY", seen)
        p.signal(signal.SIGTERM)
        self.assertEqual(p.wait(DEADLINE), 0, p.describe())

    def test_an_unusable_notify_socket_is_logged_and_the_daemon_serves_on(self):
        for bad, reason in ((os.path.join(self.tmp, "nobody-listens"), "send: No such file or directory"),
                            ("vsock:2:1234", "not a unix socket path"),
                            ("/" + "x" * 200, "name longer than 107 bytes")):
            port = free_port()
            p = self.start(bad, port)
            wait_for(lambda: "cannot tell systemd" in p.stdout() or p.poll() is not None, DEADLINE,
                     "the daemon to log the notify error")
            self.assertIsNone(p.poll(), p.describe())
            self.assertIn("NOTIFY_SOCKET=%s: %s" % (bad, reason), p.stdout())
            with socket.create_connection(("127.0.0.1", port), timeout=5):
                pass
            p.signal(signal.SIGTERM)
            self.assertEqual(p.wait(DEADLINE), 0, p.describe())


if __name__ == "__main__":
    unittest.main()
