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
#include "agent/metrics.h"
#include "agent/local_rendezvous.h"
#include "agent/logs.h"
#include "agent/remote_rendezvous.h"
#include "rendezvous/env_check.h"
#include "metrics/event.h"
#include "metrics/exposition.h"
#include "metrics/http_server.h"
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
  return config.rdzv_backend == RendezvousBackend::kStatic ||
         (config.max_nodes == 1 && !config.rdzv_endpoint);
}

std::string read_token(const LaunchConfig& config) {
  std::string path = config.token_file;
  if (path.empty()) {
    // Without --rdzv_conf token_file=, the environment may name the secret's file (docs/security.md).
    const char* env = std::getenv("DDPLAUNCH_RDZV_TOKEN_FILE");
    if (env == nullptr || *env == '\0') return "";
    path = env;
  }
  std::ifstream in(path);
  if (!in) {
    throw UsageError("ddplaunch: --rdzv_conf token_file=" + path + ": cannot read it: " +
                     std::strerror(errno) + "; give a readable file holding the job's shared token");
  }
  std::string token((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  while (!token.empty() && (token.back() == '\n' || token.back() == '\r' || token.back() == ' ')) {
    token.pop_back();
  }
  if (token.empty()) {
    throw UsageError("ddplaunch: --rdzv_conf token_file=" + path +
                     " is empty; write the job's shared token into it");
  }
  return token;
}

agent::FingerprintOptions fingerprint_options(const LaunchConfig& config,
                                              const ResolvedProgram& program) {
  agent::FingerprintOptions o;
  o.program = program.path;
  o.python = program.run_as != RunAs::kExecutable;
  o.module = program.run_as == RunAs::kModule;
  o.python_exec = config.python;
  o.env_lock = config.env_lock;
  return o;
}

nlohmann::json node_fingerprint(const LaunchConfig& config, const ResolvedProgram& program) {
  try {
    return agent::compute_fingerprint(fingerprint_options(config, program));
  } catch (const agent::FingerprintError& e) {
    throw UsageError(std::string("ddplaunch: --env_lock: ") + e.what());
  }
}

std::unique_ptr<agent::RendezvousHandler> make_rendezvous(boost::asio::io_context& io,
                                                          const LaunchConfig& config) {
  if (!uses_local_rendezvous(config)) {
    agent::RemoteRendezvousOptions remote;
    remote.endpoint = config.rdzv_endpoint ? config.rdzv_endpoint->text() : "";
    for (const Endpoint& standby : config.rdzv_standby_endpoints) remote.endpoint += "," + standby.text();
    remote.job_id = config.rdzv_id;
    remote.token = read_token(config);
    remote.connect_timeout = config.timeouts.join_timeout;
    remote.reconnect_timeout = config.reconnect_timeout;
    remote.standalone = config.standalone;
    // Through the agent's bounded console queue: a stalled console must not stop heartbeats.
    remote.log = [](const std::string& line) { agent::OutputQueue::console().write(STDERR_FILENO, "[ddplaunch] " + line + "\n"); };
    if (config.is_host) remote.host_if_local = *config.is_host;
    try {
      return std::make_unique<agent::RemoteRendezvous>(io, remote);
    } catch (const std::invalid_argument& e) {
      throw UsageError("ddplaunch: --rdzv_endpoint=" + remote.endpoint + ": " + e.what() +
                       "; expected HOST:PORT");
    }
  }
  agent::LocalRendezvousOptions opts;
  opts.max_restarts = config.max_restarts;
  const bool multi_node_static = !config.standalone && config.max_nodes > 1;
  // resolve_rules() (config.cpp) has checked the static backend's node count and rank.
  if (multi_node_static) {
    opts.nnodes = config.max_nodes;
    opts.node_rank = std::max(config.node_rank, 0);
    opts.master_addr = config.master_addr;
    opts.master_port = config.master_port.value_or(29500);
  } else {
    opts.nnodes = 1;
    opts.node_rank = 0;
    opts.master_addr = config.master_addr.empty() ? "127.0.0.1" : config.master_addr;
    opts.master_port = config.master_port.value_or(0);  // 0: a fresh one per round
  }
  return std::make_unique<agent::LocalRendezvous>(io, opts);
}

agent::AgentOptions make_agent_options(const LaunchConfig& config, const ResolvedProgram& program,
                                       const std::string& log_dir, const std::string& run_id) {
  agent::AgentOptions o;
  o.node.job_id = run_id;
  o.node.host = hostname();
  o.node.addr = config.local_addr;
  o.node.local_world_size = config.nproc_per_node;
  o.node.requested_rank = config.node_rank;
  o.node.min_nodes = config.min_nodes;
  o.node.max_nodes = config.max_nodes;
  o.node.max_restarts = config.max_restarts;
  o.node.env_check = env_check_name(config.env_check);
  o.node.timeouts = config.timeouts;
  o.command.python = config.python;
  o.command.no_python = program.run_as == RunAs::kExecutable;
  o.command.module = program.run_as == RunAs::kModule;
  o.command.run_path = program.run_as == RunAs::kRunPath;
  o.command.program = program.path;
  o.command.args = config.program_args;
  o.role = config.role;
  o.run_id = run_id;
  o.log_dir = log_dir;
  o.redirects = per_rank_bits(config.redirects, config.nproc_per_node);
  o.tee = per_rank_bits(config.tee, config.nproc_per_node);
  o.local_ranks_filter = config.local_ranks_filter;
  if (const char* t = std::getenv("TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE")) o.line_prefix_template = t;
  o.shutdown_timeout = config.timeouts.shutdown_timeout;
  o.virtual_local_rank = config.virtual_local_rank;
  o.duplicate_stdout_filters = config.duplicate_stdout_filters;
  o.duplicate_stderr_filters = config.duplicate_stderr_filters;
  if (!config.signals_to_handle.empty()) o.signals = config.signals_to_handle;
  // A single node picks a fresh MASTER_PORT per round unless --master_port was given; the
  // static backend across nodes uses --master_port on every node.
  const bool single_node = config.standalone || config.max_nodes == 1;
  o.pick_master_port = single_node ? !config.master_port : !uses_local_rendezvous(config);
  o.master_port_bind_addr = uses_local_rendezvous(config) ? "127.0.0.1" : "0.0.0.0";
  return o;
}

std::vector<agent::NumaBinding> numa_plan(const LaunchConfig& config) {
  const char* mode = agent::numa_mode_name(*config.numa_binding);
  try {
    auto plan = agent::plan_numa_bindings(agent::read_topology(), *config.numa_binding,
                                          config.nproc_per_node);
    for (std::size_t rank = 0; rank < plan.size(); ++rank) {
      std::fprintf(stderr, "ddplaunch: --numa_binding=%s: local rank %zu on CPUs %s, memory node %d\n",
                   mode, rank, agent::cpu_list_string(plan[rank].cpus).c_str(), plan[rank].memory_node);
    }
    return plan;
  } catch (const agent::NumaError& e) {
    throw UsageError(std::string("ddplaunch: --numa_binding=") + mode + ": " + e.what());
  }
}

ProgramRequest program_request(const LaunchConfig& config) {
  ProgramRequest r;
  r.program = config.program;
  r.module = config.module;
  r.no_python = config.no_python;
  r.run_path = config.run_path;
  r.python = config.python;
  return r;
}

int check_env(const LaunchConfig& config) {
  // --check_env needs no PROGRAM; given one, it is hashed as the workers would run it.
  // A PROGRAM that cannot start is not this command's concern: it is recorded as given.
  ResolvedProgram program{config.no_python ? RunAs::kExecutable
                          : config.module  ? RunAs::kModule
                                           : RunAs::kPython,
                          config.program, ""};
  if (!config.program.empty()) {
    try {
      program = resolve_program(program_request(config));
    } catch (const UsageError&) {
    }
  }
  nlohmann::json mine = node_fingerprint(config, program);
  std::fputs(agent::render_fingerprint_table(mine).c_str(), stdout);
  if (!config.rdzv_endpoint || config.rdzv_id.empty() || config.rdzv_id == "none") {
    return static_cast<int>(ExitCode::kSuccess);
  }
  // Compare against the nodes already in that job, as the rendezvous would.
  const std::string endpoint = config.rdzv_endpoint->text();
  auto result = rdzv::query_status(endpoint, read_token(config), 10.0);
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
                endpoint.c_str());
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
  const ResolvedProgram program = resolve_program(program_request(config));
  if (!program.note.empty()) std::fprintf(stderr, "ddplaunch: %s\n", program.note.c_str());
  boost::asio::io_context io(1);
  auto rendezvous = make_rendezvous(io, config);
  std::string run_id = config.rdzv_id;
  if (config.standalone && (run_id.empty() || run_id == "none")) run_id = random_run_id();
  if (run_id.empty()) run_id = "none";
  const std::string log_dir = resolve_log_dir(config);
  agent::AgentOptions options = make_agent_options(config, program, log_dir, run_id);
  if (config.numa_binding) options.numa_bindings = numa_plan(config);
  // The fingerprint is computed before the agent reaps children (its probe waits on its own
  // child) and only where a rendezvous compares nodes.
  if (!uses_local_rendezvous(config) && config.env_check != EnvCheckMode::kOff && !config.standalone) {
    options.node.fingerprint = node_fingerprint(config, program);
  }
  // Issue 15: one event bus for the event log and the metrics; the metrics server on the agent's
  // io_context (docs/metrics.md).
  auto bus = std::make_shared<metrics::EventBus>();
  if (!config.event_log.empty()) {
    try {
      bus->add(std::make_shared<metrics::EventLog>(config.event_log));
    } catch (const std::runtime_error& e) {
      throw UsageError(std::string("ddplaunch: --event_log: ") + e.what());
    }
  }
  std::shared_ptr<agent::AgentMetrics> agent_metrics;
  std::unique_ptr<metrics::HttpServer> http;
  if (config.metrics_port) {
    agent_metrics = std::make_shared<agent::AgentMetrics>();
    bus->add(agent_metrics);
    boost::system::error_code ec;
    const auto addr = boost::asio::ip::make_address(config.metrics_addr, ec);
    if (ec) throw UsageError("ddplaunch: --metrics_addr " + config.metrics_addr + ": not an IP address");
    try {
      http = std::make_unique<metrics::HttpServer>(
          io, boost::asio::ip::tcp::endpoint(addr, static_cast<unsigned short>(*config.metrics_port)));
    } catch (const boost::system::system_error& e) {
      throw UsageError("ddplaunch: --metrics_port: cannot listen on " + config.metrics_addr + ":" +
                       std::to_string(*config.metrics_port) + ": " + e.code().message());
    }
    http->route("/metrics", [agent_metrics] {
      return metrics::HttpResponse{200, metrics::kExpositionContentType, agent_metrics->render()};
    });
    http->route("/healthz", [] { return metrics::HttpResponse{200, "text/plain; charset=utf-8", "ok\n"}; });
    http->route("/readyz", [agent_metrics] {
      return agent_metrics->running() > 0
                 ? metrics::HttpResponse{200, "text/plain; charset=utf-8", "workers running\n"}
                 : metrics::HttpResponse{503, "text/plain; charset=utf-8", "no worker running\n"};
    });
    std::fprintf(stderr, "ddplaunch: metrics on http://%s:%u/metrics\n", config.metrics_addr.c_str(),
                 static_cast<unsigned>(http->port()));
  }
  if (!bus->empty()) options.events = bus;
  agent::Agent agent(io, std::move(options), std::move(rendezvous));
  return agent.run();
}

}  // namespace ddp::launcher
