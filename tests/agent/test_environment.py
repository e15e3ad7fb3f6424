"""ddplaunch gives each worker the environment of docs/architecture.md, and real PyTorch workers can use it
to form a Gloo process group and all-reduce."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ddplaunch_helpers import PYTHON, LaunchTestCase, main  # noqa: E402

DUMP_ENV = """
import json, os, sys
names = ["RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
         "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT",
         "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_RUN_ID",
         "TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_ERROR_FILE", "TORCH_NCCL_ASYNC_ERROR_HANDLING",
         "NCCL_ASYNC_ERROR_HANDLING", "OMP_NUM_THREADS", "DDPLAUNCH_GENERATION", "INHERITED_BY_WORKER"]
record = {n: os.environ.get(n) for n in names}
record["argv"] = sys.argv[1:]
record["pgid_is_pid"] = os.getpgid(0) == os.getpid()
with open(os.path.join(os.environ["OUT_DIR"], "env_%s.json" % os.environ["RANK"]), "w") as f:
    json.dump(record, f)
"""

DUMP_DIGEST = """
import json, os
with open(os.path.join(os.environ["OUT_DIR"], "digest_%s.json" % os.environ["RANK"]), "w") as f:
    json.dump({"fingerprint": os.environ.get("DDPLAUNCH_ENV_FINGERPRINT"),
               "check": os.environ.get("DDPLAUNCH_ENV_CHECK")}, f)
"""

ALL_REDUCE = """
import json, os
import torch
import torch.distributed as dist
dist.init_process_group("gloo", init_method="env://")
t = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(t)
with open(os.path.join(os.environ["OUT_DIR"], "sum_%d.json" % dist.get_rank()), "w") as f:
    json.dump({"sum": t.item(), "world": dist.get_world_size()}, f)
dist.destroy_process_group()
"""

TORCHELASTIC_DETECT = """
import json, os
import torch.distributed as dist
with open(os.path.join(os.environ["OUT_DIR"], "detect_%s.json" % os.environ["RANK"]), "w") as f:
    json.dump({"launched": dist.is_torchelastic_launched(), "run_id": os.environ.get("TORCHELASTIC_RUN_ID")}, f)
