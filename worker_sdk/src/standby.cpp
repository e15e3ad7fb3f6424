#include "standby.h"

#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <mutex>
#include <string>
#include <vector>

#include "contracts/standby_assignment.h"
#include "contracts/worker_channel.h"

// The mark ddplaunch looks for before it starts a program as a standby (launcher/program.h,
// has_standby_mark): an ELF section that exists only in programs that link this file, that is,
// programs whose worker environment is read through the SDK, where a standby waits. `retain`
// keeps it through --gc-sections.
extern "C" __attribute__((used, retain, section(".ddplaunch_standby"))) const char ddplaunch_standby_mark[] =
    "ddplaunch worker SDK: waits for a standby assignment (DDPLAUNCH_STANDBY_FD), version 1";

namespace ddp::detail {
namespace {

// Who waits for an assignment, in the lines that say why it gave up.
const char* g_waiting = "standby";

[[noreturn]] void give_up(const std::string& why) {
  std::fprintf(stderr, "ddplaunch %s (pid %d): %s; this %s ends without running the program further\n", g_waiting,
               static_cast<int>(::getpid()), why.c_str(), g_waiting);
  std::fflush(stderr);
  ::_exit(1);  // nothing of the program's (atexit handlers, static destructors) runs
}

// The agent ended the channel before an assignment: it is stopping the job, so exit 0. A standby
// leaves without a word (it never was a worker); a parked worker says why, since it was one.
[[noreturn]] void leave_at_agents_end(const std::string& why) {
  if (std::strcmp(g_waiting, "standby") != 0) {
    std::fprintf(stderr, "ddplaunch %s (pid %d): %s before the next assignment; exiting\n", g_waiting,
                 static_cast<int>(::getpid()), why.c_str());
    std::fflush(stderr);
  }
  ::_exit(0);
}

// The socket's descriptor from `variable` (digits only), checked to be a socket; -1 with
// `error` saying why not.
int socket_from(const char* variable, const char* text, std::string& error) {
  const std::string value = text;
  if (value.empty() || value.size() > 9 || value.find_first_not_of("0123456789") != std::string::npos) {
    error = std::string(variable) + "='" + value + "' is not a descriptor number";
    return -1;
  }
  const int fd = std::atoi(value.c_str());
  struct stat st {};
  if (::fstat(fd, &st) != 0 || !S_ISSOCK(st.st_mode)) {
    error = std::string(variable) + "=" + value + " is not an open socket";
    return -1;
  }
  return fd;
}

// Reads the whole message (header, then the length it gives, capped) and the two descriptors
// that come with its first byte. EOF before the first byte: the agent is stopping, exit 0.
std::string receive(int fd, std::vector<int>& fds) {
  std::string message;
  std::size_t want = contracts::kStandbyHeaderSize;
  char buffer[65536];
  while (message.size() < want) {
    iovec iov{buffer, std::min(sizeof buffer, want - message.size())};
    alignas(cmsghdr) char control[CMSG_SPACE(4 * sizeof(int))] = {};
    msghdr msg{};
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control;
    msg.msg_controllen = sizeof control;
    const ssize_t n = ::recvmsg(fd, &msg, MSG_CMSG_CLOEXEC);
    if (n < 0 && errno == EINTR) continue;
    // The agent closed its end without reading our standby_ready frame: a reset, not an EOF.
    if (n < 0 && errno == ECONNRESET && message.empty()) leave_at_agents_end("the agent reset the channel");
    if (n < 0) give_up(std::string("reading the assignment: ") + std::strerror(errno));
    for (cmsghdr* c = CMSG_FIRSTHDR(&msg); c != nullptr; c = CMSG_NXTHDR(&msg, c)) {
      if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS) continue;
      const std::size_t count = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
      for (std::size_t i = 0; i < count; ++i) {
        int passed = -1;
        std::memcpy(&passed, CMSG_DATA(c) + i * sizeof(int), sizeof passed);
        fds.push_back(passed);
      }
    }
    if (msg.msg_flags & MSG_CTRUNC) give_up("the assignment came with more descriptors than stdout and stderr");
    if (n == 0) {
      if (message.empty()) leave_at_agents_end("the agent closed the channel");  // it is stopping
      give_up("the socket closed after " + std::to_string(message.size()) + " bytes of the assignment");
    }
    message.append(buffer, static_cast<std::size_t>(n));
    if (want == contracts::kStandbyHeaderSize && message.size() >= want) {
      // The length the header announces, bounded before anything more is read.
      const auto length = contracts::announced_length(message);
      if (!length || *length > contracts::kMaxStandbyPayload) break;  // decode_assignment says why
      want += *length;
    }
  }
  return message;
}

// Receives an assignment on `fd` and applies it. The socket stays open when the assignment makes
// it the worker's channel (its DDPLAUNCH_WORKER_FD names it), else it is closed.
void take_from(int fd) {
  std::vector<int> fds;
  const std::string message = receive(fd, fds);
  std::string error;
  const auto assignment = contracts::decode_assignment(message, error);
  if (!assignment) give_up("bad assignment: " + error);
  if (fds.size() != 2) give_up("the assignment came with " + std::to_string(fds.size()) + " descriptors, not stdout and stderr");
  if (::chdir(assignment->cwd.c_str()) != 0) {
    give_up("cannot enter the working directory " + assignment->cwd + ": " + std::strerror(errno));
  }
  // What the program wrote before its assignment went to the standby's own streams; none of it
  // may reach the worker's.
  std::cout.flush();
  std::cerr.flush();
  std::fflush(nullptr);
  if (::dup2(fds[0], STDOUT_FILENO) < 0 || ::dup2(fds[1], STDERR_FILENO) < 0) {
    give_up(std::string("dup2 of the worker's streams: ") + std::strerror(errno));
  }
  for (int passed : fds) {
    if (passed > STDERR_FILENO) ::close(passed);
  }
  const auto channel = assignment->env.find(contracts::kWorkerFdVariable);
  if (channel == assignment->env.end() || channel->second != std::to_string(fd)) ::close(fd);
  ::clearenv();
  for (const auto& [name, value] : assignment->env) ::setenv(name.c_str(), value.c_str(), 1);
}

// Writes the whole frame; false when the agent is gone.
bool send_all(int fd, const std::string& frame) {
  std::size_t sent = 0;
  while (sent < frame.size()) {
    const ssize_t n = ::send(fd, frame.data() + sent, frame.size() - sent, MSG_NOSIGNAL);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return false;
    sent += static_cast<std::size_t>(n);
  }
  return true;
}

void take() {
  const char* variable = std::getenv(contracts::kStandbyFdVariable);
  if (variable == nullptr) return;
  std::string error;
  const int fd = socket_from(contracts::kStandbyFdVariable, variable, error);
  if (fd < 0) give_up(error);
  // Loaded: the agent may join now (contracts/worker_channel.h). An agent that has gone shows in
  // take_from.
  send_all(fd, contracts::encode_worker_message(contracts::WorkerMessage::make_standby_ready()));
  take_from(fd);
}

}  // namespace

