#include "launcher/launch.h"

#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <random>

#include "agent/local_rendezvous.h"
#include "agent/logs.h"

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
  return config.standalone || config.max_nodes == 1 || config.rdzv_backend == "static";
}

std::unique_ptr<agent::RendezvousHandler> make_rendezvous(boost::asio::io_context& io,
                                                          const LaunchConfig& config) {
  if (!uses_local_rendezvous(config)) {
    throw UsageError("ddplaunch: --rdzv_backend=" + config.rdzv_backend + " with --nnodes=" +
                     std::to_string(config.min_nodes) + ":" + std::to_string(config.max_nodes) +
                     " needs the multi-node rendezvous client, which this build does not include "
                     "yet; use --rdzv_backend=static with --master_addr/--master_port/--node_rank");
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

int launch(const LaunchConfig& config) {
  check_program(config);
  boost::asio::io_context io(1);
  auto rendezvous = make_rendezvous(io, config);
  std::string run_id = config.rdzv_id;
  if (config.standalone && (run_id.empty() || run_id == "none")) run_id = random_run_id();
  if (run_id.empty()) run_id = "none";
  const std::string log_dir = resolve_log_dir(config);
  agent::Agent agent(io, make_agent_options(config, log_dir, run_id), std::move(rendezvous));
  return agent.run();
}

}  // namespace ddp::launcher
