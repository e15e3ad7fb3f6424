// The one error currency of ddplaunch's programs: the launcher, its agent and the rendezvous
// daemon (the worker SDK keeps its own `ddp::Error` family, for the programs it runs).
//
// An error has two shapes, one for each side of a boundary:
// - Inside, a function that can fail on its input returns `Expected<T>`: the value, or why not
//   as a reason that does not repeat the input and knows no exit code ("missing ']'"). The
//   caller knows where the input came from and what failure means there, so it adds both.
// - At a boundary, `LaunchError` carries a complete message and the exit code it ends the
//   program with. It is thrown only to reach the one catch of each main (launcher/main.cpp,
//   rendezvous/main.cpp) or the agent shell's one catch around starting a round, which turns
//   it into an event for the supervisor. The rendezvous server's event loop and Asio handlers
//   never see one: they get error codes and the codec's decoded-or-refused values.
//
// Exit codes are API: docs/exit-codes.md (ddplaunch) and docs/cli.md (ddp-rendezvous) list
// them, and each one is tested.
#pragma once

#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>
#include <variant>

namespace ddp {

// The exit codes of ddplaunch.
enum class ExitCode : int {
  kSuccess = 0,            // the job succeeded on every node
  kJobFailed = 1,          // workers failed past the restart budget
  kUsage = 2,              // usage or configuration error; nothing was started
  kRendezvousFailed = 3,   // timeout, closed, refused, version, token or environment mismatch
  kSignalBase = 128,       // 128 + N: ddplaunch got signal N and stopped the workers
};

inline int exit_code_for_signal(int signo) { return static_cast<int>(ExitCode::kSignalBase) + signo; }

// The exit codes of ddp-rendezvous.
enum class DaemonExit : int {
  ok = 0,
  refused = 1,  // drain: the daemon refused (unknown job or node, fewer than MIN left, wrong secret)
  usage = 2,    // a bad flag, a file that cannot be read, a malformed endpoint
  connect = 3,  // cannot bind (serve), cannot reach the daemon or a bad answer (status)
};

// Why a program stops, with its exit code. what() is the whole message, ready to print; an
// empty one (after --help or --version) prints nothing.
class LaunchError : public std::runtime_error {
 public:
  template <class Code, std::enable_if_t<std::is_enum_v<Code>, int> = 0>
  LaunchError(Code code, const std::string& message)
      : std::runtime_error(message), exit_code_(static_cast<int>(code)) {}
  int exit_code() const { return exit_code_; }

 private:
  int exit_code_;
};

// The error half of an Expected: why the input was refused.
struct Unexpected {
  std::string why;
};
inline Unexpected unexpected(std::string why) { return Unexpected{std::move(why)}; }

// The value of an Expected<Ok>: done, nothing to return (C++23 would say expected<void>).
struct Ok {};

// A value or why not, in the manner of C++23's std::expected<T, std::string> (the project is
// C++17). Reading the value of an error is a bug and throws std::logic_error.
template <class T>
class [[nodiscard]] Expected {
 public:
  Expected(T value) : held_(std::in_place_index<0>, std::move(value)) {}  // NOLINT: implicit, as std::expected
  Expected(Unexpected error) : held_(std::in_place_index<1>, std::move(error)) {}  // NOLINT

  bool has_value() const { return held_.index() == 0; }
  explicit operator bool() const { return has_value(); }

  const T& value() const& { return std::get<0>(checked()); }
  T& value() & { return std::get<0>(checked()); }
  T&& value() && { return std::get<0>(std::move(checked())); }
  const T& operator*() const& { return value(); }
  T& operator*() & { return value(); }
  const T* operator->() const { return &value(); }

  // Why not; "" when there is a value.
  const std::string& error() const {
    static const std::string none;
    return has_value() ? none : std::get<1>(held_).why;
  }

 private:
  using Held = std::variant<T, Unexpected>;
  const Held& checked() const {
    if (!has_value()) throw std::logic_error("the value of an error read: " + std::get<1>(held_).why);
    return held_;
  }
  Held& checked() {
    static_cast<const Expected&>(*this).checked();
    return held_;
  }

  Held held_;
};

}  // namespace ddp
