// The resolver: raw option values (launcher/command_line.h) to a typed LaunchConfig. Every rule
// that ties flags together is checked here, in resolve_rules(), once all values are known.
#include "launcher/config.h"

#include <algorithm>
#include <cctype>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <random>
#include <sstream>

#include <unistd.h>

#include "agent/devices.h"
#include "launcher/command_line.h"
#include "launcher/slurm.h"

namespace ddp::launcher {
namespace {

// The wheel's ddplaunch lives in an environment's site-packages (<env>/lib/pythonX.Y/site-packages/
// ddplaunch/bin), under that environment's python3 (a venv's, conda's): the Python its user
// installed it for, whose torch the workers should get, whatever comes first on PATH. Other
// builds (a source build, the Debian package's /usr/bin) keep torchrun's default, the first
// python3 on PATH. "" when not the wheel's, or when no python3 is there (pip install --user).
std::string environment_python() {
#ifdef DDPLAUNCH_WHEEL
  char exe[4096];
  const ssize_t n = ::readlink("/proc/self/exe", exe, sizeof exe - 1);
  if (n <= 0) return {};
  std::string dir(exe, static_cast<std::size_t>(n));
  dir.erase(dir.find_last_of('/'));
  for (int up = 0; up < 5; ++up) {  // bin, ddplaunch, site-packages, pythonX.Y, lib
    const auto slash = dir.find_last_of('/');
    if (slash == std::string::npos || slash == 0) return {};
    dir.erase(slash);
  }
  for (const char* name : {"/bin/python3", "/bin/python"}) {
    if (::access((dir + name).c_str(), X_OK) == 0) return dir + name;
  }
#endif
  return {};
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

// One of `names` (lower case), as its index; refuses anything else.
template <typename Enum>
Enum parse_choice(const Given& g, std::initializer_list<std::pair<const char*, Enum>> names,
                  const std::string& accepted) {
  const std::string value = lower(trim(g.value));
  for (const auto& [name, e] : names) {
    if (value == name) return e;
  }
  refuse(g.shown() + ": accepted: " + accepted);
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
  auto cpus = [&] { return context.count_cpus ? context.count_cpus() : agent::count_usable_cpus(); };
  if (spec == "cpu") {
    config.nproc_per_node = cpus();
    return;
  }
  if (spec == "xpu") {
    // torchrun: "Xpu is not available." unless torch sees Intel GPUs; we count NVIDIA GPUs only.
    refuse(g.shown() + ": no XPU is visible (ddplaunch counts NVIDIA GPUs only, as torchrun "
           "does without Intel's XPU runtime); use a count, gpu, cpu or auto");
  }
  if (spec == "gpu" || spec == "auto") {
    const int gpus = context.count_gpus ? context.count_gpus() : agent::count_visible_gpus();
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
    config.nproc_per_node = cpus();
    return;
  }
  config.nproc_per_node = parse_positive_count(g.value, g, accepted);
}

const char* const kKnownRdzvKeys =
    "join_timeout, last_call_timeout, heartbeat_interval, heartbeat_timeout, probe_timeout, "
    "keep_alive_interval, keep_alive_max_attempt, shutdown_timeout, reconnect_timeout, "
    "read_timeout, timeout, token_file, tls_ca, tls_cert, tls_key, is_host; with etcd backends: "
    "protocol, cacert (ca_cert), cert (ssl_cert), key (ssl_cert_key), etcd_prefix, etcd_lease_ttl, "
    "etcd_timeout, etcd_user, etcd_password_file";

bool is_etcd(RendezvousBackend b) { return b == RendezvousBackend::kEtcd || b == RendezvousBackend::kEtcdV2; }

// One --rdzv_conf key of the etcd backends (torchrun's etcd and etcd-v2 names, and ours); false
// when `key` is none of them.
bool parse_etcd_key(const std::string& key, const std::string& value, const Given& item, EtcdRendezvousConfig& etcd) {
  if (key == "protocol") {
    const std::string p = lower(value);
    if (p != "http" && p != "https") refuse(item.shown() + ": accepted: http, https");
    etcd.protocol = p;
  } else if (key == "cacert" || key == "ca_cert") {
    etcd.ca_file = value;
  } else if (key == "cert" || key == "ssl_cert") {
    etcd.cert_file = value;
  } else if (key == "key" || key == "ssl_cert_key") {
    etcd.key_file = value;
  } else if (key == "etcd_prefix") {
    if (value.front() != '/') refuse(item.shown() + ": an etcd key prefix starting with '/', e.g. /ddplaunch/jobs");
    etcd.prefix = value;
  } else if (key == "etcd_lease_ttl") {
    const auto ttl = to_integer(value);
    if (!ttl || *ttl < 2 || *ttl > 600) refuse(item.shown() + ": accepted: whole seconds from 2 to 600 (default 5)");
    etcd.lease_ttl = static_cast<int>(*ttl);
  } else if (key == "etcd_timeout") {
    etcd.timeout = parse_seconds(item);
    if (etcd.timeout <= 0) refuse(item.shown() + ": must be greater than 0 seconds (default 10)");
  } else if (key == "etcd_user") {
    etcd.user = value;
  } else if (key == "etcd_password_file") {
    etcd.password_file = value;
  } else {
    return false;
  }
  etcd.given.push_back(key + "=" + value);
  return true;
}

// --rdzv_conf key=value,... Times are seconds. torchrun's keep_alive_interval and
// keep_alive_max_attempt are its heartbeat: interval, and a node is lost after max_attempt
// missed beats; heartbeat_interval/heartbeat_timeout (ours) win over them when both are given.
void parse_rdzv_conf(const Given& g, LaunchConfig& config, std::optional<double>& shutdown_key,
                     std::ostream& err) {
  const char* accepted = "KEY=VALUE,KEY=VALUE,... e.g. join_timeout=300,last_call_timeout=10";
  const std::string s = trim(g.value);
  if (s.empty()) return;
  std::optional<double> heartbeat_interval, heartbeat_timeout, keep_alive_interval;
  std::optional<int> keep_alive_max_attempt;
  for (const std::string& pair : split(s, ',')) {
    const auto eq = pair.find('=');
    const std::string key = trim(pair.substr(0, eq));
    const std::string value = eq == std::string::npos ? "" : trim(pair.substr(eq + 1));
    if (key.empty()) refuse(g.shown() + ": '" + pair + "' has no key; accepted: " + accepted);
    if (value.empty()) refuse(g.shown() + ": '" + key + "' has no value; accepted: " + accepted);
    const Given item{value, g.source + " " + key};
    if (parse_etcd_key(key, value, item, config.etcd)) continue;
    if (key == "timeout" && is_etcd(config.rdzv_backend)) {
      // torchrun's etcd backends: how long a rendezvous may take to complete (its join timeout).
      config.timeouts.join_timeout = parse_seconds(item);
    } else if (key == "join_timeout") {
      config.timeouts.join_timeout = parse_seconds(item);
    } else if (key == "last_call_timeout") {
      config.timeouts.last_call_timeout = parse_seconds(item);
    } else if (key == "heartbeat_interval") {
      heartbeat_interval = parse_seconds(item);
      if (*heartbeat_interval <= 0) refuse(item.shown() + ": must be greater than 0 seconds");
    } else if (key == "heartbeat_timeout") {
      heartbeat_timeout = parse_seconds(item);
    } else if (key == "probe_timeout") {
      config.timeouts.probe_timeout = parse_seconds(item);
    } else if (key == "keep_alive_interval") {
      keep_alive_interval = parse_seconds(item);
      if (*keep_alive_interval <= 0) refuse(item.shown() + ": must be greater than 0 seconds");
    } else if (key == "keep_alive_max_attempt") {
      keep_alive_max_attempt = parse_positive_count(value, item, "an integer >= 2");
      if (*keep_alive_max_attempt < 2) {
        refuse(item.shown() + ": must be at least 2 (a node is lost after this many missed "
               "heartbeats; 1 would drop a node on any delay)");
      }
    } else if (key == "shutdown_timeout") {
      shutdown_key = parse_seconds(item);
    } else if (key == "reconnect_timeout") {
      config.reconnect_timeout = parse_seconds(item);
    } else if (key == "read_timeout" || key == "timeout") {
      parse_seconds(item);
      config.unused_rdzv_conf[key] = value;
    } else if (key == "is_host") {
      auto b = to_bool(value);
      if (!b) refuse(item.shown() + ": expected true or false");
      config.is_host = *b;
    } else if (key == "token_file") {
      config.token_file = value;
    } else if (key == "tls_ca") {
      config.tls_ca = value;
    } else if (key == "tls_cert") {
      config.tls_cert = value;
    } else if (key == "tls_key") {
      config.tls_key = value;
    } else {
      err << "ddplaunch: warning: " << g.source << ": unknown key '" << key
          << "' is ignored (known: " << kKnownRdzvKeys << ")\n";
      config.unused_rdzv_conf[key] = value;
    }
  }
  if (keep_alive_interval) config.timeouts.heartbeat_interval = *keep_alive_interval;
  if (heartbeat_interval) config.timeouts.heartbeat_interval = *heartbeat_interval;
  if (keep_alive_max_attempt) {
    config.timeouts.heartbeat_timeout = config.timeouts.heartbeat_interval * *keep_alive_max_attempt;
  }
  if (heartbeat_timeout) config.timeouts.heartbeat_timeout = *heartbeat_timeout;
  if (config.timeouts.heartbeat_timeout <= config.timeouts.heartbeat_interval) {
    std::ostringstream message;
    message << g.shown() << ": heartbeat_timeout (" << config.timeouts.heartbeat_timeout
            << ") must exceed heartbeat_interval (" << config.timeouts.heartbeat_interval << ")";
    refuse(message.str());
  }
}

// --rdzv_backend, --rdzv_endpoint, --rdzv_id, --rdzv_conf, --standalone.
void resolve_rendezvous(const RawValues& raw, LaunchConfig& config,
                        std::optional<double>& shutdown_key, std::ostream& err) {
  config.standalone = raw.flag("standalone");
  if (auto g = raw.find("rdzv_backend")) {
    config.rdzv_backend = parse_choice<RendezvousBackend>(
        *g, {{"static", RendezvousBackend::kStatic}, {"c10d", RendezvousBackend::kC10d},
             {"ddp", RendezvousBackend::kC10d}, {"etcd", RendezvousBackend::kEtcd},
             {"etcd-v2", RendezvousBackend::kEtcdV2}},
        "static, c10d, ddp (c10d and ddp both mean the ddp-rendezvous daemon), etcd, etcd-v2 (the "
        "job's agents host the rendezvous on etcd); unsupported backend");
  }
  if (auto g = raw.find("rdzv_endpoint"); g != nullptr && is_etcd(config.rdzv_backend) && !trim(g->value).empty()) {
    // etcd's endpoints: HOST[:PORT] (2379 when absent), http:// allowed; https:// is protocol=https.
    for (std::string item : split(trim(g->value), ',')) {
      item = trim(item);
      if (item.rfind("http://", 0) == 0) {
        item = item.substr(7);
      } else if (item.rfind("https://", 0) == 0) {
        item = item.substr(8);
        config.etcd.protocol = "https";
      }
      while (!item.empty() && item.back() == '/') item.pop_back();
      const Endpoint e = parse_endpoint(Given{item, g->source}, 2379);
      config.etcd.endpoints.push_back(e.text());  // the scheme follows `protocol` (resolve_etcd)
    }
  } else if (auto h = raw.find("rdzv_endpoint"); h != nullptr && !trim(h->value).empty()) {
    // HOST:PORT,HOST:PORT,...: standby daemons, tried in order when one is lost (docs/cli.md).
    // Every item must parse; the first is the rendezvous, the rest its standbys. Port 0 (a free
    // port on a rendezvous this node hosts) has a meaning for a lone endpoint only.
    const std::vector<std::string> items = split(trim(h->value), ',');
    for (const std::string& item : items) {
      Endpoint e = parse_endpoint(Given{trim(item), h->source}, rdzv::kDefaultRendezvousPort);
      if (items.size() > 1 && e.port == 0) refuse(h->shown() + ": " + rdzv::connect_error(e));
      if (!config.rdzv_endpoint) {
        config.rdzv_endpoint = std::move(e);
      } else {
        config.rdzv_standby_endpoints.push_back(std::move(e));
      }
    }
  }
  if (auto g = raw.find("rdzv_id")) {
    if (trim(g->value).empty()) refuse(g->shown() + ": must not be empty");
    config.rdzv_id = trim(g->value);
  }
  if (auto g = raw.find("rdzv_conf")) parse_rdzv_conf(*g, config, shutdown_key, err);
}

// --straggler, --straggler_factor, --straggler_window (docs/maintenance.md, "Stragglers").
void resolve_straggler(const RawValues& raw, LaunchConfig& config) {
  if (auto g = raw.find("straggler")) {
    const std::string mode = lower(trim(g->value));
    if (mode != "off" && mode != "report" && mode != "replace") {
      refuse(g->shown() + ": accepted: off, report (name the node: event, metric, status) or replace (drain it onto a spare)");
    }
    config.straggler.mode = mode;
    config.straggler_given = true;
  }
  if (auto g = raw.find("straggler_factor")) {
    auto v = to_number(g->value);
    if (!v || !(*v >= rdzv::kMinStragglerFactor && *v <= rdzv::kMaxStragglerFactor)) {
      refuse(g->shown() + ": accepted: a number from 1.05 to 100, the busy time over the other nodes' median that is slow, e.g. 1.5");
    }
    config.straggler.factor = *v;
    config.straggler_given = true;
  }
  if (auto g = raw.find("straggler_window")) {
    config.straggler.window = parse_seconds(*g);
    if (config.straggler.window < 1 || config.straggler.window > 1e7) {
      refuse(g->shown() + ": accepted: seconds from 1 to 10000000, how long a node stays slow before it is named, e.g. 60");
    }
    config.straggler_given = true;
  }
}

// --max_restarts, --monitor_interval, --shutdown_timeout, --signals_to_handle.
void resolve_fault_tolerance(const RawValues& raw, LaunchConfig& config,
                             const std::optional<double>& shutdown_key) {
  if (auto g = raw.find("max_restarts")) {
    config.max_restarts = parse_non_negative(*g, "an integer >= 0");
  }
  if (auto g = raw.find("monitor_interval")) config.monitor_interval = parse_seconds(*g);
  if (auto g = raw.find("hang_timeout")) {
    if (lower(trim(g->value)) == "auto") {
      config.hang.automatic = true;
    } else {
      config.hang.timeout = parse_seconds(*g);
      if (config.hang.timeout <= 0) refuse(g->shown() + ": must be greater than 0 seconds, or 'auto'");
    }
  }
  resolve_straggler(raw, config);
  if (auto g = raw.find("crash_loop_limit")) {
    config.max_restarts_without_progress = parse_non_negative(*g, "an integer >= 0 (0: off)");
  }
  if (auto g = raw.find("check_health")) {
    if (trim(g->value).empty()) refuse(g->shown() + ": must not be empty (a shell command, or 'gpu')");
    config.health_check = trim(g->value);
  }
  if (auto g = raw.find("check_health_interval")) {
    config.health_check_interval = parse_seconds(*g);
    if (config.health_check_interval <= 0) refuse(g->shown() + ": must be greater than 0 seconds");
  }
  if (auto g = raw.find("no_restart_exit_codes")) {
    for (const auto& item : split(g->value, ',')) {
      const std::string code = trim(item);
      if (code.empty()) continue;
      std::size_t used = 0;
      int value = -1;
      try {
        value = std::stoi(code, &used);
      } catch (const std::exception&) {
        used = 0;
      }
      if (used != code.size() || value < 1 || value > 255) {
        refuse(g->shown() + ": '" + code + "' is not an exit code from 1 to 255");
      }
      config.no_restart_exit_codes.push_back(value);
    }
  }
  // --shutdown_timeout, then the rdzv_conf key, then torchrun's TORCH_ELASTIC_SHUTDOWN_TIMEOUT.
  if (auto g = raw.find("shutdown_timeout")) {
    config.timeouts.shutdown_timeout = parse_seconds(*g);
  } else if (shutdown_key) {
    config.timeouts.shutdown_timeout = *shutdown_key;
  } else if (const char* v = std::getenv("TORCH_ELASTIC_SHUTDOWN_TIMEOUT"); v != nullptr && *v) {
    config.timeouts.shutdown_timeout = parse_seconds(Given{v, "TORCH_ELASTIC_SHUTDOWN_TIMEOUT"});
  } else {
    config.timeouts.shutdown_timeout = 30.0;
  }
  if (auto g = raw.find("signals_to_handle")) {
    config.signals_to_handle = parse_signal_list(g->value, g->source);
    config.signals_to_handle_text = g->value;
  } else {
    config.signals_to_handle = {SIGTERM, SIGINT, SIGHUP, SIGQUIT};
  }
}

// How workers are started: --start_method, --role, -m, --no_python, --run_path, --python,
// --virtual_local_rank, --numa_binding.
void resolve_workers(const RawValues& raw, LaunchConfig& config) {
  if (auto g = raw.find("start_method")) {
    config.start_method = parse_choice<StartMethod>(
        *g, {{"spawn", StartMethod::kSpawn}, {"fork", StartMethod::kFork},
             {"forkserver", StartMethod::kForkserver}},
        "spawn, fork, forkserver");
  }
  if (auto g = raw.find("role")) {
    if (trim(g->value).empty()) refuse(g->shown() + ": must not be empty");
    config.role = trim(g->value);
  }
  config.module = raw.flag("module");
  config.no_python = raw.flag("no_python");
  config.run_path = raw.flag("run_path");
  if (auto g = raw.find("python")) {
    config.python = trim(g->value);
  } else if (const char* exec = std::getenv("PYTHON_EXEC"); exec != nullptr && *exec != '\0') {
    config.python = exec;
  } else if (std::string own = environment_python(); !own.empty()) {
    config.python = own;
    config.python_of_environment = true;
  }
  config.virtual_local_rank = raw.flag("virtual_local_rank");
  if (auto g = raw.find("standby")) {
    config.standby = parse_choice<LaunchConfig::Standby>(
        *g, {{"off", LaunchConfig::Standby::kOff}, {"on", LaunchConfig::Standby::kOn}, {"auto", LaunchConfig::Standby::kAuto}},
        "off, on, auto");
  }
  if (auto g = raw.find("in_memory_restart")) {
    config.in_memory_restart = parse_choice<LaunchConfig::InMemoryRestart>(
        *g,
        {{"off", LaunchConfig::InMemoryRestart::kOff},
         {"on", LaunchConfig::InMemoryRestart::kOn},
         {"auto", LaunchConfig::InMemoryRestart::kAuto}},
        "off, on, auto");
  }
  if (auto g = raw.find("preload")) {
    for (const auto& item : split(g->value, ',')) {
      const std::string name = trim(item);
      if (name.empty()) continue;
      // A dotted Python module name: what the standby passes to importlib, nothing else.
      bool valid = !std::isdigit(static_cast<unsigned char>(name[0])) && name.front() != '.' && name.back() != '.' &&
                   name.find("..") == std::string::npos;
      for (char c : name) valid = valid && (std::isalnum(static_cast<unsigned char>(c)) || c == '_' || c == '.');
      if (!valid) refuse(g->shown() + ": '" + name + "' is not a Python module name (like numpy or torch.distributed)");
      config.preload.push_back(name);
    }
  }
  if (auto g = raw.find("numa_binding")) {
    config.numa_binding = agent::parse_numa_mode(lower(trim(g->value)));
    if (!config.numa_binding) {
      refuse(g->shown() + ": accepted: node, socket, exclusive, core-complex (torchrun's modes)");
    }
  }
}

// --log_dir, --redirects, --tee, --local_ranks_filter, --log_dedup, the duplicate filters, and
// torchrun's Python plug-in options (--logs_specs, --event_log_handler) at their defaults.
void resolve_logs(const RawValues& raw, LaunchConfig& config) {
  if (auto g = raw.find("log_dir")) config.log_dir = g->value;
  if (auto g = raw.find("redirects")) config.redirects = parse_std_spec(g->value, g->source);
  if (auto g = raw.find("tee")) config.tee = parse_std_spec(g->value, g->source);
  if (auto g = raw.find("local_ranks_filter")) {
    if (!trim(g->value).empty()) config.local_ranks_filter = parse_ranks(*g);
  }
  config.log_dedup = raw.flag("log_dedup");
  if (auto g = raw.find("log_dedup_window")) {
    config.log_dedup_window = parse_seconds(*g);
    if (config.log_dedup_window <= 0 || config.log_dedup_window > 60) {
      refuse(g->shown() + ": must be more than 0 and at most 60 seconds (how long a line waits for the "
             "other ranks to print it too)");
    }
  }
  if (auto g = raw.find("duplicate_stdout_filters")) {
    config.duplicate_stdout_filters = parse_comma_list(g->value);
  }
  if (auto g = raw.find("duplicate_stderr_filters")) {
    config.duplicate_stderr_filters = parse_comma_list(g->value);
  }
  if (auto g = raw.find("logs_specs")) {
    const std::string v = trim(g->value);
    if (v != "DefaultLogsSpecs" && v != "default") {
      refuse(g->shown() + ": names an entry point of torchrun's Python plug-in group "
             "'torchrun.logs_specs', which ddplaunch (a C++ program) cannot load; its logs are "
             "laid out as DefaultLogsSpecs does (--log_dir, --redirects, --tee). Accepted: "
             "DefaultLogsSpecs (or default), or drop the flag");
    }
  }
  // The lifecycle events and the metrics server (docs/metrics.md).
  if (auto g = raw.find("event_log")) {
    if (trim(g->value).empty()) refuse(g->shown() + ": give a file name, or '-' for stderr");
    config.event_log = trim(g->value);
  }
  if (auto g = raw.find("event_log_handler")) {
    // torchrun's handlers (torch.distributed.elastic.events.handlers): console logs each event,
    // null and dynamic_rendezvous (a NullHandler) log none.
    const std::string v = trim(g->value);
    if (v == "console") {
      if (config.event_log.empty()) config.event_log = "-";
    } else if (v != "null" && v != "dynamic_rendezvous") {
      refuse(g->shown() + ": names a handler of torch.distributed.elastic.events that ddplaunch does not "
             "have. Accepted: null (torchrun's default), console (JSON lines on stderr), "
             "dynamic_rendezvous (none); or --event_log=FILE");
    }
  }
  if (auto g = raw.find("metrics_port")) config.metrics_port = parse_port(*g);
  if (auto g = raw.find("metrics_addr")) {
    if (!valid_host(trim(g->value))) refuse(g->shown() + ": not an IP address, e.g. 127.0.0.1 or 0.0.0.0");
    config.metrics_addr = trim(g->value);
  }
}

// --master_addr, --master_port, --local_addr, --node_rank, --spare.
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
  if (auto g = raw.find("master_port")) config.master_port = parse_port(*g);
  if (auto g = raw.find("local_addr")) {
    if (!valid_host(trim(g->value))) {
      refuse(g->shown() + ": not a host name or address; accepted: HOST or an IP address");
    }
    config.local_addr = trim(g->value);
  }
  if (auto g = raw.find("node_rank")) {
    config.node_rank = parse_non_negative(*g, "an integer 0 <= N < MAX nodes");
  }
  config.spare = raw.flag("spare");
  if (config.spare && raw.find("node_rank")) {
    refuse("--spare and " + raw.find("node_rank")->shown() +
           ": a spare takes the group rank of the node it replaces; drop one of them");
  }
  if (config.spare && (config.standalone || config.rdzv_backend == RendezvousBackend::kStatic)) {
    refuse("--spare needs a rendezvous daemon to wait at: use --rdzv_backend=c10d --rdzv_endpoint=HOST:PORT");
  }
}

// --env_check, --env_lock, --check_env.
void resolve_env_check(const RawValues& raw, LaunchConfig& config) {
  if (auto g = raw.find("env_check")) {
    config.env_check = parse_choice<EnvCheckMode>(
        *g, {{"strict", EnvCheckMode::kStrict}, {"warn", EnvCheckMode::kWarn}, {"off", EnvCheckMode::kOff}},
        "strict (refuse differing nodes), warn (log and go on), off (no check)");
  }
  if (auto g = raw.find("env_lock")) {
    if (trim(g->value).empty()) refuse(g->shown() + ": must name a file");
    config.env_lock = g->value;
  }
  config.check_env = raw.flag("check_env");
}

std::string nnodes_text(const LaunchConfig& c) {
  return c.min_nodes == c.max_nodes ? std::to_string(c.max_nodes)
                                    : std::to_string(c.min_nodes) + ":" + std::to_string(c.max_nodes);
}

// --rdzv_backend=etcd / etcd-v2: etcd's endpoints and the rdzv_conf keys that go with them.
void resolve_etcd(const RawValues& raw, LaunchConfig& config) {
  const std::string backend = backend_name(config.rdzv_backend);
  if (config.etcd.endpoints.empty()) {
    refuse("--rdzv_backend=" + backend + " needs --rdzv_endpoint=HOST[:PORT] of etcd (port 2379 when absent; "
           "several: HOST:PORT,HOST:PORT)");
  }
  if (config.rdzv_id.find('/') != std::string::npos) {
    refuse(raw.find("rdzv_id")->shown() + ": with --rdzv_backend=" + backend +
           " the job id is part of an etcd key and must not contain '/'");
  }
  // TLS to etcd: the files themselves are checked by the etcd client (EtcdClient::config_error,
  // launch.cpp), which says which one is unusable.
  if (config.etcd.protocol != "https" &&
      (!config.etcd.ca_file.empty() || !config.etcd.cert_file.empty() || !config.etcd.key_file.empty())) {
    refuse("--rdzv_backend=" + backend + ": --rdzv_conf cacert, cert and key are for TLS to etcd, which needs "
           "protocol=https (or https:// endpoints); drop them for an http:// etcd");
  }
  if (!config.etcd.user.empty() && config.etcd.password_file.empty()) {
    refuse("--rdzv_conf etcd_user=" + config.etcd.user + " needs etcd_password_file=PATH (a file holding the password)");
  }
  if (config.etcd.user.empty() && !config.etcd.password_file.empty()) {
    refuse("--rdzv_conf etcd_password_file needs etcd_user=NAME");
  }
  for (std::string& e : config.etcd.endpoints) e = config.etcd.protocol + "://" + e;
  if (config.etcd.prefix.back() != '/') config.etcd.prefix += '/';
  config.rdzv_endpoint.reset();
  config.rdzv_standby_endpoints.clear();
}

// Every rule that ties two or more flags together, after each value is parsed on its own.
void resolve_rules(const RawValues& raw, LaunchConfig& config, std::ostream& err) {
  if (config.no_python && config.module && !config.run_path) {
    refuse("--no_python and -m/--module cannot be used together: -m runs a Python module "
           "through the interpreter, --no_python runs PROGRAM without one; drop one of them");
  }
  if (config.node_rank >= config.max_nodes) {
    const Given* g = raw.find("node_rank");
    refuse(g->shown() + ": must be less than the number of nodes (" +
           std::to_string(config.max_nodes) + "); accepted: 0.." +
           std::to_string(config.max_nodes - 1) + " (MAX of --nnodes=" + nnodes_text(config) + ")");
  }
  if (config.virtual_local_rank) {
    // Each worker gets entry LOCAL_RANK of the device list: it must have one.
    const char* hip = std::getenv("HIP_VISIBLE_DEVICES");
    const bool use_hip = hip != nullptr && *hip != '\0';
    const char* list = use_hip ? hip : std::getenv("CUDA_VISIBLE_DEVICES");
    if (list != nullptr && static_cast<int>(split(list, ',').size()) < config.nproc_per_node) {
      refuse(std::string("--virtual_local_rank: ") + (use_hip ? "HIP" : "CUDA") +
             "_VISIBLE_DEVICES=" + list + " names fewer devices than --nproc_per_node=" +
             std::to_string(config.nproc_per_node) + "; every local rank needs its own device");
    }
  }
  if (config.standalone) {
    for (const char* name : {"rdzv_backend", "rdzv_endpoint", "rdzv_id"}) {
      if (auto g = raw.find(name)) {
        err << "ddplaunch: warning: --standalone ignores " << g->shown() << "\n";
      }
    }
    if (config.max_nodes != 1) {
      refuse("--standalone runs a single-node job, but --nnodes is " + nnodes_text(config) +
             "; drop --nnodes (or set it to 1), or use --rdzv_backend=c10d "
             "--rdzv_endpoint=HOST:PORT for more nodes");
    }
    config.rdzv_backend = RendezvousBackend::kC10d;
    config.rdzv_endpoint.reset();
    config.rdzv_id = random_run_id();
    return;
  }
  if (is_etcd(config.rdzv_backend)) {
    resolve_etcd(raw, config);
    return;
  }
  if (!config.etcd.given.empty()) {
    std::string keys;
    for (const auto& k : config.etcd.given) keys += (keys.empty() ? "" : ", ") + k;
    err << "ddplaunch: warning: --rdzv_conf " << keys << ": only the etcd backends use these; ignored with --rdzv_backend="
        << backend_name(config.rdzv_backend) << "\n";
  }
  if (config.rdzv_backend == RendezvousBackend::kC10d) {
    if (!config.rdzv_endpoint && config.max_nodes > 1) {
      refuse("--rdzv_backend=c10d on more than one node needs --rdzv_endpoint=HOST[:PORT] "
             "(where ddp-rendezvous listens)");
    }
    return;
  }
  // The static backend: a fixed node count, a rank per node, the master from the endpoint.
  if (config.min_nodes != config.max_nodes) {
    refuse("--nnodes=" + nnodes_text(config) +
           " is elastic, but the static backend needs a fixed number of nodes; use "
           "--nnodes=N, or --rdzv_backend=c10d --rdzv_endpoint=HOST:PORT for MIN:MAX");
  }
  if (config.max_nodes > 1 && config.node_rank < 0) {
    refuse("the static backend on " + std::to_string(config.max_nodes) +
           " nodes needs --node_rank (0.." + std::to_string(config.max_nodes - 1) +
           ") on each node, or use --rdzv_backend=c10d --rdzv_endpoint=HOST:PORT");
  }
  if (config.node_rank < 0) config.node_rank = 0;
  // --check_env compares this node with the job's nodes at the daemon --rdzv_endpoint names.
  if (config.rdzv_endpoint && !config.check_env) {
    const Given* g = raw.find("rdzv_endpoint");
    const Endpoint master = parse_endpoint(*g, -1);
    if (master.port < 0) refuse(g->shown() + ": the static backend needs a port: HOST:PORT");
    config.master_addr = master.host;
    config.master_port = master.port;
    config.rdzv_endpoint.reset();
  }
}

}  // namespace

const char* backend_name(RendezvousBackend backend) {
  switch (backend) {
    case RendezvousBackend::kStatic: return "static";
    case RendezvousBackend::kC10d: return "c10d";
    case RendezvousBackend::kEtcd: return "etcd";
    case RendezvousBackend::kEtcdV2: return "etcd-v2";
  }
  return "c10d";
}

const char* env_check_name(EnvCheckMode mode) {
  switch (mode) {
    case EnvCheckMode::kStrict: return "strict";
    case EnvCheckMode::kWarn: return "warn";
    case EnvCheckMode::kOff: return "off";
  }
  return "strict";
}

LaunchConfig parse_command_line(int argc, const char* const* argv) {
  return parse_command_line(argc, argv, ParseContext{});
}

LaunchConfig parse_command_line(int argc, const char* const* argv, const ParseContext& context) {
  std::ostream& out = context.out != nullptr ? *context.out : std::cout;
  std::ostream& err = context.err != nullptr ? *context.err : std::cerr;

  CommandLine line = read_command_line(argc, argv);
  if (line.help) {
    out << help_text();
    throw LaunchError(ExitCode::kSuccess, "");
  }
  if (line.version) {
    out << version_text() << "\n";
    throw LaunchError(ExitCode::kSuccess, "");
  }
  // Slurm's variables fill what the command line and PET_ variables left out (launcher/slurm.h).
  std::vector<std::string> from_slurm =
      add_slurm_values(line.values, [](const char* name) { return std::getenv(name); });
  const RawValues& raw = line.values;

  LaunchConfig config;
  config.from_slurm = std::move(from_slurm);
  if (auto g = raw.find("nnodes")) parse_nnodes(*g, config);
  if (auto g = raw.find("nproc_per_node")) parse_nproc(*g, config, context);
  std::optional<double> shutdown_key;
  resolve_rendezvous(raw, config, shutdown_key, err);
  resolve_fault_tolerance(raw, config, shutdown_key);
  resolve_workers(raw, config);
  resolve_logs(raw, config);
  resolve_addresses(raw, config);
  resolve_env_check(raw, config);

  if (!line.program.empty()) {
    config.program = line.program.front();
    config.program_args.assign(line.program.begin() + 1, line.program.end());
  }
  if (config.program.empty() && !config.check_env) {
    refuse("missing PROGRAM: ddplaunch [OPTIONS] PROGRAM [ARGS...], e.g. "
           "ddplaunch --nproc_per_node=4 train.py");
  }
  resolve_rules(raw, config, err);
  return config;
}

}  // namespace ddp::launcher
