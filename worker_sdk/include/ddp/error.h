// Errors thrown by the worker SDK. Every SDK error derives from ddp::Error, so a program can
// catch one type at the top of main; the subclasses say which layer failed.
#pragma once

#include <stdexcept>
#include <string>

namespace ddp {

class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& what) : std::runtime_error(what) {}
};

// The worker environment (RANK, WORLD_SIZE, ...) is missing, partial or inconsistent.
class EnvError : public Error {
 public:
  using Error::Error;
};

// The store or a collective failed or timed out.
class CommError : public Error {
 public:
  using Error::Error;
};

// The agent abandoned this worker's round (a peer failed) while a collective waited, and the
// Trainer can restart in memory: it catches this, parks and continues in the next round. Thrown
// only inside Trainer::fit(); code in its hooks that catches CommError must rethrow it.
class RoundAbandoned : public CommError {
 public:
  using CommError::CommError;
};

// Ranks disagree on something that must be identical everywhere (parameter set, checkpoint).
class MismatchError : public Error {
 public:
  using Error::Error;
};

// A checkpoint could not be written, or a given file is not a valid checkpoint.
class CheckpointError : public Error {
 public:
  using Error::Error;
};

// A checkpoint's lineage refuses it: it was written in another environment (another
// DDPLAUNCH_ENV_FINGERPRINT) and DDPLAUNCH_ENV_CHECK is strict (ddp/lineage.h). The message is
// one line with the ways out; `train` exits 3 on it.
class LineageError : public Error {
 public:
  using Error::Error;
};

// Bad arguments to an SDK call (batch size 0, unknown backend, ...).
class UsageError : public Error {
 public:
  using Error::Error;
};

}  // namespace ddp
