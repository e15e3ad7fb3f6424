#include "agent/failure.h"

#include <signal.h>
#include <string.h>

#include <ctime>
#include <fstream>
#include <sstream>

#include <nlohmann/json.hpp>

namespace ddp::agent {

namespace {

double to_seconds(const nlohmann::json& v) {
  if (v.is_number()) return v.get<double>();
  if (v.is_string()) {
    try {
      return std::stod(v.get<std::string>());
    } catch (const std::exception&) {
    }
  }
  return 0;
}

std::string as_text(const nlohmann::json& v) { return v.is_string() ? v.get<std::string>() : v.dump(); }

std::string format_time(double t) {
  std::time_t secs = static_cast<std::time_t>(t);
  std::tm tm{};
  localtime_r(&secs, &tm);
  char buf[64];
  std::strftime(buf, sizeof buf, "%Y-%m-%d_%H:%M:%S", &tm);
  return buf;
}

std::string indent_continuation(const std::string& text, const std::string& pad) {
  std::string out;
  for (char c : text) {
    out += c;
    if (c == '\n') out += pad;
  }
  while (!out.empty() && (out.back() == ' ' || out.back() == '\n')) out.pop_back();
  return out;
}

void append_failure(std::ostringstream& os, int idx, const rdzv::WorkerFailure& f,
                    const std::string& error_file, const std::vector<std::string>& log_files) {
  os << "[" << idx << "]:\n";
  os << "  time      : " << format_time(f.timestamp) << "\n";
  os << "  host      : " << f.host << "\n";
  if (f.rank < 0) {
    os << "  rank      : none (the node itself, not a worker)\n";
  } else {
    os << "  rank      : " << f.rank << " (local_rank: " << f.local_rank << ")\n";
  }
  if (f.signal != 0) {
    os << "  exitcode  : " << -f.signal << " (pid: " << f.pid << ")\n";
    os << "  signal    : " << f.signal << " (" << signal_name(f.signal) << ")\n";
  } else {
    os << "  exitcode  : " << f.exit_code << " (pid: " << f.pid << ")\n";
  }
  os << "  error_file: " << (error_file.empty() ? "<N/A>" : error_file) << "\n";
  for (const auto& path : log_files) os << "  log_file  : " << path << "\n";
  std::string message = f.error_file_message;
  if (message.empty()) {
    message = f.signal != 0 ? "Signal " + std::to_string(f.signal) + " (" + signal_name(f.signal) +
                                  ") received by PID " + std::to_string(f.pid)
                            : "the worker wrote no error file; decorate its entry point with "
                              "torch.distributed.elastic.multiprocessing.errors.record to get one";
  }
  os << "  traceback : " << indent_continuation(message, "    ") << "\n";
}

}  // namespace

ErrorFileContent parse_error_file(const std::string& text) {
  ErrorFileContent out;
  nlohmann::json j = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object() || !j.contains("message")) {
    out.problem = "not a PyTorch error file (expected a JSON object with \"message\")";
    return out;
  }
  const auto& m = j["message"];
  out.present = true;
  if (m.is_object()) {
    out.message = m.contains("message") ? as_text(m["message"]) : m.dump();
    if (m.contains("extraInfo") && m["extraInfo"].is_object()) {
      const auto& extra = m["extraInfo"];
      if (extra.contains("py_callstack")) out.traceback = as_text(extra["py_callstack"]);
      if (extra.contains("timestamp")) out.timestamp = to_seconds(extra["timestamp"]);
    }
  } else {
    out.message = as_text(m);
    if (j.contains("timestamp")) out.timestamp = to_seconds(j["timestamp"]);
  }
  return out;
}

ErrorFileContent read_error_file(const std::string& path) {
  std::ifstream in(path);
  if (!in) return {};
  std::ostringstream ss;
  ss << in.rdbuf();
  ErrorFileContent content = parse_error_file(ss.str());
  if (!content.present && !content.problem.empty()) {
    content.problem = "error file " + path + ": " + content.problem;
  }
  return content;
}

std::string signal_name(int signo) {
  const char* abbrev = sigabbrev_np(signo);
  if (abbrev) return std::string("SIG") + abbrev;
  return "signal " + std::to_string(signo);
}

std::string summarise_error_file(const ErrorFileContent& content) {
  if (!content.present) return content.problem;
  if (content.traceback.empty()) return content.message;
  return content.message + "\n" + content.traceback;
}

std::string format_failure_summary(const std::string& title, const rdzv::WorkerFailure& root,
                                   const std::string& root_error_file,
                                   const std::vector<LocalFailure>& others,
                                   const std::vector<std::string>& root_log_files) {
  const std::string border(60, '='), section(60, '-');
  std::ostringstream os;
  os << border << "\n" << title << " FAILED\n" << section << "\nFailures:\n";
  if (others.empty()) os << "  <NO_OTHER_FAILURES>\n";
  int idx = 1;
  for (const auto& other : others) append_failure(os, idx++, other.failure, other.error_file, other.log_files);
  os << section << "\nRoot Cause (first observed failure):\n";
  append_failure(os, 0, root, root_error_file, root_log_files);
  os << border << "\n";
  return os.str();
}

}  // namespace ddp::agent