void take_standby_assignment() {
  static std::once_flag once;
  std::call_once(once, take);
}

int worker_channel() {
  take_standby_assignment();  // a standby's channel is named by its assignment
  const char* variable = std::getenv(contracts::kWorkerFdVariable);
  if (variable == nullptr) return -1;
  std::string error;
  const int fd = socket_from(contracts::kWorkerFdVariable, variable, error);
  if (fd < 0) {
    static std::once_flag said;
    std::call_once(said, [&] {
      std::fprintf(stderr, "[ddp] %s: this worker cannot restart in memory\n", error.c_str());
    });
  }
  return fd;
}

bool tell_restartable(bool value) {
  const int fd = worker_channel();
  return fd >= 0 && send_all(fd, contracts::encode_worker_message(contracts::WorkerMessage::make_restartable(value)));
}

namespace {
std::atomic<bool> g_parking_allowed{false};
}  // namespace

void allow_parking(bool on) { g_parking_allowed.store(on, std::memory_order_relaxed); }
bool parking_allowed() { return g_parking_allowed.load(std::memory_order_relaxed); }

void park(int64_t step) {
  const int fd = worker_channel();
  if (!send_all(fd, contracts::encode_worker_message(contracts::WorkerMessage::make_parked(step)))) {
    leave_at_agents_end(std::string("telling the agent it parked failed (") + std::strerror(errno) + ")");  // agent gone
  }
  // The Trainer defers SIGTERM to the end of a step; a parked worker has none to finish.
  struct sigaction dfl {}, previous {};
  dfl.sa_handler = SIG_DFL;
  sigemptyset(&dfl.sa_mask);
  ::sigaction(SIGTERM, &dfl, &previous);
  g_waiting = "parked worker";
  take_from(fd);
  g_waiting = "standby";
  ::sigaction(SIGTERM, &previous, nullptr);
}

}  // namespace ddp::detail
