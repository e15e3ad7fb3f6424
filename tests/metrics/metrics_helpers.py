"""Shared pieces of the metrics tests: a ddp-rendezvous daemon with its metrics
server on loopback, HTTP GETs with a deadline, the exposition parsed into samples, and a worker
script that runs until the test releases it."""

import os
import re
import socket
import subprocess
import sys
import urllib.error
import urllib.request

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "agent"))
from ddplaunch_helpers import BUILD_DIR, DDPLAUNCH, PYTHON, LaunchTestCase  # noqa: E402,F401
import processes  # noqa: E402
from processes import free_port, spawn, wait_for  # noqa: E402,F401

RENDEZVOUS = os.path.join(BUILD_DIR, "bin", "ddp-rendezvous")
CONF = "heartbeat_interval=0.5,heartbeat_timeout=5,last_call_timeout=1,join_timeout=60"

# Worker: records it started, then waits for OUT/release (or a deadline), then exits with the
# code named in OUT/exit-<RANK>-<RESTART_COUNT> when such a file exists, else 0.
WAITING_WORKER = r"""
import os, sys, time
out = sys.argv[1]
rank, attempt = os.environ["RANK"], os.environ["TORCHELASTIC_RESTART_COUNT"]
open(os.path.join(out, "started-%s-%s" % (rank, attempt)), "w").close()
if os.environ.get("METRICS_TEST_STEPPING"):  # steps through the Python helper the agent puts on PYTHONPATH
    import ddplaunch
    deadline = time.time() + 120
    while not os.path.exists(os.path.join(out, "release")) and time.time() < deadline:
        ddplaunch.step()
        time.sleep(0.02)
code_file = os.path.join(out, "exit-%s-%s" % (rank, attempt))
if os.path.exists(code_file):
    sys.exit(int(open(code_file).read()))
deadline = time.time() + 120
while not os.path.exists(os.path.join(out, "release")) and time.time() < deadline:
    time.sleep(0.05)
"""


def http_get(port, path, timeout=10.0, method="GET"):
    """(status, content type, body text) of one request to 127.0.0.1:port."""
    req = urllib.request.Request("http://127.0.0.1:%d%s" % (port, path), method=method)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.headers.get("Content-Type", ""), r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.headers.get("Content-Type", ""), e.read().decode()


_SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{.*\})? (\S+)$')


def samples(text):
    """{'name{labels}': value} of every sample line of an exposition."""
    out = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE.match(line)
        if not m:
            raise AssertionError("not a sample line: %r" % line)
        out[m.group(1) + (m.group(2) or "")] = float(m.group(3))
    return out


def metrics_port_from(text, prefix):
    m = re.search(re.escape(prefix) + r" on http://[0-9.]+:(\d+)/metrics", text)
    return int(m.group(1)) if m else None


class MetricsTestCase(LaunchTestCase):
    def start_daemon(self, extra=()):
        """Starts ddp-rendezvous on free loopback ports with --metrics_port=0; sets self.port
        (rendezvous) and self.metrics_port."""
        if not os.path.exists(RENDEZVOUS):
            self.fail("ddp-rendezvous not built: %s" % RENDEZVOUS)
        self.port = free_port()
        self.daemon = spawn([RENDEZVOUS, "--host", "127.0.0.1", "--port", str(self.port), "--metrics_port", "0"]
                            + list(extra), name="ddp-rendezvous")
        self.addCleanup(self.daemon.kill)
        self.metrics_port = wait_for(lambda: metrics_port_from(self.daemon.stdout(), "metrics")
                                     or (self.daemon.poll() is not None and -1), 20, "the daemon's metrics line")
        self.assertNotEqual(self.metrics_port, -1, self.daemon.describe())
        wait_for(lambda: processes.port_open(self.port), 20, "the daemon to listen")
        return self.daemon

    def status(self, *extra):
        """`ddp-rendezvous status` of the daemon start_daemon started; its stdout."""
        r = subprocess.run([RENDEZVOUS, "status", "--endpoint", "127.0.0.1:%d" % self.port] + list(extra),
                           capture_output=True, text=True, timeout=30)
        self.assertEqual(r.returncode, 0, r.stderr)
        return r.stdout

    def job_args(self, job, nproc=2, max_restarts=0, extra=()):
        worker = self.script("worker.py", WAITING_WORKER)
        return (["--nnodes=1", "--nproc_per_node=%d" % nproc, "--rdzv_backend=c10d",
                 "--rdzv_endpoint=127.0.0.1:%d" % self.port, "--rdzv_id=%s" % job, "--rdzv_conf", CONF,
                 "--shutdown_timeout=5", "--max_restarts=%d" % max_restarts, "--python", PYTHON]
                + list(extra) + [worker, self.out])

    def release(self):
        open(os.path.join(self.out, "release"), "w").close()

    def started(self, rank, attempt):
        return os.path.exists(os.path.join(self.out, "started-%d-%d" % (rank, attempt)))

    def exit_code_for(self, rank, attempt, code):
        with open(os.path.join(self.out, "exit-%d-%d" % (rank, attempt)), "w") as f:
            f.write(str(code))


def raw_connection(port):
    s = socket.create_connection(("127.0.0.1", port), timeout=5)
    return s


def read_until_closed(sock, timeout):
    """Everything the server sends until it closes (raises socket.timeout past `timeout`)."""
    sock.settimeout(timeout)
    data = b""
    while True:
        chunk = sock.recv(65536)
        if not chunk:
            return data
        data += chunk
