// Unit tests of launcher/program.h: what a PROGRAM file is, by its name and first bytes, and the
// PATH search (the binary's behaviour is tested in test_program_resolution.py).
#include "launcher/program.h"

#include <doctest/doctest.h>

#include <elf.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <string>
#include <utility>
#include <vector>

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
    CHECK_THROWS_AS(ddp::launcher::resolve_program(request), ddp::LaunchError);
  }
}

namespace {

// A minimal ELF64 file (header, section-name table, then one section header per name after the
// null section); `mutate` may break it before it is written.
std::string tiny_elf(const std::vector<std::string>& names, const std::function<void(Elf64_Ehdr&, std::vector<Elf64_Shdr>&)>& mutate = {}) {
  std::string table(1, '\0');
  std::vector<Elf64_Shdr> sections(1);  // SHN_UNDEF
  Elf64_Shdr strtab{};
  strtab.sh_name = static_cast<Elf64_Word>(table.size());
  table += std::string(".shstrtab") + '\0';
  strtab.sh_type = SHT_STRTAB;
  sections.push_back(strtab);
  for (const auto& name : names) {
    Elf64_Shdr s{};
    s.sh_name = static_cast<Elf64_Word>(table.size());
    s.sh_type = SHT_PROGBITS;
    table += name + '\0';
    sections.push_back(s);
  }
  Elf64_Ehdr header{};
  std::memcpy(header.e_ident, ELFMAG, SELFMAG);
  header.e_ident[EI_CLASS] = ELFCLASS64;
  header.e_ident[EI_DATA] = ELFDATA2LSB;
  header.e_ident[EI_VERSION] = EV_CURRENT;
  header.e_type = ET_EXEC;
  header.e_shentsize = sizeof(Elf64_Shdr);
  header.e_shnum = static_cast<Elf64_Half>(sections.size());
  header.e_shstrndx = 1;
  sections[1].sh_offset = sizeof header;
  sections[1].sh_size = table.size();
  header.e_shoff = sizeof header + table.size();
  if (mutate) mutate(header, sections);
  std::string out(reinterpret_cast<const char*>(&header), sizeof header);
  out += table;
  out.append(reinterpret_cast<const char*>(sections.data()), sections.size() * sizeof(Elf64_Shdr));
  return out;
}

}  // namespace

TEST_SUITE("a Python script that uses in-memory restart is told by its text") {
  using ddp::launcher::file_contains;
  using ddp::launcher::kPythonInMemoryRestart;

  TEST_CASE("the token is found anywhere within the limit, across the reader's pieces") {
    TempDir dir;
    CHECK(file_contains(dir.file("uses.py", "import ddplaunch\nr = ddplaunch.InMemoryRestart()\n"), kPythonInMemoryRestart));
    CHECK_FALSE(file_contains(dir.file("plain.py", "import torch\nprint('InMemory' 'Restart')\n"), kPythonInMemoryRestart));
    // Straddling the 64 KiB boundary of the reader, and beyond a limit.
    std::string big(64 * 1024 - 5, '#');
    const std::string straddling = dir.file("straddling.py", big + kPythonInMemoryRestart + "\n");
    CHECK(file_contains(straddling, kPythonInMemoryRestart));
    CHECK_FALSE(file_contains(straddling, kPythonInMemoryRestart, 64 * 1024));
    CHECK_FALSE(file_contains(dir.path() + "/missing.py", kPythonInMemoryRestart));
    CHECK_FALSE(file_contains(dir.path(), kPythonInMemoryRestart));  // a directory reads as nothing
  }
}

TEST_SUITE("the worker SDK's standby mark is read from the ELF section headers") {
  using ddp::launcher::has_elf_section;
  using ddp::launcher::kStandbyMarkSection;

  TEST_CASE("a section is found by its exact name") {
    TempDir dir;
    const std::string marked = dir.file("marked", tiny_elf({".text", kStandbyMarkSection}));
    CHECK(has_elf_section(marked, kStandbyMarkSection));
    CHECK(has_elf_section(marked, ".text"));
    CHECK_FALSE(has_elf_section(dir.file("longer", tiny_elf({std::string(kStandbyMarkSection) + "2"})), kStandbyMarkSection));
    CHECK_FALSE(has_elf_section(dir.file("plain", tiny_elf({".text", ".data"})), kStandbyMarkSection));
    // A real program: this test binary has text and no mark (it does not link the SDK).
    CHECK(has_elf_section("/proc/self/exe", ".text"));
    CHECK_FALSE(has_elf_section("/proc/self/exe", kStandbyMarkSection));
  }

  TEST_CASE("anything that is not a well-formed 64-bit little-endian ELF is unmarked, never a crash") {
    TempDir dir;
    const std::string good = tiny_elf({kStandbyMarkSection});
    CHECK_FALSE(has_elf_section(dir.path() + "/absent", kStandbyMarkSection));
    CHECK_FALSE(has_elf_section(dir.file("script", "#!/bin/sh\n" + std::string(200, 'x')), kStandbyMarkSection));
    for (std::size_t cut : {std::size_t{4}, sizeof(Elf64_Ehdr) - 1, sizeof(Elf64_Ehdr) + 3, good.size() - 1}) {
      CAPTURE(cut);
      CHECK_FALSE(has_elf_section(dir.file("cut", good.substr(0, cut)), kStandbyMarkSection));
    }
    const std::vector<std::pair<const char*, std::function<void(Elf64_Ehdr&, std::vector<Elf64_Shdr>&)>>> breaks = {
        {"32-bit", [](Elf64_Ehdr& h, auto&) { h.e_ident[EI_CLASS] = ELFCLASS32; }},
        {"big endian", [](Elf64_Ehdr& h, auto&) { h.e_ident[EI_DATA] = ELFDATA2MSB; }},
        {"name table index out of range", [](Elf64_Ehdr& h, auto&) { h.e_shstrndx = 0xffff; }},
        {"section headers past the end", [](Elf64_Ehdr& h, auto&) { h.e_shoff = 1ull << 40; }},
        {"section headers at an offset that wraps", [](Elf64_Ehdr& h, auto&) { h.e_shoff = ~0ull - 8; }},
        {"odd section header size", [](Elf64_Ehdr& h, auto&) { h.e_shentsize = 40; }},
        {"no sections", [](Elf64_Ehdr& h, auto&) { h.e_shnum = 0; h.e_shstrndx = 0; }},
        {"name table of 4 GiB", [](auto&, std::vector<Elf64_Shdr>& s) { s[1].sh_size = 1ull << 32; }},
        {"name table past the end", [](auto&, std::vector<Elf64_Shdr>& s) { s[1].sh_offset = 1ull << 40; }},
        {"name offset past the table", [](auto&, std::vector<Elf64_Shdr>& s) { s[2].sh_name = 1u << 30; }},
    };
    for (const auto& [what, mutate] : breaks) {
      CAPTURE(what);
      CHECK_FALSE(has_elf_section(dir.file("broken", tiny_elf({kStandbyMarkSection}, mutate)), kStandbyMarkSection));
    }
  }
}
