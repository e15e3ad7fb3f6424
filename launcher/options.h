// ddplaunch's options: one table drives the parser (launcher/command_line.cpp), the PET_<NAME>
// environment fallbacks and --help, so the three never disagree. Pure data and text; any
// thread.
#pragma once

#include <string>
#include <vector>

namespace ddp::launcher {

enum class Group { kWorkers, kRendezvous, kFaultTolerance, kLogs, kEnvCheck };

// One command-line option. `name` is the underscore spelling without dashes; the dash spelling
// and the PET_ variable are derived from it.
struct OptionSpec {
  const char* name;
  char short_name;          // 0 = none
  bool is_flag;
  const char* value_name;   // for --help; nullptr for flags
  const char* default_text; // for --help; nullptr = no default line
  Group group;
  const char* help;
};

// Every option, in --help order.
const std::vector<OptionSpec>& option_table();

// "nproc-per-node" for "nproc_per_node".
std::string dash_spelling(const std::string& name);
// "PET_NPROC_PER_NODE" for "nproc_per_node".
std::string env_name(const std::string& name);

// A second name of an option, matched exactly (either spelling), never as a prefix: the
// names for options whose own names are shorter to abbreviate (--health_check is
// --check_health; as a prefixable name it would make --he ambiguous with --help, and
// --max_restarts_without_progress every abbreviation of --max_restarts). `name` is the option's.
struct OptionAlias {
  const char* alias;
  const char* name;
};
const std::vector<OptionAlias>& option_aliases();

// The option a long name (without "--") names: exactly (either spelling, an option's name before
// an alias), else as a unique prefix of an option's name, as argparse allows ("nnode" -> nnodes). "help" and "version" are found
// too (as a spec with that name, group kWorkers, is_flag). Returns nullptr and fills
// `candidates` ("--nnodes", ...) when the prefix matches more than one option; nullptr with no
// candidates when it matches none.
const OptionSpec* find_long_option(const std::string& name, std::vector<std::string>& candidates);
// The valid spellings closest to an unknown long name (without "--"), best first, at most
// three: those within a few edits (a typo, a swapped letter, '-' for '_', a plural), as
// "--name". Empty when none is close ("did you mean --nproc_per_node?").
std::vector<std::string> closest_long_options(const std::string& name);
// The option of a short letter (-m, -r, -t; -h is help), or nullptr.
const OptionSpec* find_short_option(char letter);

// The text --help prints (a man page: synopsis, options by group with defaults, exit status,
// environment, examples).
std::string help_text();

// "ddplaunch <version>", what --version prints.
std::string version_text();

}  // namespace ddp::launcher
