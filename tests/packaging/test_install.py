"""`cmake --install` installs a tool: ddplaunch and ddp-rendezvous, their man
pages, the docs, the Python package when the tree has one, and the worker SDK; the installed
binaries print the project's version and carry no search path into the build tree. With
`--strip` (docs/install.md, "A stripped install") the same files are installed, the programs
carry no symbol table and no debug sections, are smaller than unstripped, and still run."""
import os
import re
import shutil
import tempfile
import unittest

from install_helpers import BUILD, PROGRAMS, SOURCE, clean_env, project_version, sdk_built, search_paths, skip
from processes import run


class InstallTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.mkdtemp(prefix="ddp-install-")
        cls.prefix = os.path.join(cls.tmp, "prefix")
        cls.install = run(["cmake", "--install", BUILD, "--prefix", cls.prefix], timeout=300)
        cls.files = sorted(os.path.relpath(os.path.join(root, f), cls.prefix)
                           for root, _, files in os.walk(cls.prefix) for f in files)
        print("installed %d files under %s" % (len(cls.files), cls.prefix))

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.tmp, ignore_errors=True)

    def setUp(self):
        self.install.check()

    def test_binaries_man_pages_and_docs_are_installed(self):
        for name in PROGRAMS:
            path = os.path.join(self.prefix, "bin", name)
            self.assertIn("bin/" + name, self.files)
            self.assertTrue(os.access(path, os.X_OK), path + " is not executable")
            self.assertIn("share/man/man1/%s.1" % name, self.files)
        for doc in ["README.md", "cli.md", "torchrun.md", "install.md", "exit-codes.md"]:
            self.assertIn("share/doc/ddplaunch/" + doc, self.files)
        # The top-level README, not docs/README.md (the source tree's index of the docs).
        with open(os.path.join(self.prefix, "share", "doc", "ddplaunch", "README.md")) as f:
            self.assertEqual(f.readline(), "# ddplaunch\n", "share/doc/ddplaunch/README.md")
        # Only what is meant to be installed: no test, benchmark or fuzz binary.
        self.assertEqual(sorted(f for f in self.files if f.startswith("bin/")),
                         ["bin/ddp-rendezvous", "bin/ddplaunch"])

    def test_the_worker_sdk_is_installed_beside_the_tools(self):
        if not sdk_built():
            skip("the build has DDPLAUNCH_BUILD_WORKER_SDK=OFF: no SDK to install")
        self.assertIn("include/ddp/worker_sdk.h", self.files)
        self.assertTrue(any(f.endswith("cmake/ddplaunch/ddplaunchConfig.cmake") for f in self.files))

    def test_installed_binaries_print_the_project_version(self):
        version = project_version()
        for name, flags in (("ddplaunch", ["--version"]), ("ddp-rendezvous", ["--version", "-V"])):
            for flag in flags:
                res = run([os.path.join(self.prefix, "bin", name), flag], timeout=30,
                          env=clean_env(), cwd=self.tmp).check()
                self.assertEqual(res.stdout, "%s %s\n" % (name, version), res.describe())

    def test_installed_binaries_search_no_library_path_of_the_build(self):
        for name in PROGRAMS:
            paths = search_paths(os.path.join(self.prefix, "bin", name))
            self.assertEqual(paths, [], "%s keeps RPATH/RUNPATH %s after install (build: %s)"
                             % (name, paths, BUILD))

    def test_the_python_package_is_installed_and_importable(self):
        python_src = os.path.join(SOURCE, "python")
        if not os.path.isdir(python_src):
            skip("the tree has no python/ folder: no Python package to install")
        packages = [d for d in os.listdir(python_src)
                    if os.path.isfile(os.path.join(python_src, d, "__init__.py"))]
        self.assertTrue(packages, "python/ holds no package (a folder with __init__.py)")
        site = os.path.join(self.prefix, "share", "ddplaunch", "python")
        for package in packages:
            self.assertIn("share/ddplaunch/python/%s/__init__.py" % package, self.files)
            # Imported from the installed copy (run outside the source tree), not the source.
            res = run(["python3", "-c", "import %s, sys; print(%s.__file__)" % (package, package)],
                      timeout=60, env=clean_env(PYTHONPATH=site), cwd=self.tmp).check()
            self.assertTrue(res.stdout.strip().startswith(site), res.describe())
        # The standby bootstrap (--standby) sits beside the package, where ddplaunch looks.
        if os.path.isfile(os.path.join(python_src, "ddplaunch_standby.py")):
            self.assertIn("share/ddplaunch/python/ddplaunch_standby.py", self.files)


def section_names(binary):
    """The section names of `binary` (readelf -S)."""
    res = run(["readelf", "-S", "-W", binary], timeout=60).check()
    names = re.findall(r"^\s*\[\s*\d+\]\s+(\S+)", res.stdout, re.M)
    assert names, "readelf -S %s listed no section:\n%s" % (binary, res.stdout)
    return names


class StrippedInstallTest(unittest.TestCase):
    """`cmake --install build --strip`, beside a plain install of the same build."""

    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.mkdtemp(prefix="ddp-install-strip-")
        cls.plain = os.path.join(cls.tmp, "plain")
        cls.stripped = os.path.join(cls.tmp, "stripped")
        cls.installs = [run(["cmake", "--install", BUILD, "--prefix", cls.plain], timeout=300),
                        run(["cmake", "--install", BUILD, "--prefix", cls.stripped, "--strip"],
                            timeout=300)]

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.tmp, ignore_errors=True)

    def setUp(self):
        for install in self.installs:
            install.check()

    def files(self, prefix):
        return sorted(os.path.relpath(os.path.join(root, f), prefix)
                      for root, _, files in os.walk(prefix) for f in files)

    def test_the_same_files_are_installed(self):
        self.assertEqual(self.files(self.stripped), self.files(self.plain))

    def test_stripped_programs_have_no_symbols_or_debug_sections_and_are_smaller(self):
        for name in PROGRAMS:
            stripped = os.path.join(self.stripped, "bin", name)
            plain = os.path.join(self.plain, "bin", name)
            left = [s for s in section_names(stripped) if s.startswith(".debug") or s == ".symtab"]
            self.assertEqual(left, [], "%s keeps %s after --strip" % (stripped, left))
            self.assertIn(".symtab", section_names(plain), plain + " was stripped without --strip")
            print("%s: %d bytes installed, %d with --strip" % (name, os.path.getsize(plain),
                                                               os.path.getsize(stripped)))
            self.assertLess(os.path.getsize(stripped), os.path.getsize(plain))

    def test_stripped_programs_run(self):
        version = project_version()
        for name in PROGRAMS:
            res = run([os.path.join(self.stripped, "bin", name), "--version"], timeout=30,
                      env=clean_env(), cwd=self.tmp).check()
            self.assertEqual(res.stdout, "%s %s\n" % (name, version), res.describe())


if __name__ == "__main__":
    unittest.main()
