"""torchrun 2.x command lines through the real ddplaunch binary: every flag in
both spellings and as its PET_ variable, abbreviations, the NUMA binding seen from inside each
worker (/proc/self/status), the virtual local rank, and the Python plug-in options at their
defaults.
"""

import os
import re
import shutil
import tempfile
import unittest

from processes import run

BUILD = os.path.abspath(os.environ.get("DDPLAUNCH_BUILD_DIR", "build"))
DDPLAUNCH = os.path.join(BUILD, "bin", "ddplaunch")

# Each worker records its view in out/<RANK>: LOCAL_RANK, CUDA_VISIBLE_DEVICES, its allowed
# CPUs, and the run id.
RECORD = (
    'cpus=$(sed -n "s/^Cpus_allowed_list:[[:space:]]*//p" /proc/self/status); '
    'echo "$LOCAL_RANK ${CUDA_VISIBLE_DEVICES-unset} $cpus $TORCHELASTIC_RUN_ID" > "out/$RANK"'
)


def clean_env(**extra):
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("PET_") and k not in ("PYTHON_EXEC", "CUDA_VISIBLE_DEVICES",
                                                      "HIP_VISIBLE_DEVICES", "TORCH_ELASTIC_SHUTDOWN_TIMEOUT")}
    env["PATH"] = "/usr/bin:/bin"
    env.update(extra)
    return env


def parse_cpus(text):
    cpus = set()
    for part in text.strip().split(","):
        if not part:
            continue
        first, _, last = part.partition("-")
        cpus.update(range(int(first), int(last or first) + 1))
    return cpus


def numa_nodes():
    """NUMA node -> its CPUs, from sysfs (independently of ddplaunch)."""
    base = "/sys/devices/system/node"
    nodes = {}
    for name in os.listdir(base):
        if re.fullmatch(r"node\d+", name):
            with open(os.path.join(base, name, "cpulist")) as f:
                nodes[int(name[4:])] = parse_cpus(f.read())
    return nodes


