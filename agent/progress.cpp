#include "agent/progress.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <system_error>

#include "rendezvous/error.h"

namespace ddp::agent {

using contracts::kAbandonedOffset;
using contracts::kPhaseOffset;

namespace {

// The slot's 64-bit fields are written by another process with plain (aligned) stores or
// atomics; an aligned 8-byte load never tears on the machines we run on.
uint64_t load_u64(const unsigned char* p) {
  return reinterpret_cast<const std::atomic<uint64_t>*>(p)->load(std::memory_order_acquire);
}

void store_u64(unsigned char* p, uint64_t v) {
  reinterpret_cast<std::atomic<uint64_t>*>(p)->store(v, std::memory_order_release);
}

}  // namespace

ProgressBoard::ProgressBoard(int slots) : slots_(std::max(slots, 1)) {
  fd_ = ::memfd_create("ddplaunch-progress", MFD_CLOEXEC);
  if (fd_ < 0) {
    throw LaunchError(ExitCode::kUsage, std::string("ddplaunch: progress board: memfd_create: ") + std::strerror(errno));
  }
  const std::size_t size = kSlotSize * static_cast<std::size_t>(slots_);
  if (::ftruncate(fd_, static_cast<off_t>(size)) != 0) {
    const int err = errno;
    ::close(fd_);
    throw LaunchError(ExitCode::kUsage, std::string("ddplaunch: progress board: ftruncate: ") + std::strerror(err));
  }
  void* p = ::mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd_, 0);
  if (p == MAP_FAILED) {
    const int err = errno;
    ::close(fd_);
    throw LaunchError(ExitCode::kUsage, std::string("ddplaunch: progress board: mmap: ") + std::strerror(err));
  }
  base_ = static_cast<unsigned char*>(p);
  path_ = "/proc/" + std::to_string(::getpid()) + "/fd/" + std::to_string(fd_);
  reset();
}

ProgressBoard::~ProgressBoard() {
  if (base_) ::munmap(base_, kSlotSize * static_cast<std::size_t>(slots_));
  if (fd_ >= 0) ::close(fd_);
}

void ProgressBoard::reset() {
  for (int s = 0; s < slots_; ++s) {
    write(s, ProgressSample{});
    store_u64(base_ + kSlotSize * static_cast<std::size_t>(s) + kAbandonedOffset, 0);
  }
}

void ProgressBoard::abandon_round() {
  for (int s = 0; s < slots_; ++s) store_u64(base_ + kSlotSize * static_cast<std::size_t>(s) + kAbandonedOffset, 1);
}

void ProgressBoard::abandon_slot(int slot) {
  store_u64(base_ + kSlotSize * static_cast<std::size_t>(slot) + kAbandonedOffset, 1);
}

bool ProgressBoard::abandoned(int slot) const {
  return load_u64(base_ + kSlotSize * static_cast<std::size_t>(slot) + kAbandonedOffset) != 0;
}

ProgressSample ProgressBoard::read(int slot) const {
  const unsigned char* p = base_ + kSlotSize * static_cast<std::size_t>(slot);
  ProgressSample out;
  out.beats = load_u64(p + contracts::kBeatsOffset);
  out.step = static_cast<int64_t>(load_u64(p + contracts::kStepOffset));
  out.checkpoint_step = static_cast<int64_t>(load_u64(p + contracts::kCheckpointOffset));
  out.checkpoint_interval_ms = static_cast<int64_t>(load_u64(p + contracts::kIntervalOffset));
  out.final = load_u64(p + contracts::kFinalOffset) != 0;
  out.busy_us = load_u64(p + contracts::kBusyOffset);
  out.checkpoint_stall_us = load_u64(p + contracts::kCheckpointStallOffset);
  out.first_step = static_cast<int64_t>(load_u64(p + contracts::kFirstStepOffset)) - 1;  // 0 (none) reads -1
  for (std::size_t i = 0; i < kPhaseSize; ++i) {
    const char c = static_cast<char>(p[kPhaseOffset + i]);
    if (c == '\0') break;
    out.phase += (c >= 0x20 && c < 0x7f) ? c : '?';  // a worker's bytes, shown to a person
  }
  return out;
}

void ProgressBoard::write(int slot, const ProgressSample& sample) {
  unsigned char* p = base_ + kSlotSize * static_cast<std::size_t>(slot);
  std::memset(p + kPhaseOffset, 0, kPhaseSize);
  std::memcpy(p + kPhaseOffset, sample.phase.data(), std::min(sample.phase.size(), kPhaseSize - 1));
  store_u64(p + contracts::kStepOffset, static_cast<uint64_t>(sample.step));
  store_u64(p + contracts::kCheckpointOffset, static_cast<uint64_t>(sample.checkpoint_step));
  store_u64(p + contracts::kIntervalOffset, static_cast<uint64_t>(sample.checkpoint_interval_ms));
  store_u64(p + contracts::kFinalOffset, sample.final ? 1 : 0);
  store_u64(p + contracts::kBusyOffset, sample.busy_us);
  store_u64(p + contracts::kCheckpointStallOffset, sample.checkpoint_stall_us);
  store_u64(p + contracts::kFirstStepOffset, static_cast<uint64_t>(sample.first_step + 1));
  store_u64(p + contracts::kBeatsOffset, sample.beats);
}

