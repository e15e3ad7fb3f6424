"""How ddplaunch runs PROGRAM, through the real binary (docs/cli.md, "How PROGRAM is run"):
an ELF binary or a script for another interpreter is executed directly, Python sources go to
python3, a bare name not in the current directory is found on PATH, and a PROGRAM that cannot
start is refused with exit 2 before any worker starts.
"""

import os
import shutil
import tempfile
import unittest

from processes import run

BUILD = os.path.abspath(os.environ.get("DDPLAUNCH_BUILD_DIR", "build"))
BIN = os.path.join(BUILD, "bin")
DDPLAUNCH = os.path.join(BIN, "ddplaunch")
PYTHON = "/usr/bin/python3"

# A worker that records its rank in out/<RANK> (POSIX shell; also the body of the ELF worker,
# which is a copy of /bin/sh run with -c).
SH_RECORD = 'echo "$RANK $LOCAL_RANK $WORLD_SIZE $0" > "out/$RANK"'
PY_RECORD = (
    "import os, sys\n"
    "open(os.path.join('out', os.environ['RANK']), 'w').write("
    "'%s %s %s python\\n' % (os.environ['RANK'], os.environ['LOCAL_RANK'], os.environ['WORLD_SIZE']))\n"
)


def clean_env(**extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith("PET_") and k != "PYTHON_EXEC"}
    env["PATH"] = "/usr/bin:/bin"
    env.update(extra)
    return env


