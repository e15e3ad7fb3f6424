// Unit tests of ddplaunch's command line: launcher/config.cpp.
#include "launcher/config.h"

#include "agent/devices.h"

#include <doctest/doctest.h>

#include <unistd.h>

#include <csignal>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

namespace {

using ddp::ExitCode;
using ddp::launcher::EnvCheckMode;
using ddp::launcher::LaunchConfig;
using ddp::launcher::RendezvousBackend;
using ddp::launcher::StartMethod;
using ddp::launcher::ParseContext;
using ddp::LaunchError;

const char* const kAllVariables[] = {
    "PET_NNODES", "PET_NPROC_PER_NODE", "PET_NODE_RANK", "PET_MODULE", "PET_NO_PYTHON",
    "PET_RUN_PATH", "PET_PYTHON", "PET_ROLE", "PET_START_METHOD", "PET_MASTER_ADDR",
    "PET_MASTER_PORT", "PET_LOCAL_ADDR", "PET_RDZV_BACKEND", "PET_RDZV_ENDPOINT", "PET_RDZV_ID",
    "PET_RDZV_CONF", "PET_STANDALONE", "PET_MAX_RESTARTS", "PET_MONITOR_INTERVAL",
    "PET_SHUTDOWN_TIMEOUT", "PET_SIGNALS_TO_HANDLE", "PET_LOG_DIR", "PET_REDIRECTS", "PET_TEE",
    "PET_LOCAL_RANKS_FILTER", "PET_ENV_CHECK", "PET_ENV_LOCK", "PET_CHECK_ENV", "PYTHON_EXEC",
    "CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "PET_VIRTUAL_LOCAL_RANK", "PET_NUMA_BINDING",
    "PET_DUPLICATE_STDOUT_FILTERS", "PET_DUPLICATE_STDERR_FILTERS", "PET_LOGS_SPECS",
    "PET_EVENT_LOG_HANDLER", "TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "PET_IN_MEMORY_RESTART",
    // Inside a Slurm allocation Slurm's variables are a source too (launcher/slurm.h).
    "SLURM_JOB_ID"};

// Sets and unsets environment variables for one test and restores them afterwards. Starts by
// unsetting every variable the parser reads, so the caller's environment cannot leak in.
class ScopedEnv {
 public:
  ScopedEnv() {
    for (const char* name : kAllVariables) unset(name);
  }
  ~ScopedEnv() {
    for (auto it = saved_.rbegin(); it != saved_.rend(); ++it) {
      if (it->second) {
        ::setenv(it->first.c_str(), it->second->c_str(), 1);
      } else {
        ::unsetenv(it->first.c_str());
      }
    }
  }
  ScopedEnv(const ScopedEnv&) = delete;
  ScopedEnv& operator=(const ScopedEnv&) = delete;

  void set(const std::string& name, const std::string& value) {
    save(name);
    ::setenv(name.c_str(), value.c_str(), 1);
  }
  void unset(const std::string& name) {
    save(name);
    ::unsetenv(name.c_str());
  }

 private:
  void save(const std::string& name) {
    const char* old = std::getenv(name.c_str());
    saved_.emplace_back(name, old ? std::optional<std::string>(old) : std::nullopt);
  }
  std::vector<std::pair<std::string, std::optional<std::string>>> saved_;
};

struct Result {
  LaunchConfig config;
  std::string out;
  std::string err;
};

// Parses `args` (without argv[0]) with a machine of `gpus` GPUs and `cpus` CPUs.
Result parse(const std::vector<std::string>& args, int gpus = 0, int cpus = 8) {
  std::vector<const char*> argv{"ddplaunch"};
  for (const auto& a : args) argv.push_back(a.c_str());
  std::ostringstream out;
  std::ostringstream err;
  ParseContext context;
  context.out = &out;
  context.err = &err;
  context.count_gpus = [gpus] { return gpus; };
  context.count_cpus = [cpus] { return cpus; };
  Result result;
  result.config = ddp::launcher::parse_command_line(static_cast<int>(argv.size()), argv.data(), context);
  result.out = out.str();
  result.err = err.str();
  return result;
}

// The LaunchError that parsing `args` throws; fails the test when none is thrown.
LaunchError refusal(const std::vector<std::string>& args, int gpus = 0) {
  try {
    parse(args, gpus);
  } catch (const LaunchError& e) {
    return e;
  }
  std::string joined;
  for (const auto& a : args) joined += a + " ";
  FAIL("expected a LaunchError for: " << joined);
  return LaunchError(ExitCode::kUsage, "unreachable");
}

bool contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

// One flag: its underscore spelling, a value (nullptr for flags) and a check of the result.
struct FlagCase {
  const char* name;
  const char* value;
  std::function<void(const LaunchConfig&)> check;
};

const std::vector<FlagCase>& flag_cases() {
  static const std::vector<FlagCase> cases = {
      {"nnodes", "2:4", [](const LaunchConfig& c) { CHECK(c.min_nodes == 2); CHECK(c.max_nodes == 4); }},
      {"nproc_per_node", "3", [](const LaunchConfig& c) { CHECK(c.nproc_per_node == 3); }},
      {"node_rank", "1", [](const LaunchConfig& c) { CHECK(c.node_rank == 1); }},
      {"module", nullptr, [](const LaunchConfig& c) { CHECK(c.module); }},
      {"no_python", nullptr, [](const LaunchConfig& c) { CHECK(c.no_python); }},
      {"run_path", nullptr, [](const LaunchConfig& c) { CHECK(c.run_path); }},
      {"python", "/opt/py/bin/python3.11", [](const LaunchConfig& c) { CHECK(c.python == "/opt/py/bin/python3.11"); }},
      {"role", "trainer", [](const LaunchConfig& c) { CHECK(c.role == "trainer"); }},
      {"start_method", "fork", [](const LaunchConfig& c) { CHECK(c.start_method == StartMethod::kFork); }},
      {"master_addr", "10.1.2.3", [](const LaunchConfig& c) { CHECK(c.master_addr == "10.1.2.3"); }},
      {"master_port", "31000", [](const LaunchConfig& c) { CHECK(c.master_port == 31000); }},
      {"local_addr", "10.9.9.9", [](const LaunchConfig& c) { CHECK(c.local_addr == "10.9.9.9"); }},
      {"rdzv_backend", "c10d", [](const LaunchConfig& c) { CHECK(c.rdzv_backend == RendezvousBackend::kC10d); }},
      {"rdzv_endpoint", "head:29401", [](const LaunchConfig& c) {
         REQUIRE(c.rdzv_endpoint); CHECK(c.rdzv_endpoint->text() == "head:29401");
         CHECK(c.rdzv_endpoint->host == "head"); CHECK(c.rdzv_endpoint->port == 29401); }},
      {"rdzv_id", "job42", [](const LaunchConfig& c) { CHECK(c.rdzv_id == "job42"); }},
      {"rdzv_conf", "join_timeout=12,last_call_timeout=3", [](const LaunchConfig& c) {
         CHECK(c.timeouts.join_timeout == 12.0);
         CHECK(c.timeouts.last_call_timeout == 3.0); }},
      {"standalone", nullptr, [](const LaunchConfig& c) { CHECK(c.standalone); CHECK(c.rdzv_backend == RendezvousBackend::kC10d); }},
      {"max_restarts", "5", [](const LaunchConfig& c) { CHECK(c.max_restarts == 5); }},
      {"monitor_interval", "2.5", [](const LaunchConfig& c) { CHECK(c.monitor_interval == 2.5); }},
      {"shutdown_timeout", "7", [](const LaunchConfig& c) {
         CHECK(c.timeouts.shutdown_timeout == 7.0); }},
      {"signals_to_handle", "SIGUSR1,SIGTERM", [](const LaunchConfig& c) {
         CHECK(c.signals_to_handle == std::vector<int>{SIGUSR1, SIGTERM}); }},
      {"log_dir", "/tmp/logs", [](const LaunchConfig& c) { CHECK(c.log_dir == "/tmp/logs"); }},
      {"redirects", "3", [](const LaunchConfig& c) { CHECK(c.redirects.default_value == 3); }},
      {"tee", "0:1,1:2", [](const LaunchConfig& c) {
         CHECK(c.tee.for_rank(0) == 1); CHECK(c.tee.for_rank(1) == 2); CHECK(c.tee.for_rank(2) == 0); }},
      {"local_ranks_filter", "2,0", [](const LaunchConfig& c) { CHECK(c.local_ranks_filter == std::vector<int>{0, 2}); }},
      {"log_dedup", nullptr, [](const LaunchConfig& c) { CHECK(c.log_dedup); }},
      {"log_dedup_window", "1.5", [](const LaunchConfig& c) { CHECK(c.log_dedup_window == 1.5); }},
      {"env_check", "warn", [](const LaunchConfig& c) { CHECK(c.env_check == EnvCheckMode::kWarn); }},
      {"env_lock", "requirements.txt", [](const LaunchConfig& c) { CHECK(c.env_lock == "requirements.txt"); }},
      {"check_env", nullptr, [](const LaunchConfig& c) { CHECK(c.check_env); }},
      // torchrun 2.x's newer flags.
      {"virtual_local_rank", nullptr, [](const LaunchConfig& c) { CHECK(c.virtual_local_rank); }},
      {"spare", nullptr, [](const LaunchConfig& c) { CHECK(c.spare); }},
      {"numa_binding", "exclusive", [](const LaunchConfig& c) {
         CHECK(c.numa_binding == ddp::agent::NumaMode::kExclusive); }},
      {"duplicate_stdout_filters", "loss,,acc,epoch", [](const LaunchConfig& c) {
         CHECK(c.duplicate_stdout_filters == std::vector<std::string>{"loss,acc", "epoch"}); }},
      {"duplicate_stderr_filters", "Traceback", [](const LaunchConfig& c) {
         CHECK(c.duplicate_stderr_filters == std::vector<std::string>{"Traceback"}); }},
      {"logs_specs", "DefaultLogsSpecs", [](const LaunchConfig& c) { CHECK(c.program == "train.py"); }},
      {"event_log_handler", "null", [](const LaunchConfig& c) { CHECK(c.program == "train.py"); }},
  };
  return cases;
}

std::string dashed(std::string name) {
  for (char& c : name) if (c == '_') c = '-';
  return name;
}

std::string upper(std::string name) {
  for (char& c : name) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  return name;
}

// Flags some cases need so that the result is a valid configuration (node_rank needs nodes).
std::vector<std::string> context_args(const std::string& name) {
  if (name == "node_rank") return {"--nnodes=2"};
  if (name == "nnodes") return {"--rdzv_backend=c10d", "--rdzv_endpoint=head"};
  if (name == "rdzv_endpoint") return {"--rdzv_backend=c10d"};  // static: it is the master
  if (name == "spare") return {"--rdzv_backend=c10d", "--rdzv_endpoint=head"};
  return {};
}

}  // namespace

