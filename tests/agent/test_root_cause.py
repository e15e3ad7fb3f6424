"""The failure summary names the real cause: one worker of a two-node job is
killed with SIGKILL; its peers on both nodes then fail in their next collective. Every node's
ddplaunch must report the killed worker and its signal as the root cause, never a peer's
"exited with code 1".

- Repeated in one run, alternating the victim between the nodes and the local ranks.
- The worst order, forced: the victim's agent is frozen (SIGSTOP) while the victim dies, so the
  other node's "exited with code 1" reaches the rendezvous first and the victim's local peer
  dies before its agent reaps anything (both are reaped in one batch, the peer first).
"""

import os
import re
import signal

from ddplaunch_helpers import main
from processes import wait_for
from test_multinode import JOB_DEADLINE, MultiNodeTestCase

VICTIM_WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "victim_worker.py")
REPEATS = 6
ROOT_CAUSE = re.compile(r"Root Cause \(first observed failure\):\n\[0\]:\n(?:.*\n){2}"
                        r"  rank      : (\d+) \(local_rank: \d+\)\n  exitcode  : (-?\d+) .*\n"
                        r"(?:  signal    : \d+ \((\w+)\)\n)?")


class RootCause(MultiNodeTestCase):
    def start_job(self, victim, conf=None):
        self.job = "root-cause-%d-%d" % (victim, self.attempt)
        self.attempt += 1
        self.nodes = []
        for name in ("n0", "n1"):
            args = self.node_args("2", nproc=2, **({"conf": conf} if conf else {}))
            # node_args ends with the worker; use the victim worker instead of mn_worker.
            args = args[:args.index("--python") + 2] + [VICTIM_WORKER, self.out]
            proc = self.spawn_launch(args, env={"VICTIM_RANK": str(victim), "MN_NODE": name})
            self.nodes.append(proc)

    def check_summaries(self, victim):
        codes = self.wait_exit(self.nodes)
        self.assertEqual(codes, [1, 1], self.describe_nodes())
        for p in self.nodes:
            m = ROOT_CAUSE.search(p.stderr())
            self.assertIsNotNone(m, "no root cause in the summary:\n" + p.describe())
            self.assertEqual((int(m.group(1)), m.group(2), m.group(3)), (victim, "-9", "SIGKILL"),
                             "victim %d: the summary names another cause:\n%s" % (victim, p.describe()))

    def test_every_node_names_the_killed_worker_and_its_signal_as_root_cause(self):
        self.start_daemon()
        self.attempt = 0
        for i in range(REPEATS):
            with self.subTest(attempt=i):
                self.start_job(victim=i % 4)
                self.check_summaries(victim=i % 4)

    def test_the_killed_worker_is_the_root_cause_even_when_its_agent_reports_last(self):
        self.start_daemon()
        self.attempt = 0
        # A long heartbeat timeout: the frozen agent must not be declared lost meanwhile.
        conf = "heartbeat_interval=0.5,heartbeat_timeout=60,last_call_timeout=1,join_timeout=30"
        self.start_job(victim=-1, conf=conf)
        running = lambda: [n for n in os.listdir(self.out) if n.startswith("running-")]
        wait_for(lambda: len(running()) == 4, JOB_DEADLINE, "4 running workers")
        pids = {int(n.split("-")[1][1:]): int(n.split("-")[2][1:]) for n in running()}

        def parent(pid):
            with open("/proc/%d/stat" % pid) as f:
                return int(f.read().rsplit(")", 1)[1].split()[1])
        parents = {pid: parent(pid) for pid in pids.values()}  # every worker runs: readable now
        # The victim: local rank 1 of its node (reaped after its local rank 0 peer in one batch).
        agents = {p.pid: p for p in self.nodes}
        victim = next(r for r, pid in sorted(pids.items())
                      if parents[pid] in agents and any(parents[q] == parents[pid] and q < pid
                                                        for q in pids.values()))
        agent = agents[parents[pids[victim]]]
        agent.signal(signal.SIGSTOP)
        try:
            os.kill(pids[victim], signal.SIGKILL)
            # The other node's peers fail and their agent's report reaches the rendezvous first.
            wait_for(lambda: "failure on" in self.daemon.stdout(), JOB_DEADLINE,
                     "the other node's failure report")
            # The victim's local peer dies too, before its agent has reaped anything.
            peer = next(pid for pid in pids.values() if parents[pid] == agent.pid and pid != pids[victim])
            wait_for(lambda: open("/proc/%d/stat" % peer).read().rsplit(")", 1)[1].split()[0] == "Z",
                     JOB_DEADLINE, "the victim's local peer to exit")
        finally:
            agent.signal(signal.SIGCONT)
        self.check_summaries(victim)


if __name__ == "__main__":
    main()