"""

INIT_TCP = """
import json, os
import torch
import torch.distributed as dist
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
dist.init_process_group("gloo", init_method="tcp://%s:%s" % (os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"]),
                        rank=rank, world_size=world)
t = torch.tensor([float(rank + 1)])
dist.all_reduce(t)
with open(os.path.join(os.environ["OUT_DIR"], "sum_%d.json" % rank), "w") as f:
    json.dump({"sum": t.item()}, f)
dist.destroy_process_group()
"""


class WorkerEnvironment(LaunchTestCase):
    def test_four_workers_get_every_variable_with_consistent_ranks(self):
        script = self.script("dump_env.py", DUMP_ENV, executable=True)
        result = self.launch(["--nproc_per_node=4", "--no_python", "--max_restarts=2", "--rdzv_id=envjob",
                              "--role=trainer", "--log_dir", os.path.join(self.tmp, "logs"),
                              script, "a b", "--flag"],
                             env={"OUT_DIR": self.out, "INHERITED_BY_WORKER": "yes"})
        self.assertEqual(result.returncode, 0, result.describe())
        records = self.records("env_")
        self.assertEqual(sorted(records), ["env_%d.json" % r for r in range(4)])
        ports = set()
        for rank in range(4):
            e = records["env_%d.json" % rank]
            self.assertEqual(e["RANK"], str(rank))
            self.assertEqual(e["LOCAL_RANK"], str(rank))
            self.assertEqual(e["WORLD_SIZE"], "4")
            self.assertEqual(e["LOCAL_WORLD_SIZE"], "4")
            self.assertEqual(e["GROUP_RANK"], "0")
            self.assertEqual(e["GROUP_WORLD_SIZE"], "1")
            self.assertEqual(e["ROLE_RANK"], str(rank))
            self.assertEqual(e["ROLE_WORLD_SIZE"], "4")
            self.assertEqual(e["ROLE_NAME"], "trainer")
            self.assertEqual(e["MASTER_ADDR"], "127.0.0.1")
            self.assertTrue(0 < int(e["MASTER_PORT"]) < 65536)
            ports.add(e["MASTER_PORT"])
            self.assertEqual(e["TORCHELASTIC_RESTART_COUNT"], "0")
            self.assertEqual(e["TORCHELASTIC_MAX_RESTARTS"], "2")
            self.assertEqual(e["TORCHELASTIC_RUN_ID"], "envjob")
            self.assertEqual(e["TORCHELASTIC_USE_AGENT_STORE"], "False")
            self.assertEqual(e["TORCHELASTIC_ERROR_FILE"],
                             os.path.join(self.tmp, "logs", "envjob", "attempt_0", str(rank), "error.json"))
            self.assertEqual(e["TORCH_NCCL_ASYNC_ERROR_HANDLING"], "1")
            self.assertEqual(e["NCCL_ASYNC_ERROR_HANDLING"], "1")
            self.assertEqual(e["OMP_NUM_THREADS"], "1")
            self.assertEqual(e["DDPLAUNCH_GENERATION"], "1")
            self.assertEqual(e["INHERITED_BY_WORKER"], "yes")
            self.assertEqual(e["argv"], ["a b", "--flag"])
            self.assertTrue(e["pgid_is_pid"], "each worker leads its own process group")
        self.assertEqual(len(ports), 1, "every worker of a round gets the same MASTER_PORT")
        self.assertIn("OMP_NUM_THREADS", result.stderr)

    def test_omp_num_threads_set_by_the_user_is_kept(self):
        script = self.script("dump_env.py", DUMP_ENV)
        result = self.launch(["--nproc_per_node=2", "--python", PYTHON, script],
                             env={"OUT_DIR": self.out, "OMP_NUM_THREADS": "3"})
        self.assertEqual(result.returncode, 0, result.describe())
        for e in self.records("env_").values():
            self.assertEqual(e["OMP_NUM_THREADS"], "3")

    def test_static_backend_ranks_are_node_rank_times_nproc_plus_local_rank(self):
        script = self.script("dump_env.py", DUMP_ENV)
        result = self.launch(["--nnodes=3", "--node_rank=2", "--nproc_per_node=2", "--master_addr=127.0.0.1",
                              "--master_port=29999", "--python", PYTHON, script], env={"OUT_DIR": self.out})
        self.assertEqual(result.returncode, 0, result.describe())
        records = self.records("env_")
        self.assertEqual(sorted(records), ["env_4.json", "env_5.json"])
        for lr in range(2):
            e = records["env_%d.json" % (4 + lr)]
            self.assertEqual(e["LOCAL_RANK"], str(lr))
            self.assertEqual(e["WORLD_SIZE"], "6")
            self.assertEqual(e["GROUP_RANK"], "2")
            self.assertEqual(e["GROUP_WORLD_SIZE"], "3")
            self.assertEqual(e["MASTER_PORT"], "29999")

    def test_module_and_run_path_run_the_program_like_torchrun(self):
        pkg = os.path.join(self.tmp, "mypkg")
        os.mkdir(pkg)
        with open(os.path.join(pkg, "__init__.py"), "w"):
            pass
        with open(os.path.join(pkg, "dump.py"), "w") as f:
            f.write(DUMP_ENV)
        result = self.launch(["--nproc_per_node=2", "--python", PYTHON, "-m", "mypkg.dump", "x"],
                             env={"OUT_DIR": self.out, "PYTHONPATH": self.tmp})
        self.assertEqual(result.returncode, 0, result.describe())
        self.assertEqual([e["argv"] for e in self.records("env_").values()], [["x"], ["x"]])
        for name in os.listdir(self.out):
            os.unlink(os.path.join(self.out, name))
        script = self.script("dump_env.py", "if __name__ == '__main__':\n" +
                             "\n".join("    " + line for line in DUMP_ENV.splitlines()) + "\n")
        result = self.launch(["--nproc_per_node=2", "--python", PYTHON, "--run_path", script, "y"],
                             env={"OUT_DIR": self.out})
        self.assertEqual(result.returncode, 0, result.describe())
        self.assertEqual([e["argv"] for e in self.records("env_").values()], [["y"], ["y"]])

    def test_four_python_workers_form_a_gloo_group_and_all_reduce(self):
        script = self.script("all_reduce.py", ALL_REDUCE)
        result = self.launch(["--nproc_per_node=4", "--python", PYTHON, script], timeout=180,
                             env={"OUT_DIR": self.out})
        self.assertEqual(result.returncode, 0, result.describe())
        records = self.records("sum_")
        self.assertEqual(len(records), 4, result.describe())
        for r in records.values():
            self.assertEqual(r, {"sum": 10.0, "world": 4})

    # The scenarios of torchrun's own launcher tests (pytorch test/distributed/launcher/test_run.py)
    # that apply to one node.
    def test_standalone_from_pet_variables_is_detected_as_torchelastic_launched(self):
        script = self.script("detect.py", TORCHELASTIC_DETECT)
        result = self.launch(["--standalone", "--python", PYTHON, script],
                             env={"OUT_DIR": self.out, "PET_NPROC_PER_NODE": "2"})
        self.assertEqual(result.returncode, 0, result.describe())
        records = self.records("detect_")
        self.assertEqual(len(records), 2)
        run_ids = {r["run_id"] for r in records.values()}
        self.assertEqual(len(run_ids), 1, "all workers share the run id")
        self.assertNotIn(run_ids.pop(), (None, "", "none"), "--standalone makes a random run id")
        self.assertTrue(all(r["launched"] for r in records.values()))

    def test_workers_can_use_init_method_tcp_from_master_addr_and_port(self):
        script = self.script("tcp.py", INIT_TCP)
        result = self.launch(["--nproc_per_node=2", "--python", PYTHON, script], timeout=120,
                             env={"OUT_DIR": self.out})
        self.assertEqual(result.returncode, 0, result.describe())
        self.assertEqual([r["sum"] for r in self.records("sum_").values()], [3.0, 3.0])

    def test_workers_get_the_environment_digest_that_changes_with_the_software_only(self):
        script = self.script("digest.py", DUMP_DIGEST)
        lock = os.path.join(self.tmp, "requirements.txt")

        def digests(*flags, lock_text="torch==2.15.0\n"):
            with open(lock, "w") as f:
                f.write(lock_text)
            for name in os.listdir(self.out):
                os.unlink(os.path.join(self.out, name))
            result = self.launch(["--nproc_per_node=2", "--python", PYTHON, "--env_lock", lock, *flags, script],
                                 env={"OUT_DIR": self.out, "DDPLAUNCH_ENV_FINGERPRINT": "inherited"})
            self.assertEqual(result.returncode, 0, result.describe())
            records = list(self.records("digest_").values())
            self.assertEqual(len(records), 2)
            self.assertEqual(records[0], records[1], "every worker of a node gets the same")
            return records[0]

        first = digests()
        self.assertRegex(first["fingerprint"], "^[0-9a-f]{64}$")
        self.assertEqual(first["check"], "strict")
        self.assertEqual(digests("--env_check=warn"), dict(first, check="warn"), "the same software, the same digest")
        self.assertNotEqual(digests(lock_text="torch==2.14.0\n")["fingerprint"], first["fingerprint"])
        off = digests("--env_check=off")
        self.assertEqual(off, {"fingerprint": None, "check": None}, "no check, no digest, not even an inherited one")

    def test_a_shell_script_runs_with_no_python(self):
        path = os.path.join(self.tmp, "worker.sh")
        with open(path, "w") as f:
            f.write('#!/bin/sh\necho "{\\"rank\\": $RANK, \\"args\\": \\"$*\\"}" > "$OUT_DIR/sh_$RANK.json"\n')
        os.chmod(path, 0o755)
        result = self.launch(["--nproc_per_node=3", "--no_python", path, "x", "y"], env={"OUT_DIR": self.out})
        self.assertEqual(result.returncode, 0, result.describe())
        self.assertEqual([r for r in self.records("sh_").values()],
                         [{"rank": i, "args": "x y"} for i in range(3)])


if __name__ == "__main__":
    main()
