// Keeps everything a worker group starts killable as a whole, even when the agent itself is
// SIGKILLed. Two mechanisms, both owned here:
//
// - A sentinel: a tiny process forked from the agent that blocks reading a pipe whose only
//   write end the agent holds (close-on-exec, so no worker inherits it). When the agent dies,
//   for whatever reason, the read returns end of file and the sentinel SIGKILLs every process
//   group the agent told it about (each worker leads one) and the cgroup below, then exits.
//   The parent-death signal alone reaches only the workers, not what they started.
// - A cgroup v2 of the worker group's own, <agent's cgroup>/ddplaunch-<agent pid>, when the
//   machine allows it (a cgroup2 mount, our cgroup writable, cgroup.kill: Linux >= 5.14).
//   Workers are created inside it (or join it before exec); `cgroup.kill` then ends processes
//   that left their process group too (setsid, double fork). DDPLAUNCH_NO_CGROUP=1 turns it off.
// - Without a cgroup, a marker: every worker gets DDPLAUNCH_SUPERVISOR=<agent pid>.<random> in
//   its environment, which its descendants inherit; the sentinel (and kill_all()) kill every
//   process whose /proc/<pid>/environ holds it. A process that clears its environment escapes:
//   that limit is documented in docs/agent.md.
//
// Owned by PosixProcesses; lives for the agent run. Not thread-safe: called from the agent's
// io_context thread only. The sentinel is forked in the constructor (agent/spawn.h,
// run_instead_of_exec) and does only async-signal-safe work (the agent may already run threads).
// Containment starts no worker itself: it tells the spawner where workers go (place_worker()).
#pragma once

#include <sys/types.h>

#include <string>
#include <vector>

#include "agent/spawn.h"

namespace ddp::agent {

class Containment {
 public:
  Containment();
  ~Containment();  // the sentinel kills what is left, removes the cgroup, and exits
  Containment(const Containment&) = delete;
  Containment& operator=(const Containment&) = delete;

  // The worker group's cgroup directory, empty when there is none (see cgroup_problem()).
  const std::string& cgroup_dir() const { return cgroup_dir_; }
  // Why there is no cgroup ("no cgroup2 file system is mounted", ...); empty when there is one.
  const std::string& cgroup_problem() const { return cgroup_problem_; }
  // An open (close-on-exec) descriptor of the cgroup's cgroup.procs, or -1: a child that was not
  // created inside the cgroup joins it by writing "0" to it before its exec.
  int cgroup_procs_fd() const { return procs_fd_; }

  // The environment variable every worker gets (kMarkerVariable=marker_value()).
  static constexpr const char* kMarkerVariable = "DDPLAUNCH_SUPERVISOR";
  const std::string& marker_value() const { return marker_value_; }

  // Where a worker starts (agent/spawn.h, SpawnOptions::cgroup): inside the cgroup, created there
  // by clone3(CLONE_INTO_CGROUP) where the kernel allows it, else forked and moved in by itself.
  // Moving a running process costs the kernel an RCU grace period (10-30 ms for the first worker
  // of a run, bench/RESULTS.md); being created inside costs nothing. After the first kill_all()
  // (a restart) workers are moved in: see kill_all(). Without a cgroup: nothing.
  void place_worker(SpawnOptions& options) const;
  // Tells the sentinel about a process group to kill if the agent dies.
  void watch_group(int pgid);

  // The process `pid` is a standby (agent/standby.h), started outside the cgroup, leading its own
  // process group: it is a standby's until adopt_standby() or forget_standby(): watch_group()
  // tells the sentinel to kill it if the agent dies, kill_all() spares it, check_member() does
  // not judge by it. (The caller gives it no marker either, so that a restart's marker scan
  // spares it too.) REQUIRES: called before watch_group(pid).
  void add_standby(int pid);
  // The standby `pid` becomes a worker: it moves into the cgroup (an RCU grace period, as after
  // a restart) and kill_all() kills it from now on. Its own environment block keeps no marker:
  // it is found by its group, its descendants by the marker they inherit (the standby applies
  // an environment that holds it). False when `pid` is not a waiting standby.
  bool adopt_standby(int pid);
  // Forgets `pgid` if it is a standby that exited before it was adopted, so that the sentinel
  // does not kill its id once reused. REQUIRES: reaped.
  void forget_standby(int pgid);
  // Checks (once, on the first worker found running) that `pid` joined the cgroup; when it did
  // not, the cgroup is abandoned for the marker, here and in the sentinel. A worker that has
  // already exited (a zombie) decides nothing: the next one is checked.
  // REQUIRES: `pid` has not been reaped yet (its id cannot have been reused).
  void check_member(int pid);
  // SIGKILLs every watched process group and everything in the cgroup (without one: every
  // marked process), then forgets the groups. Standbys (add_standby) are spared.
  // REQUIRES: the group leaders have been reaped (so their ids cannot be reused while the
  // sentinel still holds them).
  void kill_all();

 private:
  void create_cgroup();
  void start_sentinel();
  void send(char op, int pgid);

  std::string marker_value_, marker_entry_;
  std::string cgroup_dir_;
  std::string cgroup_problem_;
  int procs_fd_ = -1;
  int dir_fd_ = -1;  // the cgroup directory (O_PATH), for clone3's CLONE_INTO_CGROUP
  bool born_inside_ = true;  // false after a cgroup.kill (see kill_all()): fork, then move
  int kill_fd_ = -1;
  int pipe_fd_ = -1;  // write end; the sentinel reads the other end
  int sentinel_pid_ = -1;
  bool checked_ = false;
  std::vector<int> groups_;
  std::vector<int> standby_groups_;
};

// The state letter of /proc/PID/stat ('R', 'S', 'Z', ...), or '\0' when there is no such process.
char process_state(int pid);

// Where this process's cgroup v2 lives in the file system ("/sys/fs/cgroup/user.slice/..."),
// or empty with `problem` set. Reads /proc/self/mountinfo and /proc/self/cgroup.
std::string own_cgroup_dir(std::string& problem);

}  // namespace ddp::agent
