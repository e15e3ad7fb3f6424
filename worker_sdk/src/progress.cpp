#include "ddp/progress.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <string>

#include "contracts/progress_slot.h"
#include "standby.h"

namespace ddp {

namespace {
using contracts::kPhaseOffset;
using contracts::kPhaseSize;
using contracts::kSlotSize;
using contracts::word;
}  // namespace

Progress& Progress::instance() {
  static Progress progress;
  return progress;
}

// Any problem (no agent, a file that is not the agent's board) leaves progress off: heartbeats
// are an aid, never a reason for a worker to fail.
Progress::Progress() {
  detail::take_standby_assignment();  // the slot is named by the assignment's environment
  const char* path = std::getenv("DDPLAUNCH_PROGRESS_FILE");
  const char* slot_text = std::getenv("DDPLAUNCH_PROGRESS_SLOT");
  if (path == nullptr || slot_text == nullptr || *slot_text == '\0') return;
  char* end = nullptr;
  const long slot = std::strtol(slot_text, &end, 10);
  if (*end != '\0' || slot < 0) return;
  const int fd = ::open(path, O_RDWR | O_CLOEXEC);
  if (fd < 0) return;
  struct stat st {};
  if (::fstat(fd, &st) != 0 || static_cast<std::size_t>(st.st_size) < (static_cast<std::size_t>(slot) + 1) * kSlotSize) {
    ::close(fd);
    return;
  }
  void* p = ::mmap(nullptr, static_cast<std::size_t>(st.st_size), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  ::close(fd);
  if (p == MAP_FAILED) return;
  slot_ = reinterpret_cast<std::atomic<uint64_t>*>(static_cast<unsigned char*>(p) + static_cast<std::size_t>(slot) * kSlotSize);
  beats_ = slot_[word(contracts::kBeatsOffset)].load(std::memory_order_relaxed);
}

void Progress::step(int64_t step) noexcept {
  if (!slot_) return;
  // The round's first step (the agent cleared the slot when the round began): where it resumed.
  std::atomic<uint64_t>& first = slot_[word(contracts::kFirstStepOffset)];
  if (first.load(std::memory_order_relaxed) == 0 && step >= 0) first.store(static_cast<uint64_t>(step) + 1, std::memory_order_relaxed);
  slot_[word(contracts::kStepOffset)].store(static_cast<uint64_t>(step), std::memory_order_relaxed);
  slot_[word(contracts::kBeatsOffset)].store(++beats_, std::memory_order_release);
}

void Progress::done() noexcept {
  if (slot_) slot_[word(contracts::kBeatsOffset)].store(contracts::kDoneBeats, std::memory_order_release);
}

void Progress::checkpoint(int64_t step) noexcept {
  if (slot_) slot_[word(contracts::kCheckpointOffset)].store(static_cast<uint64_t>(step), std::memory_order_release);
}

void Progress::checkpoint_interval(double seconds) noexcept {
  if (!slot_) return;
  // Milliseconds, clamped: a NaN or a negative interval reads as "none said".
  const double ms = seconds * 1000.0;
  const int64_t value = ms >= 0 && ms < 9.2e18 ? static_cast<int64_t>(ms + 0.5) : 0;
  slot_[word(contracts::kIntervalOffset)].store(static_cast<uint64_t>(value), std::memory_order_relaxed);
}

void Progress::busy(double seconds) noexcept {
  if (!slot_ || !(seconds >= 0) || seconds > 1e6) return;
  // The first steps are warm-up (allocations, caches, a first compile) and say nothing about the
  // hardware; after them about the last ten steps count: one slow step (a garbage collection, a
  // page fault) is not a straggler, and a slow rank shows within a few steps.
  constexpr int kWarmupSteps = 5;
  constexpr double kWeight = 0.1;
  if (busy_steps_ < kWarmupSteps) {
    ++busy_steps_;
    return;
  }
  busy_ = busy_ == 0 ? seconds : busy_ + kWeight * (seconds - busy_);
  slot_[word(contracts::kBusyOffset)].store(static_cast<uint64_t>(busy_ * 1e6 + 0.5), std::memory_order_relaxed);
}

void Progress::checkpoint_stall(double total_seconds) noexcept {
  if (!slot_ || !(total_seconds >= 0) || total_seconds > 1e7) return;
  slot_[word(contracts::kCheckpointStallOffset)].store(static_cast<uint64_t>(total_seconds * 1e6 + 0.5),
                                                       std::memory_order_relaxed);
}

void Progress::final_failure() noexcept {
  if (slot_) slot_[word(contracts::kFinalOffset)].store(1, std::memory_order_release);
}

bool Progress::round_abandoned() const noexcept {
  return slot_ != nullptr && slot_[word(contracts::kAbandonedOffset)].load(std::memory_order_acquire) != 0;
}

void Progress::set_phase(const char* name) noexcept {
  if (!slot_) return;
  char* phase = reinterpret_cast<char*>(slot_) + kPhaseOffset;
  const std::size_t n = std::min(std::strlen(name), kPhaseSize - 1);
  std::memcpy(phase, name, n);
  std::memset(phase + n, 0, kPhaseSize - n);
}

std::string Progress::phase() const {
  if (!slot_) return {};
  const char* phase = reinterpret_cast<const char*>(slot_) + kPhaseOffset;
  return std::string(phase, strnlen(phase, kPhaseSize));
}

}  // namespace ddp