class TorchRun2Flags(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.mkdtemp(prefix="ddplaunch-torchrun2-")
        self.addCleanup(shutil.rmtree, self.tmp, True)
        self.reset()

    def reset(self):
        shutil.rmtree(os.path.join(self.tmp, "out"), True)
        os.mkdir(os.path.join(self.tmp, "out"))

    def ddplaunch(self, *args, env=None, prefix=()):
        env = env or clean_env()
        env["TMPDIR"] = self.tmp
        return run([*prefix, DDPLAUNCH, *args], timeout=90, env=env, cwd=self.tmp)

    def workers(self, *flags, nproc=2, env=None, prefix=()):
        """Runs `nproc` recording workers; returns ({rank: [words]}, result)."""
        self.reset()
        r = self.ddplaunch("--nproc_per_node=%d" % nproc, *flags, "--no_python", "/bin/sh", "-c", RECORD,
                           env=env, prefix=prefix)
        self.assertEqual(r.returncode, 0, r.describe())
        out = {}
        for name in os.listdir(os.path.join(self.tmp, "out")):
            with open(os.path.join(self.tmp, "out", name)) as f:
                out[int(name)] = f.read().split()
        self.assertEqual(sorted(out), list(range(nproc)), r.describe())
        return out, r

    def refused(self, *flags, env=None):
        self.reset()
        marker = os.path.join(self.tmp, "out", "started")
        r = self.ddplaunch(*flags, "--no_python", "/usr/bin/touch", marker, env=env)
        self.assertEqual(r.returncode, 2, r.describe())
        self.assertTrue(r.stderr.startswith("ddplaunch: "), r.describe())
        self.assertFalse(os.path.exists(marker), "a worker was started: " + r.describe())
        return r

    # Each spelling of a flag, and its PET_ variable, as (args, extra env).
    def spellings(self, under, value=None):
        dash = under.replace("_", "-")
        pet = "PET_" + under.upper()
        if value is None:
            return [(["--" + under], {}), (["--" + dash], {}), ([], {pet: "1"})]
        return [(["--%s=%s" % (under, value)], {}), (["--" + dash, value], {}), ([], {pet: value})]

    def test_virtual_local_rank_gives_each_worker_local_rank_0_and_its_own_device(self):
        for args, env in self.spellings("virtual_local_rank"):
            with self.subTest(args=args, env=env):
                out, _ = self.workers(*args, env=clean_env(CUDA_VISIBLE_DEVICES="4,6", **env))
                self.assertEqual([out[r][:2] for r in (0, 1)], [["0", "4"], ["0", "6"]])
        # Without CUDA_VISIBLE_DEVICES each worker sees the device of its local rank.
        out, _ = self.workers("--virtual-local-rank", nproc=3)
        self.assertEqual([out[r][:2] for r in range(3)], [["0", "0"], ["0", "1"], ["0", "2"]])
        # Without the flag: the real local rank and the agent's list, unchanged.
        out, _ = self.workers(env=clean_env(CUDA_VISIBLE_DEVICES="4,6"))
        self.assertEqual([out[r][:2] for r in (0, 1)], [["0", "4,6"], ["1", "4,6"]])
        r = self.refused("--nproc_per_node=3", "--virtual_local_rank", env=clean_env(CUDA_VISIBLE_DEVICES="4,6"))
        self.assertIn("names fewer devices than --nproc_per_node=3", r.stderr)

    def test_numa_binding_node_gives_each_worker_its_nodes_cpus(self):
        allowed = os.sched_getaffinity(0)
        nodes = {n: cpus & allowed for n, cpus in numa_nodes().items() if cpus & allowed}
        for args, env in self.spellings("numa_binding", "node"):
            with self.subTest(args=args, env=env):
                out, r = self.workers(*args, env=clean_env(**env))
                for rank in (0, 1):
                    line = re.search(r"local rank %d on CPUs (\S+), memory node (\d+)" % rank, r.stderr)
                    self.assertIsNotNone(line, r.stderr)
                    node = int(line.group(2))
                    self.assertEqual(parse_cpus(out[rank][2]), nodes[node], r.describe())
                    self.assertEqual(parse_cpus(line.group(1)), nodes[node])

    def test_numa_binding_honours_the_launchers_affinity_and_exclusive_splits_cores(self):
        allowed = sorted(os.sched_getaffinity(0))
        first = allowed[0]
        out, _ = self.workers("--numa-binding=node", prefix=("taskset", "-c", str(first)))
        self.assertEqual([out[r][2] for r in (0, 1)], [str(first), str(first)])
        cores = set()
        for cpu in allowed:
            path = "/sys/devices/system/cpu/cpu%d/topology/thread_siblings_list" % cpu
            with open(path) as f:
                cores.add(min(parse_cpus(f.read()) & set(allowed)))
        nodes = [cpus for cpus in numa_nodes().values() if cpus & set(allowed)]
        if len(nodes) != 1 or len(cores) < 2:
            self.skipTest("exclusive split is checked on one NUMA node with >= 2 cores; here: "
                          "%d nodes, %d cores" % (len(nodes), len(cores)))
        out, r = self.workers("--numa_binding", "exclusive")
        mine = [parse_cpus(out[rank][2]) for rank in (0, 1)]
        self.assertTrue(mine[0] and mine[1], r.describe())
        self.assertFalse(mine[0] & mine[1], "exclusive workers share CPUs: " + r.describe())
        self.assertEqual(mine[0] | mine[1], set(allowed))
        r = self.refused("--numa_binding=everything")
        self.assertIn("node, socket, exclusive, core-complex", r.stderr)

    def test_duplicate_filters_logs_specs_and_event_log_handler_accept_their_values(self):
        cases = (self.spellings("duplicate_stdout_filters", "loss,,acc")
                 + self.spellings("duplicate_stderr_filters", "Traceback")
                 + self.spellings("logs_specs", "DefaultLogsSpecs")
                 + self.spellings("event_log_handler", "null")
                 + self.spellings("event_log_handler", "console"))
        for args, env in cases:
            with self.subTest(args=args, env=env):
                self.workers(*args, nproc=1, env=clean_env(**env))
        for args, env in self.spellings("logs_specs", "my_plugin"):
            with self.subTest(args=args, env=env):
                r = self.refused(*args, env=clean_env(**env))
                self.assertIn("torchrun.logs_specs", r.stderr)
        for args, env in self.spellings("event_log_handler", "fancy"):
            with self.subTest(args=args, env=env):
                r = self.refused(*args, env=clean_env(**env))
                self.assertIn("Accepted: null", r.stderr)

    def test_nproc_per_node_xpu_is_refused_with_the_reason(self):
        for args, env in self.spellings("nproc_per_node", "xpu"):
            with self.subTest(args=args, env=env):
                r = self.refused(*args, env=clean_env(**env))
                self.assertIn("no XPU is visible", r.stderr)

    def test_unique_prefixes_are_accepted_and_ambiguous_ones_name_the_candidates(self):
        self.reset()
        r = self.ddplaunch("--nproc", "3", "--max-rest=1", "--no_python", "/bin/sh", "-c", RECORD)
        self.assertEqual(r.returncode, 0, r.describe())
        self.assertEqual(sorted(os.listdir(os.path.join(self.tmp, "out"))), ["0", "1", "2"])
        r = self.refused("--n", "2")
        self.assertIn("ambiguous option: --n could match --nnodes, --nproc_per_node, --node_rank, "
                      "--no_python", r.stderr)

    def test_an_empty_pet_standalone_counts_as_unset(self):
        out, _ = self.workers(nproc=1, env=clean_env(PET_STANDALONE=""))
        self.assertEqual(out[0][3], "none")
        out, _ = self.workers(nproc=1, env=clean_env(PET_STANDALONE="1"))
        self.assertRegex(out[0][3], r"^[0-9a-f]{8}-[0-9a-f]{4}-4")

    def test_workers_see_signals_to_handle_as_given_like_torchruns(self):
        record = 'echo "$TORCHELASTIC_SIGNALS_TO_HANDLE" > "out/$RANK"'
        for flags, expected in ((["--signals_to_handle=SIGUSR1,SIGTERM"], "SIGUSR1,SIGTERM"),
                                ([], "SIGTERM,SIGINT,SIGHUP,SIGQUIT")):
            self.reset()
            r = self.ddplaunch("--nproc_per_node=1", *flags, "--no_python", "/bin/sh", "-c", record,
                               env=clean_env(TORCHELASTIC_SIGNALS_TO_HANDLE="SIGHUP"))
            self.assertEqual(r.returncode, 0, r.describe())
            with open(os.path.join(self.tmp, "out", "0")) as f:
                self.assertEqual(f.read().strip(), expected, r.describe())

    def test_torch_elastic_shutdown_timeout_and_keep_alive_keys_are_read(self):
        self.workers(nproc=1, env=clean_env(TORCH_ELASTIC_SHUTDOWN_TIMEOUT="5"))
        r = self.refused(env=clean_env(TORCH_ELASTIC_SHUTDOWN_TIMEOUT="soon"))
        self.assertIn("TORCH_ELASTIC_SHUTDOWN_TIMEOUT=soon", r.stderr)
        _, r = self.workers("--rdzv_conf=keep_alive_interval=2,keep_alive_max_attempt=3", nproc=1)
        self.assertNotIn("unknown key", r.stderr)
        r = self.refused("--rdzv_conf=keep_alive_max_attempt=1")
        self.assertIn("at least 2", r.stderr)


if __name__ == "__main__":
    unittest.main()