class ProgramResolution(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.mkdtemp(prefix="ddplaunch-program-")
        self.addCleanup(shutil.rmtree, self.tmp, True)
        os.mkdir(os.path.join(self.tmp, "out"))

    def write(self, name, body, mode=0o755):
        path = os.path.join(self.tmp, name)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            f.write(body)
        os.chmod(path, mode)
        return path

    def elf(self, name, mode=0o755):
        """A real ELF executable (a copy of /bin/sh) at `name` in the test directory."""
        path = os.path.join(self.tmp, name)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        shutil.copyfile(os.path.realpath("/bin/sh"), path)
        os.chmod(path, mode)
        with open(path, "rb") as f:
            self.assertEqual(f.read(4), b"\x7fELF")
        return path

    def ddplaunch(self, *args, env=None, cwd=None):
        env = env or clean_env()
        env["TMPDIR"] = self.tmp
        return run([DDPLAUNCH, *args], timeout=60, env=env, cwd=cwd or self.tmp)

    def recorded(self):
        out = os.path.join(self.tmp, "out")
        records = {}
        for name in sorted(os.listdir(out)):
            with open(os.path.join(out, name)) as f:
                records[name] = f.read().split()
        return records

    def assert_ran(self, result, nproc, last_word):
        self.assertEqual(result.returncode, 0, result.describe())
        records = self.recorded()
        self.assertEqual(sorted(records), [str(r) for r in range(nproc)], result.describe())
        for rank, words in records.items():
            self.assertEqual(words[:3], [rank, rank, str(nproc)])
            self.assertEqual(words[3], last_word)

    def test_an_elf_binary_runs_directly_by_path_and_by_bare_name(self):
        self.elf("bin/worker")
        r = self.ddplaunch("--nproc_per_node=2", "bin/worker", "-c", SH_RECORD)
        self.assert_ran(r, 2, "bin/worker")
        self.assertIn("bin/worker is an ELF executable: running it directly", r.stderr)
        self.assertIn("torchrun would run it with python3", r.stderr)

        shutil.rmtree(os.path.join(self.tmp, "out"))
        os.mkdir(os.path.join(self.tmp, "out"))
        # `cd build/bin && ddplaunch worker`: a bare name in the current directory.
        self.elf("worker")
        r = self.ddplaunch("--nproc-per-node=2", "worker", "-c", SH_RECORD)
        self.assert_ran(r, 2, "./worker")

    def test_a_script_for_another_interpreter_runs_directly(self):
        self.write("work.sh", "#!/bin/sh\n" + SH_RECORD + "\n")
        r = self.ddplaunch("--nproc_per_node=3", "./work.sh")
        self.assert_ran(r, 3, "./work.sh")
        self.assertIn("is a script for /bin/sh: running it directly", r.stderr)

    def test_a_python_file_without_the_exec_bit_runs_with_python_and_says_nothing(self):
        self.write("train.py", PY_RECORD, mode=0o644)
        r = self.ddplaunch("--nproc_per_node=2", "--python", PYTHON, "train.py")
        self.assert_ran(r, 2, "python")
        self.assertNotIn("torchrun would", r.stderr)

    def test_python_shebang_and_unrecognisable_files_keep_torchruns_reading(self):
        # #! naming python, no .py: Python (as torchrun); no exec bit needed.
        self.write("trainer", "#!/usr/bin/env python3\n" + PY_RECORD, mode=0o644)
        r = self.ddplaunch("--nproc_per_node=2", "--python", PYTHON, "trainer")
        self.assert_ran(r, 2, "python")
        shutil.rmtree(os.path.join(self.tmp, "out"))
        os.mkdir(os.path.join(self.tmp, "out"))
        # No #!, no extension, not ELF: ambiguous, so Python (torchrun's behaviour).
        self.write("plain", PY_RECORD, mode=0o755)
        r = self.ddplaunch("--nproc_per_node=1", "--python", PYTHON, "plain")
        self.assert_ran(r, 1, "python")
        self.assertNotIn("torchrun would", r.stderr)

    def test_a_bare_name_not_in_the_current_directory_is_found_on_path(self):
        bindir = os.path.dirname(self.write("tools/pathworker", "#!/bin/sh\n" + SH_RECORD + "\n"))
        self.elf("tools/pathelf")
        env = clean_env(PATH=bindir + ":/usr/bin:/bin")
        r = self.ddplaunch("--nproc_per_node=2", "pathworker", env=env)
        self.assert_ran(r, 2, os.path.join(bindir, "pathworker"))
        self.assertIn("pathworker (found on PATH at %s/pathworker)" % bindir, r.stderr)
        shutil.rmtree(os.path.join(self.tmp, "out"))
        os.mkdir(os.path.join(self.tmp, "out"))
        r = self.ddplaunch("--nproc_per_node=1", "pathelf", "-c", SH_RECORD, env=env)
        self.assert_ran(r, 1, os.path.join(bindir, "pathelf"))

    def test_no_python_module_and_run_path_win(self):
        # --no_python with a Python file: executed directly (here: a #!/bin/sh body named .py).
        self.write("odd.py", "#!/bin/sh\n" + SH_RECORD + "\n")
        r = self.ddplaunch("--nproc_per_node=1", "--no_python", "./odd.py")
        self.assert_ran(r, 1, "./odd.py")
        self.assertNotIn("torchrun would", r.stderr)
        # -m with a name that is also an ELF file here: the module wins.
        shutil.rmtree(os.path.join(self.tmp, "out"))
        os.mkdir(os.path.join(self.tmp, "out"))
        self.elf("recmod")
        self.write("recmod.py", PY_RECORD, mode=0o644)
        r = self.ddplaunch("--nproc_per_node=1", "--python", PYTHON, "-m", "recmod",
                           env=clean_env(PYTHONPATH=self.tmp))
        self.assert_ran(r, 1, "python")
        # --run_path with a #!/bin/sh file would go to Python: it is refused by Python, not run.
        shutil.rmtree(os.path.join(self.tmp, "out"))
        os.mkdir(os.path.join(self.tmp, "out"))
        sh = self.write("shell-script", "#!/bin/sh\n" + SH_RECORD + "\n")
        r = self.ddplaunch("--nproc_per_node=1", "--python", PYTHON, "--run_path", "--no_python", sh)
        self.assertNotEqual(r.returncode, 0, r.describe())
        self.assertEqual(self.recorded(), {})

    def test_a_missing_or_non_executable_program_exits_2_and_starts_nothing(self):
        marker = os.path.join(self.tmp, "out", "0")
        cases = [
            (["no-such-train"], "no-such-train does not exist in the current directory and no "
                                "executable no-such-train is on PATH"),
            (["./missing/train"], "./missing/train does not exist"),
        ]
        self.elf("noexec-elf", mode=0o644)
        cases.append((["noexec-elf", "-c", SH_RECORD], "is an ELF executable but is not executable"))
        self.write("noexec.sh", "#!/bin/sh\n" + SH_RECORD + "\n", mode=0o644)
        cases.append((["./noexec.sh"], "is a script for /bin/sh but is not executable"))
        for args, expected in cases:
            with self.subTest(args=args):
                r = self.ddplaunch("--nproc_per_node=2", *args)
                self.assertEqual(r.returncode, 2, r.describe())
                self.assertTrue(r.stderr.startswith("ddplaunch: "), r.describe())
                self.assertIn(expected, r.stderr, r.describe())
                self.assertFalse(os.path.exists(marker), r.describe())

    def test_the_example_train_runs_from_build_bin_by_bare_name(self):
        train = os.path.join(BIN, "train")
        if not os.path.exists(train):
            self.skipTest("build/bin/train is not built (DDPLAUNCH_BUILD_WORKER_SDK=OFF)")
        # The exact command of the issue and the README: `cd build/bin && ./ddplaunch ... train`.
        r = run(["./ddplaunch", "--nproc_per_node=1", "train", "--help"], timeout=120,
                env=clean_env(TMPDIR=self.tmp), cwd=BIN)
        self.assertEqual(r.returncode, 0, r.describe())
        self.assertIn("train is an ELF executable: running it directly", r.stderr)
        self.assertNotIn("SyntaxError", r.stderr)
        # `train` installed on PATH, run from elsewhere.
        r = run([DDPLAUNCH, "--nproc_per_node=1", "train", "--help"], timeout=120,
                env=clean_env(TMPDIR=self.tmp, PATH=BIN + ":/usr/bin:/bin"), cwd=self.tmp)
        self.assertEqual(r.returncode, 0, r.describe())
        self.assertIn("train (found on PATH at %s/train) is an ELF executable" % BIN, r.stderr)


if __name__ == "__main__":
    unittest.main()
