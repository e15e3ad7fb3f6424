"""README's commands run as written.

- Its first command, `scripts/demo`: sets up (installs nothing when everything is there, builds
  nothing when the build is current), then trains on two nodes, crashes one and recovers; it must
  exit 0 and say that the job survived. Its second, `scripts/test`, is this suite (.ci/run).
- Every command of its "Single node" block is run with bash from the repository root, after the
  block's `export` lines, and must exit 0.

The shell's first `python3` has no torch, as on a fresh Debian machine with a system or pyenv
Python. A command that needs the example `train` is skipped, saying why, when the worker SDK is
not built."""

import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ddplaunch_helpers import BUILD_DIR, LaunchTestCase, main, run  # noqa: E402

SOURCE_DIR = os.path.abspath(os.environ.get("DDPLAUNCH_SOURCE_DIR", os.path.join(os.path.dirname(__file__), "..", "..")))


def single_node_commands():
    with open(os.path.join(SOURCE_DIR, "README.md")) as f:
        text = f.read()
    block = re.search(r"## Single node\n+```sh\n(.*?)```", text, re.S)
    assert block, "README.md has no '## Single node' sh block"
    return [line for line in block.group(1).splitlines() if line.strip() and not line.startswith("#")]


def first_block_commands():
    with open(os.path.join(SOURCE_DIR, "README.md")) as f:
        text = f.read()
    block = re.search(r"```sh\n(.*?)```", text, re.S)
    assert block, "README.md has no sh block"
    return [line.split("#")[0].strip() for line in block.group(1).splitlines() if line.strip()]


class Readme(LaunchTestCase):
    def no_torch_path(self):
        """A PATH whose python3 and python have no torch (their site directories left out)."""
        self.no_torch_bin = os.path.join(self.tmp, "bin")
        os.makedirs(self.no_torch_bin, exist_ok=True)
        for name in ("python3", "python"):
            path = os.path.join(self.no_torch_bin, name)
            with open(path, "w") as f:
                f.write('#!/bin/sh\nexec /usr/bin/python3 -S "$@"\n')
            os.chmod(path, 0o755)
        probe = run([os.path.join(self.no_torch_bin, "python3"), "-c", "import torch"], timeout=30)
        self.assertNotEqual(probe.returncode, 0, "the stand-in python3 must not have torch")
        return self.no_torch_bin + ":/usr/bin:" + os.environ.get("PATH", "/bin")

    def test_the_first_command_sets_up_trains_loses_a_node_and_recovers(self):
        commands = first_block_commands()
        self.assertEqual(commands, ["scripts/demo", "scripts/test"], "README's first two commands changed")
        build = os.path.abspath(BUILD_DIR)
        if os.path.realpath(os.path.join(SOURCE_DIR, "build")) != os.path.realpath(build):
            self.skipTest("the build directory is not SOURCE/build, which scripts/demo uses: %s" % build)
        if not os.path.exists(os.path.join(build, "bin", "train")):
            self.skipTest("build/bin/train is not built (DDPLAUNCH_BUILD_WORKER_SDK=OFF); scripts/demo trains with it")
        if os.geteuid() != 0:
            self.skipTest("scripts/demo's set-up checks its Debian packages as root (apt-get)")
        env = dict(os.environ, PATH=self.no_torch_path(), TMPDIR=self.tmp)
        for name in ("PYTHON_EXEC", "DDPLAUNCH_BUILD_DIR"):
            env.pop(name, None)
        result = run(["bash", "-c", commands[0]], timeout=540, env=env, cwd=SOURCE_DIR)
        self.assertEqual(result.returncode, 0, result.describe())
        self.assertIn("the job survived the loss of node2 and finished", result.stdout, result.describe())

    def test_every_single_node_command_runs_as_written(self):
        lines = single_node_commands()
        exports = [line for line in lines if line.startswith("export ")]
        commands = [line for line in lines if not line.startswith("export ")]
        self.assertGreaterEqual(len(commands), 4)
        path = self.no_torch_path()
        build = os.path.abspath(BUILD_DIR)
        for command in commands:
            with self.subTest(command=command):
                if "train" in command.split("#")[0].split() or "build/bin/train" in command:
                    if not os.path.exists(os.path.join(build, "bin", "train")):
                        self.skipTest("build/bin/train is not built (DDPLAUNCH_BUILD_WORKER_SDK=OFF)")
                # The README's build/ is this test's build directory.
                if os.path.realpath(os.path.join(SOURCE_DIR, "build")) != os.path.realpath(build):
                    self.skipTest("the build directory is not SOURCE/build: %s" % build)
                env = dict(os.environ, PATH=path, TMPDIR=self.tmp)
                env.pop("PYTHON_EXEC", None)
                result = run(["bash", "-c", "\n".join(exports + [command])], timeout=240, env=env, cwd=SOURCE_DIR)
                self.assertEqual(result.returncode, 0, result.describe())
                self.assertNotIn("SyntaxError", result.stderr)


if __name__ == "__main__":
    main()
