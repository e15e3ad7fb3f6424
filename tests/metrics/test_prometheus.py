"""A real Prometheus scrapes a running daemon and a running agent: Debian's
`prometheus`, a temporary config with a 1 s scrape interval, its own TSDB directory and a free
loopback port; the values are read back through its HTTP query API (/api/v1/query). Skipped with
a printed reason when the prometheus binary is missing. Every wait has a deadline."""

import json
import os
import shutil
import signal
import unittest
import urllib.parse

from metrics_helpers import MetricsTestCase, free_port, http_get, metrics_port_from, spawn, wait_for

PROMETHEUS = shutil.which("prometheus") or ("/usr/bin/prometheus" if os.path.exists("/usr/bin/prometheus") else None)


class PrometheusScrapeTest(MetricsTestCase):
    def setUp(self):
        super().setUp()
        if PROMETHEUS is None:
            print("SKIP: no prometheus binary (apt-get install prometheus; scripts/setup installs it)")
            self.skipTest("no prometheus binary")

    def query(self, port, expr):
        """The instant vector of `expr` as {job label: value}."""
        status, _, body = http_get(port, "/api/v1/query?query=" + urllib.parse.quote(expr), timeout=5)
        if status != 200:
            return {}
        reply = json.loads(body)
        if reply.get("status") != "success":
            return {}
        return {r["metric"].get("job", ""): float(r["value"][1]) for r in reply["data"]["result"]}

    def test_prometheus_scrapes_the_daemon_and_the_agent(self):
        self.start_daemon()
        job = self.spawn_launch(self.job_args("prom1", extra=["--metrics_port=0"]))
        agent_port = wait_for(lambda: metrics_port_from(job.stderr(), "ddplaunch: metrics"), 30,
                              "ddplaunch's metrics line")
        wait_for(lambda: self.started(0, 0) and self.started(1, 0), 60, "both workers to start")

        prom_port = free_port()
        config = os.path.join(self.tmp, "prometheus.yml")
        with open(config, "w") as f:
            f.write("global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\n  evaluation_interval: 1s\n"
                    "scrape_configs:\n"
                    "  - job_name: rendezvous\n    static_configs:\n      - targets: ['127.0.0.1:%d']\n"
                    "  - job_name: agent\n    static_configs:\n      - targets: ['127.0.0.1:%d']\n"
                    % (self.metrics_port, agent_port))
        prom = spawn([PROMETHEUS, "--config.file=" + config, "--storage.tsdb.path=" + os.path.join(self.tmp, "tsdb"),
                      "--web.listen-address=127.0.0.1:%d" % prom_port, "--log.level=warn"], name="prometheus")
        self.addCleanup(prom.kill)

        up = wait_for(lambda: (lambda v: v if v.get("rendezvous") == 1 and v.get("agent") == 1 else None)(
            self.query(prom_port, "up")), 90, "Prometheus to scrape both targets (up == 1)")
        print("prometheus: up =", up)
        self.assertEqual(self.query(prom_port, "ddp_rendezvous_rounds_total"), {"rendezvous": 1.0})
        self.assertEqual(self.query(prom_port, 'ddp_rendezvous_jobs{state="running"}'), {"rendezvous": 1.0})
        self.assertEqual(self.query(prom_port, 'ddp_rendezvous_nodes{state="running"}'), {"rendezvous": 1.0})
        self.assertEqual(self.query(prom_port, "ddp_agent_workers_running"), {"agent": 2.0})
        self.assertEqual(self.query(prom_port, "ddp_agent_generation"), {"agent": 1.0})
        formation = self.query(prom_port, "ddp_rendezvous_round_formation_seconds_count")
        self.assertEqual(formation, {"rendezvous": 1.0})
        self.assertEqual(self.query(prom_port, 'ddp_rendezvous_round_formation_seconds_bucket{le="+Inf"}'),
                         {"rendezvous": 1.0})

        prom.signal(signal.SIGTERM)
        self.assertEqual(prom.wait(30), 0, prom.describe())
        self.release()
        self.assertEqual(job.wait(60), 0, job.describe())


if __name__ == "__main__":
    unittest.main(verbosity=2)
