"""An elastic job on the namespace cluster, for the fault-tolerance tests.

    job = ElasticJob(test, cluster, ["--epochs", 8], epochs=8)   # train; python=True: elastic_ddp.py
    job.start_rendezvous()
    for node in (1, 2, 3):
        job.start_node(node)                            # ddplaunch --nnodes=2:3 ... in nodeN
    job.wait_for_steps(world=6, steps=12, timeout=90)   # a round of 6 workers made progress
    job.cluster.crash(3)
    job.wait_for_exit([1, 2], timeout=150)
    rounds = job.rounds()                               # per generation: world, steps, resume

What it records, and from where:
- each worker appends the SDK's sample records (`--sample-log`: "attempt= world= rank= epoch=
  step= indices=") to a file per generation and rank (`samples/g<DDPLAUNCH_GENERATION>-r<RANK>.log`,
  in the shared directory; `train` fills in the path's {generation} and {rank}, so the command
  line is the same for every round, as a standby's must be);
- the output of every ddplaunch (the workers' output goes through it, unprefixed): rank 0 of
  each round prints "[train] rank 0/W (...) restart R generation G", "[ddp] resumed from PATH
  (step S, ...)", "[ddp] saved checkpoint PATH (step S, ...)" and "[train] final_accuracy=A".
  Lines of one ddplaunch's output belong to the round whose header came last in it (the
  workers of a node are stopped before its next round starts).

Everything this object starts is killed by cluster.down(), which the test registers first.
"""

import collections
import os
import re
import shutil
import sys
import tempfile
import time


BUILD_DIR = os.environ.get("DDPLAUNCH_BUILD_DIR") or os.path.join(
    os.path.dirname(os.path.abspath(__file__)), "..", "..", "build")
