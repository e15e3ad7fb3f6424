// The progress slot: one 128-byte slot per local rank of a shared-memory page (a memfd) the agent
// creates (agent/progress.h, ProgressBoard) and names to each worker (DDPLAUNCH_PROGRESS_FILE,
// DDPLAUNCH_PROGRESS_SLOT). The worker writes its slot without a system call per step (the worker
// SDK, worker_sdk/src/progress.cpp; the Python helper, python/ddplaunch/__init__.py, whose
// _SLOT_SIZE and offsets are this file's); the agent samples it. Native byte order (the agent and
// its workers share one machine; the fixture is little-endian, as every machine ddplaunch runs on):
//   offset  0: uint64 beats            incremented by every step() (the heartbeat); all ones
//                                      (kDoneBeats): the worker finished its steps, do not watch
//   offset  8: int64  step             the last step the worker reported
//   offset 16: int64  checkpoint_step  the last checkpoint it reported saving, -1 = none
//   offset 24: char   phase[32]        what it is doing (NUL-terminated; may be torn)
//   offset 56: uint64 abandoned        written by the agent, read by the worker: nonzero = the
//                                      round is lost (a peer failed); do not finish the step,
//                                      exit at once on SIGTERM, or park
//   offset 64: int64  checkpoint_interval_ms  the interval between checkpoints the worker chose
//                                      (an automatic cadence), in milliseconds; 0 = none said
//   offset 72: uint64 final           nonzero: the worker's failure ends the job instead of a
//                                      restart, which would fail the same way (a checkpoint
//                                      refused under a strict environment check)
//   offset 80: uint64 busy_us         the worker's busy time per step: the time of a step it did
//                                      not spend waiting for its peers in the gradient all-reduce
//                                      (microseconds, a moving average over its recent steps;
//                                      0 = not measured). The daemon compares nodes by it to find a
//                                      straggler (docs/maintenance.md, "Stragglers")
//   offset 88: uint64 checkpoint_stall_us  the time the worker's steps stood still for its
//                                      checkpoints since it started (microseconds, cumulative:
//                                      a synchronous save whole, an async save's snapshot); the
//                                      daemon's goodput account (docs/goodput.md)
//   offset 96: uint64 first_step       the first step the worker reported since the agent cleared
//                                      the slot (a round's start), plus one; 0 = none yet. The
//                                      worker writes it at a step() that finds 0: the step its
//                                      round resumed at, for the goodput account
//   offset 104: reserved, zero (room for what a worker will report next, without a new layout)
// The 64-bit fields are aligned words, stored and loaded as atomics. contracts/fixtures/
// progress_slot.bin is one slot both the C++ and the Python tests read and write.
// Constants only.
#pragma once

#include <cstddef>
#include <cstdint>

namespace ddp::contracts {

constexpr std::size_t kSlotSize = 128;
constexpr std::size_t kBeatsOffset = 0;
constexpr std::size_t kStepOffset = 8;
constexpr std::size_t kCheckpointOffset = 16;
constexpr std::size_t kPhaseOffset = 24;
constexpr std::size_t kPhaseSize = 32;  // the phase's bytes, its NUL included
constexpr std::size_t kAbandonedOffset = 56;
constexpr std::size_t kIntervalOffset = 64;
constexpr std::size_t kFinalOffset = 72;
constexpr std::size_t kBusyOffset = 80;
constexpr std::size_t kCheckpointStallOffset = 88;
constexpr std::size_t kFirstStepOffset = 96;

// The word index of a 64-bit field, for a writer that sees the slot as an array of words.
constexpr std::size_t word(std::size_t offset) { return offset / 8; }

// `beats` of a worker that said it is done with its steps (teardown, a final evaluation may
// follow, for however long): it is no longer watched until it beats again.
constexpr std::uint64_t kDoneBeats = ~std::uint64_t{0};

static_assert(kPhaseOffset == kCheckpointOffset + 8 && kAbandonedOffset == kPhaseOffset + kPhaseSize &&
                  kIntervalOffset == kAbandonedOffset + 8 && kFinalOffset == kIntervalOffset + 8 &&
                  kBusyOffset == kFinalOffset + 8 && kCheckpointStallOffset == kBusyOffset + 8 &&
                  kFirstStepOffset == kCheckpointStallOffset + 8 && kFirstStepOffset + 8 <= kSlotSize,
              "the slot's fields follow each other without a gap");
static_assert(kBeatsOffset % 8 == 0 && kStepOffset % 8 == 0 && kCheckpointOffset % 8 == 0 &&
                  kAbandonedOffset % 8 == 0 && kIntervalOffset % 8 == 0 && kFinalOffset % 8 == 0 &&
                  kBusyOffset % 8 == 0 && kCheckpointStallOffset % 8 == 0 && kFirstStepOffset % 8 == 0,
              "the 64-bit fields are aligned words");

}  // namespace ddp::contracts
