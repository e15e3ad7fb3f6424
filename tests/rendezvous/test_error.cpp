// The error currency (rendezvous/error.h): Expected carries a value or why not, LaunchError a
// complete message and the exit code of either program.
#include <doctest/doctest.h>

#include <memory>
#include <stdexcept>
#include <string>

#include "rendezvous/error.h"

using ddp::DaemonExit;
using ddp::ExitCode;
using ddp::Expected;
using ddp::LaunchError;

namespace {

Expected<int> parse_digit(char c) {
  if (c < '0' || c > '9') return ddp::unexpected(std::string("'") + c + "' is not a digit");
  return c - '0';
}

}  // namespace

TEST_CASE("an Expected holds the value or the reason, never both") {
  const auto good = parse_digit('7');
  REQUIRE(good);
  CHECK(good.has_value());
  CHECK(*good == 7);
  CHECK(good.value() == 7);
  CHECK(good.error().empty());

  const auto bad = parse_digit('x');
  CHECK_FALSE(bad);
  CHECK_FALSE(bad.has_value());
  CHECK(bad.error() == "'x' is not a digit");
}

TEST_CASE("reading the value of an error is a bug, reported with the reason") {
  const auto bad = parse_digit('x');
  CHECK_THROWS_WITH_AS(bad.value(), doctest::Contains("'x' is not a digit"), std::logic_error);
  CHECK_THROWS_AS(*bad, std::logic_error);
}

TEST_CASE("a value that cannot be copied moves out of an Expected") {
  Expected<std::unique_ptr<int>> held(std::make_unique<int>(5));
  REQUIRE(held);
  CHECK(**held == 5);
  std::unique_ptr<int> taken = std::move(held).value();
  CHECK(*taken == 5);
  Expected<ddp::Ok> done(ddp::Ok{});
  CHECK(done);
}

TEST_CASE("a LaunchError carries its message and the exit code of either program") {
  const LaunchError usage(ExitCode::kUsage, "ddplaunch: --nnodes=x: not a number");
  CHECK(usage.exit_code() == 2);
  CHECK(std::string(usage.what()) == "ddplaunch: --nnodes=x: not a number");
  CHECK(LaunchError(ExitCode::kRendezvousFailed, "").exit_code() == 3);
  CHECK(LaunchError(DaemonExit::connect, "ddp-rendezvous: cannot reach").exit_code() == 3);
  CHECK(ddp::exit_code_for_signal(15) == 143);
  // What a main catches as std::exception still prints the whole message.
  try {
    throw LaunchError(DaemonExit::usage, "ddp-rendezvous: --port: out of range");
  } catch (const std::exception& e) {
    CHECK(std::string(e.what()) == "ddp-rendezvous: --port: out of range");
  }
}
