"""Every command a user types from README.md and docs/*.md runs as written, or says why not.

The rule for fenced blocks in those pages:
- every block has a language tag; an untagged block fails this test;
- `sh`, `bash` and `console` blocks are commands (in a `console` block, the lines that start
  with `$ `); anything else (`text` for output, usage synopses and diagrams; `cpp`, `python`,
  `cmake`, `diff`, ...) is not, and a `text` block whose lines look like commands fails;
- a command block is run by this test: bash -e -o pipefail, from a copy of the repository root
  (its entries linked, `build` linked to the build directory under test), with the build's bin/
  on PATH, a first `python3` that has no torch (as on a fresh Debian machine with a system or
  pyenv Python), and a deadline; it must exit 0. A block that builds, installs into the system
  or runs the tests (NEVER_RUN below) is never run: it must be marked;
- or the line right above its fence is `<!-- not run here: REASON -->`, naming what covers it
  instead where something does; such blocks are printed with their reason, like skipped tests;
- or it is in RUN_ELSEWHERE: run as written by another test named there.

Placeholders and fixed paths under /tmp are replaced before a block runs (SUBSTITUTIONS below,
each with why).
"""

import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ddplaunch_helpers import BUILD_DIR, LaunchTestCase, main, run  # noqa: E402

SOURCE_DIR = os.path.abspath(os.environ.get("DDPLAUNCH_SOURCE_DIR", os.path.join(os.path.dirname(__file__), "..", "..")))

COMMAND_TAGS = {"sh", "bash", "console"}
# Tags of blocks that are shown, not typed: checked for lines that look like commands.
TEXT_TAGS = {"text", "txt", "plain", "output"}
MARKER = re.compile(r"^\s*<!-- not run here: (.*?) -->\s*$")
FENCE = re.compile(r"^( *)```(.*)$")
HEADING = re.compile(r"^#+ (.*)$")
# (page, heading above the block) -> the test that runs that block as written.
RUN_ELSEWHERE = {("README.md", "Single node"): "tests/agent/test_readme.py"}
# (text in a block, its replacement, why): applied to every block this test runs.
SUBSTITUTIONS = [
    ("/tmp/", "{tmp}/", "the test's own temporary directory: runs share no files and leave none"),
]
BLOCK_DEADLINE_S = 120
# Commands this test never runs, because they would change the build under test or the system,
# or run tests themselves: a block holding one must carry a not-run marker.
NEVER_RUN = re.compile(r"\bcmake\s+(-S|-B|--build)|\bscripts/(setup|test|demo)\b|\bctest\b|\bsudo\b"
                       r"|\bapt(-get)?\s+install|\bpip3?\s+install|\bsystemctl\b"
                       r"|--prefix[= ]/(usr|opt)\b|\binstall\s.*\s/(etc|usr|opt)/|>\s*/(etc|usr|opt)/")
# (what a block names, the build output it needs): without it the block is skipped, saying why.
NEEDS_THE_SDK = re.compile(r"lib/\*\.a|bin/train\b")
# What a line of commands starts with: a program a user runs, or a path to one.
COMMAND_WORDS = {"ddplaunch", "ddp-rendezvous", "torchrun", "train", "cmake", "ctest", "cpack", "python",
                 "python3", "pip", "pip3", "export", "curl", "kill", "openssl", "install", "systemctl",
                 "sudo", "apt", "apt-get", "dpkg", "dpkg-deb", "cd", "ls", "du", "echo", "git", "make",
                 "ninja", "srun", "sbatch", "salloc", "kubectl", "etcd", "etcdctl", "docker", "ip", "env"}
COMMAND_PATH = re.compile(r"^(\./|\.\./|build[\w-]*/|scripts/|examples/)")


def looks_like_a_command(line):
    """True for a line a user would type: it starts with a program, and is not a usage synopsis
    (`[OPTIONS]`, `-V | --version`)."""
    line = line.strip()
    if line.startswith("$ "):
        return True
    if not line or line.startswith("#") or "[" in line or " | -" in line:
        return False
    first = line.split()[0]
    return first in COMMAND_WORDS or bool(COMMAND_PATH.match(first))


