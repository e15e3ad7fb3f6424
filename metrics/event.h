// Lifecycle events (item 5): one record per thing that happened to a job, shared by the
// event log (--event_log=FILE, one JSON line each), the Prometheus metrics and the live view.
//
// One place records an event (the agent's Impl, the daemon's StateMachine through its Outbox);
// every consumer is an EventSink. Sinks are called on the recording thread (the io_context
// thread of the agent or daemon) and must not block it for long.
#pragma once

#include <cstdint>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace ddp::metrics {

struct Event {
  // What happened: "round", "worker_started", "worker_exited", "failure", "restart", "hang",
  // "node_lost", "node_left", "job_end". Consumers ignore types they do not know.
  std::string type;
  std::string job;                 // the run id
  std::string node;                // host (or address) of the node concerned; "" = the job as a whole
  std::uint64_t generation = 0;    // the rendezvous round the event belongs to (0 = before the first)
  std::vector<int> ranks;          // global ranks concerned; empty = none in particular
  // A short cause, any string ("exit_code", "signal", "hang", "node_lost", "worker_failure",
  // "succeeded", ...): the metrics use it as a label value (bounded, see metrics/labels).
  std::string cause;
  std::string message;             // free text for people; "" = none
  nlohmann::json fields = nlohmann::json::object();  // type-specific values (exit_code, world_size, ...)
  double time = 0;                 // seconds since the epoch (UTC); 0 = stamped by the recorder
};

// The event as one JSON object: {"time":..., "type":..., "job":..., "node":..., "generation":...,
// "ranks":[...], "cause":..., "message":... (when not empty), plus its fields}. Its text may hold
// invalid UTF-8 (from workers and peers): dump it with error_handler_t::replace.
nlohmann::json to_json(const Event& event);

// to_json() as one line (no newline), invalid UTF-8 replaced.
std::string to_json_line(const Event& event);

// Seconds since the epoch, now.
double wall_time();

class EventSink {
 public:
  virtual ~EventSink() = default;
  virtual void record(const Event& event) = 0;
};

// Fans one event out to every sink, stamping its time first. Owned by whoever records (the
// agent, the daemon's main); called on that one thread.
class EventBus : public EventSink {
 public:
  void add(std::shared_ptr<EventSink> sink) { sinks_.push_back(std::move(sink)); }
  void record(const Event& event) override;
  bool empty() const { return sinks_.empty(); }

 private:
  std::vector<std::shared_ptr<EventSink>> sinks_;
};

// --event_log=FILE: appends one JSON line per event and flushes it, so that a crash loses at most
// the line being written. "-" writes to stderr (torchrun's --event_log_handler=console).
// The constructor throws std::runtime_error naming the file when it cannot be opened; a write
// that fails later is reported once on stderr and the job goes on (events are not worth a job).
class EventLog : public EventSink {
 public:
  explicit EventLog(const std::string& path);
  ~EventLog() override;
  EventLog(const EventLog&) = delete;
  EventLog& operator=(const EventLog&) = delete;
  void record(const Event& event) override;

 private:
  std::string path_;
  std::FILE* file_ = nullptr;
  bool owned_ = false;
  bool failed_ = false;
};

}  // namespace ddp::metrics
