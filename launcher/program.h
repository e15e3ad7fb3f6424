// What PROGRAM is and how its workers start it: through Python (a script, -m MODULE,
// --run_path) or executed directly (--no_python, an ELF binary, a script whose #! names another
// interpreter). Decided once, before any worker starts, by launch(); the rule is in docs/cli.md
// ("How PROGRAM is run"). Reads the file system (stat, the first bytes of the file); no
// processes. Called on main's thread.
#pragma once

#include <string>

namespace ddp::launcher {

// How the workers run PROGRAM.
enum class RunAs {
  kPython,      // PYTHON -u PROGRAM ARGS
  kModule,      // PYTHON -u -m PROGRAM ARGS (-m)
  kRunPath,     // PYTHON -u -c <runpy.run_path> PROGRAM ARGS (--run_path)
  kExecutable,  // PROGRAM ARGS (--no_python, or a PROGRAM that is plainly not Python)
};

// What the user asked for on the command line (the torchrun flags).
struct ProgramRequest {
  std::string program;      // PROGRAM as given
  bool module = false;      // -m
  bool no_python = false;   // --no_python
  bool run_path = false;    // --run_path (wins over --no_python, as in torchrun)
  std::string python = "python3";  // the interpreter Python workers would use
};

struct ResolvedProgram {
  RunAs run_as = RunAs::kPython;
  // What the workers start: PROGRAM as given, or the file found on PATH, or "./NAME" for an
  // executable in the current directory (execvp would not look there).
  std::string path;
  // One line for the user when the decision differs from what torchrun would do with the same
  // command line (empty when it does not), e.g. "build/bin/train is an ELF executable: ...".
  std::string note;
};

// What a file's first bytes say it is.
enum class FileKind {
  kPythonSource,  // .py / .pyc, or #! naming python
  kElf,           // \x7fELF
  kOtherScript,   // #! naming another interpreter (sh, bash, perl, ...)
  kUnknown,       // anything else: torchrun's reading (Python) applies
};

// Classifies `path` by its name and first line. `path` must name a readable regular file;
// an unreadable one is kUnknown unless its name ends in .py/.pyc.
FileKind classify_program_file(const std::string& path);

// Whether `path` is an ELF file with a section named `name`, read from its section headers
// (64-bit little endian: Linux on x86-64 and aarch64). False
// for anything else, a truncated or malformed file included; never throws. The worker SDK
// marks programs that wait for a standby assignment with the section kStandbyMarkSection
// (worker_sdk/src/standby.cpp).
constexpr const char* kStandbyMarkSection = ".ddplaunch_standby";
bool has_elf_section(const std::string& path, const std::string& name);

// Whether the first `limit` bytes of the file `path` hold `token`. False for a file that cannot
// be read; never throws. `--in_memory_restart=auto` turns in-memory restart on for a Python
// script that names kPythonInMemoryRestart (python/ddplaunch/restart.py) or kPythonRestartable
// (python/ddplaunch/wrapper.py).
constexpr const char* kPythonInMemoryRestart = "InMemoryRestart";
constexpr const char* kPythonRestartable = "ddplaunch.restartable";
constexpr std::size_t kScriptScanLimit = std::size_t{4} << 20;
bool file_contains(const std::string& path, const std::string& token, std::size_t limit = kScriptScanLimit);

// The path of an executable regular file named `name` (no '/') on `path_variable` (":"-
// separated, an empty entry meaning the current directory), as execvp searches; "" if none.
std::string find_on_path(const std::string& name, const std::string& path_variable);

// Decides how PROGRAM runs. Throws LaunchError (exit 2) for a PROGRAM that does not exist, is
// not executable where it must be, or an interpreter that is not found.
ResolvedProgram resolve_program(const ProgramRequest& request);

}  // namespace ddp::launcher
