// The background writer of `train --checkpoint-async` (ddp/checkpoint.h, AsyncCheckpointWriter):
// one thread per writer, at most one write in flight, its result collected by poll() or wait().

#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <mutex>
#include <vector>

#include "ddp/checkpoint.h"
#include "ddp/error.h"

namespace ddp {

namespace {

// Every live AsyncCheckpointWriter, for wait_for_all(). Writers are made and destroyed on the
// thread that owns them, as wait_for_all() is called.
std::mutex g_writers_mu;
std::vector<AsyncCheckpointWriter*> g_writers;  // guarded by g_writers_mu

}  // namespace

AsyncCheckpointWriter::AsyncCheckpointWriter(WriteFn write)
    : write_(std::move(write)), thread_([this] { loop(); }) {
  std::lock_guard<std::mutex> lock(g_writers_mu);
  g_writers.push_back(this);
}

void AsyncCheckpointWriter::wait_for_all() {
  std::lock_guard<std::mutex> registry(g_writers_mu);
  for (AsyncCheckpointWriter* writer : g_writers) {
    std::unique_lock<std::mutex> lock(writer->mu_);
    writer->cv_.wait(lock, [writer] { return writer->state_ != State::kWriting; });
  }
}

AsyncCheckpointWriter::~AsyncCheckpointWriter() {
  {
    std::lock_guard<std::mutex> lock(g_writers_mu);
    g_writers.erase(std::remove(g_writers.begin(), g_writers.end(), this), g_writers.end());
  }
  {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [this] { return state_ != State::kWriting; });
    stopping_ = true;
    if (error_) {
      // Nobody is left to report it to: the process is leaving fit() with another error.
      try {
        std::rethrow_exception(error_);
      } catch (const std::exception& e) {
        std::fprintf(stderr, "[ddp] background checkpoint write of step %lld failed: %s\n",
                     static_cast<long long>(step_), e.what());
      } catch (...) {
      }
    }
  }
  cv_.notify_all();
  thread_.join();
}

bool AsyncCheckpointWriter::busy() const {
  std::lock_guard<std::mutex> lock(mu_);
  return state_ == State::kWriting;
}

void AsyncCheckpointWriter::start(int64_t step, CheckpointState snapshot, CopyFn finish_copy) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (state_ == State::kWriting) {
      throw UsageError("AsyncCheckpointWriter: the write of step " + std::to_string(step_) +
                       " is in flight; at most one at a time");
    }
    if (state_ == State::kFinished) {
      throw UsageError("AsyncCheckpointWriter: the write of step " + std::to_string(step_) +
                       " finished and was not collected (poll or wait first)");
    }
    state_ = State::kWriting;
    step_ = step;
    snapshot_ = std::move(snapshot);
    finish_copy_ = std::move(finish_copy);
    copying_ = static_cast<bool>(finish_copy_);
  }
  cv_.notify_all();
}

void AsyncCheckpointWriter::wait_copied() {
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait(lock, [this] { return !copying_; });
}

std::optional<AsyncCheckpointWriter::Done> AsyncCheckpointWriter::poll() {
  std::lock_guard<std::mutex> lock(mu_);
  if (state_ != State::kFinished) return std::nullopt;
  state_ = State::kIdle;
  if (error_) {
    std::exception_ptr error = error_;
    error_ = nullptr;
    std::rethrow_exception(error);
  }
  std::optional<Done> done = std::move(done_);
  done_.reset();
  return done;
}

std::optional<AsyncCheckpointWriter::Done> AsyncCheckpointWriter::wait() {
  {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [this] { return state_ != State::kWriting; });
  }
  return poll();
}

void AsyncCheckpointWriter::loop() {
#ifdef __linux__
  // Below the training thread: on a host with no idle core the write takes what the training
  // leaves instead of half of its core. Best effort; a failure leaves the priority as it was.
  ::setpriority(PRIO_PROCESS, static_cast<id_t>(::syscall(SYS_gettid)), 10);
#endif
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    cv_.wait(lock, [this] { return stopping_ || state_ == State::kWriting; });
    if (state_ != State::kWriting) return;  // stopping, nothing in flight
    const int64_t step = step_;
    CheckpointState snapshot = std::move(snapshot_);
    CopyFn finish_copy = std::move(finish_copy_);
    finish_copy_ = nullptr;
    lock.unlock();
    Done done;
    done.step = step;
    std::exception_ptr error;
    const auto start = std::chrono::steady_clock::now();
    if (finish_copy) {
      try {
        snapshot = finish_copy(std::move(snapshot));
      } catch (...) {
        error = std::current_exception();
      }
      finish_copy = nullptr;  // nothing of the live state stays referenced from here
      lock.lock();
      copying_ = false;
      lock.unlock();
      cv_.notify_all();
    }
    if (!error) {
      try {
        done.path = write_(step, snapshot, [&done](const std::string& line) { done.notices.push_back(line); });
      } catch (...) {
        error = std::current_exception();
      }
    }
    done.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    done.snapshot = std::move(snapshot);
    lock.lock();
    if (error) {
      error_ = error;
    } else {
      done_ = std::move(done);
    }
    state_ = State::kFinished;
    cv_.notify_all();
  }
}

}  // namespace ddp
