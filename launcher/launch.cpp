#include "launcher/launch.h"

#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <random>

#include "agent/fingerprint.h"
#include "agent/local_rendezvous.h"
#include "agent/logs.h"
#include "agent/remote_rendezvous.h"
#include "rendezvous/env_check.h"
#include "rendezvous/status.h"

namespace ddp::launcher {

namespace {

std::string hostname() {
  char buf[256] = {};
  if (::gethostname(buf, sizeof buf - 1) != 0) return "localhost";
  return buf;
}

// A random id in the shape of a UUID (--standalone without --rdzv_id, as torchrun does).
std::string random_run_id() {
  std::random_device rd;
  std::mt19937_64 gen((static_cast<std::uint64_t>(rd()) << 32) ^ rd());
  char buf[40];
  std::uint64_t a = gen(), b = gen();
  std::snprintf(buf, sizeof buf, "%08x-%04x-%04x-%04x-%012llx", static_cast<unsigned>(a >> 32),
                static_cast<unsigned>((a >> 16) & 0xffff), static_cast<unsigned>(a & 0xffff),
                static_cast<unsigned>(b >> 48), static_cast<unsigned long long>(b & 0xffffffffffffULL));
  return buf;
}

bool is_executable_file(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0 && S_ISREG(st.st_mode) && ::access(path.c_str(), X_OK) == 0;
}

// The path of `name` as execvp would find it; empty when not found.
std::string find_in_path(const std::string& name) {
  if (name.find('/') != std::string::npos) return is_executable_file(name) ? name : "";
  const char* path = std::getenv("PATH");
  std::string dirs = path ? path : "/usr/local/bin:/usr/bin:/bin";
  std::size_t start = 0;
  while (start <= dirs.size()) {
    std::size_t end = dirs.find(':', start);
    if (end == std::string::npos) end = dirs.size();
    std::string dir = dirs.substr(start, end - start);
    std::string candidate = (dir.empty() ? "." : dir) + "/" + name;
    if (is_executable_file(candidate)) return candidate;
    start = end + 1;
  }
  return "";
}

std::vector<int> per_rank_bits(const StdSpec& spec, int nproc) {
  std::vector<int> bits(nproc);
  for (int lr = 0; lr < nproc; ++lr) bits[lr] = spec.for_rank(lr);
  return bits;
}

std::string resolve_log_dir(const LaunchConfig& config) {
  if (!config.log_dir.empty()) return config.log_dir;
  char templ[] = "/tmp/ddplaunch_XXXXXX";
  const char* base = std::getenv("TMPDIR");
  std::string pattern = base && *base ? std::string(base) + "/ddplaunch_XXXXXX" : templ;
  std::vector<char> buf(pattern.begin(), pattern.end());
  buf.push_back('\0');
  if (!::mkdtemp(buf.data())) {
    throw UsageError("ddplaunch: cannot create a temporary log directory " + pattern + ": " +
                     std::strerror(errno) + "; pass --log_dir DIR");
  }
  std::string dir = buf.data();
  std::fprintf(stderr, "ddplaunch: log directory: %s (set --log_dir to choose it)\n", dir.c_str());
  return dir;
}

}  // namespace

bool uses_local_rendezvous(const LaunchConfig& config) {
  // --standalone hosts a real rendezvous server on a free loopback port (as torchrun does), so
  // `ddp-rendezvous status` can look at it; no rdzv flags at all needs no server.
  if (config.standalone) return false;
  return config.rdzv_backend == "static" || (config.max_nodes == 1 && config.rdzv_endpoint.empty());
}

std::string read_token(const LaunchConfig& config) {
  auto it = config.rdzv_conf.find("token_file");
  if (it == config.rdzv_conf.end() || it->second.empty()) {
    // Without --rdzv_conf token_file=, the environment may name the secret's file (docs/security.md).
    const char* env = std::getenv("DDPLAUNCH_RDZV_TOKEN_FILE");
    if (env == nullptr || *env == '\0') return "";
    LaunchConfig from_env = config;
    from_env.rdzv_conf["token_file"] = env;
    return read_token(from_env);
  }
  std::ifstream in(it->second);
  if (!in) {
    throw UsageError("ddplaunch: --rdzv_conf token_file=" + it->second + ": cannot read it: " +
                     std::strerror(errno) + "; give a readable file holding the job's shared token");
  }
  std::string token((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  while (!token.empty() && (token.back() == '\n' || token.back() == '\r' || token.back() == ' ')) {
    token.pop_back();
  }
  if (token.empty()) {
    throw UsageError("ddplaunch: --rdzv_conf token_file=" + it->second +
                     " is empty; write the job's shared token into it");
  }
  return token;
}

agent::FingerprintOptions fingerprint_options(const LaunchConfig& config) {
  agent::FingerprintOptions o;
  o.program = config.program;
  o.python = !config.no_python;
  o.module = config.module;
  o.python_exec = config.python;
  o.env_lock = config.env_lock;
  return o;
}

nlohmann::json node_fingerprint(const LaunchConfig& config) {
  try {
    return agent::compute_fingerprint(fingerprint_options(config));
  } catch (const agent::FingerprintError& e) {
    throw UsageError(std::string("ddplaunch: --env_lock: ") + e.what());
  }
}

std::unique_ptr<agent::RendezvousHandler> make_rendezvous(boost::asio::io_context& io,
                                                          const LaunchConfig& config) {
  if (!uses_local_rendezvous(config)) {
    agent::RemoteRendezvousOptions remote;
    remote.endpoint = config.rdzv_endpoint;
    remote.job_id = config.rdzv_id;
    remote.token = read_token(config);
    remote.connect_timeout = config.timeouts.join_timeout;
    remote.standalone = config.standalone;
    auto host = config.rdzv_conf.find("is_host");
    if (host != config.rdzv_conf.end()) {
      const std::string& v = host->second;
      remote.host_if_local = v == "1" || v == "true" || v == "True" || v == "yes" || v == "on";
    }
    try {
      return std::make_unique<agent::RemoteRendezvous>(io, remote);
    } catch (const std::invalid_argument& e) {
      throw UsageError("ddplaunch: --rdzv_endpoint=" + config.rdzv_endpoint + ": " + e.what() +
                       "; expected HOST:PORT");
    }
  }
  agent::LocalRendezvousOptions opts;
  opts.max_restarts = config.max_restarts;
  const bool multi_node_static = !config.standalone && config.max_nodes > 1;
  if (multi_node_static) {
    if (config.min_nodes != config.max_nodes) {
      throw UsageError("ddplaunch: --nnodes=" + std::to_string(config.min_nodes) + ":" +
                       std::to_string(config.max_nodes) +
                       " is elastic, but the static backend needs a fixed node count: give "
                       "--nnodes=N, or use --rdzv_backend=c10d with --rdzv_endpoint");
    }
    if (config.node_rank >= config.max_nodes) {
      throw UsageError("ddplaunch: --node_rank=" + std::to_string(config.node_rank) +
                       " is out of range for --nnodes=" + std::to_string(config.max_nodes) +
                       "; it must be 0.." + std::to_string(config.max_nodes - 1));
    }
    opts.nnodes = config.max_nodes;
    opts.node_rank = std::max(config.node_rank, 0);
    opts.master_addr = config.master_addr;
    opts.master_port = config.master_port;
  } else {
    opts.nnodes = 1;
    opts.node_rank = 0;
    opts.master_addr = config.master_addr.empty() ? "127.0.0.1" : config.master_addr;
    opts.master_port = config.master_port_given ? config.master_port : 0;  // 0: a fresh one per round
  }
  return std::make_unique<agent::LocalRendezvous>(io, opts);
}

agent::AgentOptions make_agent_options(const LaunchConfig& config, const std::string& log_dir,
                                       const std::string& run_id) {
  agent::AgentOptions o;
  o.node.job_id = run_id;
  o.node.host = hostname();
  o.node.addr = config.local_addr;
  o.node.local_world_size = config.nproc_per_node;
  o.node.requested_rank = config.node_rank;
  o.node.min_nodes = config.min_nodes;
  o.node.max_nodes = config.max_nodes;
  o.node.max_restarts = config.max_restarts;
  o.node.env_check = config.env_check;
  o.node.timeouts = config.timeouts;
  o.node.timeouts.shutdown_timeout = config.shutdown_timeout;
  o.command.python = config.python;
  o.command.no_python = config.no_python;
  o.command.module = config.module;
  o.command.run_path = config.run_path;
  o.command.program = config.program;
  o.command.args = config.program_args;
  o.role = config.role;
  o.run_id = run_id;
  o.log_dir = log_dir;
  o.redirects = per_rank_bits(config.redirects, config.nproc_per_node);
  o.tee = per_rank_bits(config.tee, config.nproc_per_node);
  o.local_ranks_filter = config.local_ranks_filter;
  if (const char* t = std::getenv("TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE")) o.line_prefix_template = t;
  o.shutdown_timeout = config.shutdown_timeout;
  if (!config.signals_to_handle.empty()) o.signals = config.signals_to_handle;
  // A single node picks a fresh MASTER_PORT per round unless --master_port was given; the
  // static backend across nodes uses --master_port on every node.
  const bool single_node = config.standalone || config.max_nodes == 1;
  o.pick_master_port = single_node ? !config.master_port_given : !uses_local_rendezvous(config);
  o.master_port_bind_addr = uses_local_rendezvous(config) ? "127.0.0.1" : "0.0.0.0";
  return o;
}

void check_program(const LaunchConfig& config) {
  if (config.program.empty()) {
    throw UsageError("ddplaunch: no training program given; usage: ddplaunch [options] "
                     "TRAINING_SCRIPT [ARGS...] (see --help)");
  }
  if (config.no_python) {
    if (find_in_path(config.program).empty()) {
      throw UsageError("ddplaunch: --no_python program " + config.program +
                       (config.program.find('/') == std::string::npos ? " was not found in PATH"
                                                                       : " does not exist or is not executable") +
                       "; give a path to an executable file");
    }
    return;
  }
  if (find_in_path(config.python).empty()) {
    throw UsageError("ddplaunch: Python interpreter " + config.python +
                     " was not found; set --python or $PYTHON_EXEC to an interpreter path, or use --no_python");
  }
  if (!config.module) {
    struct stat st {};
    if (::stat(config.program.c_str(), &st) != 0 || S_ISDIR(st.st_mode)) {
      throw UsageError("ddplaunch: training script " + config.program +
                       " does not exist; give the path of a Python file, -m MODULE for a module, "
                       "or --no_python for an executable");
    }
  }
}

int check_env(const LaunchConfig& config) {
  nlohmann::json mine = node_fingerprint(config);
  std::fputs(agent::render_fingerprint_table(mine).c_str(), stdout);
  if (config.rdzv_endpoint.empty() || config.rdzv_id.empty() || config.rdzv_id == "none") {
    return static_cast<int>(ExitCode::kSuccess);
  }
  // Compare against the nodes already in that job, as the rendezvous would.
  auto result = rdzv::query_status(config.rdzv_endpoint, read_token(config), 10.0);
  if (!result.error.empty()) {
    std::fprintf(stderr, "ddplaunch: --check_env: %s\n", result.error.c_str());
    return static_cast<int>(ExitCode::kRendezvousFailed);
  }
  std::vector<rdzv::NodeFingerprint> nodes;
  nodes.push_back({"this node", config.local_addr, mine});
  std::map<std::string, int> host_uses;  // agents sharing a host name are told apart by address
  for (const auto& job : result.status.value("jobs", nlohmann::json::array())) {
    if (job.value("job_id", "") != config.rdzv_id) continue;
    for (const auto& node : job.value("nodes", nlohmann::json::array())) {
      if (!node.contains("fingerprint")) continue;
      nodes.push_back({node.value("host", "?"), node.value("addr", ""), node["fingerprint"]});
      ++host_uses[nodes.back().name];
    }
  }
  for (auto& node : nodes) {
    if (host_uses[node.name] > 1 && !node.addr.empty()) {
      node.name += " (" + node.addr + ")";
      node.addr.clear();
    }
  }
  if (nodes.size() == 1) {
    std::printf("\nno node of job %s is known to %s yet: nothing to compare\n", config.rdzv_id.c_str(),
                config.rdzv_endpoint.c_str());
    return static_cast<int>(ExitCode::kSuccess);
  }
  auto cmp = rdzv::compare_fingerprints(nodes);
  if (cmp.empty()) {
    std::printf("\nthis node matches the %zu node(s) of job %s\n", nodes.size() - 1, config.rdzv_id.c_str());
    return static_cast<int>(ExitCode::kSuccess);
  }
  std::printf("\n%s\n", cmp.message().c_str());
  return cmp.has_breaking() ? static_cast<int>(ExitCode::kRendezvousFailed)
                            : static_cast<int>(ExitCode::kSuccess);
}

int launch(const LaunchConfig& config) {
  if (config.check_env) return check_env(config);
  check_program(config);
  boost::asio::io_context io(1);
  auto rendezvous = make_rendezvous(io, config);
  std::string run_id = config.rdzv_id;
  if (config.standalone && (run_id.empty() || run_id == "none")) run_id = random_run_id();
  if (run_id.empty()) run_id = "none";
  const std::string log_dir = resolve_log_dir(config);
  agent::AgentOptions options = make_agent_options(config, log_dir, run_id);
  // The fingerprint is computed before the agent reaps children (its probe waits on its own
  // child) and only where a rendezvous compares nodes.
  if (!uses_local_rendezvous(config) && config.env_check != "off" && !config.standalone) {
    options.node.fingerprint = node_fingerprint(config);
  }
  agent::Agent agent(io, std::move(options), std::move(rendezvous));
  return agent.run();
}

}  // namespace ddp::launcher
