"""docs/torchrun.md ("Coming from torchrun") cannot drift from torch or from ddplaunch: every option
of torch 2.x's torchrun parser (torch.distributed.run.get_args_parser(), from the test Python's
torch) has one row in its flag table with a verdict that `ddplaunch --help` agrees with; every
environment variable torch's launcher and elastic agent name is on the page; and every variable
that torch's agent or ddplaunch's (agent/worker_env.cpp) gives a worker is in its worker table."""
import glob
import inspect
import os
import re
import sys
import unittest

from processes import run

BUILD = os.path.abspath(os.environ.get("DDPLAUNCH_BUILD_DIR", "build"))
SOURCE = os.path.abspath(os.environ.get("DDPLAUNCH_SOURCE_DIR",
                                        os.path.join(os.path.dirname(__file__), "..", "..")))
DOC = os.path.join(SOURCE, "docs", "torchrun.md")
VERDICTS = {"same", "differs", "accepted", "not supported"}
FLAG = re.compile(r"(?<![\w-])(--?[A-Za-z][\w-]*)")


def torch_run_module():
    """torch.distributed.run of the test Python, or None (with the reason) when it has no torch 2.x."""
    try:
        import torch
        import torch.distributed.run as torch_run
    except ImportError as e:
        return None, "%s cannot import torch.distributed.run (%s)" % (sys.executable, e)
    if int(torch.__version__.split(".")[0]) < 2:
        return None, "%s has torch %s, not 2.x (run scripts/setup: the project venv)" % (
            sys.executable, torch.__version__)
    return torch_run, None


def table(text, heading):
    """Rows of the first table under `heading` ("## Flags"), each a list of cell texts."""
    start = text.index(heading + "\n")
    rows = []
    for line in text[start:].splitlines()[1:]:
        if line.startswith("#"):
            break
        if line.startswith("|") and not line.startswith("| ---"):
            rows.append([c.strip() for c in line.strip().strip("|").split(" | ")])
    assert len(rows) > 1, "no table under %r in %s" % (heading, DOC)
    return rows[1:]  # without the header row


def backticked(cell):
    return re.findall(r"`([^`]+)`", cell)


class TorchrunDocTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.torch_run, reason = torch_run_module()
        if reason:
            print("skipped: " + reason, file=sys.stderr)
            raise unittest.SkipTest(reason)
        with open(DOC) as f:
            cls.doc = f.read()
        cls.flag_rows = table(cls.doc, "## Flags")
        cls.parser = cls.torch_run.get_args_parser()

    def verdict_of(self):
        """Each spelling in the flag table's first column -> the row's verdict."""
        verdicts = {}
        for row in self.flag_rows:
            self.assertGreaterEqual(len(row), 4, "short row %s" % row)
            self.assertIn(row[1], VERDICTS, "row %s: verdict %r is not one of %s" % (row[0], row[1], VERDICTS))
            for spelling in backticked(row[0]):
                self.assertNotIn(spelling, verdicts, "%s has two rows" % spelling)
                verdicts[spelling] = row[1]
        return verdicts

    def test_every_torchrun_option_has_one_row_with_a_verdict(self):
        verdicts = self.verdict_of()
        names = []
        for action in self.parser._actions:
            names += action.option_strings or [action.dest]  # positionals by their name
        print("torch %s: %d option spellings" % (self.torch_run.torch.__version__, len(names)))
        missing = [n for n in names if n not in verdicts]
        self.assertEqual(missing, [], "torchrun options without a row in docs/torchrun.md")

    def test_verdicts_agree_with_ddplaunch_help(self):
        res = run([os.path.join(BUILD, "bin", "ddplaunch"), "--help"], timeout=30)
        self.assertEqual(res.returncode, 0, res.describe())
        offered = set(FLAG.findall(res.stdout))
        for spelling, verdict in self.verdict_of().items():
            if not spelling.startswith("-"):
                continue  # training_script, training_script_args
            if verdict == "not supported":
                self.assertFalse(spelling in offered, "%s is marked not supported but ddplaunch "
                                 "--help offers it: update docs/torchrun.md" % spelling)
            else:
                self.assertTrue(spelling in offered, "%s is marked %r but ddplaunch --help does not "
                                "offer it" % (spelling, verdict))

    def test_every_variable_torch_launcher_reads_or_sets_is_on_the_page(self):
        root = os.path.dirname(self.torch_run.__file__)
        files = [os.path.join(root, "run.py"), os.path.join(root, "launcher", "api.py")]
        files += [f for f in glob.glob(os.path.join(root, "elastic", "**", "*.py"), recursive=True)]
        names = set()
        for path in files:
            with open(path) as f:
                src = f.read()
            names |= set(re.findall(r"[\"']((?:TORCHELASTIC|TORCH_ELASTIC|TORCH)_[A-Z0-9_]+)[\"']", src))
            names |= set(re.findall(r"(?:getenv|environ\.get|environ\[)\(?\s*[\"']([A-Z][A-Z0-9_]+)[\"']", src))
        self.assertIn("TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE", names)  # the sources were read
        missing = sorted(n for n in names if not re.search(r"`%s`" % re.escape(n), self.doc))
        self.assertEqual(missing, [], "variables of torch's launcher not in docs/torchrun.md")

    def test_the_worker_environment_table_lists_what_either_launcher_sets(self):
        # A row may name several variables that go together (`DDPLAUNCH_PROGRESS_FILE`, `..._SLOT`).
        listed = {name for row in table(self.doc, "## The worker environment") for name in backticked(row[0])}
        from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
        torch_src = inspect.getsource(LocalElasticAgent._start_workers) + inspect.getsource(
            LocalElasticAgent._set_local_rank_env)
        torch_names = set(re.findall(r"[\"']([A-Z][A-Z0-9_]{2,})[\"']", torch_src))
        self.assertIn("GROUP_WORLD_SIZE", torch_names)
        with open(os.path.join(SOURCE, "agent", "worker_env.cpp")) as f:
            ours = set(re.findall(r"env\[\"([A-Z0-9_]+)\"\]", f.read()))
        self.assertIn("DDPLAUNCH_GENERATION", ours)
        # The containment marker every worker gets (agent/containment.h).
        with open(os.path.join(SOURCE, "agent", "containment.h")) as f:
            ours |= set(re.findall(r"kMarkerVariable = \"([A-Z0-9_]+)\"", f.read()))
        self.assertIn("DDPLAUNCH_SUPERVISOR", ours)
        missing = sorted((torch_names | ours | {"TORCHELASTIC_ERROR_FILE"}) - listed)
        self.assertEqual(missing, [], "worker variables not in docs/torchrun.md's worker table")


if __name__ == "__main__":
    unittest.main()
