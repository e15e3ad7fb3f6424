// The torchrun-compatible command line of ddplaunch: one table of options drives CLI11, the
// PET_<NAME> environment fallbacks and --help, so the three never disagree.
#include "launcher/config.h"

#include <sched.h>
#include <unistd.h>

#include <dirent.h>

#include <algorithm>
#include <cctype>
#include <charconv>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <optional>
#include <random>
#include <set>
#include <sstream>

#include <CLI/CLI.hpp>

#ifndef DDPLAUNCH_VERSION
#define DDPLAUNCH_VERSION "unknown"
#endif

namespace ddp::launcher {
namespace {

constexpr const char* kHelpHint = "\nTry 'ddplaunch --help' for the accepted options.";

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

// clang-format off
const OptionSpec kOptions[] = {
  // Workers
  {"nnodes", 0, false, "N|MIN:MAX", "1",
   Group::kWorkers, "Number of nodes, or the elastic range MIN:MAX (1 <= MIN <= MAX)."},
  {"nproc_per_node", 0, false, "N|auto|cpu|gpu", "1",
   Group::kWorkers, "Workers per node: a count, 'gpu' (visible GPUs, honouring "
   "CUDA_VISIBLE_DEVICES), 'cpu' (usable CPUs), or 'auto' (GPUs when any, else CPUs)."},
  {"node_rank", 0, false, "N", "0 with the static backend, else assigned by the rendezvous",
   Group::kWorkers, "Rank of this node (0 <= N < MAX nodes). Required by the static backend "
   "on more than one node."},
  {"module", 'm', true, nullptr, nullptr,
   Group::kWorkers, "Run PROGRAM as a Python module, like 'python -m'."},
  {"no_python", 0, true, nullptr, nullptr,
   Group::kWorkers, "Execute PROGRAM directly instead of through the Python interpreter."},
  {"run_path", 0, true, nullptr, nullptr,
   Group::kWorkers, "Run PROGRAM (an absolute path to a Python script) as runpy.run_path "
   "would; takes precedence over --no_python."},
  {"python", 0, false, "PATH", "$PYTHON_EXEC, else python3",
   Group::kWorkers, "Interpreter that runs Python workers (as 'PATH -u PROGRAM ARGS')."},
  {"role", 0, false, "NAME", "default",
   Group::kWorkers, "Role of the workers (ROLE_NAME, the log prefix)."},
  {"start_method", 0, false, "spawn|fork|forkserver", "spawn",
   Group::kWorkers, "Accepted for torchrun compatibility; workers are always new processes."},
  {"master_addr", 0, false, "HOST", "127.0.0.1",
   Group::kWorkers, "Address of the rank-0 node, static backend only (IPv6 as [::1])."},
  {"master_port", 0, false, "PORT", "29500",
   Group::kWorkers, "Port on the rank-0 node, static backend only; 0 picks a free port."},
  {"local_addr", 0, false, "ADDR", "the address used to reach the rendezvous",
   Group::kWorkers, "Address other nodes reach this node at (becomes MASTER_ADDR when this "
   "node is group rank 0)."},
  // Rendezvous
  {"rdzv_backend", 0, false, "static|c10d|ddp", "static",
   Group::kRendezvous, "Rendezvous backend. 'c10d' and 'ddp' both mean the ddp-rendezvous "
   "daemon at --rdzv_endpoint; 'static' needs no daemon (fixed --nnodes and --node_rank)."},
  {"rdzv_endpoint", 0, false, "HOST[:PORT][,HOST[:PORT]...]", "none; PORT defaults to 29400",
   Group::kRendezvous, "Where the rendezvous daemon listens; a comma-separated list names "
   "standby daemons, tried in order when one is lost. With the static backend it "
   "replaces --master_addr:--master_port."},
  {"rdzv_id", 0, false, "ID", "none",
   Group::kRendezvous, "Job id: every node of one job gives the same id."},
  {"rdzv_conf", 0, false, "KEY=VALUE,...", "none",
   Group::kRendezvous, "Rendezvous settings, in seconds where they are times: join_timeout "
   "(600), last_call_timeout (30), heartbeat_interval (1), heartbeat_timeout (5), "
   "shutdown_timeout (30), reconnect_timeout (60: how long workers keep running while no "
   "rendezvous answers), read_timeout, timeout; token_file=PATH; is_host=true|false. "
   "Other keys are ignored with a warning."},
  {"standalone", 0, true, nullptr, nullptr,
   Group::kRendezvous, "Single-node job on a private local rendezvous: sets the c10d backend, "
   "a loopback endpoint and a random run id, ignoring any --rdzv_* values given."},
  // Fault tolerance
  {"max_restarts", 0, false, "N", "0",
   Group::kFaultTolerance, "Restarts of the worker group after a failure before the job fails "
   "(counted per job across nodes)."},
  {"monitor_interval", 0, false, "SECONDS", "0.1",
   Group::kFaultTolerance, "Accepted for torchrun compatibility; worker exits are events, "
   "not polled."},
  {"shutdown_timeout", 0, false, "SECONDS", "30",
   Group::kFaultTolerance, "Grace between SIGTERM and SIGKILL when workers are stopped."},
  {"signals_to_handle", 0, false, "SIGNALS", "SIGTERM,SIGINT,SIGHUP,SIGQUIT",
   Group::kFaultTolerance, "Signals forwarded to the workers (names or numbers, comma "
   "separated); ddplaunch then exits 128+N."},
  // Logs
  {"log_dir", 0, false, "DIR", "a new temporary directory when logs are written",
   Group::kLogs, "Base directory of worker logs: DIR/RUN_ID/attempt_N/LOCAL_RANK/"
   "{stdout,stderr}.log."},
  {"redirects", 'r', false, "0-3|RANK:V,...", "0",
   Group::kLogs, "Send worker streams to log files instead of the console: 0 none, 1 stdout, "
   "2 stderr, 3 both; or per local rank, e.g. 0:3,1:1."},
  {"tee", 't', false, "0-3|RANK:V,...", "0",
   Group::kLogs, "Copy worker streams to log files and to the console, each console line "
   "prefixed like [default0]: (same forms as --redirects)."},
  {"local_ranks_filter", 0, false, "RANKS", "all local ranks",
   Group::kLogs, "Comma list of local ranks whose output reaches the console (log files "
   "are not filtered)."},
  // Environment check
  {"env_check", 0, false, "strict|warn|off", "strict",
   Group::kEnvCheck, "What to do when the nodes' software differs: refuse the round (exit 3), "
   "log and go on, or skip the check."},
  {"env_lock", 0, false, "FILE", "none",
   Group::kEnvCheck, "A lock file (requirements.txt, environment.yml, ...) whose hash must "
   "match on every node."},
  {"check_env", 0, true, nullptr, nullptr,
   Group::kEnvCheck, "Print this node's software fingerprint and exit 0; with --rdzv_endpoint "
   "and --rdzv_id, compare it with the job's nodes. PROGRAM is not needed."},
};
// clang-format on

std::string dash_spelling(const std::string& name) {
  std::string out = name;
  std::replace(out.begin(), out.end(), '_', '-');
  return out;
}

std::string env_name(const std::string& name) {
  std::string out = "PET_";
  for (char c : name) out += static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  return out;
}

std::string lower(std::string s) {
  for (char& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return s;
}

std::string trim(const std::string& s) {
  const auto begin = s.find_first_not_of(" \t");
  if (begin == std::string::npos) return "";
  const auto end = s.find_last_not_of(" \t");
  return s.substr(begin, end - begin + 1);
}

std::vector<std::string> split(const std::string& s, char sep) {
  std::vector<std::string> parts;
  std::string::size_type start = 0;
  while (true) {
    const auto pos = s.find(sep, start);
    parts.push_back(s.substr(start, pos == std::string::npos ? std::string::npos : pos - start));
    if (pos == std::string::npos) return parts;
    start = pos + 1;
  }
}

std::optional<long long> to_integer(const std::string& text) {
  const std::string s = trim(text);
  if (s.empty()) return std::nullopt;
  long long value = 0;
  const char* first = s.data();
  if (*first == '+') ++first;
  const auto [ptr, ec] = std::from_chars(first, s.data() + s.size(), value);
  if (ec != std::errc() || ptr != s.data() + s.size()) return std::nullopt;
  return value;
}

std::optional<double> to_number(const std::string& text) {
  const std::string s = trim(text);
  if (s.empty()) return std::nullopt;
  char* end = nullptr;
  const double value = std::strtod(s.c_str(), &end);
  if (end != s.c_str() + s.size() || !std::isfinite(value)) return std::nullopt;
  return value;
}

std::optional<bool> to_bool(const std::string& text) {
  const std::string s = lower(trim(text));
  if (s == "1" || s == "true" || s == "yes" || s == "on") return true;
  if (s == "0" || s == "false" || s == "no" || s == "off") return false;
  if (auto n = to_integer(s)) return *n != 0;  // torchrun's check_env: int(value) != 0
  return std::nullopt;
}

[[noreturn]] void refuse(const std::string& what) { throw UsageError("ddplaunch: " + what + kHelpHint); }

// A value given for an option, and where it came from ("--nnodes" or "PET_NNODES").
struct Given {
  std::string value;
  std::string source;
  // "--nnodes=2:1" or "PET_NNODES=2:1", for messages.
  std::string shown() const { return source + "=" + value; }
};

// The raw option values of one parse, command line first, then PET_ variables.
class RawValues {
 public:
  void set(const std::string& name, Given given) { values_[name] = std::move(given); }
  const Given* find(const std::string& name) const {
    auto it = values_.find(name);
    return it == values_.end() ? nullptr : &it->second;
  }
  bool has(const std::string& name) const { return find(name) != nullptr; }
  bool flag(const std::string& name) const {
    const Given* g = find(name);
    if (g == nullptr) return false;
    auto b = to_bool(g->value);
    if (!b) refuse(g->shown() + ": expected 1 or 0 (true or false)");
    return *b;
  }

 private:
  std::map<std::string, Given> values_;
};

// An integer >= 1 out of `text`, a part of the value `g` (all of it, or MIN or MAX of --nnodes).
int parse_positive_count(const std::string& text, const Given& g, const char* accepted) {
  auto n = to_integer(text);
  if (!n) refuse(g.shown() + ": '" + trim(text) + "' is not an integer; accepted: " + accepted);
  if (*n < 1) refuse(g.shown() + ": must be at least 1; accepted: " + accepted);
  if (*n > 1000000) refuse(g.shown() + ": too large; accepted: " + accepted);
  return static_cast<int>(*n);
}

void parse_nnodes(const Given& g, LaunchConfig& config) {
  const char* accepted = "N or MIN:MAX, integers with 1 <= MIN <= MAX";
  const auto parts = split(trim(g.value), ':');
  if (parts.size() > 2) refuse(g.shown() + ": too many ':'; accepted: " + accepted);
  const int min_nodes = parse_positive_count(parts[0], g, accepted);
  const int max_nodes = parts.size() == 2 ? parse_positive_count(parts[1], g, accepted) : min_nodes;
  if (min_nodes > max_nodes) {
    refuse(g.shown() + ": MIN (" + std::to_string(min_nodes) + ") must not exceed MAX (" +
           std::to_string(max_nodes) + "); accepted: " + accepted);
  }
  config.min_nodes = min_nodes;
  config.max_nodes = max_nodes;
}

void parse_nproc(const Given& g, LaunchConfig& config, const ParseContext& context) {
  const char* accepted = "a count >= 1, auto, cpu or gpu";
  const std::string spec = lower(trim(g.value));
  config.nproc_spec = spec;
  if (spec == "cpu") {
    config.nproc_per_node = context.count_cpus ? context.count_cpus() : count_usable_cpus();
    return;
  }
  if (spec == "gpu" || spec == "auto") {
    const int gpus = context.count_gpus ? context.count_gpus() : count_visible_gpus();
    if (gpus > 0) {
      config.nproc_per_node = gpus;
      return;
    }
    if (spec == "gpu") {
      const char* cvd = std::getenv("CUDA_VISIBLE_DEVICES");
      refuse(g.shown() + ": no GPU is visible" +
             (cvd ? std::string(" (CUDA_VISIBLE_DEVICES=") + cvd + ")" : std::string()) +
             "; use a count, cpu or auto");
    }
    config.nproc_per_node = context.count_cpus ? context.count_cpus() : count_usable_cpus();
    return;
  }
  config.nproc_per_node = parse_positive_count(g.value, g, accepted);
}

double parse_seconds(const Given& g) {
  auto v = to_number(g.value);
  if (!v) refuse(g.shown() + ": not a number; accepted: seconds >= 0, e.g. 30 or 0.5");
  if (*v < 0) refuse(g.shown() + ": must not be negative; accepted: seconds >= 0, e.g. 30 or 0.5");
  return *v;
}

int parse_non_negative(const Given& g, const char* accepted) {
  auto n = to_integer(g.value);
  if (!n) refuse(g.shown() + ": not an integer; accepted: " + accepted);
  if (*n < 0) refuse(g.shown() + ": must not be negative; accepted: " + accepted);
  if (*n > 1000000000) refuse(g.shown() + ": too large; accepted: " + accepted);
  return static_cast<int>(*n);
}

int parse_port(const Given& g) {
  auto n = to_integer(g.value);
  if (!n || *n < 0 || *n > 65535) {
    refuse(g.shown() + ": not a port; accepted: an integer 0..65535 (0 = pick a free port)");
  }
  return static_cast<int>(*n);
}

bool valid_host(const std::string& host) {
  if (host.empty()) return false;
  return std::all_of(host.begin(), host.end(), [](char c) {
    return std::isalnum(static_cast<unsigned char>(c)) || c == '.' || c == '-' || c == '_' ||
           c == ':' || c == '%';
  });
}

// HOST[:PORT], [IPV6][:PORT]. Returns host (without brackets) and port (default_port if none).
std::pair<std::string, int> parse_endpoint(const Given& g, int default_port) {
  const char* accepted = "HOST[:PORT] or [IPv6][:PORT], PORT in 0..65535";
  const std::string s = trim(g.value);
  std::string host;
  std::string port;
  if (!s.empty() && s.front() == '[') {
    const auto close = s.find(']');
    if (close == std::string::npos) refuse(g.shown() + ": missing ']'; accepted: " + accepted);
    host = s.substr(1, close - 1);
    const std::string rest = s.substr(close + 1);
    if (!rest.empty()) {
      if (rest.front() != ':') refuse(g.shown() + ": junk after ']'; accepted: " + accepted);
      port = rest.substr(1);
      if (port.empty()) refuse(g.shown() + ": empty port; accepted: " + accepted);
    }
  } else {
    const auto colon = s.rfind(':');
    const bool bare_ipv6 = colon != std::string::npos && s.find(':') != colon;
    if (colon == std::string::npos || bare_ipv6) {
      host = s;
    } else {
      host = s.substr(0, colon);
      port = s.substr(colon + 1);
      if (port.empty()) refuse(g.shown() + ": empty port; accepted: " + accepted);
    }
  }
  if (!valid_host(host)) refuse(g.shown() + ": not a host name or address; accepted: " + accepted);
  int port_number = default_port;
  if (!port.empty()) {
    auto n = to_integer(port);
    if (!n || *n < 0 || *n > 65535) refuse(g.shown() + ": bad port; accepted: " + accepted);
    port_number = static_cast<int>(*n);
  }
  return {host, port_number};
}

const char* const kTimeoutKeys[] = {"join_timeout",     "last_call_timeout", "heartbeat_interval",
                                    "heartbeat_timeout", "shutdown_timeout",  "read_timeout",
                                    "timeout",           "reconnect_timeout"};

void parse_rdzv_conf(const Given& g, LaunchConfig& config, std::ostream& err) {
  const char* accepted = "KEY=VALUE,KEY=VALUE,... e.g. join_timeout=300,last_call_timeout=10";
  const std::string s = trim(g.value);
  if (s.empty()) return;
  for (const std::string& pair : split(s, ',')) {
    const auto eq = pair.find('=');
    const std::string key = trim(pair.substr(0, eq));
    const std::string value = eq == std::string::npos ? "" : trim(pair.substr(eq + 1));
    if (key.empty()) refuse(g.shown() + ": '" + pair + "' has no key; accepted: " + accepted);
    if (value.empty()) refuse(g.shown() + ": '" + key + "' has no value; accepted: " + accepted);
    const Given item{value, g.source + " " + key};
    const bool is_timeout = std::find_if(std::begin(kTimeoutKeys), std::end(kTimeoutKeys),
                                         [&](const char* k) { return key == k; }) !=
                            std::end(kTimeoutKeys);
    if (is_timeout) {
      const double seconds = parse_seconds(item);
      if (key == "heartbeat_interval" && seconds <= 0) {
        refuse(item.shown() + ": must be greater than 0 seconds");
      }
      if (key == "join_timeout") config.timeouts.join_timeout = seconds;
      if (key == "last_call_timeout") config.timeouts.last_call_timeout = seconds;
      if (key == "heartbeat_interval") config.timeouts.heartbeat_interval = seconds;
      if (key == "heartbeat_timeout") config.timeouts.heartbeat_timeout = seconds;
      if (key == "shutdown_timeout") config.timeouts.shutdown_timeout = seconds;
    } else if (key == "is_host") {
      if (!to_bool(value)) refuse(item.shown() + ": expected true or false");
    } else if (key != "token_file") {
      err << "ddplaunch: warning: " << g.source << ": unknown key '" << key
          << "' is ignored (known: join_timeout, last_call_timeout, heartbeat_interval, "
             "heartbeat_timeout, shutdown_timeout, read_timeout, timeout, reconnect_timeout, token_file, "
             "is_host)\n";
    }
    config.rdzv_conf[key] = value;
  }
  if (config.timeouts.heartbeat_timeout <= config.timeouts.heartbeat_interval) {
    std::ostringstream message;
    message << g.shown() << ": heartbeat_timeout (" << config.timeouts.heartbeat_timeout
            << ") must exceed heartbeat_interval (" << config.timeouts.heartbeat_interval << ")";
    refuse(message.str());
  }
}

std::vector<int> parse_ranks(const Given& g) {
  const char* accepted = "a comma-separated list of local ranks, e.g. 0,1,2";
  std::vector<int> ranks;
  for (const std::string& item : split(g.value, ',')) {
    auto n = to_integer(item);
    if (!n || *n < 0 || *n > 1000000) refuse(g.shown() + ": '" + item + "' is not a rank; accepted: " + accepted);
    if (std::find(ranks.begin(), ranks.end(), static_cast<int>(*n)) == ranks.end()) {
      ranks.push_back(static_cast<int>(*n));
    }
  }
  std::sort(ranks.begin(), ranks.end());
  return ranks;
}

std::string random_run_id() {
  std::random_device device;
  std::mt19937_64 engine((static_cast<std::uint64_t>(device()) << 32) ^ device());
  std::uint64_t hi = engine();
  std::uint64_t lo = engine();
  hi = (hi & ~0xF000ULL) | 0x4000ULL;                 // version 4
  lo = (lo & ~(0xC0ULL << 56)) | (0x80ULL << 56);     // variant 10
  char text[37];
  std::snprintf(text, sizeof text, "%08x-%04x-%04x-%04x-%012llx",
                static_cast<unsigned>(hi >> 32), static_cast<unsigned>((hi >> 16) & 0xFFFF),
                static_cast<unsigned>(hi & 0xFFFF), static_cast<unsigned>(lo >> 48),
                static_cast<unsigned long long>(lo & 0xFFFFFFFFFFFFULL));
  return text;
}

struct SignalName {
  const char* name;
  int number;
};

const SignalName kSignals[] = {
    {"HUP", SIGHUP},     {"INT", SIGINT},       {"QUIT", SIGQUIT},   {"ILL", SIGILL},
    {"TRAP", SIGTRAP},   {"ABRT", SIGABRT},     {"BUS", SIGBUS},     {"FPE", SIGFPE},
    {"KILL", SIGKILL},   {"USR1", SIGUSR1},     {"SEGV", SIGSEGV},   {"USR2", SIGUSR2},
    {"PIPE", SIGPIPE},   {"ALRM", SIGALRM},     {"TERM", SIGTERM},   {"CHLD", SIGCHLD},
    {"CONT", SIGCONT},   {"STOP", SIGSTOP},     {"TSTP", SIGTSTP},   {"TTIN", SIGTTIN},
    {"TTOU", SIGTTOU},   {"URG", SIGURG},       {"XCPU", SIGXCPU},   {"XFSZ", SIGXFSZ},
    {"VTALRM", SIGVTALRM}, {"PROF", SIGPROF},   {"WINCH", SIGWINCH}, {"IO", SIGIO},
    {"PWR", SIGPWR},     {"SYS", SIGSYS},
};

std::string section_title(Group group) {
  switch (group) {
    case Group::kWorkers: return "Workers";
    case Group::kRendezvous: return "Rendezvous";
    case Group::kFaultTolerance: return "Fault tolerance";
    case Group::kLogs: return "Logs";
    case Group::kEnvCheck: return "Environment check";
  }
  return "";
}

// Wraps `text` at `width` columns, each line starting with `indent` spaces.
std::string wrap(const std::string& text, std::size_t indent, std::size_t width = 79) {
  std::string out;
  std::string line(indent, ' ');
  std::istringstream words(text);
  std::string word;
  bool line_empty = true;
  while (words >> word) {
    if (!line_empty && line.size() + 1 + word.size() > width) {
      out += line + "\n";
      line.assign(indent, ' ');
      line_empty = true;
    }
    if (!line_empty) line += ' ';
    line += word;
    line_empty = false;
  }
  if (!line_empty) out += line + "\n";
  return out;
}

std::string option_names(const OptionSpec& spec) {
  std::string names;
  if (spec.short_name != 0) names += std::string("-") + spec.short_name + ", ";
  names += std::string("--") + spec.name;
  const std::string dashed = dash_spelling(spec.name);
  if (dashed != spec.name) names += ", --" + dashed;
  if (spec.value_name != nullptr) names += std::string(" ") + spec.value_name;
  return names;
}


const OptionSpec* find_long(const std::string& name) {
  for (const OptionSpec& spec : kOptions) {
    if (name == spec.name || name == dash_spelling(spec.name)) return &spec;
  }
  return nullptr;
}

const OptionSpec* find_short(char name) {
  for (const OptionSpec& spec : kOptions) {
    if (spec.short_name == name) return &spec;
  }
  return nullptr;
}

// argv split into ddplaunch's own options (as tokens for CLI11) and the program with its
// arguments.
struct SplitArgs {
  std::vector<std::string> options;
  std::map<std::string, std::string> flag_values;  // --flag=VALUE given on the command line
  std::vector<std::string> program;
};

// torchrun 2.x options that ddplaunch does not implement: named as such rather than as typos.
const char* const kTorchrunOnly[] = {"event_log_handler", "event-log-handler", "logs_specs",
                                     "logs-specs", "numa_binding", "numa-binding"};

[[noreturn]] void refuse_unknown(const std::string& token) {
  const std::string flag = token.substr(0, token.find('='));
  for (const char* name : kTorchrunOnly) {
    if (flag == std::string("--") + name) {
      refuse(flag + " is a torchrun option that ddplaunch does not support; drop it");
    }
  }
  refuse("unknown option '" + token.substr(0, token.find('=')) +
         "' (ddplaunch's options go before PROGRAM; put '--' before a PROGRAM whose name "
         "starts with '-')");
}

[[noreturn]] void refuse_missing_value(const std::string& token, const OptionSpec& spec) {
  refuse(token + " needs a value: " + token + "=" + spec.value_name + " (and then PROGRAM)");
}

SplitArgs split_command_line(int argc, const char* const* argv) {
  SplitArgs split;
  int i = 1;
  for (; i < argc; ++i) {
    const std::string token = argv[i];
    if (token == "--") {
      ++i;
      break;
    }
    if (token.size() < 2 || token[0] != '-') break;  // the program
    if (token.compare(0, 2, "--") == 0) {
      const auto eq = token.find('=');
      const std::string name = token.substr(2, eq == std::string::npos ? std::string::npos : eq - 2);
      if (name == "help" || name == "version") {
        split.options.push_back(token);
        continue;
      }
      const OptionSpec* spec = find_long(name);
      if (spec == nullptr) refuse_unknown(token);
      if (eq == std::string::npos) {
        split.options.push_back(token);
        if (!spec->is_flag) {
          if (i + 1 >= argc) refuse_missing_value(token, *spec);
          split.options.push_back(argv[++i]);
        }
      } else if (spec->is_flag) {
        split.flag_values[spec->name] = token.substr(eq + 1);
      } else {
        // "--name=VALUE", also when VALUE is empty (CLI11 would take the next word instead).
        split.options.push_back("--" + name);
        split.options.push_back(token.substr(eq + 1));
      }
      continue;
    }
    const char letter = token[1];
    if (letter == 'h') {
      split.options.push_back(token);
      continue;
    }
    const OptionSpec* spec = find_short(letter);
    if (spec == nullptr) refuse_unknown(token);
    if (spec->is_flag) {
      if (token.size() > 2) refuse_unknown(token);
      split.options.push_back(token);
    } else if (token.size() > 2) {
      split.options.push_back(std::string("-") + letter);
      split.options.push_back(token.substr(token[2] == '=' ? 3 : 2));
    } else {
      split.options.push_back(token);
      if (i + 1 >= argc) refuse_missing_value(token, *spec);
      split.options.push_back(argv[++i]);
    }
  }
  split.program.assign(argv + std::min(i, argc), argv + argc);
  return split;
}
// --rdzv_backend, --rdzv_endpoint, --rdzv_id, --rdzv_conf and --standalone.
void resolve_rendezvous(const RawValues& raw, LaunchConfig& config, std::ostream& err) {
  config.standalone = raw.flag("standalone");
  if (auto g = raw.find("rdzv_backend")) {
    const std::string backend = lower(trim(g->value));
    if (backend != "static" && backend != "c10d" && backend != "ddp") {
      refuse(g->shown() + ": unsupported backend; accepted: static, c10d, ddp (c10d and ddp both "
             "mean the ddp-rendezvous daemon)");
    }
    config.rdzv_backend = backend;
  }
  if (auto g = raw.find("rdzv_endpoint")) {
    if (!trim(g->value).empty()) {
      config.rdzv_endpoint = trim(g->value);
      // A list HOST:PORT,HOST:PORT (issue 10: standby daemons, tried in order): every item must
      // parse; the first one is rdzv_host/rdzv_port.
      const std::vector<std::string> items = split(config.rdzv_endpoint, ',');
      for (const std::string& item : items) parse_endpoint(Given{trim(item), g->source}, 29400);
      std::tie(config.rdzv_host, config.rdzv_port) = parse_endpoint(Given{trim(items.front()), g->source}, 29400);
    }
  }
  if (auto g = raw.find("rdzv_id")) {
    if (trim(g->value).empty()) refuse(g->shown() + ": must not be empty");
    config.rdzv_id = trim(g->value);
  }
  if (auto g = raw.find("rdzv_conf")) parse_rdzv_conf(*g, config, err);

  if (config.standalone) {
    for (const char* name : {"rdzv_backend", "rdzv_endpoint", "rdzv_id"}) {
      if (auto g = raw.find(name)) {
        err << "ddplaunch: warning: --standalone ignores " << g->shown() << "\n";
      }
    }
    if (config.max_nodes != 1) {
      refuse("--standalone runs a single-node job, but --nnodes is " +
             std::to_string(config.min_nodes) + ":" + std::to_string(config.max_nodes) +
             "; drop --nnodes (or set it to 1), or use --rdzv_backend=c10d --rdzv_endpoint=HOST:PORT "
             "for more nodes");
    }
    config.rdzv_backend = "c10d";
    config.rdzv_endpoint.clear();
    config.rdzv_host.clear();
    config.rdzv_port = 29400;
    config.rdzv_id = random_run_id();
  }
}

// --max_restarts, --monitor_interval, --shutdown_timeout (after --rdzv_conf), --signals_to_handle.
void resolve_fault_tolerance(const RawValues& raw, LaunchConfig& config) {
  if (auto g = raw.find("max_restarts")) {
    config.max_restarts = parse_non_negative(*g, "an integer >= 0");
  }
  if (auto g = raw.find("monitor_interval")) config.monitor_interval = parse_seconds(*g);
  if (auto g = raw.find("shutdown_timeout")) {
    config.shutdown_timeout = parse_seconds(*g);
  } else {
    config.shutdown_timeout = config.timeouts.shutdown_timeout;
  }
  config.timeouts.shutdown_timeout = config.shutdown_timeout;
  if (auto g = raw.find("signals_to_handle")) {
    config.signals_to_handle = parse_signal_list(g->value, g->source);
  } else {
    config.signals_to_handle = {SIGTERM, SIGINT, SIGHUP, SIGQUIT};
  }
}

// How workers are started: --start_method, --role, -m, --no_python, --run_path, --python.
void resolve_worker_command(const RawValues& raw, LaunchConfig& config) {
  if (auto g = raw.find("start_method")) {
    const std::string method = lower(trim(g->value));
    if (method != "spawn" && method != "fork" && method != "forkserver") {
      refuse(g->shown() + ": accepted: spawn, fork, forkserver");
    }
    config.start_method = method;
  }
  if (auto g = raw.find("role")) {
    if (trim(g->value).empty()) refuse(g->shown() + ": must not be empty");
    config.role = trim(g->value);
  }

  config.module = raw.flag("module");
  config.no_python = raw.flag("no_python");
  config.run_path = raw.flag("run_path");
  if (config.no_python && config.module && !config.run_path) {
    refuse("--no_python and -m/--module cannot be used together: -m runs a Python module "
           "through the interpreter, --no_python runs PROGRAM without one; drop one of them");
  }
  if (auto g = raw.find("python")) {
    config.python = trim(g->value);
  } else if (const char* exec = std::getenv("PYTHON_EXEC"); exec != nullptr && *exec != '\0') {
    config.python = exec;
  }
}

// --log_dir, --redirects, --tee, --local_ranks_filter.
void resolve_logs(const RawValues& raw, LaunchConfig& config) {
  if (auto g = raw.find("log_dir")) config.log_dir = g->value;
  if (auto g = raw.find("redirects")) config.redirects = parse_std_spec(g->value, g->source);
  if (auto g = raw.find("tee")) config.tee = parse_std_spec(g->value, g->source);
  if (auto g = raw.find("local_ranks_filter")) {
    if (!trim(g->value).empty()) config.local_ranks_filter = parse_ranks(*g);
  }
}

// --master_addr, --master_port, --local_addr, --node_rank, and the static backend's rules
// (after --nnodes and the rendezvous flags).
void resolve_addresses(const RawValues& raw, LaunchConfig& config) {
  if (auto g = raw.find("master_addr")) {
    std::string addr = trim(g->value);
    if (addr.size() > 2 && addr.front() == '[' && addr.back() == ']') {
      addr = addr.substr(1, addr.size() - 2);
    }
    if (!valid_host(addr)) {
      refuse(g->shown() + ": not a host name or address; accepted: HOST, an IPv4 address, or "
             "IPv6 as [::1]");
    }
    config.master_addr = addr;
  }
  if (auto g = raw.find("master_port")) {
    config.master_port = parse_port(*g);
    config.master_port_given = true;
  }
  if (auto g = raw.find("local_addr")) {
    if (!valid_host(trim(g->value))) {
      refuse(g->shown() + ": not a host name or address; accepted: HOST or an IP address");
    }
    config.local_addr = trim(g->value);
  }

  if (auto g = raw.find("node_rank")) {
    config.node_rank = parse_non_negative(*g, "an integer 0 <= N < MAX nodes");
    if (config.node_rank >= config.max_nodes) {
      refuse(g->shown() + ": must be less than the number of nodes (" +
             std::to_string(config.max_nodes) + "); accepted: 0.." +
             std::to_string(config.max_nodes - 1));
    }
  }
  if (config.rdzv_backend == "static") {
    if (config.min_nodes != config.max_nodes) {
      refuse("--nnodes=" + std::to_string(config.min_nodes) + ":" +
             std::to_string(config.max_nodes) +
             " is elastic, but the static backend needs a fixed number of nodes; use "
             "--nnodes=N, or --rdzv_backend=c10d --rdzv_endpoint=HOST:PORT for MIN:MAX");
    }
    if (config.max_nodes > 1 && config.node_rank < 0) {
      refuse("the static backend on " + std::to_string(config.max_nodes) +
             " nodes needs --node_rank (0.." + std::to_string(config.max_nodes - 1) +
             ") on each node, or use --rdzv_backend=c10d --rdzv_endpoint=HOST:PORT");
    }
    if (config.node_rank < 0) config.node_rank = 0;
    if (!config.rdzv_endpoint.empty()) {
      const Given* g = raw.find("rdzv_endpoint");
      auto [host, port] = parse_endpoint(*g, -1);
      if (port < 0) refuse(g->shown() + ": the static backend needs a port: HOST:PORT");
      config.master_addr = host;
      config.master_port = port;
      config.master_port_given = true;
    }
  } else if (!config.standalone && config.rdzv_endpoint.empty() && config.max_nodes > 1) {
    refuse("--rdzv_backend=" + config.rdzv_backend + " on more than one node needs "
           "--rdzv_endpoint=HOST[:PORT] (where ddp-rendezvous listens)");
  }
}

// --env_check, --env_lock, --check_env (issue 6).
void resolve_env_check(const RawValues& raw, LaunchConfig& config) {
  if (auto g = raw.find("env_check")) {
    const std::string mode = lower(trim(g->value));
    if (mode != "strict" && mode != "warn" && mode != "off") {
      refuse(g->shown() + ": accepted: strict (refuse differing nodes), warn (log and go on), "
             "off (no check)");
    }
    config.env_check = mode;
  }
  if (auto g = raw.find("env_lock")) {
    if (trim(g->value).empty()) refuse(g->shown() + ": must name a file");
    config.env_lock = g->value;
  }
  config.check_env = raw.flag("check_env");
}

}  // namespace

std::string version_text() { return std::string("ddplaunch ") + DDPLAUNCH_VERSION; }

std::string help_text() {
  std::string h;
  h += "NAME\n    ddplaunch - launch and supervise distributed PyTorch training\n\n";
  h += "SYNOPSIS\n"
       "    ddplaunch [OPTIONS] PROGRAM [ARGS...]\n"
       "    ddplaunch [OPTIONS] -m MODULE [ARGS...]\n"
       "    ddplaunch [OPTIONS] --no_python EXECUTABLE [ARGS...]\n"
       "    ddplaunch --check_env [--rdzv_endpoint HOST:PORT --rdzv_id ID]\n\n";
  h += "DESCRIPTION\n";
  h += wrap("Starts --nproc_per_node workers on this node, each with the torchrun environment "
            "(RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, ...), watches them, and "
            "restarts the whole group up to --max_restarts times when one fails. With no "
            "rendezvous flags it runs a single-node job; with --rdzv_backend=c10d and "
            "--rdzv_endpoint it joins the other nodes of job --rdzv_id at a ddp-rendezvous "
            "daemon.", 4);
  h += "\n";
  h += wrap("PROGRAM is a Python script run as 'python3 -u PROGRAM ARGS', a module with -m, or "
            "any executable with --no_python. Everything after PROGRAM belongs to it, flags "
            "included. Every option has two spellings (--nproc_per_node, --nproc-per-node) and "
            "can also be set as PET_<NAME> in the environment (PET_NPROC_PER_NODE=4); the "
            "command line wins. For a flag, PET_<NAME>=1 turns it on.", 4);
  h += "\nOPTIONS\n";
  h += "    -h, --help\n        Print this help and exit 0.\n";
  h += "    --version\n        Print the version and exit 0.\n";
  for (Group group : {Group::kWorkers, Group::kRendezvous, Group::kFaultTolerance, Group::kLogs,
                      Group::kEnvCheck}) {
    h += "\n  " + section_title(group) + "\n";
    for (const OptionSpec& spec : kOptions) {
      if (spec.group != group) continue;
      h += "    " + option_names(spec) + "\n";
      std::string text = spec.help;
      if (spec.default_text != nullptr) text += std::string(" Default: ") + spec.default_text + ".";
      text += " Env: " + env_name(spec.name) + ".";
      h += wrap(text, 8);
    }
  }
  h += "\nEXIT STATUS\n"
       "    0      the job succeeded on every node (also --help, --version, --check_env)\n"
       "    1      the job failed: workers failed past the restart budget\n"
       "           (--max_restarts)\n"
       "    2      usage or configuration error (bad flag, bad value, missing program);\n"
       "           nothing was started\n"
       "    3      rendezvous failed: timeout, connection closed or refused, protocol\n"
       "           version, token, or software mismatch between nodes (--env_check)\n"
       "    128+N  ddplaunch received signal N (SIGINT 130, SIGTERM 143), forwarded\n"
       "           it to the workers and stopped them\n";
  h += "\nENVIRONMENT\n"
       "    PET_<NAME>\n"
       "        Default for option --<name>: PET_NNODES, PET_NPROC_PER_NODE,\n"
       "        PET_RDZV_ENDPOINT, PET_MAX_RESTARTS, PET_STANDALONE=1, ...\n"
       "        The command line wins; an empty variable counts as unset.\n"
       "    PYTHON_EXEC\n"
       "        Interpreter for Python workers when neither --python nor PET_PYTHON\n"
       "        is given (else python3).\n"
       "    CUDA_VISIBLE_DEVICES\n"
       "        Limits the GPUs counted by --nproc_per_node=gpu|auto; passed on to\n"
       "        the workers unchanged.\n"
       "    TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE\n"
       "        Prefix of tee'd console lines; ${role_name}, ${rank} and\n"
       "        ${local_rank} are replaced. Default: [${role_name}${local_rank}]:\n"
       "    OMP_NUM_THREADS\n"
       "        Set to 1 for the workers when unset and more than one worker runs\n"
       "        per node.\n";
  h += "\nEXAMPLES\n"
       "    One node, four workers:\n"
       "        ddplaunch --nproc_per_node=4 train.py --epochs 3\n"
       "    One worker per visible GPU, a module, restarts on failure:\n"
       "        ddplaunch --standalone --nproc_per_node=gpu --max_restarts=3 \\\n"
       "                  -m pkg.train\n"
       "    Two to four nodes at a rendezvous daemon (on head: ddp-rendezvous\n"
       "    --port 29400), run on every node:\n"
       "        ddplaunch --nnodes=2:4 --nproc_per_node=8 --rdzv_backend=c10d \\\n"
       "                  --rdzv_endpoint=head:29400 --rdzv_id=job42 train.py\n"
       "    Two nodes without a daemon (static), run on each node with its rank:\n"
       "        ddplaunch --nnodes=2 --node_rank=0 --master_addr=10.0.0.1 \\\n"
       "                  --master_port=29500 --nproc_per_node=4 train.py\n"
       "    A C++ program, logs of rank 0 only on the console, all in files:\n"
       "        ddplaunch --nproc_per_node=4 --no_python --tee=3 --log_dir=logs \\\n"
       "                  --local_ranks_filter=0 ./train\n"
       "\nSEE ALSO\n"
       "    ddp-rendezvous(1), docs/cli.md, docs/exit-codes.md\n";
  return h;
}

int apply_cuda_visible_devices(int physical, const char* cuda_visible_devices) {
  if (cuda_visible_devices == nullptr) return physical;
  int visible = 0;
  std::set<std::string> seen;
  const std::string list = cuda_visible_devices;
  if (trim(list).empty()) return 0;
  for (const std::string& raw : split(list, ',')) {
    const std::string entry = trim(raw);
    if (entry.rfind("GPU-", 0) == 0 || entry.rfind("MIG-", 0) == 0) {
      if (!seen.insert(entry).second) break;
    } else {
      auto n = to_integer(entry);
      if (!n || *n < 0 || *n >= physical) break;
      if (!seen.insert(std::to_string(*n)).second) break;
    }
    ++visible;
  }
  return std::min(visible, physical);
}

int count_visible_gpus(const std::string& proc_gpus_dir, const std::string& dev_dir,
                       const char* cuda_visible_devices) {
  int physical = 0;
  if (DIR* dir = ::opendir(proc_gpus_dir.c_str())) {
    while (const dirent* entry = ::readdir(dir)) {
      if (entry->d_name[0] != '.') ++physical;
    }
    ::closedir(dir);
  }
  if (physical == 0) {
    if (DIR* dir = ::opendir(dev_dir.c_str())) {
      while (const dirent* entry = ::readdir(dir)) {
        const std::string name = entry->d_name;
        if (name.size() > 6 && name.compare(0, 6, "nvidia") == 0 &&
            std::all_of(name.begin() + 6, name.end(),
                        [](char c) { return std::isdigit(static_cast<unsigned char>(c)); })) {
          ++physical;
        }
      }
      ::closedir(dir);
    }
  }
  return apply_cuda_visible_devices(physical, cuda_visible_devices);
}

int count_visible_gpus() {
  return count_visible_gpus("/proc/driver/nvidia/gpus", "/dev", std::getenv("CUDA_VISIBLE_DEVICES"));
}

int count_usable_cpus() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (::sched_getaffinity(0, sizeof set, &set) == 0) {
    const int n = CPU_COUNT(&set);
    if (n > 0) return n;
  }
  const long online = ::sysconf(_SC_NPROCESSORS_ONLN);
  return online > 0 ? static_cast<int>(online) : 1;
}

StdSpec parse_std_spec(const std::string& value, const std::string& flag) {
  const std::string shown = flag + "=" + value;
  const std::string accepted =
      "0 (none), 1 (stdout), 2 (stderr), 3 (both), or LOCAL_RANK:V,... e.g. 0:3,1:1";
  StdSpec spec;
  const std::string s = trim(value);
  if (s.find(':') == std::string::npos) {
    auto n = to_integer(s);
    if (!n || *n < 0 || *n > 3) refuse(shown + ": not a stream setting; accepted: " + accepted);
    spec.default_value = static_cast<int>(*n);
    return spec;
  }
  for (const std::string& item : split(s, ',')) {
    const auto parts = split(item, ':');
    if (parts.size() != 2) refuse(shown + ": '" + item + "' is not RANK:V; accepted: " + accepted);
    auto rank = to_integer(parts[0]);
    auto v = to_integer(parts[1]);
    if (!rank || *rank < 0 || *rank > 1000000) {
      refuse(shown + ": '" + parts[0] + "' is not a local rank; accepted: " + accepted);
    }
    if (!v || *v < 0 || *v > 3) {
      refuse(shown + ": '" + parts[1] + "' is not 0..3; accepted: " + accepted);
    }
    if (!spec.per_rank.emplace(static_cast<int>(*rank), static_cast<int>(*v)).second) {
      refuse(shown + ": local rank " + std::to_string(*rank) + " is given twice");
    }
  }
  return spec;
}

std::vector<int> parse_signal_list(const std::string& value, const std::string& flag) {
  const std::string shown = flag + "=" + value;
  const char* accepted = "comma-separated signal names or numbers, e.g. SIGTERM,SIGINT,SIGUSR1";
  std::vector<int> signals;
  for (const std::string& raw : split(value, ',')) {
    const std::string item = trim(raw);
    int number = 0;
    if (auto n = to_integer(item)) {
      if (*n < 1 || *n > SIGRTMAX) refuse(shown + ": no signal " + item + "; accepted: " + accepted);
      number = static_cast<int>(*n);
    } else {
      std::string name;
      for (char c : item) name += static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
      if (name.rfind("SIG", 0) == 0) name = name.substr(3);
      for (const SignalName& s : kSignals) {
        if (name == s.name) number = s.number;
      }
      if (number == 0) refuse(shown + ": unknown signal '" + item + "'; accepted: " + accepted);
    }
    if (number == SIGKILL || number == SIGSTOP) {
      refuse(shown + ": '" + item + "' cannot be caught, so it cannot be forwarded");
    }
    if (number == SIGCHLD) {
      refuse(shown + ": '" + item + "' tells ddplaunch that a worker exited; it is not forwarded");
    }
    if (std::find(signals.begin(), signals.end(), number) == signals.end()) signals.push_back(number);
  }
  return signals;
}

LaunchConfig parse_command_line(int argc, const char* const* argv) {
  return parse_command_line(argc, argv, ParseContext{});
}

LaunchConfig parse_command_line(int argc, const char* const* argv, const ParseContext& context) {
  std::ostream& out = context.out != nullptr ? *context.out : std::cout;
  std::ostream& err = context.err != nullptr ? *context.err : std::cerr;

  // Split argv into ddplaunch's options and the program with its arguments before CLI11 sees
  // anything: the first word that is not an option (or the word after "--") is the program, and
  // nothing after it is ever read as ours.
  const SplitArgs split_args = split_command_line(argc, argv);

  CLI::App app{"ddplaunch", "ddplaunch"};
  app.set_help_flag();  // our own --help, printed from the same table
  app.option_defaults()->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
  CLI::Option* help = app.add_flag("-h,--help");
  CLI::Option* version = app.add_flag("--version");

  std::map<std::string, CLI::Option*> cli_options;
  std::map<std::string, std::string> cli_values;
  for (const OptionSpec& spec : kOptions) {
    std::string names;
    if (spec.short_name != 0) names += std::string("-") + spec.short_name + ",";
    names += std::string("--") + spec.name;
    const std::string dashed = dash_spelling(spec.name);
    if (dashed != spec.name) names += ",--" + dashed;
    cli_options[spec.name] = spec.is_flag ? app.add_flag(names)
                                          : app.add_option(names, cli_values[spec.name]);
  }

  try {
    std::vector<std::string> reversed(split_args.options.rbegin(), split_args.options.rend());
    app.parse(reversed);
  } catch (const CLI::ParseError& e) {
    refuse(std::string(e.what()));
  }

  if (help->count() > 0) {
    out << help_text();
    throw UsageError("", ExitCode::kSuccess);
  }
  if (version->count() > 0) {
    out << version_text() << "\n";
    throw UsageError("", ExitCode::kSuccess);
  }

  // Command line first, then PET_ variables (an empty variable counts as unset).
  RawValues raw;
  for (const OptionSpec& spec : kOptions) {
    const CLI::Option* option = cli_options[spec.name];
    const std::string source = std::string("--") + spec.name;
    if (auto it = split_args.flag_values.find(spec.name); it != split_args.flag_values.end()) {
      raw.set(spec.name, Given{it->second, source});
      continue;
    }
    if (option->count() > 0) {
      raw.set(spec.name, Given{spec.is_flag ? "1" : cli_values[spec.name], source});
      continue;
    }
    const std::string variable = env_name(spec.name);
    const char* value = std::getenv(variable.c_str());
    if (value != nullptr && *value != '\0') raw.set(spec.name, Given{value, variable});
  }

  LaunchConfig config;
  if (auto g = raw.find("nnodes")) parse_nnodes(*g, config);
  if (auto g = raw.find("nproc_per_node")) {
    parse_nproc(*g, config, context);
  }

  resolve_rendezvous(raw, config, err);
  resolve_fault_tolerance(raw, config);
  resolve_worker_command(raw, config);
  resolve_logs(raw, config);
  resolve_addresses(raw, config);
  resolve_env_check(raw, config);

  const std::vector<std::string>& rest = split_args.program;
  if (!rest.empty()) {
    config.program = rest.front();
    config.program_args.assign(rest.begin() + 1, rest.end());
  }
  if (config.program.empty() && !config.check_env) {
    refuse("missing PROGRAM: ddplaunch [OPTIONS] PROGRAM [ARGS...], e.g. "
           "ddplaunch --nproc_per_node=4 train.py");
  }
  return config;
}

}  // namespace ddp::launcher
