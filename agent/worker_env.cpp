#include "agent/worker_env.h"

#include <arpa/inet.h>
#include <ifaddrs.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <stdexcept>
#include <system_error>

#include "agent/standby.h"         // kStandbyFdVariable
#include "contracts/worker_channel.h"  // kWorkerFdVariable
#include "rendezvous/error.h"

extern char** environ;

namespace ddp::agent {

namespace {
// Runs the script the way torchrun's --run_path does (runpy.run_path as __main__), but in a
// worker process of its own rather than inside the launcher.
constexpr const char* kRunPathBootstrap =
    "import runpy, sys; sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')";
// torchrun 2.x's virtual local rank (LocalElasticAgent._set_local_rank_env).
void narrow_to_own_device(int local_rank, const std::map<std::string, std::string>& inherited,
                          std::map<std::string, std::string>& env) {
  env["LOCAL_RANK"] = "0";
  // HIP_VISIBLE_DEVICES wins over CUDA_VISIBLE_DEVICES on ROCm, so it is the source when set.
  const auto hip = inherited.find("HIP_VISIBLE_DEVICES");
  const bool use_hip = hip != inherited.end() && !hip->second.empty();
  const auto source = use_hip ? hip : inherited.find("CUDA_VISIBLE_DEVICES");
  std::string device = std::to_string(local_rank);
  if (source != inherited.end()) {
    std::vector<std::string> devices;
    std::string::size_type start = 0;
    for (;;) {
      const auto comma = source->second.find(',', start);
      devices.push_back(source->second.substr(start, comma == std::string::npos ? comma : comma - start));
      if (comma == std::string::npos) break;
      start = comma + 1;
    }
    if (local_rank >= static_cast<int>(devices.size())) {
      throw LaunchError(ExitCode::kUsage, "--virtual_local_rank: local rank " + std::to_string(local_rank) +
                                  " has no device in " + source->first + "=" + source->second);
    }
    device = devices[local_rank];
    const auto first = device.find_first_not_of(" \t");
    device = first == std::string::npos ? "" : device.substr(first, device.find_last_not_of(" \t") - first + 1);
  }
  env["CUDA_VISIBLE_DEVICES"] = device;
  if (use_hip) env["HIP_VISIBLE_DEVICES"] = device;
}

}  // namespace

std::vector<std::string> worker_argv(const WorkerCommand& command) {
  std::vector<std::string> argv;
  if (command.no_python) {
    argv.push_back(command.program);
  } else {
    argv = {command.python, "-u"};
    if (command.module) {
      argv.insert(argv.end(), {"-m", command.program});
    } else if (command.run_path) {
      argv.insert(argv.end(), {"-c", kRunPathBootstrap, command.program});
    } else {
      argv.push_back(command.program);
    }
  }
  argv.insert(argv.end(), command.args.begin(), command.args.end());
  return argv;
}

std::map<std::string, std::string> worker_env(const RoundEnv& round, int local_rank,
                                              const std::string& error_file,
                                              const std::map<std::string, std::string>& inherited) {
  const auto& a = round.assignment;
  auto inherited_or = [&](const char* name, const std::string& fallback) {
    auto it = inherited.find(name);
    return it == inherited.end() ? fallback : it->second;
  };
  std::map<std::string, std::string> env;
  env["RANK"] = std::to_string(a.rank_offset + local_rank);
  env["LOCAL_RANK"] = std::to_string(local_rank);
  env["WORLD_SIZE"] = std::to_string(a.world_size);
  env["LOCAL_WORLD_SIZE"] = std::to_string(round.local_world_size);
  env["GROUP_RANK"] = std::to_string(a.group_rank);
  env["GROUP_WORLD_SIZE"] = std::to_string(a.group_world_size);
  // One role per job: role ranks are the global ranks.
  env["ROLE_RANK"] = env["RANK"];
  env["ROLE_WORLD_SIZE"] = env["WORLD_SIZE"];
  env["ROLE_NAME"] = round.role;
  env["MASTER_ADDR"] = a.master_addr;
  env["MASTER_PORT"] = std::to_string(a.master_port);
  env["TORCHELASTIC_RESTART_COUNT"] = std::to_string(a.restart_count);
  env["TORCHELASTIC_MAX_RESTARTS"] = std::to_string(a.max_restarts);
  env["TORCHELASTIC_RUN_ID"] = round.run_id;
  // We host no TCPStore for the workers: rank 0 creates its own at MASTER_PORT.
  env["TORCHELASTIC_USE_AGENT_STORE"] = "False";
  env["TORCHELASTIC_ERROR_FILE"] = error_file;
  env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = inherited_or("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1");
  env["NCCL_ASYNC_ERROR_HANDLING"] = inherited_or("NCCL_ASYNC_ERROR_HANDLING", "1");
  // torchrun 2.x's --signals_to_handle (ddplaunch exports the flag's text, as run.py does), or
  // its default for an agent started without the launcher.
  env["TORCHELASTIC_SIGNALS_TO_HANDLE"] =
      inherited_or("TORCHELASTIC_SIGNALS_TO_HANDLE", "SIGTERM,SIGINT,SIGHUP,SIGQUIT");
  if (round.set_omp_num_threads) env["OMP_NUM_THREADS"] = "1";
  env["DDPLAUNCH_GENERATION"] = std::to_string(a.generation);
  if (!round.gloo_socket_ifname.empty()) env["GLOO_SOCKET_IFNAME"] = round.gloo_socket_ifname;
  if (round.virtual_local_rank) narrow_to_own_device(local_rank, inherited, env);
  return env;
}

namespace {

// What every worker gets from `setup`, the same in every round: the environment's digest that
// checkpoints record; for a Python worker, what it needs from its interpreter's start: `import
// ddplaunch` and its start-up hook (python/sitecustomize.py, which runs the sitecustomize it
// hides), and faulthandler for the stacks of a hung worker. The helper directory goes first, so
// that a sitecustomize on the user's PYTHONPATH does not hide ours.
void add_setup_env(const WorkerSetup& setup, const std::map<std::string, std::string>& inherited,
                   std::map<std::string, std::string>& env) {
  if (!setup.env_digest.empty()) {
    env["DDPLAUNCH_ENV_FINGERPRINT"] = setup.env_digest;
    env["DDPLAUNCH_ENV_CHECK"] = setup.env_check;
  } else {  // an outer launcher's digest is not this job's
    env.erase("DDPLAUNCH_ENV_FINGERPRINT");
    env.erase("DDPLAUNCH_ENV_CHECK");
  }
  if (!setup.python) return;
  if (!setup.python_helper_dir.empty()) {
    auto& path = env["PYTHONPATH"];
    path = path.empty() ? setup.python_helper_dir : setup.python_helper_dir + ":" + path;
  }
  if (setup.fault_handler && inherited.count("PYTHONFAULTHANDLER") == 0) env["PYTHONFAULTHANDLER"] = "1";
}

}  // namespace

std::map<std::string, std::string> build_worker_env(const RoundEnv& round, const WorkerSetup& setup, int local_rank,
                                                    const std::string& error_file,
                                                    const std::map<std::string, std::string>& inherited) {
  std::map<std::string, std::string> env = inherited;
  for (auto& [k, v] : worker_env(round, local_rank, error_file, inherited)) env[k] = std::move(v);
  if (!setup.progress_file.empty()) {
    env["DDPLAUNCH_PROGRESS_FILE"] = setup.progress_file;
    env["DDPLAUNCH_PROGRESS_SLOT"] = std::to_string(local_rank);
  }
  if (!setup.timer_file.empty()) env["TORCHELASTIC_TIMER_FILE"] = setup.timer_file;
  add_setup_env(setup, inherited, env);
  return env;
}

std::map<std::string, std::string> build_standby_env(const WorkerSetup& setup, int local_world_size, int standby_fd,
                                                     const std::map<std::string, std::string>& inherited) {
  std::map<std::string, std::string> env = inherited;
  if (should_set_omp_num_threads(local_world_size, inherited)) env["OMP_NUM_THREADS"] = "1";
  add_setup_env(setup, inherited, env);
  env[kStandbyFdVariable] = std::to_string(standby_fd);
  return env;
}

void set_worker_channel(std::map<std::string, std::string>& env, int fd) {
  if (fd < 0) {
    env.erase(contracts::kWorkerFdVariable);
  } else {
    env[contracts::kWorkerFdVariable] = std::to_string(fd);
  }
}

std::string interface_towards(const std::string& addr) {
  sockaddr_storage ss{};
  socklen_t len = 0;
  auto* v4 = reinterpret_cast<sockaddr_in*>(&ss);
  auto* v6 = reinterpret_cast<sockaddr_in6*>(&ss);
  if (::inet_pton(AF_INET, addr.c_str(), &v4->sin_addr) == 1) {
    if ((ntohl(v4->sin_addr.s_addr) >> 24) == 127) return "";
    v4->sin_family = AF_INET;
    v4->sin_port = htons(9);
    len = sizeof(sockaddr_in);
  } else if (::inet_pton(AF_INET6, addr.c_str(), &v6->sin6_addr) == 1) {
    if (IN6_IS_ADDR_LOOPBACK(&v6->sin6_addr)) return "";
    v6->sin6_family = AF_INET6;
    v6->sin6_port = htons(9);
    len = sizeof(sockaddr_in6);
  } else {
    return "";
  }
  int fd = ::socket(ss.ss_family, SOCK_DGRAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return "";
  sockaddr_storage local{};
  socklen_t local_len = sizeof local;
  bool ok = ::connect(fd, reinterpret_cast<sockaddr*>(&ss), len) == 0 &&
            ::getsockname(fd, reinterpret_cast<sockaddr*>(&local), &local_len) == 0;
  ::close(fd);
  if (!ok) return "";
  std::string name;
  ifaddrs* list = nullptr;
  if (::getifaddrs(&list) != 0) return "";
  for (ifaddrs* it = list; it != nullptr && name.empty(); it = it->ifa_next) {
    if (it->ifa_addr == nullptr || it->ifa_addr->sa_family != local.ss_family) continue;
    if (local.ss_family == AF_INET) {
      auto* a = reinterpret_cast<sockaddr_in*>(it->ifa_addr);
      if (a->sin_addr.s_addr == reinterpret_cast<sockaddr_in*>(&local)->sin_addr.s_addr) name = it->ifa_name;
    } else {
      auto* a = reinterpret_cast<sockaddr_in6*>(it->ifa_addr);
      if (std::memcmp(&a->sin6_addr, &reinterpret_cast<sockaddr_in6*>(&local)->sin6_addr, 16) == 0) {
        name = it->ifa_name;
      }
    }
  }
  ::freeifaddrs(list);
  return name;
}

std::map<std::string, std::string> current_environment() {
  std::map<std::string, std::string> env;
  for (char** e = environ; e && *e; ++e) {
    const char* eq = std::strchr(*e, '=');
    if (!eq) continue;
    env.emplace(std::string(*e, static_cast<std::size_t>(eq - *e)), std::string(eq + 1));
  }
  return env;
}

bool should_set_omp_num_threads(int local_world_size,
                                const std::map<std::string, std::string>& inherited) {
  return local_world_size > 1 && inherited.count("OMP_NUM_THREADS") == 0;
}

int pick_free_port(const std::string& addr) {
  int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) throw LaunchError(ExitCode::kUsage, std::string("pick a free port: socket: ") + std::strerror(errno));
  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  sa.sin_port = 0;
  if (::inet_pton(AF_INET, addr.c_str(), &sa.sin_addr) != 1) sa.sin_addr.s_addr = htonl(INADDR_ANY);
  if (::bind(fd, reinterpret_cast<sockaddr*>(&sa), sizeof sa) != 0) {
    int err = errno;
    ::close(fd);
    throw LaunchError(ExitCode::kUsage, "pick a free port: bind " + addr + ":0: " + std::strerror(err));
  }
  socklen_t len = sizeof sa;
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&sa), &len);
  ::close(fd);
  return ntohs(sa.sin_port);
}

}  // namespace ddp::agent