TEST_SUITE("every flag is accepted in both spellings and as PET_ variable") {
  TEST_CASE("each flag works as --under_score, --dash-ed, '=VALUE' and ' VALUE'") {
    for (const FlagCase& flag : flag_cases()) {
      for (const std::string& spelling : {std::string(flag.name), dashed(flag.name)}) {
        std::vector<std::vector<std::string>> forms;
        if (flag.value == nullptr) {
          forms.push_back({"--" + spelling});
        } else {
          forms.push_back({"--" + spelling + "=" + flag.value});
          forms.push_back({"--" + spelling, flag.value});
        }
        for (auto form : forms) {
          CAPTURE(spelling);
          ScopedEnv env;
          std::vector<std::string> args = context_args(flag.name);
          args.insert(args.end(), form.begin(), form.end());
          args.push_back("train.py");
          const Result r = parse(args);
          flag.check(r.config);
          CHECK(r.config.program == "train.py");
        }
      }
    }
  }

  TEST_CASE("each flag is read from PET_<NAME> when not on the command line") {
    for (const FlagCase& flag : flag_cases()) {
      CAPTURE(flag.name);
      ScopedEnv env;
      env.set("PET_" + upper(flag.name), flag.value ? flag.value : "1");
      std::vector<std::string> args = context_args(flag.name);
      args.push_back("train.py");
      flag.check(parse(args).config);
    }
  }

  TEST_CASE("short options -m, -r and -t") {
    ScopedEnv env;
    const Result r = parse({"-r", "2", "-t3", "-m", "pkg.train"});
    CHECK(r.config.redirects.default_value == 2);
    CHECK(r.config.tee.default_value == 3);
    CHECK(r.config.module);
    CHECK(r.config.program == "pkg.train");
    CHECK(parse({"-r=1", "-t", "0:2", "t.py"}).config.redirects.default_value == 1);
  }

  TEST_CASE("a PET_ flag set to 0 stays off") {
    ScopedEnv env;
    env.set("PET_STANDALONE", "0");
    env.set("PET_NO_PYTHON", "false");
    const Result r = parse({"train.py"});
    CHECK_FALSE(r.config.standalone);
    CHECK_FALSE(r.config.no_python);
  }
}

TEST_SUITE("the command line wins over PET_ variables and defaults") {
  TEST_CASE("defaults without flags or variables match torchrun's") {
    ScopedEnv env;
    const LaunchConfig c = parse({"train.py"}).config;
    CHECK(c.min_nodes == 1);
    CHECK(c.max_nodes == 1);
    CHECK(c.nproc_per_node == 1);
    CHECK(c.rdzv_backend == RendezvousBackend::kStatic);
    CHECK(c.rdzv_id == "none");
    CHECK(c.node_rank == 0);
    CHECK(c.max_restarts == 0);
    CHECK(c.master_addr == "127.0.0.1");
    CHECK_FALSE(c.master_port);  // 29500 on several nodes, a fresh port per round on one
    CHECK(c.role == "default");
    CHECK(c.python == "python3");
    CHECK(c.env_check == EnvCheckMode::kStrict);
    CHECK(c.timeouts.shutdown_timeout == 30.0);
    CHECK_FALSE(c.virtual_local_rank);
    CHECK_FALSE(c.numa_binding);
    CHECK(c.duplicate_stdout_filters.empty());
    CHECK(c.duplicate_stderr_filters.empty());
    CHECK(c.timeouts.join_timeout == 600.0);
    CHECK(c.signals_to_handle == std::vector<int>{SIGTERM, SIGINT, SIGHUP, SIGQUIT});
    CHECK(c.redirects.default_value == 0);
    CHECK(c.tee.default_value == 0);
    CHECK(c.local_ranks_filter.empty());
    CHECK_FALSE(c.log_dedup);
    CHECK(c.log_dedup_window == 0.25);
    CHECK_FALSE(c.standalone);
  }

  TEST_CASE("a flag overrides its PET_ variable") {
    ScopedEnv env;
    env.set("PET_NPROC_PER_NODE", "4");
    env.set("PET_MAX_RESTARTS", "9");
    env.set("PET_RDZV_ENDPOINT", "envhost:1");
    const LaunchConfig c =
        parse({"--nproc-per-node=2", "--max_restarts", "1", "--rdzv_backend=c10d", "--rdzv_endpoint=cli:2",
               "train.py"}).config;
    CHECK(c.nproc_per_node == 2);
    CHECK(c.max_restarts == 1);
    CHECK(c.rdzv_endpoint->host == "cli");
    CHECK(c.rdzv_endpoint->port == 2);
  }

  TEST_CASE("a PET_ variable overrides the default, an empty one counts as unset") {
    ScopedEnv env;
    env.set("PET_NPROC_PER_NODE", "4");
    env.set("PET_ROLE", "");
    const LaunchConfig c = parse({"train.py"}).config;
    CHECK(c.nproc_per_node == 4);
    CHECK(c.role == "default");
  }

  TEST_CASE("a bad PET_ value is refused naming the variable, unless the flag overrides it") {
    ScopedEnv env;
    env.set("PET_NNODES", "2:1");
    const LaunchError e = refusal({"train.py"});
    CHECK(e.exit_code() == static_cast<int>(ExitCode::kUsage));
    CHECK(contains(e.what(), "PET_NNODES=2:1"));
    CHECK(parse({"--nnodes=1", "train.py"}).config.max_nodes == 1);
  }

  TEST_CASE("the interpreter is --python, then PET_PYTHON, then PYTHON_EXEC, then python3") {
    ScopedEnv env;
    CHECK(parse({"train.py"}).config.python == "python3");
    env.set("PYTHON_EXEC", "/usr/bin/python3");
    CHECK(parse({"train.py"}).config.python == "/usr/bin/python3");
    env.set("PET_PYTHON", "/env/python");
    CHECK(parse({"train.py"}).config.python == "/env/python");
    CHECK(parse({"--python=/cli/python", "train.py"}).config.python == "/cli/python");
  }

  TEST_CASE("a flag given twice takes the last value, as argparse does") {
    ScopedEnv env;
    CHECK(parse({"--nproc_per_node=2", "--nproc-per-node=5", "train.py"}).config.nproc_per_node == 5);
  }
}

