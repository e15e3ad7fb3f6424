"""Shared by the packaging tests: the build folder, its cache, and checks on installed binaries."""
import os
import re
import sys
import unittest

from processes import run

BUILD = os.path.abspath(os.environ.get("DDPLAUNCH_BUILD_DIR", "build"))
SOURCE = os.path.abspath(os.environ.get("DDPLAUNCH_SOURCE_DIR",
                                        os.path.join(os.path.dirname(__file__), "..", "..")))
PROGRAMS = ("ddplaunch", "ddp-rendezvous")


def cache_value(name):
    """The value of `name` in the build's CMakeCache.txt, or None."""
    with open(os.path.join(BUILD, "CMakeCache.txt")) as f:
        for line in f:
            if line.startswith(name + ":"):
                return line.split("=", 1)[1].strip()
    return None


def project_version():
    version = cache_value("CMAKE_PROJECT_VERSION")
    assert version, "CMAKE_PROJECT_VERSION not in %s/CMakeCache.txt" % BUILD
    return version


def sdk_built():
    return cache_value("DDPLAUNCH_BUILD_WORKER_SDK") in ("ON", "TRUE", "1")


def clean_env(**extra):
    """No build-tree or project paths: what a user's shell on a fresh machine would have."""
    env = {"PATH": "/usr/bin:/bin", "HOME": os.environ.get("HOME", "/tmp"), "LANG": "C.UTF-8"}
    env.update(extra)
    return env


def dynamic_section(binary):
    """readelf -d of `binary`: (tag, value) pairs, e.g. ("NEEDED", "libssl.so.3")."""
    res = run(["readelf", "-d", binary], timeout=60).check()
    entries = []
    for line in res.stdout.splitlines():
        m = re.match(r"\s*0x[0-9a-f]+\s+\((\w+)\)\s+(.*)", line)
        if m:
            value = re.search(r"\[(.*)\]", m.group(2))
            entries.append((m.group(1), value.group(1) if value else m.group(2)))
    assert entries, "readelf -d %s found no dynamic section:\n%s" % (binary, res.stdout)
    return entries


def search_paths(binary):
    """The RPATH and RUNPATH entries of `binary` (empty when it has none)."""
    return [v for tag, v in dynamic_section(binary) if tag in ("RPATH", "RUNPATH")]


def skip(reason):
    """Skips the running test, saying why on stderr (ctest shows it without -V)."""
    print("skipped: " + reason, file=sys.stderr)
    raise unittest.SkipTest(reason)
