// How PROGRAM is run: the rule of docs/cli.md ("How PROGRAM is run").
#include "launcher/program.h"

#include <elf.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <algorithm>
#include <cstring>
#include <fstream>
#include <sstream>
#include <vector>

#include "launcher/values.h"

namespace ddp::launcher {
namespace {

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

std::string basename_of(const std::string& path) {
  const auto slash = path.rfind('/');
  return slash == std::string::npos ? path : path.substr(slash + 1);
}

bool is_regular_file(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0 && S_ISREG(st.st_mode);
}

bool is_executable_file(const std::string& path) {
  return is_regular_file(path) && ::access(path.c_str(), X_OK) == 0;
}

std::string path_variable() {
  const char* path = std::getenv("PATH");
  // glibc's execvp default when PATH is unset.
  return path != nullptr ? path : "/bin:/usr/bin";
}

// "an ELF executable" / "a script for /bin/sh": what the file is, for messages.
std::string describe(FileKind kind, const std::string& path) {
  if (kind == FileKind::kElf) return "an ELF executable";
  std::ifstream in(path);
  std::string line;
  std::getline(in, line);
  std::istringstream words(line.substr(2));
  std::string interpreter;
  words >> interpreter;
  return "a script for " + interpreter;
}

// The interpreter must exist before any worker starts.
void check_python(const ProgramRequest& request) {
  const std::string& python = request.python;
  const bool found = python.find('/') != std::string::npos
                         ? is_executable_file(python)
                         : !find_on_path(python, path_variable()).empty();
  if (!found) {
    throw LaunchError(ExitCode::kUsage, "ddplaunch: Python interpreter " + python +
                     " was not found; set --python or $PYTHON_EXEC to an interpreter path, or use "
                     "--no_python");
  }
}

ResolvedProgram resolve_no_python(const ProgramRequest& request) {
  const std::string& program = request.program;
  const bool has_slash = program.find('/') != std::string::npos;
  const std::string found = has_slash ? (is_executable_file(program) ? program : "")
                                      : find_on_path(program, path_variable());
  if (found.empty()) {
    throw LaunchError(ExitCode::kUsage, "ddplaunch: --no_python program " + program +
                     (has_slash ? " does not exist or is not executable" : " was not found in PATH") +
                     "; give a path to an executable file");
  }
  // execvp semantics: a bare name is looked up on PATH by the spawner, as torchrun does.
  return {RunAs::kExecutable, program, ""};
}

}  // namespace

FileKind classify_program_file(const std::string& path) {
  if (ends_with(path, ".py") || ends_with(path, ".pyc")) return FileKind::kPythonSource;
  std::ifstream in(path, std::ios::binary);
  char head[4] = {};
  if (!in.read(head, sizeof head)) return FileKind::kUnknown;
  if (head[0] == '\x7f' && head[1] == 'E' && head[2] == 'L' && head[3] == 'F') return FileKind::kElf;
  if (head[0] != '#' || head[1] != '!') return FileKind::kUnknown;
  in.seekg(2);
  std::string line;
  std::getline(in, line);
  std::istringstream words(line);
  std::vector<std::string> argv;
  for (std::string w; words >> w;) argv.push_back(w);
  if (argv.empty()) return FileKind::kUnknown;
  std::string interpreter = basename_of(argv[0]);
  if (interpreter == "env") {
    // #!/usr/bin/env [-S] [NAME=VALUE...] python3 [ARGS]: the first word that is neither an
    // option nor an assignment is the interpreter.
    interpreter.clear();
    for (std::size_t i = 1; i < argv.size(); ++i) {
      if (argv[i][0] == '-' || argv[i].find('=') != std::string::npos) continue;
      interpreter = basename_of(argv[i]);
      break;
    }
    if (interpreter.empty()) return FileKind::kUnknown;
  }
  if (interpreter.rfind("python", 0) == 0 || interpreter.rfind("pypy", 0) == 0) {
    return FileKind::kPythonSource;
  }
  return FileKind::kOtherScript;
}

bool has_elf_section(const std::string& path, const std::string& name) {
  std::ifstream in(path, std::ios::binary);
  auto read_at = [&in](std::uint64_t offset, void* out, std::size_t size) {
    in.seekg(static_cast<std::streamoff>(offset));
    return static_cast<bool>(in.read(static_cast<char*>(out), static_cast<std::streamsize>(size)));
  };
  Elf64_Ehdr header{};
  if (!read_at(0, &header, sizeof header)) return false;
  if (std::memcmp(header.e_ident, ELFMAG, SELFMAG) != 0 || header.e_ident[EI_CLASS] != ELFCLASS64 ||
      header.e_ident[EI_DATA] != ELFDATA2LSB || header.e_shentsize != sizeof(Elf64_Shdr) ||
      header.e_shnum == 0 || header.e_shstrndx >= header.e_shnum) {
    return false;  // not ours to read (or > 65,279 sections, where the count moves elsewhere)
  }
  std::vector<Elf64_Shdr> sections(header.e_shnum);
  if (!read_at(header.e_shoff, sections.data(), sections.size() * sizeof(Elf64_Shdr))) return false;
  const Elf64_Shdr& names = sections[header.e_shstrndx];
  constexpr std::uint64_t kMaxNames = 1 << 20;  // a section-name table is a few hundred bytes
  if (names.sh_size == 0 || names.sh_size > kMaxNames) return false;
  std::string table(names.sh_size, '\0');
  if (!read_at(names.sh_offset, table.data(), table.size())) return false;
  for (const Elf64_Shdr& section : sections) {
    // c_str() ends in a NUL even when the table does not: the name read is bounded.
    if (section.sh_name < table.size() && name == table.c_str() + section.sh_name) return true;
  }
  return false;
}

bool file_contains(const std::string& path, const std::string& token, std::size_t limit) {
  if (token.empty()) return true;
  std::ifstream in(path, std::ios::binary);
  if (!in) return false;
  // In 64 KiB pieces, each searched with the end of the one before (a token may span two).
  constexpr std::size_t kPiece = 64 * 1024;
  std::string window;
  std::vector<char> piece(kPiece);
  std::size_t read = 0;
  while (read < limit && in) {
    in.read(piece.data(), static_cast<std::streamsize>(std::min(kPiece, limit - read)));
    const auto got = static_cast<std::size_t>(in.gcount());
    if (got == 0) break;
    read += got;
    const std::size_t keep = std::min(window.size(), token.size() - 1);
    window.erase(0, window.size() - keep);
    window.append(piece.data(), got);
    if (window.find(token) != std::string::npos) return true;
  }
  return false;
}

std::string find_on_path(const std::string& name, const std::string& path_variable) {
  std::size_t start = 0;
  while (start <= path_variable.size()) {
    std::size_t end = path_variable.find(':', start);
    if (end == std::string::npos) end = path_variable.size();
    const std::string dir = path_variable.substr(start, end - start);
    const std::string candidate = (dir.empty() ? "." : dir) + "/" + name;
    if (is_executable_file(candidate)) return candidate;
    start = end + 1;
  }
  return "";
}

ResolvedProgram resolve_program(const ProgramRequest& request) {
  const std::string& program = request.program;
  if (program.empty()) {
    throw LaunchError(ExitCode::kUsage, "ddplaunch: no training program given; usage: ddplaunch [options] "
                     "PROGRAM [ARGS...] (see --help)");
  }
  // The torchrun flags win: --run_path over --no_python, -m, --no_python.
  if (request.run_path) {
    check_python(request);
    if (!is_regular_file(program)) {
      throw LaunchError(ExitCode::kUsage, "ddplaunch: --run_path script " + program +
                       " does not exist; give the path of a Python file");
    }
    return {RunAs::kRunPath, program, ""};
  }
  if (request.module) {
    check_python(request);
    return {RunAs::kModule, program, ""};  // Python finds (or refuses) the module
  }
  if (request.no_python) return resolve_no_python(request);

  // No flag: look at PROGRAM. A bare name not in the current directory is searched on PATH.
  const bool has_slash = program.find('/') != std::string::npos;
  std::string path = program;
  bool on_path = false;
  struct stat st {};
  if (::stat(program.c_str(), &st) != 0) {
    const std::string found = has_slash ? "" : find_on_path(program, path_variable());
    if (found.empty()) {
      throw LaunchError(ExitCode::kUsage, 
          "ddplaunch: PROGRAM " + program + " does not exist" +
          (has_slash ? std::string() : " in the current directory and no executable " + program +
                                           " is on PATH") +
          "; give the path of a Python script or an executable (or -m MODULE for a module)");
    }
    path = found;
    on_path = true;
    ::stat(path.c_str(), &st);
  }
  const std::string where = on_path ? program + " (found on PATH at " + path + ")" : program;
  if (S_ISDIR(st.st_mode)) {
    // Python runs a directory's __main__.py, as under torchrun.
    check_python(request);
    return {RunAs::kPython, path, ""};
  }

  const FileKind kind = classify_program_file(path);
  if (kind == FileKind::kElf || kind == FileKind::kOtherScript) {
    const std::string what = describe(kind, path);
    if (::access(path.c_str(), X_OK) != 0) {
      throw LaunchError(ExitCode::kUsage, "ddplaunch: PROGRAM " + where + " is " + what +
                       " but is not executable; make it executable (chmod +x " + path + ")");
    }
    // execvp would search PATH for a bare name; the file is the one in this directory.
    if (!has_slash && !on_path) path = "./" + program;
    return {RunAs::kExecutable, path,
            where + " is " + what + ": running it directly (torchrun would run it with " +
                request.python + "; --no_python says the same)"};
  }
  // A Python source, or nothing recognisable: torchrun's reading.
  check_python(request);
  std::string note;
  if (on_path) {
    note = where + ": running it with " + request.python +
           " (torchrun would look for it in the current directory only)";
  }
  return {RunAs::kPython, path, note};
}

}  // namespace ddp::launcher