TEST_SUITE("everything after the program belongs to the program") {
  TEST_CASE("flags after the program, even ddplaunch's own, go to the program") {
    ScopedEnv env;
    const LaunchConfig c =
        parse({"--nproc_per_node=2", "train.py", "--lr", "0.1", "--nnodes", "3", "--help", "-m"}).config;
    CHECK(c.nproc_per_node == 2);
    CHECK(c.max_nodes == 1);
    CHECK_FALSE(c.module);
    CHECK(c.program == "train.py");
    CHECK(c.program_args == std::vector<std::string>{"--lr", "0.1", "--nnodes", "3", "--help", "-m"});
  }

  TEST_CASE("a module and its arguments") {
    ScopedEnv env;
    const LaunchConfig c = parse({"-m", "pkg.train", "--epochs=3"}).config;
    CHECK(c.module);
    CHECK(c.program == "pkg.train");
    CHECK(c.program_args == std::vector<std::string>{"--epochs=3"});
  }

  TEST_CASE("'--' ends the options, so a program may start with '-'") {
    ScopedEnv env;
    const LaunchConfig c = parse({"--no_python", "--", "-weird", "x"}).config;
    CHECK(c.program == "-weird");
    CHECK(c.program_args == std::vector<std::string>{"x"});
    const LaunchConfig d = parse({"--", "train.py", "--", "a"}).config;
    CHECK(d.program == "train.py");
    CHECK(d.program_args == std::vector<std::string>{"--", "a"});
  }

  TEST_CASE("arguments with spaces and empty arguments pass through unchanged") {
    ScopedEnv env;
    const LaunchConfig c = parse({"--no_python", "/bin/echo", "a b", "", "--x=1 2"}).config;
    CHECK(c.program == "/bin/echo");
    CHECK(c.program_args == std::vector<std::string>{"a b", "", "--x=1 2"});
  }

  TEST_CASE("--check_env needs no program") {
    ScopedEnv env;
    const LaunchConfig c = parse({"--check_env"}).config;
    CHECK(c.check_env);
    CHECK(c.program.empty());
    // The endpoint is the daemon to compare with, whatever the backend.
    const LaunchConfig d = parse({"--check_env", "--rdzv_endpoint=h:5", "--rdzv_id=j"}).config;
    REQUIRE(d.rdzv_endpoint);
    CHECK(d.rdzv_endpoint->text() == "h:5");
  }
}

