#include "launcher/launch.h"

#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <thread>

#include <boost/asio/ip/address.hpp>
#include <boost/asio/ip/udp.hpp>
#include <boost/filesystem.hpp>

#include "agent/fingerprint.h"
#include "agent/local_rendezvous.h"
#include "agent/logs.h"
#include "agent/progress_line.h"
#include "agent/remote_rendezvous.h"
#include "rendezvous/env_check.h"
#include "rendezvous/fingerprint_schema.h"
#include "launcher/metrics_endpoint.h"
#include "metrics/event.h"
#include "rendezvous/status.h"

namespace ddp::launcher {

namespace {

std::string hostname() {
  char buf[256] = {};
  if (::gethostname(buf, sizeof buf - 1) != 0) return "localhost";
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
    throw LaunchError(ExitCode::kUsage, "ddplaunch: cannot create a temporary log directory " + pattern + ": " +
                     std::strerror(errno) + "; pass --log_dir DIR");
  }
  std::string dir = buf.data();
  std::fprintf(stderr, "ddplaunch: log directory: %s (set --log_dir to choose it)\n", dir.c_str());
  return dir;
}

// A run without --rdzv_id ("none") writes its logs into a folder of its own under
// --log_dir, <log_dir>/none_XXXXXX (torchrun's DefaultLogsSpecs makes <run_id>_<random> too), so
// that a second run never appends to the first one's files. A run with an id keeps
// <log_dir>/<id>, the one place every node and every restart of that job write to. A fresh
// temporary log root needs no sub-folder of its own.
std::string log_subdir(const LaunchConfig& config, const std::string& log_dir, const std::string& run_id) {
  if (config.log_dir.empty() || run_id != "none") return run_id;
  boost::system::error_code ec;
  boost::filesystem::create_directories(log_dir, ec);
  if (ec) throw LaunchError(ExitCode::kUsage, "ddplaunch: --log_dir=" + log_dir + ": cannot create it: " + ec.message());
  std::string pattern = log_dir + "/none_XXXXXX";
  std::vector<char> buf(pattern.begin(), pattern.end());
  buf.push_back('\0');
  if (!::mkdtemp(buf.data())) {
    throw LaunchError(ExitCode::kUsage, "ddplaunch: --log_dir=" + log_dir +
                                            ": cannot create a folder for this run's logs in it: " + std::strerror(errno));
  }
  return boost::filesystem::path(buf.data()).filename().string();
}

}  // namespace

