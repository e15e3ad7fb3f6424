"""`cpack -G DEB` builds Debian packages whose binaries run from a clean unpack:
the package's fields (name, the project's version, maintainer, the libraries' packages as
dependencies), the man pages and docs inside, and ddplaunch running a two-worker job from a
temporary root made with `dpkg-deb -x`, with no path into the build tree."""
import glob
import os
import re
import shutil
import tempfile
import unittest

from install_helpers import (BUILD, PROGRAMS, clean_env, dynamic_section, project_version, sdk_built,
                             search_paths, skip)
from processes import run, spawn, wait_for


def deb_field(deb, field):
    return run(["dpkg-deb", "-f", deb, field], timeout=60).check().stdout.strip()


def deb_files(deb):
    """Paths in the package, without the leading './'."""
    listing = run(["dpkg-deb", "-c", deb], timeout=60).check().stdout
    return sorted(line.split()[-1].lstrip(".").lstrip("/") for line in listing.splitlines()
                  if not line.startswith("d"))


def owning_package(soname):
    """The Debian package that ships the library `soname` on this machine (ldconfig, dpkg -S)."""
    cache = run(["/sbin/ldconfig", "-p"], timeout=60).check().stdout
    for line in cache.splitlines():
        if not line.strip().startswith(soname + " ") or "=>" not in line:
            continue
        path = line.split("=>")[1].strip()
        # dpkg knows one spelling: /lib/x86_64-linux-gnu/... or, merged, /usr/lib/...
        for candidate in (path, os.path.realpath(path), "/usr" + path):
            owner = run(["dpkg", "-S", candidate], timeout=60)
            if owner.returncode == 0:
                return owner.stdout.split(":")[0]
    raise AssertionError("no package on this machine ships %s" % soname)


class DebPackageTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.mkdtemp(prefix="ddp-deb-")
        out = os.path.join(cls.tmp, "out")
        cls.cpack = run(["cpack", "-G", "DEB", "--config", os.path.join(BUILD, "CPackConfig.cmake"),
                         "-B", out], timeout=600, cwd=BUILD)
        cls.debs = {deb_field(d, "Package"): d for d in glob.glob(os.path.join(out, "*.deb"))
                    + glob.glob(os.path.join(out, "*.ddeb"))} if cls.cpack.returncode == 0 else {}
        print("built: %s" % ", ".join(os.path.basename(d) for d in cls.debs.values()))

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.tmp, ignore_errors=True)

    def setUp(self):
        self.cpack.check()
        self.assertIn("ddplaunch", self.debs, "no package named ddplaunch: %s" % self.debs)
        self.deb = self.debs["ddplaunch"]

    def unpack(self, deb):
        root = tempfile.mkdtemp(prefix="root-", dir=self.tmp)
        run(["dpkg-deb", "-x", deb, root], timeout=120).check()
        return root

    def test_the_package_is_named_versioned_and_maintained(self):
        version = project_version()
        self.assertEqual(deb_field(self.deb, "Version"), version)
        arch = run(["dpkg", "--print-architecture"], timeout=30).check().stdout.strip()
        self.assertEqual(deb_field(self.deb, "Architecture"), arch)
        self.assertEqual(os.path.basename(self.deb), "ddplaunch_%s_%s.deb" % (version, arch))
        self.assertRegex(deb_field(self.deb, "Maintainer"), r"^[^<>]+ <[^<>@\s]+@[^<>\s]+>$")
        self.assertTrue(deb_field(self.deb, "Description"))

    def test_it_depends_on_the_package_of_every_library_the_binaries_link(self):
        depends = [d.strip().split()[0] for d in deb_field(self.deb, "Depends").split(",")]
        print("Depends: %s" % ", ".join(depends))
        root = self.unpack(self.deb)
        for name in PROGRAMS:
            for tag, soname in dynamic_section(os.path.join(root, "usr", "bin", name)):
                if tag == "NEEDED":
                    package = owning_package(soname)
                    self.assertIn(package, depends, "%s links %s (package %s), not in Depends"
                                  % (name, soname, package))

    def test_binaries_man_pages_and_docs_are_in_the_package(self):
        files = deb_files(self.deb)
        version = project_version()
        for name in PROGRAMS:
            self.assertIn("usr/bin/" + name, files)
            self.assertIn("usr/share/man/man1/%s.1" % name, files)
        for doc in ("README.md", "torchrun.md", "install.md"):
            self.assertIn("usr/share/doc/ddplaunch/" + doc, files)
        self.assertFalse([f for f in files if f.startswith("usr/include/")],
                         "the SDK's headers belong in ddplaunch-dev")
        root = self.unpack(self.deb)
        for name in PROGRAMS:
            with open(os.path.join(root, "usr", "share", "man", "man1", name + ".1")) as f:
                header = [line for line in f if line.startswith(".TH ")]
            self.assertEqual(len(header), 1, "%s.1 has no .TH line" % name)
            self.assertIn('"%s %s"' % (name, version), header[0], "%s.1 does not carry the version" % name)

    def test_the_unpacked_binaries_run_from_a_clean_root(self):
        root = self.unpack(self.deb)
        bindir = os.path.join(root, "usr", "bin")
        work = tempfile.mkdtemp(prefix="cwd-", dir=self.tmp)
        env = clean_env()
        version = project_version()
        for name in PROGRAMS:
            binary = os.path.join(bindir, name)
            self.assertEqual(search_paths(binary), [], "%s has an RPATH/RUNPATH" % binary)
            res = run([binary, "--version"], timeout=30, env=env, cwd=work).check()
            self.assertEqual(res.stdout, "%s %s\n" % (name, version))
        # A two-worker job run by the unpacked ddplaunch, each worker saying who it is.
        res = run([os.path.join(bindir, "ddplaunch"), "--nproc_per_node=2", "--no_python",
                   "sh", "-c", 'echo "worker $RANK of $WORLD_SIZE"'], timeout=120, env=env, cwd=work)
        self.assertEqual(res.returncode, 0, res.describe())
        self.assertIn("worker 0 of 2", res.stdout, res.describe())
        self.assertIn("worker 1 of 2", res.stdout, res.describe())
        res = run([os.path.join(bindir, "ddplaunch"), "--nproc_per_node=2", "--no_python", "true"],
                  timeout=120, env=env, cwd=work)
        self.assertEqual(res.returncode, 0, res.describe())

    def test_the_unpacked_daemon_serves_a_job_of_the_unpacked_launcher(self):
        root = self.unpack(self.deb)
        bindir = os.path.join(root, "usr", "bin")
        work = tempfile.mkdtemp(prefix="cwd-", dir=self.tmp)
        env = clean_env()
        with spawn([os.path.join(bindir, "ddp-rendezvous"), "--host", "127.0.0.1", "--port", "0"],
                   env=env, cwd=work) as daemon:
            port = wait_for(lambda: re.search(r"listening on 127\.0\.0\.1:(\d+)", daemon.stdout()),
                            timeout=30, what="the unpacked ddp-rendezvous to listen").group(1)
            res = run([os.path.join(bindir, "ddplaunch"), "--nnodes=1", "--nproc_per_node=2",
                       "--rdzv_backend=c10d", "--rdzv_endpoint=127.0.0.1:" + port, "--rdzv_id=deb-test",
                       "--no_python", "sh", "-c", 'echo "worker $RANK of $WORLD_SIZE in $TORCHELASTIC_RUN_ID"'],
                      timeout=120, env=env, cwd=work)
            self.assertEqual(res.returncode, 0, res.describe() + "\n" + daemon.describe())
            self.assertIn("worker 1 of 2 in deb-test", res.stdout, res.describe())
            wait_for(lambda: "deb-test" in daemon.stdout(), timeout=30, what="the daemon to log the job")

    def test_binaries_are_stripped_and_their_symbols_are_in_the_dbgsym_package(self):
        root = self.unpack(self.deb)
        build_ids = set()
        for name in PROGRAMS:
            binary = os.path.join(root, "usr", "bin", name)
            sections = run(["readelf", "-S", binary], timeout=60).check().stdout
            self.assertNotIn(".debug_info", sections, "%s is not stripped" % name)
            notes = run(["readelf", "-n", binary], timeout=60).check().stdout
            build_ids.add(re.search(r"Build ID: ([0-9a-f]+)", notes).group(1))
        self.assertIn("ddplaunch-dbgsym", self.debs)
        dbgsym = self.debs["ddplaunch-dbgsym"]
        self.assertEqual(set(deb_field(dbgsym, "Build-Ids").split()), build_ids)
        self.assertEqual(deb_field(dbgsym, "Depends"), "ddplaunch (= %s)" % project_version())
        debug_files = [f for f in deb_files(dbgsym) if f.endswith(".debug")]
        self.assertEqual(len(debug_files), len(PROGRAMS), debug_files)

    def test_the_sdk_is_a_dev_package_of_its_own(self):
        if not sdk_built():
            skip("the build has DDPLAUNCH_BUILD_WORKER_SDK=OFF: no ddplaunch-dev package")
        self.assertIn("ddplaunch-dev", self.debs)
        dev = self.debs["ddplaunch-dev"]
        self.assertEqual(deb_field(dev, "Version"), project_version())
        files = deb_files(dev)
        self.assertIn("usr/include/ddp/worker_sdk.h", files)
        self.assertTrue(any(f.endswith("cmake/ddplaunch/ddplaunchConfig.cmake") for f in files), files)
        self.assertFalse([f for f in files if f.startswith("usr/bin/")], files)


if __name__ == "__main__":
    unittest.main()
