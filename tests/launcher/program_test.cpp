// Unit tests of launcher/program.h: what a PROGRAM file is, by its name and first bytes, and the
// PATH search (the binary's behaviour is tested in test_program_resolution.py).
#include "launcher/program.h"

#include <doctest/doctest.h>

#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>

#include "launcher/values.h"

namespace fs = std::filesystem;
using ddp::launcher::FileKind;
using ddp::launcher::classify_program_file;
using ddp::launcher::find_on_path;

namespace {

class TempDir {
 public:
  TempDir() : path_(fs::temp_directory_path() / ("ddplaunch-program-" + std::to_string(::getpid()))) {
    fs::remove_all(path_);
    fs::create_directories(path_);
  }
  ~TempDir() { fs::remove_all(path_); }
  std::string file(const std::string& name, const std::string& text, int mode = 0644) {
    const fs::path p = path_ / name;
    fs::create_directories(p.parent_path());
    std::ofstream(p, std::ios::binary) << text;
    ::chmod(p.c_str(), static_cast<mode_t>(mode));
    return p.string();
  }
  std::string path() const { return path_.string(); }

 private:
  fs::path path_;
};

}  // namespace

TEST_SUITE("PROGRAM is classified by its name and first bytes") {
  TEST_CASE("python sources, ELF binaries, other scripts and the rest") {
    TempDir dir;
    CHECK(classify_program_file(dir.file("a.py", "print(1)\n")) == FileKind::kPythonSource);
    CHECK(classify_program_file(dir.file("a.pyc", std::string("\x55\x0d\x0d\x0a", 4))) == FileKind::kPythonSource);
    CHECK(classify_program_file(dir.file("b", "#!/usr/bin/python3.11 -u\n")) == FileKind::kPythonSource);
    CHECK(classify_program_file(dir.file("c", "#!/usr/bin/env python3\n")) == FileKind::kPythonSource);
    CHECK(classify_program_file(dir.file("d", "#!/usr/bin/env -S PYTHONPATH=x python3 -u\n")) == FileKind::kPythonSource);
    CHECK(classify_program_file(dir.file("e", "#! /opt/pypy3/bin/pypy3\n")) == FileKind::kPythonSource);
    CHECK(classify_program_file(dir.file("f", std::string("\x7f" "ELF\x02\x01\x01", 7))) == FileKind::kElf);
    CHECK(classify_program_file(dir.file("g", "#!/bin/sh\necho\n")) == FileKind::kOtherScript);
    CHECK(classify_program_file(dir.file("h", "#!/usr/bin/env bash\n")) == FileKind::kOtherScript);
    CHECK(classify_program_file(dir.file("i", "import torch\n")) == FileKind::kUnknown);
    CHECK(classify_program_file(dir.file("j", "#!\n")) == FileKind::kUnknown);
    CHECK(classify_program_file(dir.file("k", "")) == FileKind::kUnknown);
    CHECK(classify_program_file(dir.path() + "/missing") == FileKind::kUnknown);
  }

  TEST_CASE("PATH is searched like execvp: executable regular files, in order") {
    TempDir dir;
    dir.file("one/tool", "#!/bin/sh\n", 0644);  // not executable: skipped
    const std::string two = dir.file("two/tool", "#!/bin/sh\n", 0755);
    dir.file("three/tool", "#!/bin/sh\n", 0755);
    fs::create_directories(dir.path() + "/four/tool");  // a directory: skipped
    const std::string path = dir.path() + "/four:" + dir.path() + "/one:" + dir.path() + "/two:" +
                             dir.path() + "/three";
    CHECK(find_on_path("tool", path) == two);
    CHECK(find_on_path("absent", path).empty());
  }

  TEST_CASE("the torchrun flags win over what the file looks like") {
    TempDir dir;
    const std::string elf = dir.file("elf", std::string("\x7f" "ELF", 4), 0755);
    ddp::launcher::ProgramRequest request;
    request.program = elf;
    request.python = "/bin/sh";  // any interpreter that exists
    CHECK(ddp::launcher::resolve_program(request).run_as == ddp::launcher::RunAs::kExecutable);
    CHECK_FALSE(ddp::launcher::resolve_program(request).note.empty());
    request.module = true;
    CHECK(ddp::launcher::resolve_program(request).run_as == ddp::launcher::RunAs::kModule);
    request.module = false;
    request.run_path = true;
    request.no_python = true;
    CHECK(ddp::launcher::resolve_program(request).run_as == ddp::launcher::RunAs::kRunPath);
    request.run_path = false;
    const auto no_python = ddp::launcher::resolve_program(request);
    CHECK(no_python.run_as == ddp::launcher::RunAs::kExecutable);
    CHECK(no_python.note.empty());  // torchrun does the same
    request.no_python = false;
    request.program = dir.path() + "/nothing-here";
    CHECK_THROWS_AS(ddp::launcher::resolve_program(request), ddp::launcher::UsageError);
  }
}
