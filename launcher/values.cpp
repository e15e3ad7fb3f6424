// Value parsers of the command line (launcher/values.h).
#include "launcher/values.h"

#include <algorithm>
#include <cctype>
#include <charconv>
#include <cmath>
#include <csignal>
#include <cstdlib>

namespace ddp::launcher {
namespace {

constexpr const char* kHelpHint = "\nTry 'ddplaunch --help' for the accepted options.";

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

}  // namespace

void refuse(const std::string& what) { throw LaunchError(ExitCode::kUsage, "ddplaunch: " + what + kHelpHint); }

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

int parse_positive_count(const std::string& text, const Given& g, const char* accepted) {
  auto n = to_integer(text);
  if (!n) refuse(g.shown() + ": '" + trim(text) + "' is not an integer; accepted: " + accepted);
  if (*n < 1) refuse(g.shown() + ": must be at least 1; accepted: " + accepted);
  if (*n > 1000000) refuse(g.shown() + ": too large; accepted: " + accepted);
  return static_cast<int>(*n);
}

int parse_non_negative(const Given& g, const char* accepted) {
  auto n = to_integer(g.value);
  if (!n) refuse(g.shown() + ": not an integer; accepted: " + accepted);
  if (*n < 0) refuse(g.shown() + ": must not be negative; accepted: " + accepted);
  if (*n > 1000000000) refuse(g.shown() + ": too large; accepted: " + accepted);
  return static_cast<int>(*n);
}

double parse_seconds(const Given& g) {
  auto v = to_number(g.value);
  if (!v) refuse(g.shown() + ": not a number; accepted: seconds >= 0, e.g. 30 or 0.5");
  if (*v < 0) refuse(g.shown() + ": must not be negative; accepted: seconds >= 0, e.g. 30 or 0.5");
  return *v;
}

int parse_port(const Given& g) {
  auto n = to_integer(g.value);
  if (!n || *n < 0 || *n > 65535) {
    refuse(g.shown() + ": not a port; accepted: an integer 0..65535 (0 = pick a free port)");
  }
  return static_cast<int>(*n);
}

bool parse_flag(const Given& g) {
  auto b = to_bool(g.value);
  if (!b) refuse(g.shown() + ": expected 1 or 0 (true or false)");
  return *b;
}

bool valid_host(const std::string& host) {
  if (host.empty()) return false;
  return std::all_of(host.begin(), host.end(), [](char c) {
    return std::isalnum(static_cast<unsigned char>(c)) || c == '.' || c == '-' || c == '_' ||
           c == ':' || c == '%';
  });
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

std::vector<std::string> parse_comma_list(const std::string& value) {
  std::vector<std::string> items;
  if (value.empty()) return items;
  std::string current;
  for (std::size_t i = 0; i < value.size(); ++i) {
    if (value[i] != ',') {
      current += value[i];
    } else if (i + 1 < value.size() && value[i + 1] == ',') {
      current += ',';  // ",," is a literal comma
      ++i;
    } else {
      items.push_back(current);
      current.clear();
    }
  }
  items.push_back(current);
  return items;
}

}  // namespace ddp::launcher