TEST_SUITE("bad values exit 2 naming the flag and the accepted forms") {
  struct RefusalCase {
    std::vector<std::string> args;
    std::vector<std::string> message_parts;
  };

  TEST_CASE("every invalid value is refused with exit code 2 and a clear message") {
    const std::vector<RefusalCase> cases = {
        {{"--nnodes=2:1", "t.py"}, {"--nnodes=2:1", "MIN (2) must not exceed MAX (1)", "MIN:MAX"}},
        {{"--nnodes=1:2:3", "t.py"}, {"--nnodes=1:2:3", "too many ':'", "N or MIN:MAX"}},
        {{"--nnodes=0", "t.py"}, {"--nnodes=0", "at least 1"}},
        {{"--nnodes=two", "t.py"}, {"--nnodes=two", "not an integer"}},
        {{"--nnodes=", "t.py"}, {"--nnodes=", "N or MIN:MAX"}},
        {{"--nproc_per_node=many", "t.py"}, {"--nproc_per_node=many", "auto, cpu or gpu"}},
        {{"--nproc_per_node=0", "t.py"}, {"--nproc_per_node=0", "at least 1"}},
        {{"--nproc_per_node=-2", "t.py"}, {"--nproc_per_node=-2", "at least 1"}},
        {{"--nproc_per_node=gpu", "t.py"}, {"--nproc_per_node=gpu", "no GPU is visible"}},
        {{"--no_python", "-m", "pkg"}, {"--no_python", "-m/--module", "cannot be used together"}},
        {{"--redirects=7", "t.py"}, {"--redirects=7", "0 (none)", "3 (both)"}},
        {{"--tee=0:4", "t.py"}, {"--tee=0:4", "'4' is not 0..3"}},
        {{"--tee=0:1,0:2", "t.py"}, {"--tee=0:1,0:2", "given twice"}},
        {{"-r", "x:1", "t.py"}, {"--redirects=x:1", "not a local rank"}},
        {{"--rdzv_conf=join_timeout", "t.py"}, {"--rdzv_conf=join_timeout", "'join_timeout' has no value", "KEY=VALUE"}},
        {{"--rdzv_conf==5", "t.py"}, {"--rdzv_conf==5", "has no key"}},
        {{"--rdzv_conf=join_timeout=soon", "t.py"}, {"join_timeout=soon", "not a number"}},
        {{"--rdzv_conf=last_call_timeout=-1", "t.py"}, {"last_call_timeout=-1", "must not be negative"}},
        {{"--rdzv_conf=is_host=perhaps", "t.py"}, {"is_host=perhaps", "true or false"}},
        {{"--rdzv_conf=heartbeat_interval=0", "t.py"}, {"heartbeat_interval=0", "greater than 0"}},
        {{"--rdzv_conf=heartbeat_timeout=1,heartbeat_interval=2", "t.py"}, {"heartbeat_timeout (1) must exceed heartbeat_interval (2)"}},
        {{"--max_restarts=-1", "t.py"}, {"--max_restarts=-1", "must not be negative", ">= 0"}},
        {{"--max_restarts=lots", "t.py"}, {"--max_restarts=lots", "not an integer"}},
        {{"--shutdown_timeout=-5", "t.py"}, {"--shutdown_timeout=-5", "must not be negative"}},
        {{"--monitor_interval=-0.1", "t.py"}, {"--monitor_interval=-0.1", "must not be negative"}},
        {{"--shutdown_timeout=nan", "t.py"}, {"--shutdown_timeout=nan", "not a number"}},
        {{"--env_check=maybe", "t.py"}, {"--env_check=maybe", "strict", "warn", "off"}},
        {{"--env_lock=", "t.py"}, {"--env_lock=", "must name a file"}},
        {{"--start_method=thread", "t.py"}, {"--start_method=thread", "spawn, fork, forkserver"}},
        {{"--rdzv_backend=zookeeper", "t.py"}, {"--rdzv_backend=zookeeper", "static, c10d, ddp", "etcd, etcd-v2"}},
        {{"--rdzv_backend=etcd", "t.py"}, {"--rdzv_backend=etcd needs --rdzv_endpoint=HOST[:PORT] of etcd"}},
        {{"--rdzv_backend=etcd-v2", "--rdzv_endpoint=e", "--rdzv_conf=etcd_lease_ttl=1", "t.py"}, {"etcd_lease_ttl=1", "2 to 600"}},
        {{"--rdzv_backend=etcd-v2", "--rdzv_endpoint=e", "--rdzv_conf=protocol=ftp", "t.py"}, {"protocol=ftp", "http, https"}},
        {{"--rdzv_backend=etcd", "--rdzv_endpoint=e", "--rdzv_conf=cacert=/ca.pem", "t.py"}, {"cacert", "protocol=https"}},
        {{"--rdzv_backend=etcd", "--rdzv_endpoint=e", "--rdzv_id=a/b", "t.py"}, {"--rdzv_id=a/b", "must not contain '/'"}},
        {{"--rdzv_backend=c10d", "--rdzv_endpoint=host:99999", "t.py"}, {"--rdzv_endpoint=host:99999", "HOST[:PORT]"}},
        {{"--rdzv_backend=c10d", "--rdzv_endpoint=bad host", "t.py"}, {"--rdzv_endpoint=bad host", "not a host"}},
        {{"--rdzv_backend=c10d", "--rdzv_endpoint=[::1", "t.py"}, {"missing ']'"}},
        {{"--rdzv_backend=c10d", "--rdzv_endpoint=fe80::1:29400", "t.py"}, {"not an IPv6 address", "[ADDRESS]:PORT"}},
        {{"--rdzv_backend=c10d", "--rdzv_endpoint=[head]:1", "t.py"}, {"--rdzv_endpoint=[head]:1", "not an IPv6 address"}},
        {{"--rdzv_backend=c10d", "--rdzv_endpoint=head:", "t.py"}, {"--rdzv_endpoint=head:", "empty port"}},
        {{"--rdzv_backend=c10d", "--rdzv_endpoint=a:1,b:0", "t.py"}, {"b:0: port 0", "cannot be connected to"}},
        {{"--rdzv_id=", "t.py"}, {"--rdzv_id=", "must not be empty"}},
        {{"--master_port=70000", "t.py"}, {"--master_port=70000", "0..65535"}},
        {{"--master_addr=a b", "t.py"}, {"--master_addr=a b", "not a host"}},
        {{"--local_ranks_filter=0,x", "t.py"}, {"--local_ranks_filter=0,x", "'x' is not a rank", "0,1,2"}},
        {{"--log_dedup_window=0", "t.py"}, {"--log_dedup_window=0", "more than 0 and at most 60 seconds"}},
        {{"--log_dedup_window=soon", "t.py"}, {"--log_dedup_window=soon"}},
        {{"--signals_to_handle=SIGFOO", "t.py"}, {"--signals_to_handle=SIGFOO", "unknown signal", "SIGTERM"}},
        {{"--signals_to_handle=SIGKILL", "t.py"}, {"cannot be caught"}},
        {{"--signals_to_handle=CHLD", "t.py"}, {"CHLD", "not forwarded"}},
        {{"--signals_to_handle=999", "t.py"}, {"no signal 999"}},
        {{"--nnodes=2", "t.py"}, {"static backend", "--node_rank"}},
        {{"--nnodes=1:2", "t.py"}, {"--nnodes=1:2", "fixed number of nodes"}},
        {{"--nnodes=2", "--node_rank=2", "t.py"}, {"--node_rank=2", "less than the number of nodes (2)", "0..1"}},
        {{"--node_rank=1", "t.py"}, {"--node_rank=1", "0..0"}},
        {{"--node_rank=-1", "t.py"}, {"--node_rank=-1", "must not be negative"}},
        {{"--standalone", "--nnodes=2", "t.py"}, {"--standalone", "single-node", "--nnodes"}},
        {{"--rdzv_backend=c10d", "--nnodes=2", "t.py"}, {"--rdzv_endpoint=HOST[:PORT]"}},
        {{"--nnodes=2", "--node_rank=0", "--rdzv_endpoint=host", "t.py"}, {"--rdzv_endpoint=host", "needs a port"}},
        {{}, {"missing PROGRAM", "ddplaunch [OPTIONS] PROGRAM"}},
        {{"--nproc_per_node=2"}, {"missing PROGRAM"}},
        {{"--bogus", "t.py"}, {"unknown option '--bogus'"}},
        {{"--nprocs_per_node=2", "t.py"}, {"unknown option '--nprocs_per_node'; did you mean --nproc_per_node?"}},
        {{"--Nnode-Rank=1", "t.py"}, {"did you mean --node_rank?"}},
        {{"--nodes=2", "t.py"}, {"did you mean --nnodes?"}},
        {{"--bogus=3", "t.py"}, {"unknown option '--bogus'"}},
        {{"--numa-binding=nodes", "t.py"}, {"--numa_binding=nodes", "node, socket, exclusive, core-complex"}},
        {{"--logs_specs", "x", "t.py"}, {"--logs_specs=x", "torchrun.logs_specs", "DefaultLogsSpecs"}},
        {{"--event-log-handler=fancy", "t.py"}, {"--event_log_handler=fancy", "Accepted: null", "console"}},
        {{"--metrics_port=70000", "t.py"}, {"--metrics_port=70000", "0..65535"}},
        {{"--event_log=", "t.py"}, {"--event_log=", "give a file name"}},
        {{"--nproc-per-node=xpu", "t.py"}, {"--nproc_per_node=xpu", "no XPU is visible"}},
        {{"--n=2", "t.py"}, {"ambiguous option: --n could match", "--nnodes", "--nproc_per_node", "--node_rank", "--no_python"}},
        {{"--rdzv", "x", "t.py"}, {"ambiguous option: --rdzv could match", "--rdzv_backend", "--rdzv_conf"}},
        {{"--rdzv_conf=keep_alive_max_attempt=1", "t.py"}, {"keep_alive_max_attempt=1", "at least 2"}},
        {{"--rdzv_conf=keep_alive_interval=0", "t.py"}, {"keep_alive_interval=0", "greater than 0"}},
        {{"--nnodes"}, {"--nnodes needs a value: --nnodes=N|MIN:MAX"}},
        {{"-r"}, {"-r needs a value"}},
        {{"-mx", "t.py"}, {"unknown option '-mx'"}},
        {{"--standalone=maybe", "t.py"}, {}},
    };
    for (const RefusalCase& c : cases) {
      std::string joined;
      for (const auto& a : c.args) joined += a + " ";
      CAPTURE(joined);
      ScopedEnv env;
      const LaunchError e = refusal(c.args);
      CHECK(e.exit_code() == static_cast<int>(ExitCode::kUsage));
      CHECK(e.exit_code() == 2);
      const std::string message = e.what();
      CAPTURE(message);
      CHECK(message.rfind("ddplaunch: ", 0) == 0);
      CHECK(contains(message, "ddplaunch --help"));
      for (const std::string& part : c.message_parts) {
        CHECK_MESSAGE(contains(message, part), "missing '" << part << "'");
      }
    }
  }

  TEST_CASE("a refused PET_ flag names the variable") {
    ScopedEnv env;
    env.set("PET_STANDALONE", "maybe");
    const LaunchError e = refusal({"t.py"});
    CHECK(e.exit_code() == static_cast<int>(ExitCode::kUsage));
    CHECK(contains(e.what(), "PET_STANDALONE=maybe"));
  }
}

