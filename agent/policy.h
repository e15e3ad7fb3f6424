// What the supervisor's policy units share (agent/*_policy.h, agent/*_schedule.h): the view of a
// worker they decide about, and how they write a duration for a person. Pure: no Asio, no clock,
// no system call. Time is monotonic seconds, given to every call that needs it.
#pragma once

#include <string>

namespace ddp::agent {

// A worker as a policy sees it: who it is, nothing of how it runs.
struct WorkerRef {
  int pid = 0;
  int rank = 0;        // global rank
  int local_rank = 0;
};

// "30", "0.5": a duration in seconds as a person writes it (not std::to_string's "30.000000").
std::string seconds_text(double seconds);

// "5.0", "5.3", "120": a stall in seconds, to a tenth below 100 s.
std::string tenths(double seconds);

}  // namespace ddp::agent
