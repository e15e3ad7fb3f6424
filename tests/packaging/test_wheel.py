"""`pip install` of the ddplaunch wheel (docs/install.md, "pip"): pyproject.toml builds it,
auditwheel accepts it for a manylinux policy, and in a fresh venv that sees the project's torch
(through a .pth file, so torch is not downloaded again) it runs a 2-worker job with no --python,
a 2-node job against its own ddp-rendezvous, `python -m ddplaunch`, and a C++ program built with
find_package(ddplaunch) against that torch; `pip uninstall` then leaves nothing behind.

The wheel, the venv and the consumer's build live in the build folder (wheel-test/), at the same
place every run, so that ccache serves what an earlier run of any clone compiled."""
import os
import re
import shutil
import sys
import unittest
import zipfile

from install_helpers import BUILD, SOURCE, project_version, skip
from processes import free_port, port_open, run, spawn, wait_all, wait_for

ROOT = os.path.join(BUILD, "wheel-test")
VENV = os.path.join(ROOT, "venv")
VENV_PY = os.path.join(VENV, "bin", "python3")
# The script's python3 is the project venv's (tests/CMakeLists.txt puts its bin/ first on PATH).
TORCH_VENV = os.path.dirname(os.path.dirname(os.path.abspath(sys.executable)))

JOB = r"""
import os, sys
import torch
import torch.distributed as dist
dist.init_process_group("gloo")
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(3):
    opt.zero_grad()
    model(torch.randn(8, 4)).sum().backward()
    opt.step()
total = torch.tensor([1.0])
dist.all_reduce(total)
sys.stdout.write("job: rank %d of %d, prefix %s, torch %s, sum %d\n"
                 % (dist.get_rank(), dist.get_world_size(), sys.prefix, torch.__version__, int(total.item())))
dist.destroy_process_group()
"""


def step(cmd, timeout, env=None, cwd=None):
    res = run(cmd, timeout=timeout, env=env, cwd=cwd)
    assert res.returncode == 0, res.describe()
    return res


def user_env(**extra):
    """A user's shell: the venv's bin/ LAST on PATH, after /usr/bin, whose python3 is Debian's
    (torch 1.13): `ddplaunch` is found in the venv, the first python3 is not the venv's."""
    env = {"PATH": "/usr/bin:/bin:" + os.path.join(VENV, "bin"), "HOME": os.environ.get("HOME", "/tmp"),
           "LANG": "C.UTF-8"}
    env.update(extra)
    return env


class WheelTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        if not os.path.exists(os.path.join(TORCH_VENV, "pyvenv.cfg")):
            skip("the tests do not run on the project venv (%s): no torch to lend the wheel's venv"
                 % sys.executable)
        shutil.rmtree(ROOT, ignore_errors=True)
        os.makedirs(ROOT)
        tools = step([os.path.join(SOURCE, "scripts", "python-env"), "--wheel"], timeout=600).stdout.strip()
        tools_py = os.path.join(tools, "bin", "python3")
        dist, cls.repaired = os.path.join(ROOT, "dist"), os.path.join(ROOT, "repaired")
        env = dict(os.environ, CCACHE_BASEDIR=SOURCE, CCACHE_NOHASHDIR="1",
                   CCACHE_DIR=os.environ.get("CCACHE_DIR", os.path.expanduser("~/.cache/ccache")),
                   CMAKE_BUILD_PARALLEL_LEVEL=str(os.cpu_count() or 2))
        # The build folder inside the checkout (pyproject.toml's build-dir) is the contributor's;
        # the test's goes beside the wheel.
        cls.build = step([tools_py, "-m", "pip", "wheel", "--no-build-isolation", "--no-deps", "-w", dist,
                          "--config-settings=build-dir=" + os.path.join(ROOT, "cmake"), SOURCE],
                         timeout=1200, env=env)
        wheels = os.listdir(dist)
        assert len(wheels) == 1, wheels
        cls.plain = os.path.join(dist, wheels[0])
        tools_env = dict(env, PATH=os.path.join(tools, "bin") + ":" + env["PATH"])
        step([os.path.join(tools, "bin", "auditwheel"), "repair", "-w", cls.repaired, cls.plain],
             timeout=300, env=tools_env)
        repaired = os.listdir(cls.repaired)
        assert len(repaired) == 1, repaired
        cls.wheel = os.path.join(cls.repaired, repaired[0])
        cls.show = step([os.path.join(tools, "bin", "auditwheel"), "show", cls.wheel], timeout=120, env=tools_env)
        print("wheel: %s, %.1f MiB" % (os.path.basename(cls.wheel), os.path.getsize(cls.wheel) / 2**20))
        print(cls.show.stdout)
        # A fresh venv that sees the project's torch through a .pth file.
        step(["/usr/bin/python3", "-m", "venv", VENV], timeout=120)
        site = step([VENV_PY, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                    timeout=60).stdout.strip()
        torch_site = step([os.path.join(TORCH_VENV, "bin", "python3"), "-c",
                           "import sysconfig; print(sysconfig.get_paths()['purelib'])"], timeout=60).stdout.strip()
        with open(os.path.join(site, "torch-of-the-project.pth"), "w") as f:
            f.write(torch_site + "\n")
        cls.before = cls.tree(VENV)
        step([VENV_PY, "-m", "pip", "install", "--no-index", "--no-deps", cls.wheel], timeout=300)

    @staticmethod
    def tree(top):
        return sorted(os.path.relpath(os.path.join(r, f), top) for r, _, fs in os.walk(top) for f in fs)

    def test_the_wheel_is_manylinux_and_holds_the_stripped_programs(self):
        version = project_version()
        name = os.path.basename(self.wheel)
        self.assertRegex(name, r"^ddplaunch-%s-py3-none-manylinux_2_\d+_x86_64\.whl$" % re.escape(version))
        # auditwheel show on the wheel as built: it names the policy its binaries satisfy.
        self.assertRegex(self.show.stdout.replace("\n", " "), r'consistent with the following platform tag:\s+"manylinux_2_\d+_x86_64"')
        with zipfile.ZipFile(self.wheel) as z:
            names = z.namelist()
            for program in ("ddplaunch", "ddp-rendezvous"):
                path = "ddplaunch/bin/" + program
                self.assertIn(path, names)
                data = z.read(path)
                self.assertEqual(data[:4], b"\x7fELF", path)
                self.assertNotIn(b".symtab", data, path + " is not stripped")
                self.assertNotIn(SOURCE.encode(), data, path + " names the build machine's source tree")
        for program in ("ddplaunch", "ddp-rendezvous"):  # the commands on PATH: shell scripts
            with zipfile.ZipFile(self.wheel) as z:
                command = z.read("ddplaunch-%s.data/scripts/%s" % (version, program))
            self.assertTrue(command.startswith(b"#!/bin/sh\n"), command[:80])
        for expected in ("ddplaunch/__init__.py", "ddplaunch/__main__.py",
                         "ddplaunch/share/cmake/ddplaunch/ddplaunchConfig.cmake",
                         "ddplaunch/share/ddplaunch/sdk/include/ddp/worker_sdk.h",
                         "ddplaunch/share/ddplaunch/python/ddplaunch_standby.py",
                         "ddplaunch/share/ddplaunch/python/ddplaunch/__init__.py",
                         "ddplaunch_standby.py"):
            self.assertIn(expected, names)
        # The workers' start-up hook is never on the environment's own path.
        self.assertNotIn("sitecustomize.py", names)
        self.assertFalse([n for n in names if "/tests/" in n or n.endswith(".pyc")], names)
        # Only libraries outside the policy are carried: here Debian's prometheus-cpp, nothing else.
        libs = [n for n in names if n.startswith("ddplaunch.libs/") and not n.endswith("/")]
        self.assertEqual([re.sub(r"-[0-9a-f]{8}\.", ".", os.path.basename(n)) for n in libs],
                         ["libprometheus-cpp-core.so.1.0.1"], libs)

    def test_a_two_worker_job_runs_on_the_environments_python_without_python_flag(self):
        script = os.path.join(ROOT, "job.py")
        with open(script, "w") as f:
            f.write(JOB)
        res = step(["ddplaunch", "--nproc_per_node=2", "--monitor_interval=0.05", script], timeout=240,
                   env=user_env(), cwd=ROOT)
        lines = sorted(l for l in res.stdout.splitlines() if "job: rank" in l)
        self.assertEqual(len(lines), 2, res.describe())
        for rank, line in enumerate(lines):
            self.assertIn("job: rank %d of 2, prefix %s," % (rank, VENV), line)
            self.assertIn("sum 2", line)
        # Not Debian's torch 1.13 of the first python3 on PATH: the venv's, through its .pth.
        torch_version = step([os.path.join(TORCH_VENV, "bin", "python3"), "-c",
                              "import torch; print(torch.__version__)"], timeout=120).stdout.strip()
        self.assertIn("torch %s," % torch_version, lines[0])

    def test_two_nodes_join_the_wheels_rendezvous_daemon(self):
        script = os.path.join(ROOT, "job2.py")
        with open(script, "w") as f:
            f.write(JOB)
        port = free_port()
        with spawn([os.path.join(VENV, "bin", "ddp-rendezvous"), "--host", "127.0.0.1", "--port", str(port)],
                   env=user_env(), name="ddp-rendezvous") as daemon:
            wait_for(lambda: port_open(port) or daemon.poll() is not None, 30, "the daemon to listen")
            self.assertIsNone(daemon.poll(), daemon.describe())
            nodes = [spawn(["ddplaunch", "--nnodes=2", "--nproc_per_node=1", "--rdzv_backend=c10d",
                            "--rdzv_endpoint=127.0.0.1:%d" % port, "--rdzv_id=wheel-test", script],
                           env=user_env(), cwd=ROOT, name="node%d" % i) for i in range(2)]
            try:
                wait_all(nodes, timeout=240)
                for node in nodes:
                    self.assertEqual(node.returncode, 0, node.describe())
                out = "".join(node.stdout() for node in nodes)
                self.assertEqual(sorted(re.findall(r"job: rank (\d) of 2", out)), ["0", "1"], out)
            finally:
                for node in nodes:
                    node.kill()
            self.assertIsNone(daemon.poll(), daemon.describe())

    def test_python_m_ddplaunch_is_the_same_program(self):
        res = step([VENV_PY, "-m", "ddplaunch", "--version"], timeout=60, env=user_env())
        self.assertEqual(res.stdout, "ddplaunch %s\n" % project_version())

    def test_find_package_builds_the_sdk_against_the_environments_torch(self):
        prefix = step([VENV_PY, "-c", "import ddplaunch; print(ddplaunch.cmake_prefix_path)"], timeout=120,
                      env=user_env()).stdout.strip()
        build = os.path.join(ROOT, "consumer")
        env = dict(os.environ, CCACHE_BASEDIR=SOURCE, CCACHE_NOHASHDIR="1")
        # No Torch_DIR: the package asks its environment's python3 where torch is.
        step(["cmake", "-S", os.path.join(SOURCE, "tests", "worker_sdk", "consumer"), "-B", build, "-G", "Ninja",
              "-DCMAKE_CXX_COMPILER_LAUNCHER=ccache", "-DCMAKE_PREFIX_PATH=" + prefix], timeout=300, env=env)
        step(["cmake", "--build", build, "--", "-j%d" % (os.cpu_count() or 2)], timeout=1200, env=env)
        res = step(["ddplaunch", "--nproc_per_node=2", "--monitor_interval=0.05", "--no_python",
                    os.path.join(build, "consumer")], timeout=240, env=user_env(), cwd=ROOT)
        self.assertEqual(res.stdout.count("consumer: world size 2, trained 2 steps"), 2, res.describe())

    def test_find_package_refuses_a_torch_older_than_the_sdk_needs(self):
        # Debian's torch 1.13 is old enough; a version file that says 1.12 stands for an older one.
        fake = os.path.join(ROOT, "old-torch", "Torch")
        os.makedirs(fake, exist_ok=True)
        with open(os.path.join(fake, "TorchConfig.cmake"), "w") as f:
            f.write("set(TORCH_LIBRARIES torch)\nset(Torch_FOUND TRUE)\n")
        with open(os.path.join(fake, "TorchConfigVersion.cmake"), "w") as f:
            f.write('set(PACKAGE_VERSION "1.12.1")\nset(PACKAGE_VERSION_COMPATIBLE TRUE)\n')
        prefix = step([VENV_PY, "-c", "import ddplaunch; print(ddplaunch.cmake_prefix_path)"], timeout=120,
                      env=user_env()).stdout.strip()
        res = run(["cmake", "-S", os.path.join(SOURCE, "tests", "worker_sdk", "consumer"),
                   "-B", os.path.join(ROOT, "old-consumer"), "-G", "Ninja", "-DCMAKE_PREFIX_PATH=" + prefix,
                   "-DTorch_DIR=" + fake], timeout=300)
        self.assertNotEqual(res.returncode, 0, res.describe())
        text = " ".join((res.stdout + res.stderr).split())
        self.assertIn("needs torch 1.13 or newer; found torch 1.12.1", text)
        self.assertIn("ddplaunch worker SDK %s" % project_version(), text)

    def test_without_torch_programs_run_and_python_scripts_are_refused(self):
        bare = os.path.join(ROOT, "venv-without-torch")
        step(["/usr/bin/python3", "-m", "venv", bare], timeout=120)
        step([os.path.join(bare, "bin", "python3"), "-m", "pip", "install", "--no-index", "--no-deps", self.wheel],
             timeout=300)
        env = user_env(PATH="/usr/bin:/bin:" + os.path.join(bare, "bin"))
        res = step(["ddplaunch", "--nproc_per_node=2", "--no_python", "/bin/sh", "-c", "echo program $RANK"],
                   timeout=60, env=env, cwd=ROOT)
        self.assertEqual(sorted(l for l in res.stdout.splitlines() if l.startswith("program")),
                         ["program 0", "program 1"], res.describe())
        script = os.path.join(ROOT, "job.py")
        with open(script, "w") as f:
            f.write(JOB)
        res = run(["ddplaunch", "--nproc_per_node=2", script], timeout=120, env=env, cwd=ROOT)
        self.assertEqual(res.returncode, 2, res.describe())
        text = " ".join(res.stderr.split())
        self.assertIn("the Python that would run the workers, %s (the Python of ddplaunch's own environment), "
                      "cannot import torch" % os.path.join(bare, "bin", "python3"), text)
        self.assertIn("Nothing was started.", text)

    def test_the_conda_recipe_has_the_projects_version(self):
        with open(os.path.join(SOURCE, "recipe", "meta.yaml")) as f:
            recipe = f.read()
        self.assertIn('{%% set version = "%s" %%}' % project_version(), recipe)
        self.assertIn("pip install . ", recipe)  # the same pyproject.toml as the wheel

    def test_zz_pip_uninstall_leaves_nothing_behind(self):
        # After the others (unittest runs them by name): their runs must leave nothing either,
        # __pycache__ of the workers' helper included.
        step([VENV_PY, "-m", "pip", "uninstall", "--yes", "ddplaunch"], timeout=120)
        # (pip compiles its own modules as it runs: their __pycache__ is not ours.)
        left = [p for p in self.tree(VENV) if p not in self.before
                and ("ddplaunch" in p or "__pycache__" not in p)]
        self.assertEqual(left, [], "pip uninstall left files behind")
        self.assertFalse(os.path.exists(os.path.join(VENV, "share", "ddplaunch")))
        self.assertFalse(os.path.exists(os.path.join(VENV, "bin", "ddplaunch")))


if __name__ == "__main__":
    unittest.main()
