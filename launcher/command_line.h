// Reads argv and the PET_<NAME> environment into raw option values: the one parser of
// ddplaunch's command line. It knows the shape of options (flag or value, long or short, unique
// prefixes) but not what values mean; launcher/config.cpp resolves them into a LaunchConfig.
// Pure apart from reading the environment; any thread.
#pragma once

#include <map>
#include <string>
#include <vector>

#include "launcher/values.h"

namespace ddp::launcher {

// The raw option values of one command line, by the option's underscore name: the command line
// first (the last occurrence wins, as argparse does), then non-empty PET_ variables.
class RawValues {
 public:
  void set(const std::string& name, Given given) { values_[name] = std::move(given); }
  const Given* find(const std::string& name) const {
    auto it = values_.find(name);
    return it == values_.end() ? nullptr : &it->second;
  }
  // A flag's value; false when not given. Throws LaunchError for a value that is not boolean.
  bool flag(const std::string& name) const {
    const Given* g = find(name);
    return g != nullptr && parse_flag(*g);
  }

 private:
  std::map<std::string, Given> values_;
};

struct CommandLine {
  bool help = false;     // -h/--help before PROGRAM
  bool version = false;  // --version before PROGRAM
  RawValues values;
  std::vector<std::string> program;  // PROGRAM and its arguments, untouched; empty = none
};

// Splits argv: options up to the first word that is not one (or "--"), which is PROGRAM;
// everything after PROGRAM belongs to it. Throws LaunchError for an unknown or ambiguous option
// or a missing value.
CommandLine read_command_line(int argc, const char* const* argv);

}  // namespace ddp::launcher
