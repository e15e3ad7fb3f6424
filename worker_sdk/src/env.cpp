#include "ddp/env.h"

#include <cerrno>
#include <cstdlib>
#include <sstream>
#include <vector>

#include "ddp/error.h"
#include "standby.h"

namespace ddp {
namespace {

const char* const kHowToStart =
    "start the program with ddplaunch (or torchrun), or set RANK, WORLD_SIZE, MASTER_ADDR and "
    "MASTER_PORT yourself; with none of them set it runs as a single process";

// Strict base-10 parse: digits only (an optional leading '-'), no spaces, no trailing text.
int64_t parse_int(const std::string& name, const std::string& text) {
  bool ok = !text.empty();
  size_t start = (!text.empty() && text[0] == '-') ? 1 : 0;
  if (start == text.size()) ok = false;
  for (size_t i = start; ok && i < text.size(); ++i) {
    if (text[i] < '0' || text[i] > '9') ok = false;
  }
  int64_t value = 0;
  if (ok) {
    errno = 0;
    value = std::strtoll(text.c_str(), nullptr, 10);
    if (errno == ERANGE || value > INT32_MAX || value < INT32_MIN) ok = false;
  }
  if (!ok) {
    throw EnvError("worker environment: " + name + "='" + text +
                   "' is not an integer; " + kHowToStart);
  }
  return value;
}

bool parse_bool(const std::string& name, const std::string& text) {
  if (text == "1" || text == "True" || text == "true" || text == "TRUE") return true;
  if (text == "0" || text == "False" || text == "false" || text == "FALSE" || text.empty()) {
    return false;
  }
  throw EnvError("worker environment: " + name + "='" + text +
                 "' is not a boolean (use 1/0 or True/False)");
}

// A launched worker cannot do without RANK and WORLD_SIZE, nor MASTER_ADDR and MASTER_PORT when
// the world has more than one process. Throws EnvError naming every one that is missing.
void require_launcher_variables(const std::optional<int64_t>& rank, const std::optional<int64_t>& world,
                                const std::optional<std::string>& addr, const std::optional<int64_t>& port) {
  std::vector<std::string> missing;
  if (!rank) missing.push_back("RANK");
  if (!world) missing.push_back("WORLD_SIZE");
  if (world && *world > 1) {
    if (!addr || addr->empty()) missing.push_back("MASTER_ADDR");
    if (!port) missing.push_back("MASTER_PORT");
  }
  if (missing.empty()) return;
  std::string list;
  for (size_t i = 0; i < missing.size(); ++i) list += (i ? ", " : "") + missing[i];
  throw EnvError("worker environment: some launcher variables are set but " + list +
                 (missing.size() == 1 ? " is" : " are") + " missing; " + kHowToStart);
}

}  // namespace

WorkerEnv WorkerEnv::from_environment() {
  detail::take_standby_assignment();  // a standby's environment is its assignment's (standby.h)
  return from_lookup([](const std::string& name) -> std::optional<std::string> {
    const char* value = std::getenv(name.c_str());
    if (value == nullptr) return std::nullopt;
    return std::string(value);
  });
}

WorkerEnv WorkerEnv::from_lookup(
    const std::function<std::optional<std::string>(const std::string&)>& lookup) {
  WorkerEnv env;
  auto get = [&](const char* name) { return lookup(name); };
  auto get_int = [&](const char* name) -> std::optional<int64_t> {
    auto text = get(name);
    if (!text) return std::nullopt;
    return parse_int(name, *text);
  };

  const auto rank = get_int("RANK");
  const auto world = get_int("WORLD_SIZE");
  const auto local_rank = get_int("LOCAL_RANK");
  const auto local_world = get_int("LOCAL_WORLD_SIZE");
  const auto addr = get("MASTER_ADDR");
  const auto port = get_int("MASTER_PORT");

  // Optional bookkeeping variables are read in both modes.
  env.restart_count = static_cast<int>(get_int("TORCHELASTIC_RESTART_COUNT").value_or(0));
  env.max_restarts = static_cast<int>(get_int("TORCHELASTIC_MAX_RESTARTS").value_or(0));
  env.run_id = get("TORCHELASTIC_RUN_ID").value_or("");
  if (auto g = get("DDPLAUNCH_GENERATION")) env.generation = parse_int("DDPLAUNCH_GENERATION", *g);
  if (auto s = get("TORCHELASTIC_USE_AGENT_STORE")) {
    env.use_agent_store = parse_bool("TORCHELASTIC_USE_AGENT_STORE", *s);
  }
  if (env.restart_count < 0) {
    throw EnvError("worker environment: TORCHELASTIC_RESTART_COUNT=" +
                   std::to_string(env.restart_count) + " is negative");
  }

  if (!rank && !world && !local_rank && !local_world && !addr && !port) {
    return env;  // no launcher: one process, world size 1
  }
  env.launched = true;

  require_launcher_variables(rank, world, addr, port);
  if (*world < 1) {
    throw EnvError("worker environment: WORLD_SIZE=" + std::to_string(*world) +
                   " must be at least 1");
  }
  if (*rank < 0 || *rank >= *world) {
    throw EnvError("worker environment: RANK=" + std::to_string(*rank) +
                   " is outside [0, WORLD_SIZE=" + std::to_string(*world) + ")");
  }
  env.rank = static_cast<int>(*rank);
  env.world_size = static_cast<int>(*world);
  // Without LOCAL_* every worker is assumed to be on this node (the manual multi-process
  // setup of the PyTorch tutorials); ddplaunch and torchrun always set both.
  env.local_world_size = static_cast<int>(local_world.value_or(*world));
  env.local_rank = static_cast<int>(local_rank.value_or(*rank));
  if (env.local_world_size < 1 || env.local_world_size > env.world_size) {
    throw EnvError("worker environment: LOCAL_WORLD_SIZE=" + std::to_string(env.local_world_size) +
                   " must be in [1, WORLD_SIZE=" + std::to_string(env.world_size) + "]");
  }
  if (env.local_rank < 0 || env.local_rank >= env.local_world_size) {
    throw EnvError("worker environment: LOCAL_RANK=" + std::to_string(env.local_rank) +
                   " is outside [0, LOCAL_WORLD_SIZE=" + std::to_string(env.local_world_size) +
                   ")");
  }
  env.group_rank = static_cast<int>(get_int("GROUP_RANK").value_or(0));
  if (addr) env.master_addr = *addr;
  if (port) {
    if (*port < 1 || *port > 65535) {
      throw EnvError("worker environment: MASTER_PORT=" + std::to_string(*port) +
                     " is not a TCP port (1..65535)");
    }
    env.master_port = static_cast<int>(*port);
  }
  return env;
}

std::string WorkerEnv::describe() const {
  std::ostringstream out;
  if (!launched) {
    out << "single process (no launcher variables)";
    return out.str();
  }
  out << "rank " << rank << "/" << world_size << " (local " << local_rank << "/"
      << local_world_size << ", node " << group_rank << ")";
  if (!master_addr.empty()) out << " master " << master_addr << ":" << master_port;
  out << " restart " << restart_count;
  if (generation) out << " generation " << *generation;
  return out.str();
}

}  // namespace ddp
