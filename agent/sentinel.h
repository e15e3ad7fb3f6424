// The sentinel (agent/containment.h): a small process that outlives the agent by a moment and
// kills what the agent's workers left behind. Its code, shared by the `ddp-sentinel` program
// (agent/sentinel_main.cpp, spawned without copying the agent's memory) and by the fallback
// that forks the agent when that program cannot be found. Everything here is async-signal-safe:
// raw system calls and static buffers only, no allocation.
#pragma once

namespace ddp::agent {

// One message from the agent to the sentinel: op '+' watches `pgid`, 'c' forgets every group,
// 'n' abandons the cgroup for the marker. 8 bytes, so every write is atomic (< PIPE_BUF) and
// reads see whole messages.
struct SentinelMessage {
  char op;
  char pad[3];
  int pgid;
};
static_assert(sizeof(SentinelMessage) == 8);

// Kills every process but this one whose environment holds the entry `entry` ("NAME=value"),
// again while some were found (one may have forked meanwhile).
void kill_all_marked(const char* entry);

// The sentinel's life: detaches from the agent (own process group, signals that stop a job
// ignored, descriptors 0-2 on /dev/null, every other one but `read_fd` closed), reads
// messages from `read_fd` until end of file (the agent is gone), then SIGKILLs every watched
// group and either writes `<cgroup_dir>/cgroup.kill`, waits (at most 5 s) for the cgroup to
// empty and removes it, or (no cgroup: `cgroup_dir` empty) kills every process marked with
// `marker` ("DDPLAUNCH_SUPERVISOR=..."). Exits 0.
[[noreturn]] void sentinel_main(int read_fd, const char* cgroup_dir, const char* marker);

}  // namespace ddp::agent
