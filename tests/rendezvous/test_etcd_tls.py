"""TLS to etcd (rendezvous/etcd.*: https:// endpoints, the server verified against a CA
and the endpoint's host, an optional client certificate; ddp-rendezvous --etcd_cacert,
--etcd_cert, --etcd_key). A CA, a server and a client certificate are made with the openssl CLI
in a temporary directory; a real etcd (one member) serves https on loopback with
--client-cert-auth. Nothing is mocked at the etcd boundary; etcd and the daemons are stopped in
cleanup, the directory removed.
"""

import json
import os
import shutil
import subprocess
import tempfile
import unittest
import uuid

from etcd_cluster import ETCD, EtcdCluster
from processes import free_port, run, spawn, wait_for

BUILD = os.environ.get("DDPLAUNCH_BUILD_DIR", "build")
PROBE = os.path.join(BUILD, "bin", "rdzv_etcd_probe")
RENDEZVOUS = os.path.join(BUILD, "bin", "ddp-rendezvous")


def openssl(*args, cwd):
    subprocess.run(["openssl"] + list(args), cwd=cwd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                   timeout=60)


def make_pki(d):
    """ca.pem/ca.key, server.pem/.key (127.0.0.1, localhost), client.pem/.key, and other-ca.pem (an
    unrelated CA). EC P-256 keys: quick to make."""
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    for ca in ("ca", "other-ca"):
        openssl("req", "-x509", *ec, "-keyout", ca + ".key", "-out", ca + ".pem", "-days", "2", "-subj",
                "/CN=ddp-test-" + ca, cwd=d)
    # etcd's gateway dials its own gRPC server with the server certificate: clientAuth as well.
    for name, cn, ext in (("server", "127.0.0.1",
                           "subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth,clientAuth\n"),
                          ("client", "ddp-rendezvous", "extendedKeyUsage=clientAuth\n")):
        with open(os.path.join(d, name + ".ext"), "w") as f:
            f.write(ext)
        openssl("req", *ec, "-keyout", name + ".key", "-out", name + ".csr", "-subj", "/CN=" + cn, cwd=d)
        openssl("x509", "-req", "-in", name + ".csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
                "-out", name + ".pem", "-days", "2", "-extfile", name + ".ext", cwd=d)


