// Unit tests of launcher/slurm.cpp: Slurm's hostlist syntax, and Slurm's variables as a source
// of ddplaunch's options (through parse_command_line, as the binary resolves them).
#include "launcher/slurm.h"

#include <doctest/doctest.h>

#include <cstdlib>
#include <cstring>
#include <map>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "launcher/config.h"

extern char** environ;

namespace {

using ddp::ExitCode;
using ddp::launcher::expand_hostlist;
using ddp::launcher::first_host;
using ddp::launcher::LaunchConfig;
using ddp::launcher::ParseContext;
using ddp::launcher::RendezvousBackend;
using ddp::LaunchError;
using Hosts = std::vector<std::string>;

bool contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

// Why `list` is refused; fails the test when the list expands.
std::string hostlist_refusal(const std::string& list) {
  const auto hosts = expand_hostlist(list);
  if (hosts) FAIL("expected '" << list << "' to be refused");
  // first_host() checks the whole list the same way.
  CHECK_FALSE(first_host(list));
  return hosts.error();
}

// Clears every variable ddplaunch's resolver reads (PET_*, SLURM_*, the device lists, the
// shutdown grace) for one test, so the caller's environment (a CI job inside Slurm) cannot leak
// in, and restores them afterwards.
class SlurmEnv {
 public:
  SlurmEnv() {
    std::vector<std::string> names;
    for (char** e = environ; *e != nullptr; ++e) {
      const std::string entry = *e;
      const std::string name = entry.substr(0, entry.find('='));
      if (name.rfind("PET_", 0) == 0 || name.rfind("SLURM_", 0) == 0) names.push_back(name);
    }
    for (const char* name : {"CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "PYTHON_EXEC",
                             "TORCH_ELASTIC_SHUTDOWN_TIMEOUT"}) {
      names.push_back(name);
    }
    for (const auto& name : names) unset(name);
  }
  ~SlurmEnv() {
    for (auto it = saved_.rbegin(); it != saved_.rend(); ++it) {
      if (it->second) {
        ::setenv(it->first.c_str(), it->second->c_str(), 1);
      } else {
        ::unsetenv(it->first.c_str());
      }
    }
  }
  SlurmEnv(const SlurmEnv&) = delete;
  SlurmEnv& operator=(const SlurmEnv&) = delete;

  void set(const std::string& name, const std::string& value) {
    save(name);
    ::setenv(name.c_str(), value.c_str(), 1);
  }
  // The variables srun gives the task on node `node_id` of a 2-node step, one task per node.
  void two_node_step(int node_id) {
    set("SLURM_JOB_ID", "4242");
    set("SLURM_NNODES", "2");
    set("SLURM_NODEID", std::to_string(node_id));
    set("SLURM_JOB_NODELIST", "gpu[07-08]");
    set("SLURM_STEP_NODELIST", "gpu[07-08]");
    set("SLURM_STEP_NUM_NODES", "2");
    set("SLURM_STEP_NUM_TASKS", "2");
  }

 private:
  void unset(const std::string& name) {
    save(name);
    ::unsetenv(name.c_str());
  }
  void save(const std::string& name) {
    const char* old = std::getenv(name.c_str());
    saved_.emplace_back(name, old ? std::optional<std::string>(old) : std::nullopt);
  }
  std::vector<std::pair<std::string, std::optional<std::string>>> saved_;
};

// Parses `args` then "train.py" on a machine without GPUs (8 CPUs).
LaunchConfig parse(std::vector<std::string> args) {
  args.insert(args.begin(), "ddplaunch");
  args.push_back("train.py");
  std::vector<const char*> argv;
  for (const auto& a : args) argv.push_back(a.c_str());
  std::ostringstream out, err;
  ParseContext context;
  context.out = &out;
  context.err = &err;
  context.count_gpus = [] { return 0; };
  context.count_cpus = [] { return 8; };
  return ddp::launcher::parse_command_line(static_cast<int>(argv.size()), argv.data(), context);
}

LaunchError refusal(const std::vector<std::string>& args) {
  try {
    parse(args);
  } catch (const LaunchError& e) {
    return e;
  }
  FAIL("expected a LaunchError");
  return LaunchError(ExitCode::kUsage, "unreachable");
}

std::string joined(const std::vector<std::string>& items) {
  std::string s;
  for (const auto& i : items) s += i + "\n";
  return s;
}

}  // namespace