std::optional<rdzv::NodeProgress> summarize(const std::vector<ProgressSample>& samples) {
  std::optional<rdzv::NodeProgress> out;
  for (std::size_t slot = 0; slot < samples.size(); ++slot) {
    const ProgressSample& s = samples[slot];
    const bool stepped = s.beats != 0;
    if (!stepped && s.checkpoint_step < 0 && s.checkpoint_interval_ms <= 0) continue;
    if (!out) out.emplace();
    if (stepped) out->step = std::max<int64_t>(out->step, std::clamp<int64_t>(s.step, -1, rdzv::kMaxReportedStep));
    out->checkpoint_step = std::max<int64_t>(out->checkpoint_step, std::min(s.checkpoint_step, rdzv::kMaxReportedStep));
    // A worker's number, bounded as the wire bounds it (rdzv::kMaxTimeoutSeconds).
    const double interval = static_cast<double>(std::clamp<int64_t>(s.checkpoint_interval_ms, 0, int64_t{10'000'000'000})) / 1000.0;
    out->checkpoint_interval = std::max(out->checkpoint_interval, interval);
    // A worker's number again: at most what the wire takes (rdzv::kMaxTimeoutSeconds).
    const double busy = static_cast<double>(std::min<uint64_t>(s.busy_us, uint64_t{10'000'000'000'000})) / 1e6;
    const double stall = static_cast<double>(std::min<uint64_t>(s.checkpoint_stall_us, uint64_t{10'000'000'000'000})) / 1e6;
    out->checkpoint_stall = std::max(out->checkpoint_stall, stall);
    if (stepped && s.first_step >= 0 && s.first_step <= rdzv::kMaxReportedStep &&
        (out->first_step < 0 || s.first_step < out->first_step)) {
      out->first_step = s.first_step;  // the earliest: where the node's round resumed
    }
    if (stepped && busy > 0 && busy > out->busy) {
      out->busy = busy;
      out->busy_local_rank = static_cast<int>(slot);
    }
  }
  return out;
}

HangMonitor::HangMonitor(HangPolicy policy, int slots) : policy_(policy), slots_(static_cast<std::size_t>(std::max(slots, 1))) {}

void HangMonitor::reset(double now) {
  for (auto& s : slots_) s = Slot{0, now, 0, {}, 0, false};
  best_step_ = -1;
  best_checkpoint_ = -1;
  any_beat_ = false;
}

void HangMonitor::observe(int slot, const ProgressSample& sample, double now) {
  if (slot < 0 || slot >= static_cast<int>(slots_.size())) return;
  Slot& s = slots_[static_cast<std::size_t>(slot)];
  s.phase = sample.phase;
  if (sample.checkpoint_step > best_checkpoint_) best_checkpoint_ = sample.checkpoint_step;
  if (sample.beats == contracts::kDoneBeats) {
    s.done = true;
    if (sample.step > best_step_) best_step_ = sample.step;
    return;
  }
  s.done = false;
  if (sample.beats == s.beats) return;
  if (s.beats > 0 && s.beats >= static_cast<uint64_t>(policy_.auto_skip)) {
    // Samples are taken periodically: several beats may fall into one interval, so the interval
    // per beat is an average, and a slow one is never underestimated by more than the period.
    const double per_beat = (now - s.last_change) / static_cast<double>(sample.beats - s.beats);
    slowest_ = std::max(slowest_, per_beat);
    ++s.counted;
  }
  any_beat_ = true;
  s.beats = sample.beats;
  s.step = sample.step;
  s.last_change = now;
  if (sample.step > best_step_) best_step_ = sample.step;
}

double HangMonitor::timeout_for(int slot) const {
  const Slot& s = slots_.at(static_cast<std::size_t>(slot));
  if (s.beats == 0 || s.done) return 0;
  if (!policy_.automatic) return policy_.timeout;
  if (s.counted < policy_.auto_warmup) return 0;
  return std::max(policy_.auto_floor, policy_.auto_factor * slowest_);
}

std::vector<Hang> HangMonitor::check(double now) const {
  std::vector<Hang> out;
  if (!policy_.enabled()) return out;
  bool any_over = false;
  for (std::size_t i = 0; i < slots_.size(); ++i) {
    const double timeout = timeout_for(static_cast<int>(i));
    if (timeout <= 0) continue;
    const Slot& s = slots_[i];
    const double stalled = now - s.last_change;
    if (stalled >= timeout * kStalledTogether) {
      out.push_back(Hang{static_cast<int>(i), stalled, timeout, s.step, s.phase});
      any_over = any_over || stalled >= timeout;
    }
  }
  if (!any_over) out.clear();
  return out;
}

}  // namespace ddp::agent
