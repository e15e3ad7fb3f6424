// The value parsers of ddplaunch's command line: text helpers, numbers, and the small grammars
// of single options (--tee, --signals_to_handle, --local_ranks_filter, torchrun's comma lists).
// Each parser refuses bad input with a LaunchError whose message names where the value came
// from (the flag or the PET_ variable) and what is accepted. Pure functions; any thread.
#pragma once

#include <map>
#include <optional>
#include <string>
#include <vector>

#include "rendezvous/error.h"

namespace ddp::launcher {

// A command-line or configuration error is a LaunchError (rendezvous/error.h) with exit code
// kUsage; main() prints what() and exits with its code. Messages are complete, ready to print as
// is: they start with "ddplaunch: ", name the flag (or PET_ variable) and its value, say what is
// accepted, and end with a hint to --help.

// Throws LaunchError(kUsage, "ddplaunch: <what>" + the hint to --help).
[[noreturn]] void refuse(const std::string& what);

// A value given for an option, and where it came from ("--nnodes" or "PET_NNODES").
struct Given {
  std::string value;
  std::string source;
  // "--nnodes=2:1" or "PET_NNODES=2:1", for messages.
  std::string shown() const { return source + "=" + value; }
};

std::string lower(std::string s);
std::string trim(const std::string& s);
std::vector<std::string> split(const std::string& s, char sep);

// Whole-string conversions (surrounding blanks allowed); nullopt when the text is not one.
std::optional<long long> to_integer(const std::string& text);
std::optional<double> to_number(const std::string& text);  // finite only
// 1/true/yes/on, 0/false/no/off (any case), or an integer (non-zero = true, as torchrun's
// check_env reads it).
std::optional<bool> to_bool(const std::string& text);

// An integer 1..1000000 (a count: --nproc_per_node, a side of --nnodes). `text` is part of `g`.
int parse_positive_count(const std::string& text, const Given& g, const char* accepted);
// An integer 0..1000000000.
int parse_non_negative(const Given& g, const char* accepted);
// Seconds >= 0, fractions allowed.
double parse_seconds(const Given& g);
// A TCP port 0..65535.
int parse_port(const Given& g);
// A flag's value: 1/0, true/false, ...
bool parse_flag(const Given& g);

// How a worker's stdout/stderr is handled: 0 none, 1 stdout, 2 stderr, 3 both (torchrun's Std).
// `default_value` applies to local ranks without an entry in `per_rank`.
struct StdSpec {
  int default_value = 0;
  std::map<int, int> per_rank;  // local rank -> 0..3
  int for_rank(int local_rank) const {
    auto it = per_rank.find(local_rank);
    return it == per_rank.end() ? default_value : it->second;
  }
};

// Parses a --redirects/--tee value: "0".."3", or "LOCAL_RANK:V,..." with V in 0..3.
// Throws LaunchError naming `flag`.
StdSpec parse_std_spec(const std::string& value, const std::string& flag);

// Parses --signals_to_handle: comma list of names (SIGTERM, TERM, sigterm) or numbers.
// Throws LaunchError naming `flag`.
std::vector<int> parse_signal_list(const std::string& value, const std::string& flag);

// --local_ranks_filter: local ranks, sorted, duplicates dropped.
std::vector<int> parse_ranks(const Given& g);

// torchrun's comma_separated_list: "a,b" -> {a, b}; ",," stands for a literal comma; "" -> {}.
std::vector<std::string> parse_comma_list(const std::string& value);

// A host name or address as given to --master_addr/--local_addr (letters, digits, . - _ : %).
bool valid_host(const std::string& host);

}  // namespace ddp::launcher
