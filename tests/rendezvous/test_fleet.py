"""Many agents in several processes through a job's life against a real daemon (bench/rendezvous/fleet.cpp
at a reduced scale): every agent resumes after the daemon's SIGKILL and restart with no restart told,
and one agent's death reaches every survivor, read as it comes or dated by its arrival while the load
is still. With and without a cluster secret (sealed node secrets, HMAC handshakes). The tool enforces
each phase with a deadline and exits 1 on any miss; this test checks its exit, its JSON line, and
what the restarted daemon logged. Loopback only."""

import json
import os
import subprocess
import tempfile
import unittest

BUILD = os.environ.get("DDPLAUNCH_BUILD_DIR", "build")
FLEET = os.path.join(BUILD, "bin", "ddp-rdzv-fleet")
DAEMON = os.path.join(BUILD, "bin", "ddp-rendezvous")


@unittest.skipUnless(os.path.exists(FLEET), "ddp-rdzv-fleet is not built (DDPLAUNCH_BUILD_BENCH=OFF, as in the "
                                            "sanitizer build): the full build runs this test")
class FleetTest(unittest.TestCase):
    def run_fleet(self, agents, procs, secret, extra=()):
        with tempfile.TemporaryDirectory() as tmp:
            log = os.path.join(tmp, "daemon.log")
            args = [FLEET, "--daemon", DAEMON, "--agents", str(agents), "--procs", str(procs), "--deadline", "60",
                    "--daemon-log", log] + list(extra)
            if secret:
                token = os.path.join(tmp, "token")
                with open(token, "w") as f:
                    f.write(os.urandom(24).hex() + "\n")
                args += ["--token-file", token]
            out = subprocess.run(args, capture_output=True, text=True, timeout=300)
            with open(log) as f:
                daemon_log = f.read()
        self.assertEqual(out.returncode, 0, out.stderr + out.stdout[-2000:] + daemon_log[-3000:])
        result = json.loads(out.stdout.strip().splitlines()[-1])
        return result, daemon_log

    def check(self, result, daemon_log, agents, procs):
        self.assertEqual((result["agents"], result["procs"]), (agents, procs))
        for key in ("connect_s", "round_s", "resume_s", "dead_broadcast_s", "rss_kb_per_agent"):
            self.assertGreater(result[key], 0, key)
        # Two daemons wrote the log: the first formed the round, the second rebuilt it from the
        # agents' resumes (no restart: the tool failed otherwise), then told the death to all.
        tail = daemon_log[-3000:]
        self.assertEqual(daemon_log.count("listening on"), 2, tail)
        self.assertTrue(f"restored: every one of {agents} nodes resumed generation 1" in daemon_log, tail)
        self.assertRegex(daemon_log[:100000], r"restart after generation 1 \(not counted\): node fleet0 .* lost")

    def test_a_thousand_agents_in_three_processes_resume_and_hear_a_death_from_writer_threads(self):
        # Over 2 x kFanOutPerThread recipients: the restart goes out through write_to_all on two
        # threads (--writer_threads 2, whatever this machine's cores).
        result, log = self.run_fleet(1200, 3, secret=False, extra=["--daemon-arg=--writer_threads=2"])
        self.check(result, log, 1200, 3)

    def test_a_death_told_while_the_load_is_still_is_dated_by_each_survivors_arrival(self):
        # --still: every load process sleeps through the broadcast, then reads by hand; each
        # restart's time is the kernel's arrival stamp, so the figure lies within the still time.
        result, log = self.run_fleet(600, 2, secret=False, extra=["--still", "0.5"])
        self.check(result, log, 600, 2)
        self.assertEqual(result["load_still_s"], 0.5)
        self.assertLess(result["dead_broadcast_s"], 0.5)

    def test_with_a_cluster_secret_every_sealed_node_secret_still_resumes(self):
        result, log = self.run_fleet(200, 2, secret=True)
        self.check(result, log, 200, 2)


if __name__ == "__main__":
    unittest.main()
