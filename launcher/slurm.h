// Slurm as a source of ddplaunch's options: inside an allocation (SLURM_JOB_ID set) the
// variables Slurm gives every task fill the options the command line and PET_ variables left
// out, so `srun ddplaunch train.py` needs no flags. Also the parser of Slurm's hostlist syntax
// (`gpu[01-04,07],cpu3`). Pure functions over an environment lookup; any thread.
#pragma once

#include <cstddef>
#include <functional>
#include <string>
#include <vector>

#include "launcher/command_line.h"
#include "rendezvous/endpoint.h"
#include "rendezvous/error.h"

namespace ddp::launcher {

// Expands a Slurm hostlist: comma-separated items, each a name with any number of bracket
// groups of comma-separated numbers and ranges, e.g. `gpu[01-04,07],cpu3`, `n[1-2]-ib`,
// `rack[1-2]-n[01-02]` (the first group varies slowest). A bound written with a leading zero
// fixes the width (`[08-10]` gives 08 09 10). Hosts come out in the list's order, duplicates
// kept, as Slurm writes them. A malformed list, or one of more than `max_hosts` hosts, is refused:
// the reason says where and what is wrong, without the "ddplaunch: " prefix (callers add the
// variable it came from).
Expected<std::vector<std::string>> expand_hostlist(const std::string& list, std::size_t max_hosts = 65536);

// The first host of a hostlist, after checking the whole list is well formed (a range of a
// million hosts is not expanded for it), or why not as above.
Expected<std::string> first_host(const std::string& list);

// The environment Slurm reads come from; returns nullptr when a variable is unset. Tests give
// a map; ddplaunch gives std::getenv.
using EnvLookup = std::function<const char*(const char*)>;

// The Rendezvous port Slurm jobs use when their endpoint comes from the node list: the
// rendezvous' default port (torchrun's c10d default).
constexpr int kSlurmRendezvousPort = rdzv::kDefaultRendezvousPort;
// The grace between SIGTERM and SIGKILL inside Slurm when none is given: five seconds less than
// Slurm's default KillWait (30 s), so that the workers' checkpoint and ddplaunch's own report
// finish before Slurm's SIGKILL (docs/slurm.md).
constexpr double kSlurmShutdownTimeout = 25.0;

// Adds to `raw` the options Slurm supplies and `raw` lacks (sources named after the variable,
// e.g. "SLURM_NNODES"), and returns one "--flag=value (from VARIABLE)" text per option added,
// for the start-up line. Does nothing outside Slurm (SLURM_JOB_ID unset or empty) or with
// --standalone. Supplies:
//   --nnodes          SLURM_NNODES (SLURM_STEP_NUM_NODES when the step has fewer nodes)
//   --node_rank       SLURM_NODEID
//   --rdzv_id         SLURM_JOB_ID
//   --rdzv_backend=c10d and --rdzv_endpoint=FIRST_HOST:29400, on more than one node, when no
//                     rendezvous flag (--rdzv_backend, --rdzv_endpoint, --master_addr) is given;
//                     with --rdzv_backend=c10d alone the endpoint, with =static --master_addr.
//                     FIRST_HOST is the first of SLURM_STEP_NODELIST, else SLURM_JOB_NODELIST,
//                     else SLURM_NODELIST.
//   --nproc_per_node  the node's GPUs: SLURM_GPUS_ON_NODE, else the entries of SLURM_STEP_GPUS,
//                     SLURM_JOB_GPUS or CUDA_VISIBLE_DEVICES; none = ddplaunch's default.
//   --shutdown_timeout kSlurmShutdownTimeout, unless a grace is given in any form.
// Throws LaunchError (exit 2) for a malformed Slurm variable, and when srun started more than
// one task per node while Slurm is to supply --node_rank.
std::vector<std::string> add_slurm_values(RawValues& raw, const EnvLookup& env);

}  // namespace ddp::launcher