TEST_SUITE("Slurm hostlists expand as Slurm expands them") {
  TEST_CASE("ranges and single numbers in one group, then a plain name") {
    CHECK(*expand_hostlist("gpu[01-04,07],cpu3") ==
          Hosts{"gpu01", "gpu02", "gpu03", "gpu04", "gpu07", "cpu3"});
    CHECK(*first_host("gpu[01-04,07],cpu3") == "gpu01");
  }
  TEST_CASE("a suffix after the brackets stays on every host") {
    CHECK(*expand_hostlist("n[1-2]-ib") == Hosts{"n1-ib", "n2-ib"});
    CHECK(*expand_hostlist("n[1-2].cluster.example") == Hosts{"n1.cluster.example", "n2.cluster.example"});
  }
  TEST_CASE("a leading zero fixes the width; without one there is no padding") {
    CHECK(*expand_hostlist("node[8-11]") == Hosts{"node8", "node9", "node10", "node11"});
    CHECK(*expand_hostlist("node[08-11]") == Hosts{"node08", "node09", "node10", "node11"});
    CHECK(*expand_hostlist("n[098-101]") == Hosts{"n098", "n099", "n100", "n101"});
    CHECK(*expand_hostlist("n[0-1]") == Hosts{"n0", "n1"});
    CHECK(*expand_hostlist("n[007]") == Hosts{"n007"});
  }
  TEST_CASE("several bracket groups: the first varies slowest") {
    CHECK(*expand_hostlist("rack[1-2]-n[01-02]") ==
          Hosts{"rack1-n01", "rack1-n02", "rack2-n01", "rack2-n02"});
    CHECK(*first_host("rack[3,1]-n[02-03]") == "rack3-n02");
  }
  TEST_CASE("commas inside brackets do not split items; items keep their order") {
    CHECK(*expand_hostlist("b[1,3-4],a[01-02],login") ==
          Hosts{"b1", "b3", "b4", "a01", "a02", "login"});
    CHECK(*expand_hostlist("x[1-2,2]") == Hosts{"x1", "x2", "x2"});  // as given, duplicates kept
  }
  TEST_CASE("plain names, addresses and a bare group") {
    CHECK(*expand_hostlist("localhost") == Hosts{"localhost"});
    CHECK(*expand_hostlist("10.213.0.[11-12]") == Hosts{"10.213.0.11", "10.213.0.12"});
    CHECK(*expand_hostlist("[1-2]") == Hosts{"1", "2"});
    CHECK(*expand_hostlist("my_node-3.a") == Hosts{"my_node-3.a"});
  }
  TEST_CASE("the first host of a huge range is found without expanding it") {
    CHECK(*first_host("n[000000001-999999999]") == "n000000001");
    CHECK(contains(expand_hostlist("n[000000001-999999999]").error(), "names more than 65536 hosts"));
    CHECK(expand_hostlist("n[1-4]", 4)->size() == 4);
    CHECK_FALSE(expand_hostlist("n[1-4],m", 4));
  }
}

TEST_SUITE("malformed hostlists are refused with the position and the reason") {
  TEST_CASE("each malformation names what is wrong") {
    const std::vector<std::pair<std::string, std::string>> cases = {
        {"", "empty hostlist"},
        {"gpu[01-04", "'[' is never closed"},
        {"gpu[01-04,", "'[' is never closed"},
        {"gpu01-04]", "']' without '['"},
        {"gpu[]", "empty brackets"},
        {"gpu[4-1]", "range 4-1 runs backwards"},
        {"gpu[a-b]", "expected a number, found 'a'"},
        {"gpu[1-]", "expected a number, found ']'"},
        {"gpu[-1]", "expected a number, found '-'"},
        {"gpu[[1-2]]", "expected a number, found '['"},
        {"gpu[1[2]]", "brackets cannot nest"},
        {"gpu[1,]", "a ',' with no range after it"},
        {"a,,b", "empty host name"},
        {",a", "empty host name"},
        {"a,", "empty host name"},
        {"gpu 01", "blank inside the list"},
        {"gpu@1", "'@' cannot be part of a host name"},
        {"n[1234567890]", "number of more than 9 digits"},
        {"n[1-2;3]", "unexpected ';' inside brackets"},
    };
    for (const auto& [list, reason] : cases) {
      CAPTURE(list);
      const std::string message = hostlist_refusal(list);
      CHECK(contains(message, reason));
      if (!list.empty()) {
        CHECK(contains(message, "malformed hostlist '" + list + "' at position "));
        CHECK(contains(message, "Slurm's syntax"));
      }
    }
  }
  TEST_CASE("a long list is shown as the part around the error") {
    std::string list;
    for (int i = 0; i < 300; ++i) list += "node" + std::to_string(i) + ",";
    list += "bad@name";
    const std::string message = hostlist_refusal(list);
    CHECK(contains(message, "malformed hostlist '..."));
    CHECK(contains(message, "node299,bad@name' at position " + std::to_string(list.find('@') + 1)));
    CHECK_FALSE(contains(message, "node0,"));
    CHECK(message.size() < 400);
  }
  TEST_CASE("the position points at the offending character (1-based)") {
    CHECK(contains(hostlist_refusal("gpu[4-1]"), "at position 7:"));
    CHECK(contains(hostlist_refusal("ab,cd,,e"), "at position 7:"));
    CHECK(contains(hostlist_refusal("gpu[01-04"), "at position 4:"));
  }
}