class EtcdTls(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        reason = EtcdCluster.unavailable_reason()
        if reason:
            raise unittest.SkipTest(reason)
        if not shutil.which("openssl"):
            raise unittest.SkipTest("the openssl command is not installed")
        cls.dir = tempfile.mkdtemp(prefix="ddp-etcd-tls-")
        try:
            make_pki(cls.dir)
            port, peer = free_port(), free_port()
            cls.endpoint = "https://127.0.0.1:%d" % port
            f = lambda name: os.path.join(cls.dir, name)  # noqa: E731
            cls.etcd = spawn([ETCD, "--name", "m0", "--data-dir", f("data"),
                              "--listen-client-urls", cls.endpoint, "--advertise-client-urls", cls.endpoint,
                              "--listen-peer-urls", "http://127.0.0.1:%d" % peer,
                              "--initial-advertise-peer-urls", "http://127.0.0.1:%d" % peer,
                              "--initial-cluster", "m0=http://127.0.0.1:%d" % peer,
                              "--cert-file", f("server.pem"), "--key-file", f("server.key"),
                              "--trusted-ca-file", f("ca.pem"), "--client-cert-auth",
                              "--logger", "zap", "--log-outputs", f("etcd.log")], name="etcd-tls")
            wait_for(lambda: cls.etcd.poll() is not None or cls.probe_once("get", "/t/ready").returncode == 0, 30,
                     what="etcd to serve https")
            if cls.etcd.poll() is not None:
                raise AssertionError("etcd exited: " + cls.etcd.describe())
        except BaseException:
            cls.tearDownClass()
            raise

    @classmethod
    def tearDownClass(cls):
        if getattr(cls, "etcd", None):
            cls.etcd.kill()
        shutil.rmtree(cls.dir, ignore_errors=True)

    @classmethod
    def tls_args(cls, ca="ca.pem", client=True):
        args = ["--cacert", os.path.join(cls.dir, ca)] if ca else []
        if client:
            args += ["--cert", os.path.join(cls.dir, "client.pem"), "--key", os.path.join(cls.dir, "client.key")]
        return args

    @classmethod
    def probe_once(cls, *args, ca="ca.pem", client=True, endpoint=None):
        return run([PROBE, "--endpoints", endpoint or cls.endpoint, "--timeout", "3"] + cls.tls_args(ca, client) +
                   [str(a) for a in args], timeout=15)

    def probe(self, *args, ok=True, **kw):
        r = self.probe_once(*args, **kw)
        self.assertFalse(r.timed_out, r.describe())
        self.assertEqual(r.returncode, 0 if ok else 1, r.describe())
        return json.loads(r.stdout.splitlines()[-1])

    def test_the_client_works_over_https_with_the_ca_and_a_client_certificate(self):
        self.probe("put", "/t/tls", "over tls")
        got = self.probe("get", "/t/tls")
        self.assertEqual(got["kvs"][0]["value"], "over tls")
        self.assertEqual(got["endpoint"], self.endpoint)
        # The same host by name: the certificate names localhost too.
        by_name = self.endpoint.replace("127.0.0.1", "localhost")
        self.assertEqual(self.probe("get", "/t/tls", endpoint=by_name)["kvs"][0]["value"], "over tls")
        # A watch streams over TLS too.
        w = spawn([PROBE, "--endpoints", self.endpoint, "--timeout", "3"] + self.tls_args() +
                  ["watch", "/t/tls-watch", "1"], name="watch-tls")
        self.addCleanup(w.kill)
        wait_for(lambda: '"created":true' in w.stdout() or w.poll() is not None, 15, what="the TLS watch")
        self.probe("put", "/t/tls-watch", "seen")
        self.assertEqual(w.wait(15), 0, w.describe())
        self.assertIn('"value":"seen"', w.stdout())

    def test_a_server_certificate_from_another_ca_is_refused_naming_the_endpoint(self):
        out = self.probe("get", "/t/tls", ca="other-ca.pem", ok=False)
        self.assertIn(self.endpoint, out["error"])
        self.assertIn("the server's certificate is not trusted", out["error"])
        self.assertIn("--etcd_cacert", out["error"])

    def test_client_cert_auth_refuses_a_client_without_a_certificate(self):
        out = self.probe("get", "/t/tls", client=False, ok=False)
        self.assertIn(self.endpoint, out["error"])
        self.assertIn("client certificate", out["error"])

    def test_plain_http_to_a_tls_member_is_an_error_not_a_hang(self):
        plain = self.endpoint.replace("https://", "http://")
        r = run([PROBE, "--endpoints", plain, "--timeout", "2", "get", "/t/tls"], timeout=15)
        self.assertEqual(r.returncode, 1, r.describe())
        self.assertIn(plain, json.loads(r.stdout)["error"])

    def test_a_replica_leads_over_tls(self):
        port = free_port()
        prefix = "/ddp-tls-%s/" % uuid.uuid4().hex[:8]
        d = spawn([RENDEZVOUS, "--host", "127.0.0.1", "--port", str(port), "--etcd", self.endpoint,
                   "--etcd_lease_ttl", "2", "--etcd_prefix", prefix,
                   "--etcd_cacert", os.path.join(self.dir, "ca.pem"),
                   "--etcd_cert", os.path.join(self.dir, "client.pem"),
                   "--etcd_key", os.path.join(self.dir, "client.key")], name="replica-tls")
        self.addCleanup(d.kill)
        wait_for(lambda: "etcd: leading" in d.stdout() or d.poll() is not None, 30, what="the replica to lead")
        wait_for(lambda: "etcd: watching the leader key" in d.stdout() or d.poll() is not None, 30,
                 what="the replica's watch over TLS")
        self.assertIsNone(d.poll(), d.describe())
        self.assertEqual(self.probe("get", prefix + "leader")["kvs"][0]["value"], "127.0.0.1:%d" % port)

    def test_unusable_tls_files_stop_the_daemon_at_start_with_exit_2(self):
        base = [RENDEZVOUS, "--host", "127.0.0.1", "--port", "0", "--etcd", self.endpoint]
        missing = os.path.join(self.dir, "missing.pem")
        garbage = os.path.join(self.dir, "garbage.pem")
        with open(garbage, "w") as f:
            f.write("not a certificate\n")
        cases = [
            (["--etcd_cacert", missing], "CA file " + missing),
            (["--etcd_cacert", garbage], "CA file " + garbage),
            (["--etcd_cert", os.path.join(self.dir, "client.pem")], "needs its key file too"),
            (["--etcd_cert", os.path.join(self.dir, "client.pem"), "--etcd_key", os.path.join(self.dir, "ca.key")],
             "is not the key of the certificate"),
        ]
        for extra, expected in cases:
            with self.subTest(expected=expected):
                r = run(base + extra, timeout=15)
                self.assertEqual(r.returncode, 2, r.describe())
                self.assertIn(expected, r.stderr)
        r = run([RENDEZVOUS, "--host", "127.0.0.1", "--port", "0", "--etcd", "http://127.0.0.1:2379",
                 "--etcd_cacert", os.path.join(self.dir, "ca.pem")], timeout=15)
        self.assertEqual(r.returncode, 2, r.describe())
        self.assertIn("for https:// endpoints", r.stderr)


if __name__ == "__main__":
    unittest.main(verbosity=2)