TEST_SUITE("rendezvous settings resolve like torchrun") {
  TEST_CASE("etcd and etcd-v2 take etcd's endpoints (port 2379) and torchrun's rdzv_conf keys") {
    ScopedEnv env;
    const Result a = parse({"--rdzv_backend=etcd-v2", "--rdzv_endpoint=e1,http://e2:2400", "--rdzv_id=job",
                            "--nnodes=1:2", "--rdzv_conf=protocol=HTTP,etcd_prefix=/torchelastic/p2p,etcd_lease_ttl=3,"
                            "timeout=90,etcd_timeout=4", "train.py"});
    CHECK(a.config.rdzv_backend == RendezvousBackend::kEtcdV2);
    CHECK(a.config.etcd.endpoints == std::vector<std::string>{"http://e1:2379", "http://e2:2400"});
    CHECK_FALSE(a.config.rdzv_endpoint);
    CHECK(a.config.etcd.protocol == "http");
    CHECK(a.config.etcd.prefix == "/torchelastic/p2p/");
    CHECK(a.config.etcd.lease_ttl == 3);
    CHECK(a.config.etcd.timeout == 4);
    CHECK(a.config.timeouts.join_timeout == 90);  // torchrun's etcd `timeout`: the join timeout
    CHECK(a.err.empty());
    const Result tls = parse({"--rdzv_backend=etcd", "--rdzv_endpoint=https://e1:2379,e2",
                              "--rdzv_conf=cacert=/ca.pem,cert=/c.pem,key=/k.pem", "train.py"});
    CHECK(tls.err.empty());
    CHECK(tls.config.etcd.endpoints == std::vector<std::string>{"https://e1:2379", "https://e2:2379"});
    CHECK(tls.config.etcd.ca_file == "/ca.pem");
    CHECK(tls.config.etcd.cert_file == "/c.pem");
    CHECK(tls.config.etcd.key_file == "/k.pem");
    const Result b = parse({"--rdzv_backend=etcd", "--rdzv_endpoint=e", "train.py"});
    CHECK(b.config.rdzv_backend == RendezvousBackend::kEtcd);
    CHECK(b.config.etcd.prefix == "/ddplaunch/jobs/");
    CHECK(b.config.etcd.lease_ttl == 5);
  }

  TEST_CASE("etcd keys given to another backend are ignored with a warning") {
    ScopedEnv env;
    const Result a = parse({"--rdzv_backend=c10d", "--rdzv_endpoint=h", "--rdzv_conf=etcd_lease_ttl=3", "train.py"});
    CHECK(contains(a.err, "etcd_lease_ttl=3: only the etcd backends use these"));
  }

  TEST_CASE("--standalone picks c10d, leaves the endpoint to the agent and draws a random run id") {
    ScopedEnv env;
    const Result a = parse({"--standalone", "train.py"});
    const Result b = parse({"--standalone", "train.py"});
    CHECK(a.config.standalone);
    CHECK(a.config.rdzv_backend == RendezvousBackend::kC10d);
    CHECK_FALSE(a.config.rdzv_endpoint);
    CHECK(a.config.rdzv_id.size() == 36);
    CHECK(a.config.rdzv_id[14] == '4');
    CHECK(a.config.rdzv_id != b.config.rdzv_id);
    CHECK(a.err.empty());
  }

  TEST_CASE("--standalone ignores explicit rendezvous flags with a warning") {
    ScopedEnv env;
    const Result r = parse({"--standalone", "--rdzv_id=mine", "--rdzv_endpoint=h:1", "train.py"});
    CHECK(r.config.rdzv_id != "mine");
    CHECK_FALSE(r.config.rdzv_endpoint);
    CHECK(contains(r.err, "--standalone ignores --rdzv_id=mine"));
    CHECK(contains(r.err, "--standalone ignores --rdzv_endpoint=h:1"));
  }

  TEST_CASE("static multi-node takes --node_rank and the master address, or --rdzv_endpoint") {
    ScopedEnv env;
    const LaunchConfig c =
        parse({"--nnodes=3", "--node_rank=2", "--master_addr=10.0.0.1", "--master_port=1234", "t.py"}).config;
    CHECK(c.rdzv_backend == RendezvousBackend::kStatic);
    CHECK(c.node_rank == 2);
    CHECK(c.master_addr == "10.0.0.1");
    CHECK(c.master_port == 1234);
    CHECK(parse({"--master_addr=[::1]", "t.py"}).config.master_addr == "::1");
    const LaunchConfig d = parse({"--nnodes=2", "--node_rank=1", "--rdzv_endpoint=[fe80::1]:4321", "t.py"}).config;
    CHECK(d.master_addr == "fe80::1");
    CHECK(d.master_port == 4321);
    CHECK_FALSE(d.rdzv_endpoint);  // the static backend's endpoint is the master's
  }

  TEST_CASE("c10d endpoints default to port 29400 and accept IPv6") {
    ScopedEnv env;
    const LaunchConfig c = parse({"--rdzv_backend=c10d", "--rdzv_endpoint=head", "--nnodes=1:4", "t.py"}).config;
    CHECK(c.rdzv_endpoint->host == "head");
    CHECK(c.rdzv_endpoint->port == 29400);
    CHECK(c.node_rank == -1);
    const LaunchConfig d = parse({"--rdzv_backend=ddp", "--rdzv_endpoint=[::1]:5000", "t.py"}).config;
    CHECK(d.rdzv_endpoint->host == "::1");
    CHECK(d.rdzv_endpoint->port == 5000);
    CHECK(d.rdzv_endpoint->text() == "[::1]:5000");
    // A bare IPv6 address is the host alone, the same as in the rendezvous client.
    const LaunchConfig e = parse({"--rdzv_backend=c10d", "--rdzv_endpoint=::1", "t.py"}).config;
    CHECK(*e.rdzv_endpoint == ddp::rdzv::parse_endpoint("::1").value());
    CHECK(e.rdzv_endpoint->text() == "[::1]:29400");
    // Port 0 alone: a free port on a rendezvous this node hosts (torch 2.x's --standalone form).
    CHECK(parse({"--rdzv_backend=c10d", "--rdzv_endpoint=localhost:0", "t.py"}).config.rdzv_endpoint->port == 0);
  }

  TEST_CASE("unknown --rdzv_conf keys are kept and warned about") {
    ScopedEnv env;
    const Result r = parse({"--rdzv_conf=close_timeout=5,token_file=/s/token,is_host=false", "t.py"});
    CHECK(r.config.unused_rdzv_conf.at("close_timeout") == "5");
    CHECK(r.config.token_file == "/s/token");
    CHECK(r.config.is_host == false);
    CHECK(contains(r.err, "unknown key 'close_timeout' is ignored"));
    CHECK_FALSE(contains(r.err, "token_file'"));
  }

  TEST_CASE("is_host is read like every boolean, whatever its case") {
    ScopedEnv env;
    for (const char* yes : {"TRUE", "True", "1", "yes", "On"}) {
      CAPTURE(yes);
      CHECK(parse({std::string("--rdzv_conf=is_host=") + yes, "t.py"}).config.is_host == true);
    }
    for (const char* no : {"FALSE", "false", "0", "No", "off"}) {
      CAPTURE(no);
      CHECK(parse({std::string("--rdzv_conf=is_host=") + no, "t.py"}).config.is_host == false);
    }
    CHECK_FALSE(parse({"t.py"}).config.is_host);
  }

  TEST_CASE("torchrun's keep_alive keys set the heartbeat: interval, and timeout = interval * attempts") {
    ScopedEnv env;
    const LaunchConfig c = parse({"--rdzv_conf=keep_alive_interval=2,keep_alive_max_attempt=4", "t.py"}).config;
    CHECK(c.timeouts.heartbeat_interval == 2.0);
    CHECK(c.timeouts.heartbeat_timeout == 8.0);
    // Only the attempts: our interval (1 s by default) times them.
    CHECK(parse({"--rdzv_conf=keep_alive_max_attempt=7", "t.py"}).config.timeouts.heartbeat_timeout == 7.0);
    // Our own keys win over torchrun's when both are given.
    const LaunchConfig d = parse({"--rdzv_conf=keep_alive_interval=2,keep_alive_max_attempt=4,"
                                  "heartbeat_timeout=20", "t.py"}).config;
    CHECK(d.timeouts.heartbeat_interval == 2.0);
    CHECK(d.timeouts.heartbeat_timeout == 20.0);
    const Result r = parse({"--rdzv_conf=keep_alive_interval=3", "t.py"});
    CHECK_FALSE(contains(r.err, "unknown key"));
  }

  TEST_CASE("--shutdown_timeout wins over the rdzv_conf key, then TORCH_ELASTIC_SHUTDOWN_TIMEOUT, then 30") {
    ScopedEnv env;
    CHECK(parse({"--rdzv_conf=shutdown_timeout=4", "t.py"}).config.timeouts.shutdown_timeout == 4.0);
    const LaunchConfig c = parse({"--rdzv_conf=shutdown_timeout=4", "--shutdown_timeout=9", "t.py"}).config;
    CHECK(c.timeouts.shutdown_timeout == 9.0);
    env.set("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "12");
    CHECK(parse({"t.py"}).config.timeouts.shutdown_timeout == 12.0);
    CHECK(parse({"--rdzv_conf=shutdown_timeout=4", "t.py"}).config.timeouts.shutdown_timeout == 4.0);
    CHECK(parse({"--shutdown-timeout=5", "t.py"}).config.timeouts.shutdown_timeout == 5.0);
    env.set("PET_SHUTDOWN_TIMEOUT", "6");
    CHECK(parse({"t.py"}).config.timeouts.shutdown_timeout == 6.0);
    env.unset("PET_SHUTDOWN_TIMEOUT");
    env.set("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "soon");
    const LaunchError e = refusal({"t.py"});
    CHECK(contains(e.what(), "TORCH_ELASTIC_SHUTDOWN_TIMEOUT=soon"));
  }

  TEST_CASE("signals are taken by name, short name or number") {
    ScopedEnv env;
    const LaunchConfig c = parse({"--signals_to_handle=sigint, USR2,15,SIGINT", "t.py"}).config;
    CHECK(c.signals_to_handle == std::vector<int>{SIGINT, SIGUSR2, SIGTERM});
  }
}

TEST_SUITE("torchrun 2.x command lines are accepted") {
  TEST_CASE("a unique prefix of a long option is that option, as argparse allows") {
    ScopedEnv env;
    const LaunchConfig c = parse({"--nnode", "2", "--node_r=1", "--nproc=3", "--max-re", "4",
                                  "--rdzv_b=c10d", "--rdzv-endp", "head", "--virt", "t.py"}).config;
    CHECK(c.max_nodes == 2);
    CHECK(c.node_rank == 1);
    CHECK(c.nproc_per_node == 3);
    CHECK(c.max_restarts == 4);
    CHECK(c.rdzv_backend == RendezvousBackend::kC10d);
    CHECK(c.rdzv_endpoint->host == "head");
    CHECK(c.virtual_local_rank);
    CHECK(parse({"--stand", "t.py"}).config.standalone);
    // A newer option of ddplaunch's own (--standby) does not take that prefix from --standalone.
    CHECK(parse({"--standb=on", "t.py"}).config.standby == LaunchConfig::Standby::kOn);
    CHECK(parse({"--stand", "t.py"}).config.standby == LaunchConfig::Standby::kAuto);  // the default, untouched
    CHECK(parse({"--no_p", "/bin/true"}).config.no_python);
    // An exact name wins over longer names it is a prefix of (--tee, not --tee_anything).
    CHECK(parse({"--tee=1", "t.py"}).config.tee.default_value == 1);
    // --he is --help.
    std::vector<const char*> argv{"ddplaunch", "--he"};
    std::ostringstream out;
    ParseContext context;
    context.out = &out;
    CHECK_THROWS_AS(ddp::launcher::parse_command_line(2, argv.data(), context), LaunchError);
    CHECK(contains(out.str(), "SYNOPSIS"));
  }

  TEST_CASE("the requested names --health_check, --health_check_interval, --max_restarts_without_progress are exact aliases") {
    ScopedEnv env;
    const LaunchConfig c = parse({"--health_check=true", "--health-check-interval=7",
                                  "--max_restarts_without_progress", "3", "t.py"}).config;
    CHECK(c.health_check == "true");
    CHECK(c.health_check_interval == 7.0);
    CHECK(c.max_restarts_without_progress == 3);
    const LaunchConfig d = parse({"--health-check", "gpu", "--health_check_interval", "2",
                                  "--max-restarts-without-progress=4", "t.py"}).config;
    CHECK(d.health_check == "gpu");
    CHECK(d.health_check_interval == 2.0);
    CHECK(d.max_restarts_without_progress == 4);
    // The last occurrence wins, whichever name it uses.
    CHECK(parse({"--check_health=a", "--health_check=b", "t.py"}).config.health_check == "b");
    CHECK(parse({"--crash_loop_limit=5", "--max_restarts_without_progress=1", "t.py"})
              .config.max_restarts_without_progress == 1);
    // A bad value is named as written.
    CHECK(contains(refusal({"--health_check_interval=0", "t.py"}).what(), "--health_check_interval"));
    // --max_restarts is still exact, and its abbreviations still unambiguous.
    const LaunchConfig e = parse({"--max_restarts=2", "t.py"}).config;
    CHECK(e.max_restarts == 2);
    CHECK(e.max_restarts_without_progress == 0);
    CHECK(parse({"--max_r=3", "t.py"}).config.max_restarts == 3);
    CHECK(parse({"--max", "6", "t.py"}).config.max_restarts == 6);
    // Aliases are exact only: no abbreviation of them, so --he and --hel stay --help.
    for (const char* help : {"--he", "--hel"}) {
      std::vector<const char*> argv{"ddplaunch", help};
      std::ostringstream out;
      ParseContext context;
      context.out = &out;
      CHECK_THROWS_AS(ddp::launcher::parse_command_line(2, argv.data(), context), LaunchError);
      CHECK(contains(out.str(), "SYNOPSIS"));
    }
    CHECK(contains(refusal({"--health_chec=x", "t.py"}).what(), "unknown option '--health_chec'"));
    CHECK(contains(refusal({"--max_restarts_without=1", "t.py"}).what(), "unknown option"));
    // --help lists them beside the options they name.
    const std::string help = ddp::launcher::help_text();
    for (const char* alias : {"--health_check,", "--health-check", "--health_check_interval,",
                              "--health-check-interval", "--max_restarts_without_progress,",
                              "--max-restarts-without-progress"}) {
      CHECK_MESSAGE(contains(help, alias), "missing " << alias);
    }
  }

  TEST_CASE("an ambiguous prefix names every option it could be") {
    ScopedEnv env;
    const LaunchError e = refusal({"--no", "t.py"});
    CHECK(contains(e.what(), "ambiguous option: --no could match --node_rank, --no_python"));
    CHECK(e.exit_code() == static_cast<int>(ExitCode::kUsage));
  }

  TEST_CASE("Kubeflow's PET_STANDALONE=\"\" counts as unset") {
    ScopedEnv env;
    env.set("PET_STANDALONE", "");
    CHECK_FALSE(parse({"t.py"}).config.standalone);
    env.set("PET_STANDALONE", "1");
    CHECK(parse({"t.py"}).config.standalone);
  }

  TEST_CASE("--spare needs a rendezvous daemon and no --node_rank") {
    CHECK(parse({"--spare", "--nnodes=2", "--rdzv_backend=c10d", "--rdzv_endpoint=head", "t.py"}).config.spare);
    CHECK(contains(refusal({"--spare", "t.py"}).what(), "--spare needs a rendezvous daemon"));
    CHECK(contains(refusal({"--spare", "--standalone", "t.py"}).what(), "--spare needs a rendezvous daemon"));
    CHECK(contains(refusal({"--spare", "--node_rank=1", "--nnodes=2", "--rdzv_backend=c10d", "--rdzv_endpoint=head",
                            "t.py"}).what(),
                   "a spare takes the group rank of the node it replaces"));
  }

  TEST_CASE("--straggler, --straggler_factor and --straggler_window: defaults, values, and bad ones named") {
    const LaunchConfig d = parse({"t.py"}).config;
    CHECK(d.straggler == ddp::rdzv::StragglerPolicy{"report", 1.5, 60});
    CHECK_FALSE(d.straggler_given);
    const LaunchConfig c = parse({"--straggler=REPLACE", "--straggler_factor=1.8", "--straggler-window", "120", "t.py"}).config;
    CHECK(c.straggler == ddp::rdzv::StragglerPolicy{"replace", 1.8, 120});
    CHECK(c.straggler_given);
    CHECK(parse({"--straggler=off", "t.py"}).config.straggler.mode == "off");
    CHECK(contains(refusal({"--straggler=evict", "t.py"}).what(), "--straggler=evict: accepted: off, report"));
    for (const char* bad : {"--straggler_factor=1", "--straggler_factor=x", "--straggler_factor=101"}) {
      CHECK(contains(refusal({bad, "t.py"}).what(), "accepted: a number from 1.05 to 100"));
    }
    for (const char* bad : {"--straggler_window=0.5", "--straggler_window=-1", "--straggler_window=soon"}) {
      CHECK(contains(refusal({bad, "t.py"}).what(), "--straggler_window"));
    }
  }

  TEST_CASE("--virtual_local_rank needs a device per local rank in CUDA_VISIBLE_DEVICES") {
    ScopedEnv env;
    env.set("CUDA_VISIBLE_DEVICES", "3,5");
    CHECK(parse({"--virtual-local-rank", "--nproc_per_node=2", "t.py"}).config.virtual_local_rank);
    const LaunchError e = refusal({"--virtual_local_rank", "--nproc_per_node=3", "t.py"});
    CHECK(contains(e.what(), "CUDA_VISIBLE_DEVICES=3,5 names fewer devices than --nproc_per_node=3"));
    env.unset("CUDA_VISIBLE_DEVICES");
    CHECK(parse({"--virtual_local_rank", "--nproc_per_node=3", "t.py"}).config.nproc_per_node == 3);
  }

  TEST_CASE("the Python plug-in options accept their defaults; console events map onto --event_log") {
    ScopedEnv env;
    CHECK_NOTHROW(parse({"--logs-specs=default", "--event_log_handler", "null", "t.py"}));
    env.set("PET_LOGS_SPECS", "my_specs");
    CHECK(contains(refusal({"t.py"}).what(), "PET_LOGS_SPECS=my_specs"));
    env.unset("PET_LOGS_SPECS");
    env.set("PET_EVENT_LOG_HANDLER", "console");
    CHECK(parse({"t.py"}).config.event_log == "-");
    CHECK(parse({"--event_log=ev.jsonl", "t.py"}).config.event_log == "ev.jsonl");  // an explicit file wins
    env.set("PET_EVENT_LOG_HANDLER", "fancy");
    CHECK(contains(refusal({"t.py"}).what(), "PET_EVENT_LOG_HANDLER=fancy"));
  }

  TEST_CASE("duplicate filters: ',,' is a comma, an empty value copies nothing") {
    ScopedEnv env;
    CHECK(parse({"--duplicate_stdout_filters=", "t.py"}).config.duplicate_stdout_filters.empty());
    CHECK(parse({"--duplicate_stdout_filters=a,,b,,", "t.py"}).config.duplicate_stdout_filters ==
          std::vector<std::string>{"a,b,"});
    env.set("PET_DUPLICATE_STDERR_FILTERS", "x,y");
    CHECK(parse({"t.py"}).config.duplicate_stderr_filters == std::vector<std::string>{"x", "y"});
  }
}

TEST_SUITE("tee and redirects accept a level or a per-rank map") {
  TEST_CASE("a single level applies to every local rank") {
    const auto spec = ddp::launcher::parse_std_spec("2", "--tee");
    CHECK(spec.default_value == 2);
    CHECK(spec.per_rank.empty());
    CHECK(spec.for_rank(7) == 2);
  }

  TEST_CASE("a map sets listed ranks and leaves the others at 0") {
    const auto spec = ddp::launcher::parse_std_spec("0:3,1:1,12:2", "--redirects");
    CHECK(spec.for_rank(0) == 3);
    CHECK(spec.for_rank(1) == 1);
    CHECK(spec.for_rank(12) == 2);
    CHECK(spec.for_rank(2) == 0);
  }

  TEST_CASE("malformed maps are refused") {
    for (const char* bad : {"4", "-1", "a", "0:", ":1", "0:1,", "0:1:2", "0-1"}) {
      CAPTURE(bad);
      CHECK_THROWS_AS(ddp::launcher::parse_std_spec(bad, "--tee"), LaunchError);
    }
  }
}

TEST_SUITE("nproc_per_node counts GPUs honouring CUDA_VISIBLE_DEVICES") {
  TEST_CASE("auto, gpu and cpu resolve to a count") {
    ScopedEnv env;
    CHECK(parse({"--nproc_per_node=gpu", "t.py"}, 4).config.nproc_per_node == 4);
    CHECK(parse({"--nproc_per_node=auto", "t.py"}, 2).config.nproc_per_node == 2);
    CHECK(parse({"--nproc_per_node=auto", "t.py"}, 0, 6).config.nproc_per_node == 6);
    const LaunchConfig c = parse({"--nproc_per_node=cpu", "t.py"}, 8, 3).config;
    CHECK(c.nproc_per_node == 3);
  }

  TEST_CASE("CUDA_VISIBLE_DEVICES narrows the physical GPUs as the CUDA runtime does") {
    using ddp::agent::apply_cuda_visible_devices;
    CHECK(apply_cuda_visible_devices(4, nullptr) == 4);
    CHECK(apply_cuda_visible_devices(4, "") == 0);
    CHECK(apply_cuda_visible_devices(4, "0,2") == 2);
    CHECK(apply_cuda_visible_devices(4, " 3 ") == 1);
    CHECK(apply_cuda_visible_devices(4, "-1") == 0);
    CHECK(apply_cuda_visible_devices(4, "0,-1,1") == 1);
    CHECK(apply_cuda_visible_devices(4, "1,7,2") == 1);
    CHECK(apply_cuda_visible_devices(4, "1,1") == 1);
    CHECK(apply_cuda_visible_devices(2, "GPU-aaaa,GPU-bbbb,GPU-cccc") == 2);
    CHECK(apply_cuda_visible_devices(0, "0") == 0);
  }

  TEST_CASE("GPUs are counted from /proc/driver/nvidia/gpus, else /dev/nvidiaN") {
    namespace fs = std::filesystem;
    const fs::path root = fs::temp_directory_path() /
                          ("ddplaunch-gpu-test-" + std::to_string(::getpid()));
    fs::remove_all(root);
    fs::create_directories(root / "proc");
    fs::create_directories(root / "dev");
    for (const char* name : {"nvidia0", "nvidia1", "nvidia2", "nvidiactl", "nvidia-uvm", "nvidia-modeset"}) {
      std::ofstream(root / "dev" / name).put('x');
    }
    using ddp::agent::count_visible_gpus;
    CHECK(count_visible_gpus((root / "proc").string(), (root / "dev").string(), nullptr) == 3);
    CHECK(count_visible_gpus((root / "proc").string(), (root / "dev").string(), "2") == 1);
    fs::create_directories(root / "proc" / "0000:17:00.0");
    fs::create_directories(root / "proc" / "0000:65:00.0");
    CHECK(count_visible_gpus((root / "proc").string(), (root / "dev").string(), nullptr) == 2);
    CHECK(count_visible_gpus((root / "missing").string(), (root / "missing").string(), nullptr) == 0);
    fs::remove_all(root);
  }

  TEST_CASE("gpu and auto use this machine's counters when no test seam is given") {
    // ParseContext without counters: the real probes (tests/agent/numa_test.cpp checks them
    // against /proc and the affinity mask). CUDA_VISIBLE_DEVICES="" hides every GPU.
    ScopedEnv env;
    env.set("CUDA_VISIBLE_DEVICES", "");
    std::vector<const char*> argv{"ddplaunch", "--nproc_per_node=auto", "t.py"};
    const LaunchConfig c = ddp::launcher::parse_command_line(3, argv.data());
    CHECK(c.nproc_per_node == ddp::agent::count_usable_cpus());
    argv[1] = "--nproc_per_node=gpu";
    CHECK_THROWS_WITH_AS(ddp::launcher::parse_command_line(3, argv.data()),
                         doctest::Contains("CUDA_VISIBLE_DEVICES=)"), LaunchError);
  }
}

TEST_SUITE("help reads like a man page and exits 0") {
  TEST_CASE("--help prints every section and option with its default, and exits 0") {
    for (const char* flag : {"--help", "-h"}) {
      ScopedEnv env;
      std::vector<const char*> argv{"ddplaunch", flag, "--nnodes=0"};
      std::ostringstream out;
      ParseContext context;
      context.out = &out;
      try {
        ddp::launcher::parse_command_line(static_cast<int>(argv.size()), argv.data(), context);
        FAIL("--help did not stop the parse");
      } catch (const LaunchError& e) {
        CHECK(e.exit_code() == static_cast<int>(ExitCode::kSuccess));
        CHECK(std::string(e.what()).empty());
      }
      const std::string help = out.str();
      CHECK(help == ddp::launcher::help_text());
      for (const char* section : {"SYNOPSIS", "DESCRIPTION", "OPTIONS", "Workers", "Rendezvous",
                                  "Fault tolerance", "Logs", "Environment check", "EXIT STATUS",
                                  "ENVIRONMENT", "EXAMPLES", "128+N", "PYTHON_EXEC",
                                  "TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE"}) {
        CHECK_MESSAGE(contains(help, section), "missing " << section);
      }
      for (const FlagCase& f : flag_cases()) {
        CHECK_MESSAGE(contains(help, std::string("--") + f.name), "missing --" << f.name);
        CHECK_MESSAGE(contains(help, "PET_" + upper(f.name)), "missing PET_" << upper(f.name));
        if (dashed(f.name) != f.name) CHECK(contains(help, "--" + dashed(f.name)));
      }
      CHECK(contains(help, "--nproc_per_node, --nproc-per-node N|auto|cpu|gpu"));
      // The master port's default says what happens (a free port on one node).
      std::string flat;  // the help with its line wrapping undone
      for (char c : help) {
        if (c == '\n' || c == ' ') {
          if (!flat.empty() && flat.back() != ' ') flat += ' ';
        } else {
          flat += c;
        }
      }
      CHECK(contains(flat, "Default: 29500 for the static backend on several nodes; a single-node job picks a "
                           "free port for each round"));
      std::istringstream lines(help);
      std::string line;
      while (std::getline(lines, line)) {
        CAPTURE(line);
        CHECK(line.size() <= 80);
      }
    }
  }

  TEST_CASE("--version prints the version and exits 0") {
    ScopedEnv env;
    std::vector<const char*> argv{"ddplaunch", "--version"};
    std::ostringstream out;
    ParseContext context;
    context.out = &out;
    try {
      ddp::launcher::parse_command_line(static_cast<int>(argv.size()), argv.data(), context);
      FAIL("--version did not stop the parse");
    } catch (const LaunchError& e) {
      CHECK(e.exit_code() == static_cast<int>(ExitCode::kSuccess));
    }
    CHECK(out.str() == std::string("ddplaunch ") + DDPLAUNCH_EXPECTED_VERSION + "\n");
  }

  TEST_CASE("--help after the program belongs to the program") {
    ScopedEnv env;
    const Result r = parse({"train.py", "--help"});
    CHECK(r.out.empty());
    CHECK(r.config.program_args == std::vector<std::string>{"--help"});
  }
}

// --in_memory_restart, from the command line or PET_IN_MEMORY_RESTART.
TEST_CASE("--in_memory_restart is off, on or auto (the default); anything else is refused with the accepted values") {
  ScopedEnv env;
  CHECK(parse({"t.py"}).config.in_memory_restart == LaunchConfig::InMemoryRestart::kAuto);
  CHECK(parse({"--in_memory_restart=off", "t.py"}).config.in_memory_restart == LaunchConfig::InMemoryRestart::kOff);
  CHECK(parse({"--in-memory-restart", "on", "t.py"}).config.in_memory_restart == LaunchConfig::InMemoryRestart::kOn);
  const LaunchError e = refusal({"--in_memory_restart=yes", "t.py"});
  CHECK(e.exit_code() == static_cast<int>(ddp::ExitCode::kUsage));
  CHECK(contains(e.what(), "--in_memory_restart"));
  CHECK(contains(e.what(), "off, on, auto"));
  env.set("PET_IN_MEMORY_RESTART", "off");
  CHECK(parse({"t.py"}).config.in_memory_restart == LaunchConfig::InMemoryRestart::kOff);
  CHECK(parse({"--in_memory_restart=on", "t.py"}).config.in_memory_restart == LaunchConfig::InMemoryRestart::kOn);
  env.set("PET_IN_MEMORY_RESTART", "sometimes");
  CHECK(contains(refusal({"t.py"}).what(), "sometimes"));
}

// A list of rendezvous endpoints (standby daemons) and reconnect_timeout.
TEST_CASE("--rdzv_endpoint takes a list of standby endpoints; the first is the rendezvous and a bad item is refused") {
  ScopedEnv env;
  const Result r = parse({"--rdzv_backend=c10d", "--nnodes=2", "--rdzv_endpoint=head:29401,standby:29402,third",
                          "--rdzv_conf=reconnect_timeout=120", "t.py"});
  REQUIRE(r.config.rdzv_endpoint);
  CHECK(r.config.rdzv_endpoint->text() == "head:29401");
  REQUIRE(r.config.rdzv_standby_endpoints.size() == 2);
  CHECK(r.config.rdzv_standby_endpoints[0].text() == "standby:29402");
  CHECK(r.config.rdzv_standby_endpoints[1].text() == "third:29400");
  CHECK(r.config.reconnect_timeout == 120);
  CHECK(parse({"--rdzv_backend=c10d", "--nnodes=2", "--rdzv_endpoint=head", "t.py"}).config.reconnect_timeout == 60);
  CHECK(r.err.find("unknown key") == std::string::npos);
  const LaunchError e = refusal({"--rdzv_backend=c10d", "--nnodes=2", "--rdzv_endpoint=head:29401,standby:99999", "t.py"});
  CHECK(std::string(e.what()).find("99999") != std::string::npos);
  const LaunchError t = refusal({"--rdzv_backend=c10d", "--rdzv_conf=reconnect_timeout=-1", "t.py"});
  CHECK(std::string(t.what()).find("reconnect_timeout") != std::string::npos);
}