def joined_lines(lines):
    """Lines with their backslash continuations joined."""
    joined, current = [], ""
    for line in lines:
        current += line.rstrip()
        if current.endswith("\\"):
            current = current[:-1] + " "
        else:
            joined.append(current)
            current = ""
    return joined + ([current] if current else [])


class Block:
    def __init__(self, page, line, tag, heading, marker, lines):
        self.page, self.line, self.tag, self.heading, self.marker, self.lines = page, line, tag, heading, marker, lines

    def where(self):
        return "%s:%d" % (self.page, self.line)

    def script(self):
        if self.tag == "console":
            return "\n".join(line[2:] for line in self.lines if line.startswith("$ "))
        return "\n".join(self.lines)


def pages():
    names = ["README.md"] + sorted(os.path.join("docs", n) for n in os.listdir(os.path.join(SOURCE_DIR, "docs"))
                                   if n.endswith(".md"))
    return names


def blocks(page):
    """The fenced blocks of a page, with the tag, the heading above, the marker right above."""
    with open(os.path.join(SOURCE_DIR, page)) as f:
        text = f.read().splitlines()
    found, heading, i = [], "", 0
    while i < len(text):
        fence = FENCE.match(text[i])
        if not fence:
            title = HEADING.match(text[i])
            if title:
                heading = title.group(1).strip()
            i += 1
            continue
        indent, tag = len(fence.group(1)), fence.group(2).strip()
        marker = MARKER.match(text[i - 1]) if i > 0 else None
        start, i, lines = i, i + 1, []
        while i < len(text) and not re.match(r"^\s*```\s*$", text[i]):
            lines.append(text[i][indent:] if text[i][:indent].strip() == "" else text[i])
            i += 1
        assert i < len(text), "%s:%d: a fence that is never closed" % (page, start + 1)
        found.append(Block(page, start + 1, tag, heading, marker.group(1).strip() if marker else None, lines))
        i += 1
    return found


def all_blocks():
    return [b for page in pages() for b in blocks(page)]