SOURCE_DIR = os.environ.get("DDPLAUNCH_SOURCE_DIR") or os.path.abspath(
    os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
DDPLAUNCH = os.path.join(BUILD_DIR, "bin", "ddplaunch")
RENDEZVOUS = os.path.join(BUILD_DIR, "bin", "ddp-rendezvous")


def start_cluster(test, nodes=3, reason=None):
    """For a test's setUp: skips `test`, printing why, when the namespace cluster cannot run here
    (or for `reason`, the test's own); otherwise checks that ddplaunch and ddp-rendezvous are
    built, brings up `nodes` namespaces, tears them down at the test's cleanup, returns the cluster."""
    from cluster import Cluster
    reason = Cluster.unavailable_reason() or reason
    if reason:
        print("skipped: " + reason, file=sys.stderr)
        test.skipTest(reason)
    for binary in (DDPLAUNCH, RENDEZVOUS):
        test.assertTrue(os.access(binary, os.X_OK), "%s is not built" % binary)
    cluster = Cluster(nodes=nodes)
    test.addCleanup(cluster.down)
    cluster.up()
    return cluster
TRAIN = os.path.join(BUILD_DIR, "bin", "train")


def programs_in(cluster, node, name):
    """{pid: parent pid} of the processes in the node's namespace whose program (argv[0]'s base
    name) is `name`."""
    from processes import run
    found = {}
    for pid in run(["ip", "netns", "pids", cluster.ns(node)], timeout=10).check().stdout.split():
        try:
            with open("/proc/%s/cmdline" % pid, "rb") as f:
                argv0 = f.read().split(b"\0")[0].decode(errors="replace")
            with open("/proc/%s/status" % pid) as f:
                ppid = int(next(l for l in f if l.startswith("PPid:")).split()[1])
        except (OSError, StopIteration, ValueError):
            continue   # gone meanwhile
        if os.path.basename(argv0) == name:
            found[int(pid)] = ppid
    return found


class TimedTrainTest:
    """A mixin for the unittest.TestCases that run `train` on the cluster: setUp brings the
    cluster up (or skips, printing why: no namespaces, or `train` not built), tearDown prints how
    long the test took."""

    def setUp(self):
        missing = None if os.path.exists(TRAIN) else \
            "%s is not built (configure with -DDDPLAUNCH_BUILD_WORKER_SDK=ON)" % TRAIN
        self.cluster = start_cluster(self, reason=missing)
        self.started = time.monotonic()

    def tearDown(self):
        print("%s: %.1f s" % (self.id().rsplit(".", 1)[-1], time.monotonic() - self.started), file=sys.stderr)

    def server_lines(self, job):
        """The rendezvous daemon's output so far, line by line."""
        return (job.rendezvous.stdout() + job.rendezvous.stderr()).splitlines()

    def assert_round_goes_on(self, job, before, steps, agents=(), banned=()):
        """Round `before` makes `steps` more steps than it had (within 60 s) and no round forms
        after it, while the ddplaunch of every node in `agents` keeps running and the daemon logs
        no line that contains one of `banned`. The steps are the SDK's sample records."""
        target = len(before.steps) + steps

        def stepped():
            rounds = job.rounds()
            self.assertEqual([r for r in rounds if r.generation > before.generation], [],
                             "a new round formed\n" + job.describe())
            made = len(next(r for r in rounds if r.generation == before.generation).steps)
            return made >= target, "round %d made %d steps, not %d" % (before.generation, made, target)
        self.wait_untouched(job, stepped, agents, banned)

    def wait_untouched(self, job, stepped, agents, banned):
        """Polls `stepped()` (done, what it saw) until done, 60 s at most, while the ddplaunch of
        every node in `agents` keeps running and the daemon logs no line that contains one of
        `banned`."""
        deadline = time.monotonic() + 60
        while True:
            for node in agents:
                self.assertIsNone(job.agent(node).poll(), "ddplaunch on node%d exited\n%s" % (node, job.describe()))
            self.assertEqual([line for line in self.server_lines(job) if any(b in line for b in banned)], [],
                             job.describe())
            done, saw = stepped()
            if done:
                return
            if time.monotonic() > deadline:
                self.fail("%s within 60 s\n%s" % (saw, job.describe()))
            time.sleep(0.2)

    def assert_trained_well(self, job, samples, epochs, accuracy):
        """Exactly one round, the last, completed training at `accuracy` or better; every sample
        of every epoch was used exactly once; each round's records agree on its world size.
        Returns that round."""
        rounds = job.rounds()
        print("rounds: " + "\n        ".join(map(repr, rounds)), file=sys.stderr)
        final = [r for r in rounds if r.completed]
        self.assertEqual(len(final), 1, "expected exactly one round to complete training\n" + job.describe())
        self.assertIs(final[0], [r for r in rounds if r.world is not None][-1],
                      "the round that completed is not the last one\n" + job.describe())
        self.assertIsNotNone(final[0].accuracy, job.describe())
        self.assertGreaterEqual(final[0].accuracy, accuracy, job.describe())
        self.assertEqual(sample_accounting(rounds, samples, epochs), [], "sample accounting failed\n" + job.describe())
        for r in rounds:
            if r.records:
                self.assertEqual(r.record_worlds, {r.world}, "round %r: records disagree on the world size" % r)
        return final[0]

ELASTIC_DDP = os.path.join(SOURCE_DIR, "scripts", "elastic_ddp.py")
PYTHON = sys.executable  # the Python ctest runs the tests on (DDPLAUNCH_PYTHON)
RDZV_PORT = 29400  # the head is a fresh namespace: nothing else listens there

# Timeouts short enough for CI (2 cores): a lost node is noticed within 2 s of silence.
RDZV_CONF = "heartbeat_timeout=2,last_call_timeout=1,join_timeout=60"

HEADER_RE = re.compile(r"^\[(?:train|elastic_ddp)\] (?:start: world (?P<pworld>\d+) restart (?P<prestart>\d+) "
                       r"generation (?P<pgen>\d+)|rank 0/(?P<world>\d+) .*restart (?P<restart>\d+) "
                       r"generation (?P<gen>\d+))")
RESUMED_RE = re.compile(r"^\[(?:ddp|elastic_ddp)\] resumed from (?P<path>\S+) (?:\(step|at step) (?P<step>\d+)")
FRESH_RE = re.compile(r"^\[elastic_ddp\] no checkpoint: starting at step 0")
SAVED_RE = re.compile(r"^\[(?:ddp|elastic_ddp)\] saved (?:checkpoint )?(?P<path>\S+) \(step (?P<step>\d+)")
ACCURACY_RE = re.compile(r"final_accuracy=(?P<acc>[0-9.]+)")
STEPS_THIS_RUN_RE = re.compile(r"steps_this_run=(?P<n>\d+)")
EPOCHS_RE = re.compile(r"^\[train\] steps=\d+ .*epochs_completed=(?P<epochs>\d+)")
RECORD_RE = re.compile(r"^attempt=(\d+) world=(\d+) rank=(\d+) epoch=(\d+) step=(\d+) indices=([0-9,]*)$")
SAMPLE_FILE_RE = re.compile(r"^g(\d+)-r(\d+)\.log$")


class Round:
    """One generation of the worker group, as its rank 0 and its sample records tell it."""

    def __init__(self, generation):
        self.generation = generation
        self.world = None          # from rank 0's header line
        self.restart = None
        self.resumed_from_step = None   # None: no "resumed from" line (a fresh start)
        self.resumed_from = None        # the checkpoint's path, or "memory" (an in-memory restart)
        self.fresh_start = False
        self.saved_steps = []      # checkpoints rank 0 saved in this round
        self.accuracy = None       # rank 0's test accuracy when the round ended (also when stopped)
        self.completed = False     # the round trained to the last epoch
        self.steps_this_run = None  # steps the round trained, from the Python job's "done:" line
        self.records = []          # (world, rank, epoch, step, indices) from the sample logs

    @property
    def steps(self):
        return sorted({r[3] for r in self.records})

    @property
    def record_worlds(self):
        return {r[0] for r in self.records}

    def __repr__(self):
        steps = self.steps
        return ("Round(gen=%s world=%s restart=%s resumed=%s saved=%s steps=%s accuracy=%s%s)" % (
            self.generation, self.world, self.restart, self.resumed_from_step, self.saved_steps[-3:],
            "%d..%d" % (steps[0], steps[-1]) if steps else "-", self.accuracy,
            " completed" if self.completed else ""))


class ElasticJob:
    """A job of `ddplaunch --nnodes=2:3 --nproc_per_node=2` agents on the cluster's nodes."""

    def __init__(self, test, cluster, program_args, python=False, job_id="e2e", nproc=2,
                 nnodes="2:3", max_restarts=3, epochs=None, ddplaunch_flags=None, rdzv_conf=RDZV_CONF,
                 token_file=None):
        self.test = test
        self.rdzv_conf = rdzv_conf
        # The rendezvous secret (docs/security.md): the daemon's --token_file, `status`'s, and
        # token_file= in every agent's --rdzv_conf. None: no secret.
        self.token_file = token_file
        # Extra ddplaunch flags for every node (e.g. --standby=on); None: from the environment's
        # DDPLAUNCH_E2E_FLAGS (space-separated), which ctest sets for the variants of a test.
        if ddplaunch_flags is None:
            ddplaunch_flags = os.environ.get("DDPLAUNCH_E2E_FLAGS", "").split()
        self.ddplaunch_flags = list(ddplaunch_flags)
        self.epochs = epochs   # the job's --epochs, to tell a completed round from a stopped one
        self.cluster = cluster
        self.python = python
        self.job_id = job_id
        self.nproc = nproc
        self.nnodes = nnodes
        self.max_restarts = max_restarts
        self.shared = tempfile.mkdtemp(prefix="ddp-e2e-")  # stands for the NFS share
        test.addCleanup(shutil.rmtree, self.shared, True)
        self.checkpoint_dir = os.path.join(self.shared, "checkpoints")
        self.sample_dir = os.path.join(self.shared, "samples")
        os.makedirs(self.checkpoint_dir)
        os.makedirs(self.sample_dir)
        self.program_args = list(program_args)
        self.head_addr = cluster.addr("head")
        self.endpoint = "%s:%d" % (self.head_addr, RDZV_PORT)
        self.rendezvous = None
        self.agents = collections.defaultdict(list)   # node -> [Proc, ...] in start order
        self.started_at = time.monotonic()
    # ---- starting -------------------------------------------------------------------------

    def start_rendezvous(self):
        secret = ["--token_file", self.token_file] if self.token_file else []
        self.rendezvous = self.cluster.spawn("head", [RENDEZVOUS, "--host", self.head_addr,
                                                      "--port", RDZV_PORT] + secret, name="ddp-rendezvous")
        status = [RENDEZVOUS, "status", "--endpoint", self.endpoint] + secret
        deadline = time.monotonic() + 30
        while self.cluster.run("head", status, timeout=10).returncode != 0:
            if self.rendezvous.poll() is not None:
                raise AssertionError("ddp-rendezvous exited:\n" + self.rendezvous.describe())
            if time.monotonic() >= deadline:
                raise AssertionError("ddp-rendezvous does not answer `status` on %s after 30 s\n%s"
                                     % (self.endpoint, self.rendezvous.describe()))
            time.sleep(0.05)

    def command(self, node):
        cmd = [DDPLAUNCH, "--nnodes=" + self.nnodes, "--nproc_per_node=%d" % self.nproc,
               "--max_restarts=%d" % self.max_restarts, "--rdzv_backend=c10d",
               "--rdzv_endpoint=" + self.endpoint, "--rdzv_id=" + self.job_id,
               "--rdzv_conf", self.rdzv_conf + (",token_file=" + self.token_file if self.token_file else ""),
               "--shutdown_timeout=5",
               "--local_addr", self.cluster.addr(node)] + self.ddplaunch_flags
        if self.python:
            return cmd + ["--python", PYTHON, ELASTIC_DDP, "--checkpoint-dir", self.checkpoint_dir] + \
                self.program_args
        return cmd + ["--no_python", TRAIN, "--checkpoint-dir", self.checkpoint_dir] + self.program_args + \
            ["--sample-log", os.path.join(self.sample_dir, "g{generation}-r{rank}.log")]

    def start_node(self, node, env=None):
        """Starts ddplaunch on `node`, with `env` added to the test's environment (its workers
        inherit it)."""
        env = dict(os.environ, **(env or {}))
        env.pop("TORCHELASTIC_RESTART_COUNT", None)
        # Every namespace's hostname resolves to 127.0.0.1 (/etc/hosts). GLOO_SOCKET_IFNAME is
        # deliberately not set: ddplaunch gives the workers the interface that reaches
        # MASTER_ADDR, so scripts run unchanged on such hosts.
        env.pop("GLOO_SOCKET_IFNAME", None)
        proc = self.cluster.spawn(node, self.command(node), env=env,
                                  name="ddplaunch@node%s#%d" % (node, len(self.agents[node]) + 1))
        self.agents[node].append(proc)
        return proc

    def agent(self, node):
        """The newest ddplaunch started on `node`."""
        return self.agents[node][-1]

    # ---- observing ------------------------------------------------------------------------

    def rounds(self):
        """Every generation seen so far, by generation number."""
        rounds = {}

        def get(gen):
            return rounds.setdefault(gen, Round(gen))

        for procs in self.agents.values():
            for proc in procs:
                current = None
                for line in proc.stdout().splitlines():
                    m = HEADER_RE.match(line)
                    if m:
                        current = get(int(m.group("gen") or m.group("pgen")))
                        current.world = int(m.group("world") or m.group("pworld"))
                        current.restart = int(m.group("restart") or m.group("prestart"))
                        continue
                    if current is None:
                        continue
                    m = RESUMED_RE.match(line)
                    if m:
                        current.resumed_from_step = int(m.group("step"))
                        current.resumed_from = m.group("path")
                    if FRESH_RE.match(line):
                        current.fresh_start = True
                    m = SAVED_RE.match(line)
                    if m:
                        current.saved_steps.append(int(m.group("step")))
                    m = EPOCHS_RE.match(line)
                    if m and self.epochs is not None and int(m.group("epochs")) >= self.epochs:
                        current.completed = True
                    if line.startswith("[elastic_ddp] done:"):
                        current.completed = True
                        m = STEPS_THIS_RUN_RE.search(line)
                        if m:
                            current.steps_this_run = int(m.group("n"))
                    m = ACCURACY_RE.search(line)
                    if m and (line.startswith("[train] final_accuracy=") or line.startswith("[elastic_ddp] done:")):
                        current.accuracy = float(m.group("acc"))
        for name in os.listdir(self.sample_dir):
            m = SAMPLE_FILE_RE.match(name)
            if not m:
                continue
            r = get(int(m.group(1)))
            with open(os.path.join(self.sample_dir, name)) as f:
                for line in f:
                    rec = RECORD_RE.match(line.strip())
                    if rec:  # a torn last line of a killed worker does not match
                        idx = [int(i) for i in rec.group(6).split(",") if i]
                        r.records.append((int(rec.group(2)), int(rec.group(3)), int(rec.group(4)),
                                          int(rec.group(5)), idx))
        return [rounds[g] for g in sorted(rounds)]

    def progress(self, world, steps):
        """The newest round of `world` workers once it has completed `steps` steps since its
        start (by its sample records, or rank 0's saved-checkpoint lines for the Python job)."""
        for r in reversed(self.rounds()):
            if r.world != world:
                continue
            if self.python:
                first = r.resumed_from_step or 0
                if r.saved_steps and r.saved_steps[-1] - first >= steps:
                    return r
            elif r.steps and len(r.steps) >= steps:
                return r
            return None
        return None

    def wait_for_steps(self, world, steps, timeout, nodes=None):
        """Waits until a round of `world` workers has made `steps` steps; fails the test
        (with every agent's output) at once if the ddplaunch of one of `nodes` (default: all)
        exits first, or at the deadline."""
        deadline = time.monotonic() + timeout
        while True:
            for node, procs in self.agents.items():
                if (nodes is None or node in nodes) and procs[-1].poll() is not None:
                    raise AssertionError("ddplaunch on node%s exited (%s) before a round of %d workers "
                                         "made %d steps (if it finished, the job is too short for this "
                                         "machine)\n%s" % (node, procs[-1].returncode, world, steps,
                                                            self.describe()))
            found = self.progress(world, steps)
            if found:
                return found
            if time.monotonic() >= deadline:
                raise AssertionError("timed out after %.0f s waiting for a round of %d workers to make "
                                     "%d steps\n%s" % (timeout, world, steps, self.describe()))
            time.sleep(0.2)  # each look parses every log: not too often on 2 cores

    def wait_for_exit(self, nodes, timeout):
        """Waits for the newest ddplaunch of each node to exit; returns {node: exit status}."""
        deadline = time.monotonic() + timeout
        codes = {}
        for node in nodes:
            proc = self.agent(node)
            try:
                codes[node] = proc.wait(max(0.1, deadline - time.monotonic()))
            except TimeoutError:
                raise AssertionError("ddplaunch on node%s did not finish within %.0f s\n%s"
                                     % (node, timeout, self.describe())) from None
        return codes

    def describe(self):
        """Everything a failing assertion should show: rounds, then each agent's output tail."""
        parts = ["rounds: %r" % (self.rounds(),)]
        for node in sorted(self.agents, key=str):
            for proc in self.agents[node]:
                out = proc.output()
                parts.append("--- %s (exit %s), last 60 lines ---\n%s" % (
                    proc.name, proc.poll(), "\n".join(out.splitlines()[-60:])))
        if self.rendezvous is not None:
            parts.append("--- ddp-rendezvous (exit %s), last 40 lines ---\n%s" % (
                self.rendezvous.poll(), "\n".join(self.rendezvous.output().splitlines()[-40:])))
        return "\n".join(parts)


def committed_steps(rounds):
    """The steps whose updates the final model contains: {step: [(world, rank, epoch, indices)]}.

    A round that resumes at step S discards every step >= S of the rounds before it (those
    updates were lost with the round that made them and are made again)."""
    committed = {}
    for r in rounds:
        if not r.records:
            continue
        first = min(rec[3] for rec in r.records)
        for step in [s for s in committed if s >= first]:
            del committed[step]
        for world, rank, epoch, step, idx in r.records:
            committed.setdefault(step, []).append((world, rank, epoch, idx))
    return committed


def sample_accounting(rounds, dataset_size, epochs):
    """Problems with the sampler guarantee, as a list of strings (empty: every sample of every
    epoch used exactly once by the committed steps). Assumes no padding (the tests choose a
    data set size and batch size for which no shard needs padding at 4 or 6 workers)."""
    problems = []
    per_epoch = collections.defaultdict(collections.Counter)
    for step, recs in sorted(committed_steps(rounds).items()):
        worlds = {rec[0] for rec in recs}
        if len(worlds) != 1:
            problems.append("step %d was recorded at several world sizes %s" % (step, sorted(worlds)))
            continue
        world = worlds.pop()
        ranks = sorted(rec[1] for rec in recs)
        if ranks != list(range(world)):
            problems.append("step %d has records of ranks %s, expected 0..%d" % (step, ranks, world - 1))
        for _, _, epoch, idx in recs:
            per_epoch[epoch].update(idx)
    for epoch in range(epochs):
        used = per_epoch.get(epoch, collections.Counter())
        missing = [i for i in range(dataset_size) if used[i] == 0]
        repeated = sorted(i for i, n in used.items() if n > 1)
        foreign = sorted(i for i in used if not 0 <= i < dataset_size)
        if missing or repeated or foreign:
            problems.append("epoch %d: %d samples missing (e.g. %s), %d used more than once (e.g. %s), "
                            "%d out of range" % (epoch, len(missing), missing[:5], len(repeated),
                                                 repeated[:5], len(foreign)))
    extra = sorted(set(per_epoch) - set(range(epochs)))
    if extra:
        problems.append("records of epochs beyond the last: %s" % extra)
    return problems
