// The glue between the command line and the agent: resolve what LaunchConfig leaves open (the
// log directory, the run id, the rendezvous to use), check that the program can start, build
// the Agent and run it. Called once by main(); runs on main's thread.
#pragma once

#include <memory>
#include <string>

#include <boost/asio/io_context.hpp>

#include "agent/agent.h"
#include "agent/rendezvous_handler.h"
#include "launcher/config.h"
#include "launcher/program.h"
#include "metrics/event.h"

namespace ddp::launcher {

// Runs the job this configuration describes on this node; returns ddplaunch's exit code.
// Throws LaunchError (exit 2) when it cannot start: a program that does not exist, a
// rendezvous configuration this build cannot serve.
int launch(const LaunchConfig& config);

// The agent options for `config`, with the log root already resolved. Exposed for tests.
agent::AgentOptions make_agent_options(const LaunchConfig& config, const ResolvedProgram& program,
                                       const std::string& log_dir, const std::string& run_id);

// True when this node's job needs no rendezvous daemon: --standalone, one node, or the static
// backend (torchrun's default, with --master_addr/--master_port/--node_rank).
bool uses_local_rendezvous(const LaunchConfig& config);

// The rendezvous the agent joins. Local (in-process) when uses_local_rendezvous(); otherwise the
// multi-node client (RemoteRendezvous), which is wired here once rendezvous/ provides it.
// `hosted_events` (may be null): where a rendezvous server this node hosts records its events.
std::unique_ptr<agent::RendezvousHandler> make_rendezvous(boost::asio::io_context& io, const LaunchConfig& config,
                                                          std::shared_ptr<metrics::EventSink> hosted_events = nullptr);

// The CPUs and memory node of each local rank for --numa_binding, from this machine's sysfs.
// Throws LaunchError (exit 2) when the mode cannot be satisfied here.
std::vector<agent::NumaBinding> numa_plan(const LaunchConfig& config);

// What resolve_program() needs from the command line (launcher/program.h).
ProgramRequest program_request(const LaunchConfig& config);

}  // namespace ddp::launcher