class DocsCommands(LaunchTestCase):
    def setUp(self):
        super().setUp()
        self.blocks = all_blocks()
        self.assertGreater(len(self.blocks), 10)

    def test_every_block_is_tagged_and_no_text_block_holds_commands(self):
        for block in self.blocks:
            with self.subTest(block=block.where()):
                self.assertNotEqual(block.tag, "", "%s: an untagged block: tag commands `sh` (run by this test, or "
                                    "marked `<!-- not run here: REASON -->`) and output, synopses and diagrams "
                                    "`text`%s" % (block.where(), " (its lines look like commands)"
                                                  if any(map(looks_like_a_command, joined_lines(block.lines)))
                                                  else ""))
                if block.tag in TEXT_TAGS:
                    commands = [line for line in joined_lines(block.lines) if looks_like_a_command(line)]
                    self.assertEqual(commands, [], "%s: a `%s` block with commands: tag it `sh`"
                                     % (block.where(), block.tag))
                if block.tag not in COMMAND_TAGS:
                    self.assertIsNone(block.marker, "%s: a not-run marker above a `%s` block, which is never run"
                                      % (block.where(), block.tag))

    def test_markers_give_a_reason_and_name_tests_that_exist(self):
        for block in self.blocks:
            if block.tag in COMMAND_TAGS and block.marker is not None:
                with self.subTest(block=block.where()):
                    self.assertGreater(len(block.marker), 10, "%s: a marker without a reason" % block.where())
                    for path in re.findall(r"tests/[\w/.-]+\.py", block.marker):
                        self.assertTrue(os.path.exists(os.path.join(SOURCE_DIR, path)),
                                        "%s: the marker names %s, which does not exist" % (block.where(), path))
        for (page, heading), test in RUN_ELSEWHERE.items():
            with open(os.path.join(SOURCE_DIR, test)) as f:
                self.assertIn(heading, f.read(), "%s no longer runs %s's %r block" % (test, page, heading))
            self.assertTrue(any(b.page == page and b.heading == heading and b.tag in COMMAND_TAGS
                                for b in self.blocks), "%s has no %r command block" % (page, heading))

    def root(self):
        """A copy of the repository root: its entries linked, `build` linked to the build under test."""
        root = os.path.join(self.tmp, "root")
        os.mkdir(root)
        for name in os.listdir(SOURCE_DIR):
            if name != "build":
                os.symlink(os.path.join(SOURCE_DIR, name), os.path.join(root, name))
        os.symlink(os.path.abspath(BUILD_DIR), os.path.join(root, "build"))
        return root

    def no_torch_bin(self):
        """python3 and python without their site directories: no torch."""
        path = os.path.join(self.tmp, "no-torch-bin")
        os.mkdir(path)
        for name in ("python3", "python"):
            with open(os.path.join(path, name), "w") as f:
                f.write('#!/bin/sh\nexec /usr/bin/python3 -S "$@"\n')
            os.chmod(os.path.join(path, name), 0o755)
        probe = run([os.path.join(path, "python3"), "-c", "import torch"], timeout=30)
        self.assertNotEqual(probe.returncode, 0, "the stand-in python3 must not have torch")
        return path

    def test_every_command_block_runs_as_written_or_says_why_not(self):
        root, no_torch = self.root(), self.no_torch_bin()
        env = {k: v for k, v in os.environ.items()
               if k not in ("PYTHON_EXEC", "PYTHONPATH", "VIRTUAL_ENV", "DDPLAUNCH_BUILD_DIR", "DDPLAUNCH_SOURCE_DIR")}
        env.update(PATH=":".join([no_torch, os.path.join(os.path.abspath(BUILD_DIR), "bin"),
                                  "/usr/local/bin", "/usr/bin", "/bin", "/usr/sbin", "/sbin"]),
                   TMPDIR=self.tmp)
        report = []
        for block in self.blocks:
            if block.tag not in COMMAND_TAGS:
                continue
            elsewhere = RUN_ELSEWHERE.get((block.page, block.heading))
            if elsewhere:
                report.append("%s: run by %s" % (block.where(), elsewhere))
                continue
            if block.marker is not None:
                report.append("%s: not run here: %s" % (block.where(), block.marker))
                continue
            script = block.script()
            self.assertTrue(script.strip(), "%s: an empty command block" % block.where())
            substituted = []
            for text, value, _ in SUBSTITUTIONS:
                if text in script:
                    script = script.replace(text, value.format(tmp=self.tmp))
                    substituted.append(text)
            report.append("%s: run%s" % (block.where(), " (substituted %s)" % ", ".join(substituted)
                                         if substituted else ""))
            with self.subTest(block=block.where()):
                unsafe = NEVER_RUN.search("\n".join(re.sub(r"(^|\s)#.*", "", line) for line in script.splitlines()))
                if unsafe:
                    report[-1] = "%s: NOT RUN: it holds %r" % (block.where(), unsafe.group(0).strip())
                    self.fail("%s holds %r, which this test never runs (it would change the build under test "
                              "or the system): mark the block `<!-- not run here: REASON -->`"
                              % (block.where(), unsafe.group(0).strip()))
                if NEEDS_THE_SDK.search(script) and not os.path.exists(os.path.join(BUILD_DIR, "bin", "train")):
                    report[-1] = "%s: skipped: the worker SDK is not built (DDPLAUNCH_BUILD_WORKER_SDK=OFF)" % block.where()
                    continue
                result = run(["bash", "--noprofile", "--norc", "-e", "-o", "pipefail", "-c", script],
                             timeout=BLOCK_DEADLINE_S, env=env, cwd=root)
                self.assertFalse(result.timed_out, "%s: still running after %d s\n%s"
                                 % (block.where(), BLOCK_DEADLINE_S, result.describe()))
                self.assertEqual(result.returncode, 0, "%s: exit %s\n%s" % (block.where(), result.returncode,
                                                                            result.describe()))
        print("\n[docs] command blocks of README.md and docs/*.md:\n  " + "\n  ".join(report), file=sys.stderr)
        self.assertTrue(any(line.endswith(": run") or "(substituted" in line for line in report),
                        "no command block was run")


if __name__ == "__main__":
    main()