bool uses_local_rendezvous(const LaunchConfig& config) {
  // --standalone hosts a real rendezvous server on a free loopback port (as torchrun does), so
  // `ddp-rendezvous status` can look at it; no rdzv flags at all needs no server.
  if (config.standalone) return false;
  if (config.rdzv_backend == RendezvousBackend::kEtcd || config.rdzv_backend == RendezvousBackend::kEtcdV2) return false;
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
    throw LaunchError(ExitCode::kUsage, "ddplaunch: --rdzv_conf token_file=" + path + ": cannot read it: " +
                     std::strerror(errno) + "; give a readable file holding the job's shared token");
  }
  std::string token((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  while (!token.empty() && (token.back() == '\n' || token.back() == '\r' || token.back() == ' ')) {
    token.pop_back();
  }
  if (token.empty()) {
    throw LaunchError(ExitCode::kUsage, "ddplaunch: --rdzv_conf token_file=" + path +
                     " is empty; write the job's shared token into it");
  }
  return token;
}

// The TLS settings of --rdzv_conf tls_ca=,tls_cert=,tls_key= (else $DDPLAUNCH_RDZV_TLS_CA, _CERT,
// _KEY), loaded; null when none is set (plain TCP). Throws LaunchError naming the bad file.
std::shared_ptr<rdzv::TlsContext> rendezvous_tls(const LaunchConfig& config) {
  const auto pick = [](const std::string& conf, const char* variable) {
    if (!conf.empty()) return conf;
    const char* env = std::getenv(variable);
    return std::string(env ? env : "");
  };
  rdzv::TlsFiles files;
  files.ca = pick(config.tls_ca, "DDPLAUNCH_RDZV_TLS_CA");
  files.cert = pick(config.tls_cert, "DDPLAUNCH_RDZV_TLS_CERT");
  files.key = pick(config.tls_key, "DDPLAUNCH_RDZV_TLS_KEY");
  if (files.ca.empty() && files.cert.empty() && files.key.empty()) return nullptr;
  Expected<std::shared_ptr<rdzv::TlsContext>> context = rdzv::TlsContext::for_client(files);
  if (!context) throw LaunchError(ExitCode::kUsage, std::string("ddplaunch: --rdzv_conf ") + context.error());
  return std::move(*context);
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
  Expected<nlohmann::json> fingerprint = agent::compute_fingerprint(fingerprint_options(config, program));
  if (!fingerprint) throw LaunchError(ExitCode::kUsage, "ddplaunch: --env_lock: " + fingerprint.error());
  return std::move(*fingerprint);
}

namespace {

// How the workers' interpreter was chosen, for messages (docs/cli.md "Which Python").
std::string interpreter_origin(const LaunchConfig& config) {
  if (config.python_of_environment) return "the Python of ddplaunch's own environment";
  if (config.python == "python3") return "the first python3 on PATH";
  const char* exec = std::getenv("PYTHON_EXEC");
  if (exec != nullptr && config.python == exec) return "from $PYTHON_EXEC";
  return "from --python";
}

// Why Python workers could not import torch with the interpreter they would run, from
// the fingerprint's interpreter probe (cached). Empty when they can, when the workers are not
// Python, or when the probe itself gave no answer (then the workers will say what is wrong).
std::string torch_problem(const LaunchConfig& config, const ResolvedProgram& program) {
  if (program.run_as == RunAs::kExecutable) return {};
  nlohmann::json py;
  try {
    py = agent::interpreter_fingerprint(fingerprint_options(config, program));
  } catch (const std::exception&) {
    return {};
  }
  if (!py.is_object() || py.contains("error")) return {};
  auto torch = py.find("torch");
  if (torch == py.end() || !torch->is_null()) return {};
  const std::string executable = py.value("executable", config.python);
  return "the Python that would run the workers, " + executable + " (" + interpreter_origin(config) +
         "), cannot import torch: " + py.value("torch_error", std::string("import torch failed")) +
         ". Nothing was started. Name an interpreter that has torch with --python=PATH or PYTHON_EXEC=PATH, "
         "or activate the environment that has torch so that its python3 comes first on PATH; pass "
         "--no_python if PROGRAM is not a Python script";
}

}  // namespace

namespace {

// The address this node reaches `endpoint` ("http://HOST:PORT") from: the source
// address the kernel's routing picks for it (a UDP socket's connect sends nothing). "" when the
// host does not resolve.
std::string address_towards(const std::string& endpoint) {
  const auto scheme = endpoint.find("//");
  const Expected<Endpoint> parsed =
      rdzv::parse_endpoint(endpoint.substr(scheme == std::string::npos ? 0 : scheme + 2), 2379);
  if (!parsed) return "";
  const Endpoint& target = *parsed;
  boost::asio::io_context io;
  boost::asio::ip::udp::resolver resolver(io);
  boost::system::error_code ec;
  auto results = resolver.resolve(target.host, std::to_string(target.port), ec);
  if (ec) return "";
  for (const auto& entry : results) {
    boost::asio::ip::udp::socket socket(io);
    socket.open(entry.endpoint().protocol(), ec);
    if (ec) continue;
    socket.connect(entry.endpoint(), ec);
    if (ec) continue;
    const auto local = socket.local_endpoint(ec);
    if (!ec) return local.address().to_string();
  }
  return "";
}

std::string read_first_line(const std::string& path, const char* what) {
  std::ifstream in(path);
  std::string line;
  if (!in || !std::getline(in, line) || line.empty()) {
    throw LaunchError(ExitCode::kUsage, std::string("ddplaunch: --rdzv_conf ") + what + "=" + path + ": cannot read it" +
                     (in ? std::string(" (it is empty)") : ": " + std::string(std::strerror(errno))));
  }
  return line;
}

// Reads `key` until etcd answers, for up to etcd_timeout (every endpoint in turn, again every
// 200 ms): an unreachable etcd is a failed rendezvous (exit 3) at once, not a join_timeout later.
void wait_for_etcd(const LaunchConfig& config, rdzv::EtcdOptions options, const std::string& key) {
  const EtcdRendezvousConfig& c = config.etcd;
  std::string endpoints;
  for (const auto& e : c.endpoints) endpoints += (endpoints.empty() ? "" : ",") + e;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(c.timeout);
  rdzv::EtcdStatus status;
  for (;;) {
    const double left = std::chrono::duration<double>(deadline - std::chrono::steady_clock::now()).count();
    options.call_timeout = std::max(left, 0.05);
    rdzv::EtcdClient etcd(options);
    if (!etcd.config_error().empty()) {
      throw LaunchError(ExitCode::kUsage, "ddplaunch: --rdzv_endpoint=" + endpoints + ": " + etcd.config_error());
    }
    status = etcd.range(key).status;
    // etcd itself answered with an error (permission denied, ...): asking again changes nothing.
    if (status.ok() || (status.code != 0 && status.code != 14)) break;
    if (std::chrono::steady_clock::now() + std::chrono::milliseconds(200) >= deadline) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
  }
  if (!status.ok()) {
    throw LaunchError(ExitCode::kRendezvousFailed,
                      "ddplaunch: --rdzv_backend=" + std::string(backend_name(config.rdzv_backend)) + ": etcd at " +
                          endpoints + " did not answer within " +
                          std::to_string(static_cast<long long>(std::ceil(c.timeout))) +
                          " s (--rdzv_conf etcd_timeout): " + status.error +
                          ". Check --rdzv_endpoint (etcd's client URL, port 2379 by default) and that etcd runs");
  }
}

// The replica this agent hosts with --rdzv_backend=etcd / etcd-v2 (docs/etcd.md "Agents on
// etcd"), once etcd has answered.
agent::EtcdReplicaOptions etcd_replica(const LaunchConfig& config) {
  const EtcdRendezvousConfig& c = config.etcd;
  agent::EtcdReplicaOptions r;
  r.etcd.endpoints = c.endpoints;
  r.etcd.user = c.user;
  if (!c.password_file.empty()) r.etcd.password = read_first_line(c.password_file, "etcd_password_file");
  r.etcd.ca_file = c.ca_file;
  r.etcd.cert_file = c.cert_file;
  r.etcd.key_file = c.key_file;
  r.prefix = c.prefix + config.rdzv_id + "/";
  r.lease_ttl = c.lease_ttl;
  wait_for_etcd(config, r.etcd, r.prefix + "leader");
  // Where this node's replica listens and what the leader key names: --local_addr (an address:
  // listen there; a name: listen everywhere), else the address this node reaches etcd from.
  boost::system::error_code ec;
  if (!config.local_addr.empty()) {
    boost::asio::ip::make_address(config.local_addr, ec);
    r.listen_addr = ec ? "0.0.0.0" : config.local_addr;
    r.advertise_host = config.local_addr;
  } else {
    r.listen_addr = address_towards(c.endpoints.front());
    if (r.listen_addr.empty()) r.listen_addr = "0.0.0.0";
    r.advertise_host = r.listen_addr == "0.0.0.0" ? hostname() : r.listen_addr;
  }
  return r;
}

}  // namespace

std::unique_ptr<agent::RendezvousHandler> make_rendezvous(boost::asio::io_context& io, const LaunchConfig& config,
                                                          std::shared_ptr<metrics::EventSink> hosted_events) {
  if (config.rdzv_backend == RendezvousBackend::kEtcd || config.rdzv_backend == RendezvousBackend::kEtcdV2) {
    agent::RemoteRendezvousOptions remote;
    remote.job_id = config.rdzv_id;
    remote.token = read_token(config);
    remote.connect_timeout = config.timeouts.join_timeout;
    remote.reconnect_timeout = config.reconnect_timeout;
    remote.host_if_local = false;
    remote.log = [](const std::string& line) { agent::say(line); };
    remote.progress = &agent::ProgressLine::console();
    const char* server_log = std::getenv("DDPLAUNCH_RDZV_SERVER_LOG");
    remote.echo_server_log = server_log != nullptr && *server_log != '\0' && std::string(server_log) != "0";
    remote.etcd_replica = etcd_replica(config);
    return std::make_unique<agent::RemoteRendezvous>(io, remote);
  }
  if (!uses_local_rendezvous(config)) {
    agent::RemoteRendezvousOptions remote;
    if (config.rdzv_endpoint) remote.endpoints.push_back(*config.rdzv_endpoint);
    for (const Endpoint& standby : config.rdzv_standby_endpoints) remote.endpoints.push_back(standby);
    remote.job_id = config.rdzv_id;
    remote.token = read_token(config);
    remote.tls = rendezvous_tls(config);
    remote.connect_timeout = config.timeouts.join_timeout;
    remote.reconnect_timeout = config.reconnect_timeout;
    remote.standalone = config.standalone;
    // Through the agent's bounded console queue: a stalled console must not stop heartbeats.
    remote.log = [](const std::string& line) { agent::say(line); };
    // Every wait shows its progress; the hosted server's own log only when asked.
    remote.progress = &agent::ProgressLine::console();
    const char* server_log = std::getenv("DDPLAUNCH_RDZV_SERVER_LOG");
    remote.echo_server_log = server_log != nullptr && *server_log != '\0' && std::string(server_log) != "0";
    if (config.is_host) remote.host_if_local = *config.is_host;
    remote.hosted_events = std::move(hosted_events);
    return std::make_unique<agent::RemoteRendezvous>(io, remote);
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

// Where the `ddplaunch` Python helper is: installed beside the binary
// (<prefix>/bin/ddplaunch -> <prefix>/share/ddplaunch/python or <prefix>/lib/ddplaunch/python),
// else the source tree's python/ (a build that was not installed). Empty when none has it.
std::string python_helper_dir() {
  namespace fs = boost::filesystem;
  boost::system::error_code ec;
  const fs::path exe = fs::read_symlink("/proc/self/exe", ec);
  std::vector<fs::path> candidates;
  if (!ec) {
    const fs::path prefix = exe.parent_path().parent_path();
    candidates = {prefix / "share" / "ddplaunch" / "python", prefix / "lib" / "ddplaunch" / "python"};
  }
#ifdef DDPLAUNCH_SOURCE_PYTHON_DIR
  candidates.emplace_back(DDPLAUNCH_SOURCE_PYTHON_DIR);
#endif
  for (const auto& dir : candidates) {
    if (fs::exists(dir / "ddplaunch" / "__init__.py", ec)) return dir.string();
  }
  return {};
}

// torchrun's TORCHELASTIC_ENABLE_FILE_TIMER=1: the FIFO named by TORCHELASTIC_TIMER_FILE, else
// one in the log directory. Empty when the watchdog is not enabled.
std::string file_timer_path(const std::string& log_dir) {
  const char* enabled = std::getenv("TORCHELASTIC_ENABLE_FILE_TIMER");
  if (enabled == nullptr || std::string(enabled) != "1") return {};
  const char* path = std::getenv("TORCHELASTIC_TIMER_FILE");
  if (path != nullptr && *path != '\0') return path;
  return log_dir + "/watchdog_timer_" + std::to_string(::getpid());
}

// --log_dedup collapses the lines of several local ranks: with fewer than two ranks on the
// console (one worker, --local_ranks_filter, --redirects without --tee) it has nothing to do,
// and says so once.
void say_if_log_dedup_has_nothing_to_collapse(const agent::AgentOptions& o) {
  int on_console = 0;
  for (int lr = 0; lr < o.node.local_world_size; ++lr) {
    const auto& filter = o.local_ranks_filter;
    if (!filter.empty() && std::find(filter.begin(), filter.end(), lr) == filter.end()) continue;
    const int redirected = lr < static_cast<int>(o.redirects.size()) ? o.redirects[lr] : agent::kStdNone;
    const int teed = lr < static_cast<int>(o.tee.size()) ? o.tee[lr] : agent::kStdNone;
    if ((~redirected | teed) & agent::kStdAll) ++on_console;
  }
  if (on_console >= 2) return;
  std::fprintf(stderr,
               "ddplaunch: --log_dedup: %s of this node's workers reach%s the console (--nproc_per_node, "
               "--local_ranks_filter, --redirects), so there is no line to collapse; it collapses a line "
               "that several local ranks print alike\n",
               on_console == 0 ? "none" : "only one", on_console == 0 ? "" : "es");
}

// --straggler compares the busy time per step of a job's nodes. Said at start-up when a
// --straggler flag was given and there is nothing to compare: one node, or the static backend
// (no rendezvous sees several); or a program that reports no busy time (neither run by Python nor
// marked as a worker SDK program), whose node is then never compared.
void say_what_straggler_detection_compares(const LaunchConfig& config, const agent::AgentOptions& o) {
  if (!config.straggler_given || config.straggler.mode == "off") return;
  const bool one_node = config.max_nodes == 1 && !config.spare;
  if (one_node || config.rdzv_backend == RendezvousBackend::kStatic) {
    std::fprintf(stderr,
                 "ddplaunch: --straggler: %s, so there is no node to compare this one with; it compares the busy "
                 "time of a job's nodes: give --nnodes above 1 and a rendezvous (--rdzv_backend=c10d or etcd)\n",
                 one_node ? "this job has one node (--nnodes=1)" : "the static rendezvous backend compares nothing");
  } else if (o.command.no_python && !has_elf_section(o.command.program, kStandbyMarkSection)) {
    std::fprintf(stderr,
                 "ddplaunch: --straggler: %s is not run by Python, so its busy time per step is known only if it "
                 "reports it through the worker SDK (ddp::Trainer, or ddp::Progress::busy); a node whose workers "
                 "report none is not compared\n",
                 o.command.program.c_str());
  }
}

// --standby: on for Python programs and for programs that link the worker SDK (the
// ELF mark of launcher/program.h) when asked ('on') or by 'auto', the default; everything else
// starts cold, with a line when 'on' was asked for. 'auto' starts the first round cold and keeps
// standbys from its first step on, so that a short job never waits for them; 'on' also starts
// the first round from standbys. --preload without a Python standby is said too. The
// program's file is read only when a standby was asked for.
void resolve_standby(const LaunchConfig& config, agent::AgentOptions& o) {
  const bool asked = config.standby != LaunchConfig::Standby::kOff;
  const char* why_not = nullptr;
  if (!asked) {
    why_not = "not asked for";
  } else if (o.command.no_python) {
    if (!has_elf_section(o.command.program, kStandbyMarkSection)) {
      why_not = "PROGRAM is neither run by Python nor a program of the worker SDK that waits for its assignment";
    }
  } else if (o.python_helper_dir.empty() || !boost::filesystem::exists(o.python_helper_dir + "/ddplaunch_standby.py")) {
    why_not = "its Python bootstrap (ddplaunch_standby.py) is not installed";
  }
  o.standby = why_not == nullptr;
  o.standby_first_round = o.standby && config.standby == LaunchConfig::Standby::kOn;
  o.preload = config.preload;
  if (config.standby == LaunchConfig::Standby::kOn && why_not != nullptr) {
    std::fprintf(stderr,
                 "ddplaunch: --standby=on: %s; its workers start cold (standbys are for Python programs and "
                 "worker SDK programs)\n",
                 why_not);
  }
  if (!config.preload.empty() && (!o.standby || o.command.no_python)) {
    std::fprintf(stderr, "ddplaunch: --preload has no effect without a Python standby (--standby=on|auto, Python programs)\n");
  }
}

// --hang_timeout watches the steps workers report. A Python worker reports every optimizer step
// with no code change (python/ddplaunch_autostart.py); another program only through the worker
// SDK. One that is neither run by Python nor marked as an SDK program is said at start-up: it may
// well report nothing, and then nothing is watched.
void say_what_hang_detection_watches(const agent::AgentOptions& o) {
  if (!o.hang.enabled() || !o.command.no_python || has_elf_section(o.command.program, kStandbyMarkSection)) return;
  std::fprintf(stderr,
               "ddplaunch: --hang_timeout: %s is not run by Python, so it is watched only if it reports its steps "
               "through the worker SDK (ddp::Progress or ddp::Trainer); a worker that reports none is never "
               "declared hung\n",
               o.command.program.c_str());
}

// --in_memory_restart: 'auto' is on for programs that link the worker SDK (the ELF
// mark --standby uses), which speak the worker channel; Python programs do not. 'on' gives every
// worker the channel: a program that never says it is restartable is stopped as without it.
void resolve_in_memory_restart(const LaunchConfig& config, agent::AgentOptions& o) {
  switch (config.in_memory_restart) {
    case LaunchConfig::InMemoryRestart::kOff:
      o.in_memory_restart = false;
      break;
    case LaunchConfig::InMemoryRestart::kOn:
      o.in_memory_restart = true;
      break;
    case LaunchConfig::InMemoryRestart::kAuto:
      // Programs that speak the channel: those that link the worker SDK, and Python scripts that
      // use ddplaunch.InMemoryRestart or ddplaunch.restartable (python/ddplaunch/). Any other
      // program would only inherit one more descriptor.
      if (o.command.no_python) {
        o.in_memory_restart = has_elf_section(o.command.program, kStandbyMarkSection);
      } else {
        o.in_memory_restart = !o.command.module && !o.command.run_path &&
                              (file_contains(o.command.program, kPythonInMemoryRestart) ||
                               file_contains(o.command.program, kPythonRestartable));
      }
      break;
  }
}

agent::AgentOptions make_agent_options(const LaunchConfig& config, const ResolvedProgram& program,
                                       const std::string& log_dir, const std::string& run_id) {
  agent::AgentOptions o;
  o.node.job_id = run_id;
  o.node.host = hostname();
  o.node.addr = config.local_addr;
  o.node.local_world_size = config.nproc_per_node;
  o.node.requested_rank = config.node_rank;
  o.node.spare = config.spare;
  o.node.min_nodes = config.min_nodes;
  o.node.max_nodes = config.max_nodes;
  o.node.max_restarts = config.max_restarts;
  o.node.env_check = env_check_name(config.env_check);
  o.node.timeouts = config.timeouts;
  o.node.straggler = config.straggler;
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
  o.log_dedup = config.log_dedup;
  o.log_dedup_window = std::chrono::milliseconds(std::llround(config.log_dedup_window * 1000));
  if (o.log_dedup) say_if_log_dedup_has_nothing_to_collapse(o);
  if (const char* t = std::getenv("TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE")) o.line_prefix_template = t;
  o.shutdown_timeout = config.timeouts.shutdown_timeout;
  o.virtual_local_rank = config.virtual_local_rank;
  o.duplicate_stdout_filters = config.duplicate_stdout_filters;
  o.duplicate_stderr_filters = config.duplicate_stderr_filters;
  if (!config.signals_to_handle.empty()) o.signals = config.signals_to_handle;
  o.hang = config.hang;
  o.max_restarts_without_progress = config.max_restarts_without_progress;
  o.no_restart_exit_codes = config.no_restart_exit_codes;
  o.python_helper_dir = python_helper_dir();
  resolve_standby(config, o);
  if (const char* t = std::getenv("DDPLAUNCH_STANDBY_READY_TIMEOUT"); t != nullptr && *t != '\0') {
    o.standby_ready_timeout = parse_seconds({t, "DDPLAUNCH_STANDBY_READY_TIMEOUT"});
  }
  if (const char* t = std::getenv("DDPLAUNCH_STANDBY_DELAY_MAX"); t != nullptr && *t != '\0') {
    o.standby_delay_max = parse_seconds({t, "DDPLAUNCH_STANDBY_DELAY_MAX"});
  }
  resolve_in_memory_restart(config, o);
  say_what_hang_detection_watches(o);
  say_what_straggler_detection_compares(config, o);
  o.health_check = config.health_check;
  o.health_check_interval = config.health_check_interval;
  o.file_timer_path = file_timer_path(log_dir);
  // A single node picks a fresh MASTER_PORT per round unless --master_port was given; the
  // static backend across nodes uses --master_port on every node.
  const bool single_node = config.standalone || config.max_nodes == 1;
  o.pick_master_port = single_node ? !config.master_port : !uses_local_rendezvous(config);
  o.master_port_bind_addr = uses_local_rendezvous(config) ? "127.0.0.1" : "0.0.0.0";
  // A line per round wherever nodes wait for each other (a lone node has no news).
  o.announce_rounds = !uses_local_rendezvous(config) || config.max_nodes > 1;
  return o;
}

std::vector<agent::NumaBinding> numa_plan(const LaunchConfig& config) {
  const char* mode = agent::numa_mode_name(*config.numa_binding);
  const Expected<agent::Topology> topology = agent::read_topology();
  Expected<std::vector<agent::NumaBinding>> plan =
      topology ? agent::plan_numa_bindings(*topology, *config.numa_binding, config.nproc_per_node)
               : unexpected(topology.error());
  if (!plan) throw LaunchError(ExitCode::kUsage, std::string("ddplaunch: --numa_binding=") + mode + ": " + plan.error());
  for (std::size_t rank = 0; rank < plan->size(); ++rank) {
    std::fprintf(stderr, "ddplaunch: --numa_binding=%s: local rank %zu on CPUs %s, memory node %d\n", mode, rank,
                 agent::cpu_list_string((*plan)[rank].cpus).c_str(), (*plan)[rank].memory_node);
  }
  return std::move(*plan);
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

namespace {

// Names the job's nodes apart: by host; by host and address where hosts repeat; and by
// node rank too where both repeat (two agents of one host on one address).
void name_nodes_apart(std::vector<rdzv::NodeFingerprint>& nodes, const std::vector<int>& ranks) {
  std::map<std::string, int> host_uses, addr_uses;
  for (const auto& node : nodes) {
    ++host_uses[node.name];
    ++addr_uses[node.name + "\n" + node.addr];
  }
  for (std::size_t i = 1; i < nodes.size(); ++i) {  // nodes[0] is "this node"
    auto& node = nodes[i];
    std::vector<std::string> parts;
    if (host_uses[node.name] > 1 && !node.addr.empty()) parts.push_back(node.addr);
    if (addr_uses[node.name + "\n" + node.addr] > 1) {
      parts.push_back(ranks[i] >= 0 ? "node rank " + std::to_string(ranks[i]) : "joining, #" + std::to_string(i));
    }
    if (parts.empty()) continue;
    std::string label;
    for (const auto& p : parts) label += (label.empty() ? "" : ", ") + p;
    node.name += " (" + label + ")";
    node.addr.clear();
  }
}

// Without PROGRAM, what depends on the program is left out of the comparison: its
// hash and libraries, and the Python section when the job's nodes run no Python.
void drop_program_facts(std::vector<rdzv::NodeFingerprint>& nodes) {
  const std::string program(rdzv::fingerprint::kProgram), python(rdzv::fingerprint::kPython);
  bool others_run_python = false;
  for (std::size_t i = 1; i < nodes.size(); ++i) others_run_python |= nodes[i].fingerprint.contains(python);
  for (auto& node : nodes) {
    if (node.fingerprint.is_object()) node.fingerprint.erase(program);
  }
  if (!others_run_python && nodes.size() > 1 && nodes[0].fingerprint.is_object()) nodes[0].fingerprint.erase(python);
}

}  // namespace

int check_env(const LaunchConfig& config) {
  // --check_env needs no PROGRAM; given one, it is hashed as the workers would run it.
  ResolvedProgram program{config.no_python ? RunAs::kExecutable
                          : config.module  ? RunAs::kModule
                                           : RunAs::kPython,
                          config.program, ""};
  std::string cannot_run;  // why this node cannot run the job (exit 2)
  if (!config.program.empty()) {
    try {
      program = resolve_program(program_request(config));
    } catch (const LaunchError& e) {
      cannot_run = e.what();  // still fingerprinted as given, so the table shows the rest
    }
  }
  nlohmann::json mine = node_fingerprint(config, program);
  std::fputs(agent::render_fingerprint_table(mine).c_str(), stdout);
  if (cannot_run.empty()) cannot_run = torch_problem(config, program);
  auto verdict = [&](int code, const std::string& text) {
    std::printf("\nverdict: %s\n", text.c_str());
    return code;
  };
  if (!cannot_run.empty()) {
    const std::string why = cannot_run.rfind("ddplaunch: ", 0) == 0 ? cannot_run.substr(11) : cannot_run;
    return verdict(static_cast<int>(ExitCode::kUsage), "this node cannot run the job: " + why);
  }
  if (config.rdzv_backend == RendezvousBackend::kEtcd || config.rdzv_backend == RendezvousBackend::kEtcdV2) {
    // No daemon to ask: the job's replicas exist only while its agents run (docs/etcd.md).
    return verdict(static_cast<int>(ExitCode::kSuccess),
                   std::string("this node can run the job (with --rdzv_backend=") + backend_name(config.rdzv_backend) +
                       " no daemon holds the job's nodes: they are compared when the round forms)");
  }
  if (!config.rdzv_endpoint || config.rdzv_id.empty() || config.rdzv_id == "none") {
    return verdict(static_cast<int>(ExitCode::kSuccess),
                   "this node can run the job (give --rdzv_endpoint and --rdzv_id to compare it with a job's nodes)");
  }
  // Compare against the nodes already in that job, as the rendezvous would.
  const std::string endpoint = config.rdzv_endpoint->text();
  auto result = rdzv::query_status(*config.rdzv_endpoint, read_token(config), 10.0, "", rendezvous_tls(config));
  if (!result.error.empty()) {
    std::fprintf(stderr, "ddplaunch: --check_env: %s\n", result.error.c_str());
    return verdict(static_cast<int>(ExitCode::kRendezvousFailed),
                   "unknown: the rendezvous at " + endpoint + " did not answer");
  }
  std::vector<rdzv::NodeFingerprint> nodes;
  std::vector<int> ranks;
  nodes.push_back({"this node", config.local_addr, mine});
  ranks.push_back(-1);
  for (const auto& job : result.status.value("jobs", nlohmann::json::array())) {
    if (job.value("job_id", "") != config.rdzv_id) continue;
    for (const auto& node : job.value("nodes", nlohmann::json::array())) {
      if (!node.contains("fingerprint")) continue;
      nodes.push_back({node.value("host", "?"), node.value("addr", ""), node["fingerprint"]});
      ranks.push_back(node.value("group_rank", -1));
    }
  }
  name_nodes_apart(nodes, ranks);
  if (config.program.empty()) drop_program_facts(nodes);
  if (nodes.size() == 1) {
    std::printf("\nno node of job %s is known to %s yet: nothing to compare\n", config.rdzv_id.c_str(),
                endpoint.c_str());
    return verdict(static_cast<int>(ExitCode::kSuccess), "this node can run the job; no node of job " +
                                                             config.rdzv_id + " to compare it with yet");
  }
  const std::string scope = config.program.empty() ? " (without PROGRAM: the program's files were not compared)" : "";
  auto cmp = rdzv::compare_fingerprints(nodes);
  if (cmp.empty()) {
    std::printf("\nthis node matches the %zu node(s) of job %s\n", nodes.size() - 1, config.rdzv_id.c_str());
    return verdict(static_cast<int>(ExitCode::kSuccess), "this node can join job " + config.rdzv_id + scope);
  }
  std::printf("\n%s\n", cmp.message().c_str());
  if (cmp.has_breaking()) {
    return verdict(static_cast<int>(ExitCode::kRendezvousFailed),
                   "this node cannot join job " + config.rdzv_id + " under --env_check=strict: the differences "
                   "above break a job" + scope);
  }
  return verdict(static_cast<int>(ExitCode::kSuccess), "this node can join job " + config.rdzv_id +
                                                           "; the differences above do not break a job" + scope);
}

int launch(const LaunchConfig& config) {
  if (!config.from_slurm.empty()) {
    std::string line;
    for (const std::string& item : config.from_slurm) line += (line.empty() ? "" : ", ") + item;
    std::fprintf(stderr, "ddplaunch: from Slurm: %s (flags and PET_ variables override these)\n",
                 line.c_str());
  }
  if (config.check_env) return check_env(config);
  // torchrun's run.py exports --signals_to_handle as it was given to its workers (their
  // @record handler reads it); the agent's workers inherit its environment.
  ::setenv("TORCHELASTIC_SIGNALS_TO_HANDLE", config.signals_to_handle_text.c_str(), 1);
  const ResolvedProgram program = resolve_program(program_request(config));
  if (!program.note.empty()) std::fprintf(stderr, "ddplaunch: %s\n", program.note.c_str());
  // --env_check=off promises no interpreter probe at all (docs/env-check.md): no torch check then.
  if (config.env_check != EnvCheckMode::kOff) {
    if (std::string problem = torch_problem(config, program); !problem.empty()) {
      throw LaunchError(ExitCode::kUsage, "ddplaunch: " + problem);
    }
  }
  boost::asio::io_context io(1);
  // Made first: a server the rendezvous hosts records into it from its start (the dashboard).
  const HostedEvents hosted = hosted_events(config);
  auto rendezvous = make_rendezvous(io, config, hosted.bus);
  std::string run_id = config.rdzv_id;
  if (run_id.empty()) run_id = "none";
  const std::string log_dir = resolve_log_dir(config);
  agent::AgentOptions options = make_agent_options(config, program, log_dir, run_id);
  options.log_subdir = log_subdir(config, log_dir, run_id);
  if (options.log_subdir != run_id) {
    std::fprintf(stderr, "ddplaunch: logs of this run: %s/%s (no --rdzv_id: a folder of its own)\n", log_dir.c_str(),
                 options.log_subdir.c_str());
  }
  if (config.numa_binding) options.numa_bindings = numa_plan(config);
  // The fingerprint is computed before the agent reaps children (its probe waits on its own
  // child) and only where a rendezvous compares nodes.
  if (!uses_local_rendezvous(config) && config.env_check != EnvCheckMode::kOff && !config.standalone) {
    options.node.fingerprint = node_fingerprint(config, program);
    options.env_digest = agent::environment_digest(options.node.fingerprint);
  } else if (config.env_check != EnvCheckMode::kOff) {
    // Alone, a node compares with no one, but its checkpoints still record which environment
    // wrote them: the interpreter probe is the one the torch check above made (cached).
    const Expected<nlohmann::json> environment = agent::environment_fingerprint(fingerprint_options(config, program));
    if (!environment) throw LaunchError(ExitCode::kUsage, "ddplaunch: --env_lock: " + environment.error());
    options.env_digest = agent::environment_digest(*environment);
  }
  // One event bus for the event log and the metrics; the metrics server on the agent's
  // io_context (docs/metrics.md).
  auto bus = std::make_shared<metrics::EventBus>();
  if (!config.event_log.empty()) {
    try {
      bus->add(std::make_shared<metrics::EventLog>(config.event_log));
    } catch (const std::runtime_error& e) {
      throw LaunchError(ExitCode::kUsage, std::string("ddplaunch: --event_log: ") + e.what());
    }
  }
  auto http = serve_metrics(io, config, *bus, options, *rendezvous, hosted);
  if (!bus->empty()) options.events = bus;
  agent::Agent agent(io, std::move(options), std::move(rendezvous));
  return agent.run();
}

}  // namespace ddp::launcher
