"""The man pages say what --help says: ddplaunch(1) is generated from
`ddplaunch --help` (packaging/help_to_roff.py) and ddp-rendezvous(1) is written by hand
(docs/man/ddp-rendezvous.1.in); both must render without a groff warning and name every flag
and subcommand that the programs' --help names, so that a flag added without its man page fails
here."""
import os
import re
import unittest

from install_helpers import BUILD, project_version
from processes import run

MAN_DIR = os.path.join(BUILD, "man", "man1")
FLAG = re.compile(r"(?<![\w-])(--?[A-Za-z][\w-]*)")


def help_of(*argv):
    res = run([os.path.join(BUILD, "bin", argv[0])] + list(argv[1:]) + ["--help"], timeout=30)
    assert res.returncode == 0, res.describe()
    return res.stdout


def flags_in(text):
    return set(FLAG.findall(text))


def subcommands_in(cli11_help):
    """Names under CLI11's "Subcommands:" heading."""
    names, inside = set(), False
    for line in cli11_help.splitlines():
        if line.strip() == "Subcommands:":
            inside = True
        elif inside and line.startswith("  ") and line.strip():
            names.add(line.split()[0])
        elif inside and line.strip():
            inside = False
    return names


def render(page):
    """The page as plain text (no hyphenation, long lines), after checking groff's warnings."""
    check = run(["groff", "-man", "-Tascii", "-ww", "-z", page], timeout=60)
    assert check.returncode == 0 and not check.stderr.strip(), "groff warns on %s:\n%s" % (
        page, check.stderr)
    res = run(["groff", "-man", "-Tascii", "-P-cbou", "-rLL=400n", "-rHY=0", page], timeout=60)
    assert res.returncode == 0, res.describe()
    return res.stdout


class ManPagesTest(unittest.TestCase):
    def page(self, name):
        path = os.path.join(MAN_DIR, name + ".1")
        self.assertTrue(os.path.isfile(path), "%s is missing: build the target ddp_man_pages" % path)
        with open(path) as f:
            header = [line for line in f if line.startswith(".TH ")]
        self.assertEqual(len(header), 1, path)
        self.assertIn('"%s %s"' % (name, project_version()), header[0])
        return render(path)

    def assert_names_all(self, page_text, names, what):
        missing = sorted(n for n in names if not re.search(r"(?<![\w-])%s(?![\w-])" % re.escape(n), page_text))
        self.assertEqual(missing, [], "%s: the man page lacks %s" % (what, missing))

    def test_ddplaunch_page_names_every_flag_of_its_help(self):
        text = self.page("ddplaunch")
        flags = flags_in(help_of("ddplaunch"))
        self.assertIn("--nproc_per_node", flags)  # the help was read at all
        self.assert_names_all(text, flags, "ddplaunch --help")
        for section in ("NAME", "SYNOPSIS", "DESCRIPTION", "OPTIONS", "EXIT STATUS", "ENVIRONMENT",
                        "EXAMPLES", "SEE ALSO"):
            self.assertRegex(text, r"(?m)^%s$" % section)

    def test_ddp_rendezvous_page_names_every_flag_and_subcommand_of_its_help(self):
        text = self.page("ddp-rendezvous")
        top = help_of("ddp-rendezvous")
        self.assertIn("--port", flags_in(top))
        self.assert_names_all(text, flags_in(top), "ddp-rendezvous --help")
        subcommands = subcommands_in(top)
        self.assertIn("status", subcommands)
        self.assert_names_all(text, subcommands, "ddp-rendezvous --help (subcommands)")
        for sub in subcommands:
            self.assert_names_all(text, flags_in(help_of("ddp-rendezvous", sub)),
                                  "ddp-rendezvous %s --help" % sub)


if __name__ == "__main__":
    unittest.main()