TEST_SUITE("inside Slurm the options come from Slurm's variables unless given") {
  TEST_CASE("a 2-node step: nodes, rank, job id, the first host as endpoint, GPUs, grace") {
    SlurmEnv env;
    env.two_node_step(1);
    env.set("SLURM_GPUS_ON_NODE", "4");
    const LaunchConfig c = parse({});
    CHECK(c.min_nodes == 2);
    CHECK(c.max_nodes == 2);
    CHECK(c.node_rank == 1);
    CHECK(c.rdzv_id == "4242");
    CHECK(c.rdzv_backend == RendezvousBackend::kC10d);
    REQUIRE(c.rdzv_endpoint);
    CHECK(c.rdzv_endpoint->text() == "gpu07:29400");
    CHECK(c.nproc_per_node == 4);
    CHECK(c.timeouts.shutdown_timeout == ddp::launcher::kSlurmShutdownTimeout);
    CHECK(c.timeouts.shutdown_timeout < 30.0);  // below Slurm's default KillWait
    const std::string said = joined(c.from_slurm);
    CHECK(contains(said, "--nnodes=2 (SLURM_NNODES)"));
    CHECK(contains(said, "--node_rank=1 (SLURM_NODEID)"));
    CHECK(contains(said, "--rdzv_id=4242 (SLURM_JOB_ID)"));
    CHECK(contains(said, "--rdzv_backend=c10d"));
    CHECK(contains(said, "--rdzv_endpoint=gpu07:29400 (the first host of SLURM_STEP_NODELIST)"));
    CHECK(contains(said, "--nproc_per_node=4 (GPUs from SLURM_GPUS_ON_NODE)"));
    CHECK(contains(said, "--shutdown_timeout=25"));
    CHECK(c.from_slurm.size() == 7);
  }
  TEST_CASE("outside an allocation (no SLURM_JOB_ID) Slurm's other variables are ignored") {
    SlurmEnv env;
    env.two_node_step(1);
    env.set("SLURM_JOB_ID", "");
    const LaunchConfig c = parse({});
    CHECK(c.max_nodes == 1);
    CHECK(c.node_rank == 0);
    CHECK(c.rdzv_backend == RendezvousBackend::kStatic);
    CHECK(c.timeouts.shutdown_timeout == 30.0);
    CHECK(c.from_slurm.empty());
  }
  TEST_CASE("explicit flags win over every Slurm variable") {
    SlurmEnv env;
    env.two_node_step(1);
    env.set("SLURM_GPUS_ON_NODE", "4");
    const LaunchConfig c = parse({"--nnodes=2:4", "--node_rank=0", "--rdzv_id=mine", "--rdzv_backend=c10d",
                                  "--rdzv_endpoint=head:1234", "--nproc_per_node=2", "--shutdown_timeout=9"});
    CHECK(c.min_nodes == 2);
    CHECK(c.max_nodes == 4);
    CHECK(c.node_rank == 0);
    CHECK(c.rdzv_id == "mine");
    CHECK(c.rdzv_endpoint->text() == "head:1234");
    CHECK(c.nproc_per_node == 2);
    CHECK(c.timeouts.shutdown_timeout == 9.0);
    CHECK(c.from_slurm.empty());
  }
  TEST_CASE("PET_ variables win over Slurm's") {
    SlurmEnv env;
    env.two_node_step(0);
    env.set("PET_NNODES", "1:2");
    env.set("PET_RDZV_ENDPOINT", "10.0.0.9:29555");
    env.set("PET_RDZV_BACKEND", "c10d");
    const LaunchConfig c = parse({});
    CHECK(c.min_nodes == 1);
    CHECK(c.max_nodes == 2);
    CHECK(c.rdzv_endpoint->text() == "10.0.0.9:29555");
    CHECK(c.rdzv_id == "4242");
    CHECK(c.node_rank == 0);
    const std::string said = joined(c.from_slurm);
    CHECK_FALSE(contains(said, "--nnodes"));
    CHECK_FALSE(contains(said, "--rdzv_endpoint"));
  }
  TEST_CASE("a grace given any other way is kept") {
    SlurmEnv env;
    env.two_node_step(0);
    CHECK(parse({"--rdzv_conf=shutdown_timeout=12"}).timeouts.shutdown_timeout == 12.0);
    env.set("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "40");
    CHECK(parse({}).timeouts.shutdown_timeout == 40.0);
  }
  TEST_CASE("a step on part of the allocation counts the step's nodes") {
    SlurmEnv env;
    env.two_node_step(0);
    env.set("SLURM_NNODES", "4");  // the allocation; srun -N2 runs the step on two of them
    env.set("SLURM_JOB_NODELIST", "gpu[05-08]");
    const LaunchConfig c = parse({});
    CHECK(c.max_nodes == 2);
    CHECK(c.rdzv_endpoint->text() == "gpu07:29400");
    CHECK(contains(joined(c.from_slurm), "--nnodes=2 (SLURM_STEP_NUM_NODES)"));
  }
  TEST_CASE("one node keeps the in-process rendezvous") {
    SlurmEnv env;
    env.set("SLURM_JOB_ID", "77");
    env.set("SLURM_NNODES", "1");
    env.set("SLURM_NODEID", "0");
    env.set("SLURM_JOB_NODELIST", "gpu01");
    const LaunchConfig c = parse({});
    CHECK(c.max_nodes == 1);
    CHECK(c.rdzv_backend == RendezvousBackend::kStatic);
    CHECK_FALSE(c.rdzv_endpoint);
    CHECK(c.rdzv_id == "77");
  }
  TEST_CASE("an explicit elastic --nnodes inside a 1-node allocation still gets the endpoint") {
    SlurmEnv env;
    env.set("SLURM_JOB_ID", "77");
    env.set("SLURM_NNODES", "1");
    env.set("SLURM_JOB_NODELIST", "gpu01");
    const LaunchConfig c = parse({"--nnodes=1:2"});
    REQUIRE(c.rdzv_endpoint);
    CHECK(c.rdzv_endpoint->text() == "gpu01:29400");
  }
  TEST_CASE("--standalone takes nothing from Slurm") {
    SlurmEnv env;
    env.two_node_step(1);
    const LaunchConfig c = parse({"--standalone"});
    CHECK(c.max_nodes == 1);
    CHECK(c.from_slurm.empty());
  }
  TEST_CASE("the static backend takes its master address from the node list") {
    SlurmEnv env;
    env.two_node_step(1);
    const LaunchConfig c = parse({"--rdzv_backend=static"});
    CHECK(c.rdzv_backend == RendezvousBackend::kStatic);
    CHECK(c.master_addr == "gpu07");
    CHECK(c.node_rank == 1);
    CHECK_FALSE(c.rdzv_endpoint);
    CHECK(contains(joined(c.from_slurm), "--master_addr=gpu07 (the first host of SLURM_STEP_NODELIST)"));
  }
  TEST_CASE("c10d named alone gets the endpoint; --master_addr alone keeps the static backend") {
    SlurmEnv env;
    env.two_node_step(0);
    CHECK(parse({"--rdzv_backend=c10d"}).rdzv_endpoint->text() == "gpu07:29400");
    const LaunchConfig c = parse({"--master_addr=10.1.1.1", "--master_port=29500"});
    CHECK(c.rdzv_backend == RendezvousBackend::kStatic);
    CHECK(c.master_addr == "10.1.1.1");
  }
  TEST_CASE("the step's node list is preferred to the job's, then SLURM_NODELIST") {
    SlurmEnv env;
    env.two_node_step(0);
    env.set("SLURM_JOB_NODELIST", "big[01-08]");
    env.set("SLURM_STEP_NODELIST", "big[05-06]");
    CHECK(parse({}).rdzv_endpoint->text() == "big05:29400");
    env.set("SLURM_STEP_NODELIST", "");
    CHECK(parse({}).rdzv_endpoint->text() == "big01:29400");
    env.set("SLURM_JOB_NODELIST", "");
    env.set("SLURM_NODELIST", "old[3-4]");
    CHECK(parse({}).rdzv_endpoint->text() == "old3:29400");
  }
  TEST_CASE("workers per node from the GPUs Slurm gave the node") {
    SlurmEnv env;
    env.two_node_step(0);
    CHECK(parse({}).nproc_per_node == 1);  // no GPU variable: ddplaunch's default
    env.set("CUDA_VISIBLE_DEVICES", "0,1");
    CHECK(parse({}).nproc_per_node == 2);
    env.set("SLURM_JOB_GPUS", "4,5,6");
    CHECK(parse({}).nproc_per_node == 3);
    env.set("SLURM_STEP_GPUS", "2,3,4,5");
    CHECK(parse({}).nproc_per_node == 4);
    env.set("SLURM_GPUS_ON_NODE", "0");  // zero says nothing: the lists decide
    CHECK(parse({}).nproc_per_node == 4);
    env.set("SLURM_GPUS_ON_NODE", "8");
    CHECK(parse({}).nproc_per_node == 8);
    CHECK(parse({"--nproc_per_node=3"}).nproc_per_node == 3);
  }
  TEST_CASE("Slurm's 'no GPU' marker keeps the default") {
    SlurmEnv env;
    env.two_node_step(0);
    env.set("CUDA_VISIBLE_DEVICES", "NoDevFiles");
    CHECK(parse({}).nproc_per_node == 1);
  }
}

TEST_SUITE("bad Slurm variables exit 2 naming the variable") {
  TEST_CASE("a node count, node id or GPU count that is not a number") {
    SlurmEnv env;
    env.two_node_step(0);
    env.set("SLURM_NNODES", "two");
    LaunchError e = refusal({});
    CHECK(e.exit_code() == static_cast<int>(ExitCode::kUsage));
    CHECK(contains(e.what(), "SLURM_NNODES=two: not a node count"));
    env.set("SLURM_NNODES", "2");
    env.set("SLURM_GPUS_ON_NODE", "-1");
    CHECK(contains(refusal({}).what(), "SLURM_GPUS_ON_NODE=-1: not a GPU count"));
  }
  TEST_CASE("a node id outside the node count") {
    SlurmEnv env;
    env.two_node_step(0);
    env.set("SLURM_NODEID", "5");
    const LaunchError e = refusal({});
    CHECK(e.exit_code() == static_cast<int>(ExitCode::kUsage));
    CHECK(contains(e.what(), "SLURM_NODEID=5: must be less than the number of nodes (2)"));
  }
  TEST_CASE("a malformed node list names the variable and the way out") {
    SlurmEnv env;
    env.two_node_step(0);
    env.set("SLURM_STEP_NODELIST", "gpu[01-");
    const LaunchError e = refusal({});
    CHECK(e.exit_code() == static_cast<int>(ExitCode::kUsage));
    CHECK(contains(e.what(), "SLURM_STEP_NODELIST: malformed hostlist 'gpu[01-'"));
    CHECK(contains(e.what(), "--rdzv_endpoint=HOST:PORT"));
    // An explicit endpoint does not need the list.
    CHECK(parse({"--rdzv_endpoint=head:29400", "--rdzv_backend=c10d"}).rdzv_endpoint->text() == "head:29400");
  }
  TEST_CASE("several tasks per node are refused when Slurm is to give the node rank") {
    SlurmEnv env;
    env.two_node_step(0);
    env.set("SLURM_STEP_NUM_TASKS", "8");
    const LaunchError e = refusal({});
    CHECK(e.exit_code() == static_cast<int>(ExitCode::kUsage));
    CHECK(contains(e.what(), "srun started 8 tasks on 2 node(s)"));
    CHECK(contains(e.what(), "srun --ntasks-per-node=1"));
    CHECK(parse({"--node_rank=1"}).node_rank == 1);  // the user decides the ranks
  }
}
