// Slurm's variables as a source of options, and Slurm's hostlist syntax (launcher/slurm.h).
#include "launcher/slurm.h"

#include <cctype>
#include <limits>
#include <sstream>

namespace ddp::launcher {
namespace {

// One numeric range of a bracket group: lo..hi, printed at least `width` digits wide.
struct Range {
  unsigned long lo = 0;
  unsigned long hi = 0;
  std::size_t width = 0;
  std::size_t size() const { return hi - lo + 1; }
};

// A piece of one hostlist item: literal text, or a bracket group (the text is then empty).
struct Piece {
  std::string text;
  std::vector<Range> ranges;
  std::size_t size() const {
    if (ranges.empty()) return 1;
    std::size_t n = 0;
    for (const Range& r : ranges) n += r.size();
    return n;
  }
  // The i-th value of a bracket group, 0 <= i < size().
  std::string value(std::size_t i) const {
    if (ranges.empty()) return text;
    for (const Range& r : ranges) {
      if (i < r.size()) {
        std::string digits = std::to_string(r.lo + i);
        if (digits.size() < r.width) digits.insert(0, r.width - digits.size(), '0');
        return digits;
      }
      i -= r.size();
    }
    return "";
  }
};

using Item = std::vector<Piece>;

bool name_char(char c) {
  return std::isalnum(static_cast<unsigned char>(c)) != 0 || c == '-' || c == '.' || c == '_';
}

// A long list (Slurm's can run to kilobytes) is shown as the part around the error.
std::string excerpt(const std::string& list, std::size_t at) {
  constexpr std::size_t kShown = 100;
  if (list.size() <= kShown) return list;
  const std::size_t start = at > kShown / 2 ? at - kShown / 2 : 0;
  return (start > 0 ? "..." : "") + list.substr(start, kShown) + (start + kShown < list.size() ? "..." : "");
}

// The parser's refusal, unwinding from where it is found to expand_hostlist() or first_host(),
// which return it as their error; it never leaves this file.
struct Malformed {
  std::string why;
};

[[noreturn]] void bad(const std::string& list, std::size_t at, const std::string& what) {
  std::ostringstream message;
  message << "malformed hostlist '" << excerpt(list, at) << "' at position " << at + 1 << ": " << what
          << " (Slurm's syntax: NAME, NAME[1-4,7], NAME[01-04]-SUFFIX, items separated by commas)";
  throw Malformed{message.str()};
}

// Digits at `pos` as a number (at most 9, so no range can overflow).
unsigned long read_number(const std::string& list, std::size_t& pos, std::size_t& digits) {
  const std::size_t start = pos;
  while (pos < list.size() && std::isdigit(static_cast<unsigned char>(list[pos])) != 0) ++pos;
  digits = pos - start;
  if (digits == 0) {
    bad(list, start, pos < list.size() ? std::string("expected a number, found '") + list[pos] + "'"
                                       : "expected a number, found the end of the list");
  }
  if (digits > 9) bad(list, start, "number of more than 9 digits");
  return std::stoul(list.substr(start, digits));
}

// A bracket group from just after '[' up to and including ']'.
Piece read_group(const std::string& list, std::size_t& pos) {
  Piece group;
  const std::size_t open = pos - 1;
  for (;;) {
    if (pos >= list.size()) bad(list, open, "'[' is never closed");
    if (list[pos] == ']') bad(list, pos, group.ranges.empty() ? "empty brackets" : "a ',' with no range after it");
    Range range;
    std::size_t lo_digits = 0, hi_digits = 0;
    const std::size_t lo_at = pos;
    range.lo = read_number(list, pos, lo_digits);
    // A bound written with a leading zero fixes the width, as Slurm's hostlist does.
    if (lo_digits > 1 && list[lo_at] == '0') range.width = lo_digits;
    range.hi = range.lo;
    if (pos < list.size() && list[pos] == '-') {
      ++pos;
      const std::size_t hi_at = pos;
      range.hi = read_number(list, pos, hi_digits);
      if (range.hi < range.lo) {
        bad(list, hi_at, "range " + list.substr(lo_at, pos - lo_at) + " runs backwards");
      }
    }
    group.ranges.push_back(range);
    if (pos >= list.size()) bad(list, open, "'[' is never closed");
    if (list[pos] == ']') {
      ++pos;
      return group;
    }
    if (list[pos] == ',') {
      ++pos;
      continue;
    }
    if (list[pos] == '[') bad(list, pos, "brackets cannot nest");
    bad(list, pos, std::string("unexpected '") + list[pos] + "' inside brackets (numbers and ranges only)");
  }
}

// Parses the whole list into items. Checks every character.
std::vector<Item> parse(const std::string& list) {
  if (list.empty()) throw Malformed{"empty hostlist (Slurm names at least one node)"};
  std::vector<Item> items;
  std::size_t pos = 0;
  while (pos <= list.size()) {
    Item item;
    const std::size_t item_start = pos;
    while (pos < list.size() && list[pos] != ',') {
      const char c = list[pos];
      if (c == '[') {
        ++pos;
        item.push_back(read_group(list, pos));
      } else if (c == ']') {
        bad(list, pos, "']' without '['");
      } else if (name_char(c)) {
        std::string text;
        while (pos < list.size() && name_char(list[pos])) text += list[pos++];
        item.push_back(Piece{text, {}});
      } else if (std::isspace(static_cast<unsigned char>(c)) != 0) {
        bad(list, pos, "blank inside the list");
      } else {
        bad(list, pos, std::string("'") + c + "' cannot be part of a host name");
      }
    }
    if (item.empty()) bad(list, item_start, "empty host name (two commas in a row, or a comma at an end)");
    items.push_back(std::move(item));
    if (pos == list.size()) break;
    ++pos;  // the ','
    if (pos == list.size()) bad(list, pos - 1, "empty host name (two commas in a row, or a comma at an end)");
  }
  return items;
}

std::size_t item_size(const Item& item) {
  std::size_t n = 1;
  for (const Piece& p : item) {
    const std::size_t s = p.size();
    if (n > std::numeric_limits<std::size_t>::max() / s) return std::numeric_limits<std::size_t>::max();
    n *= s;
  }
  return n;
}

// The i-th host of an item: the first group varies slowest.
std::string item_host(const Item& item, std::size_t i) {
  std::vector<std::string> parts(item.size());
  for (std::size_t k = item.size(); k-- > 0;) {
    const std::size_t s = item[k].size();
    parts[k] = item[k].value(i % s);
    i /= s;
  }
  std::string host;
  for (const auto& p : parts) host += p;
  return host;
}

// --- Slurm's variables ------------------------------------------------------------------------

const char* get(const EnvLookup& env, const char* name) {
  const char* v = env(name);
  return v != nullptr && *v != '\0' ? v : nullptr;
}

// An integer variable, 0..max; refuses anything else naming the variable.
long slurm_integer(const EnvLookup& env, const char* name, long min, const char* meaning) {
  const char* v = get(env, name);
  const auto n = to_integer(v);
  if (!n || *n < min || *n > 1000000) {
    refuse(std::string(name) + "=" + v + ": not " + meaning + " (Slurm sets it inside an "
           "allocation; unset it, or give the matching ddplaunch flag to override it)");
  }
  return static_cast<long>(*n);
}

// The GPUs Slurm gave this node, and the variable that says so; 0 when none says.
std::pair<int, std::string> slurm_gpus(const EnvLookup& env) {
  if (get(env, "SLURM_GPUS_ON_NODE") != nullptr) {
    const long n = slurm_integer(env, "SLURM_GPUS_ON_NODE", 0, "a GPU count");
    if (n > 0) return {static_cast<int>(n), "SLURM_GPUS_ON_NODE"};
  }
  for (const char* name : {"SLURM_STEP_GPUS", "SLURM_JOB_GPUS", "CUDA_VISIBLE_DEVICES"}) {
    const char* v = get(env, name);
    if (v == nullptr) continue;
    // Slurm writes "NoDevFiles" (older releases) when the node has no GPU for the job.
    if (trim(v) == "NoDevFiles") continue;
    int count = 0;
    for (const std::string& entry : split(v, ',')) count += trim(entry).empty() ? 0 : 1;
    if (count > 0) return {count, name};
  }
  return {0, ""};
}

bool rdzv_conf_names(const RawValues& raw, const std::string& key) {
  const Given* g = raw.find("rdzv_conf");
  if (g == nullptr) return false;
  for (const std::string& pair : split(g->value, ',')) {
    if (trim(pair.substr(0, pair.find('='))) == key) return true;
  }
  return false;
}

// Fills one RawValues from Slurm's variables, one concern per method (add_slurm_values' phases).
struct SlurmSource {
  RawValues& raw;
  const EnvLookup& env;
  std::vector<std::string> added;  // "--flag=value (note)" per option supplied

  // Sets `option` unless the command line or a PET_ variable gave it.
  void supply(const char* option, const std::string& value, const std::string& source,
              const std::string& note) {
    if (raw.find(option) != nullptr) return;
    raw.set(option, Given{value, source});
    added.push_back("--" + std::string(option) + "=" + value + " (" + note + ")");
  }

  // --nnodes from SLURM_NNODES; returns Slurm's node count (1 when unset). A step on part of
  // the allocation (srun -N1 in a 2-node job) runs on SLURM_STEP_NUM_NODES nodes: waiting for
  // the allocation's count would wait for nodes that never come.
  long add_nodes() {
    const char* name = "SLURM_NNODES";
    if (get(env, "SLURM_STEP_NUM_NODES") != nullptr &&
        (get(env, name) == nullptr ||
         slurm_integer(env, "SLURM_STEP_NUM_NODES", 1, "a node count >= 1") !=
             slurm_integer(env, name, 1, "a node count >= 1"))) {
      name = "SLURM_STEP_NUM_NODES";
    }
    if (get(env, name) == nullptr) return 1;
    const long nodes = slurm_integer(env, name, 1, "a node count >= 1");
    supply("nnodes", std::to_string(nodes), name, name);
    return nodes;
  }

  // --node_rank from SLURM_NODEID. Every task of a node shares its SLURM_NODEID, so several
  // ddplaunch per node would all claim one rank: ddplaunch starts the node's workers itself.
  void add_node_rank() {
    if (get(env, "SLURM_NODEID") == nullptr || raw.find("node_rank") != nullptr) return;
    const char* tasks = get(env, "SLURM_STEP_NUM_TASKS");
    const char* step_nodes = get(env, "SLURM_STEP_NUM_NODES");
    if (tasks != nullptr && step_nodes != nullptr) {
      const long t = slurm_integer(env, "SLURM_STEP_NUM_TASKS", 1, "a task count >= 1");
      const long n = slurm_integer(env, "SLURM_STEP_NUM_NODES", 1, "a node count >= 1");
      if (t > n) {
        refuse("srun started " + std::to_string(t) + " tasks on " + std::to_string(n) +
               " node(s) (SLURM_STEP_NUM_TASKS=" + tasks + ", SLURM_STEP_NUM_NODES=" + step_nodes +
               "), but ddplaunch runs once per node and starts that node's workers itself: use "
               "srun --ntasks-per-node=1 (see examples/slurm/train.sbatch), or give --node_rank "
               "to each task yourself");
      }
    }
    const long rank = slurm_integer(env, "SLURM_NODEID", 0, "a node index >= 0");
    supply("node_rank", std::to_string(rank), "SLURM_NODEID", "SLURM_NODEID");
  }

  // The rendezvous on more than one node (by Slurm, or by an explicit --nnodes such as an
  // elastic range): the first node of the step hosts it (the c10d backend's in-process server).
  void add_rendezvous(long nodes) {
    const Given* nnodes = raw.find("nnodes");
    const bool several = nodes > 1 || (nnodes != nullptr && trim(nnodes->value) != "1");
    if (!several || raw.find("rdzv_endpoint") != nullptr) return;
    const char* list_name = nullptr;
    for (const char* name : {"SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST"}) {
      if (get(env, name) != nullptr) {
        list_name = name;
        break;
      }
    }
    if (list_name == nullptr) return;
    const Expected<std::string> first = first_host(get(env, list_name));
    if (!first) {
      refuse(std::string(list_name) + ": " + first.error() + "; give --rdzv_endpoint=HOST:PORT to "
             "name the rendezvous yourself");
    }
    const std::string& host = *first;
    const std::string source = std::string("the first host of ") + list_name;
    const std::string endpoint = host + ":" + std::to_string(kSlurmRendezvousPort);
    const Given* backend = raw.find("rdzv_backend");
    const std::string backend_value = backend != nullptr ? lower(trim(backend->value)) : "";
    const bool master_given = raw.find("master_addr") != nullptr;
    if (backend == nullptr && !master_given) {
      supply("rdzv_backend", "c10d", list_name, "a Slurm job on several nodes");
      supply("rdzv_endpoint", endpoint, source, source);
    } else if (backend_value == "c10d" || backend_value == "ddp") {
      supply("rdzv_endpoint", endpoint, source, source);
    } else if (backend_value == "static" && !master_given) {
      supply("master_addr", host, source, source);
    }
  }

  // --nproc_per_node from the GPUs Slurm gave the node, when it gave any.
  void add_workers() {
    if (raw.find("nproc_per_node") != nullptr) return;
    const auto [gpus, variable] = slurm_gpus(env);
    if (gpus > 0) supply("nproc_per_node", std::to_string(gpus), variable, "GPUs from " + variable);
  }

  // --shutdown_timeout under Slurm's KillWait, unless a grace is given in any form.
  void add_grace() {
    if (get(env, "TORCH_ELASTIC_SHUTDOWN_TIMEOUT") != nullptr || rdzv_conf_names(raw, "shutdown_timeout")) return;
    std::ostringstream grace;
    grace << kSlurmShutdownTimeout;
    supply("shutdown_timeout", grace.str(), "Slurm", "5 s less than Slurm's default KillWait of 30 s");
  }
};

}  // namespace

Expected<std::vector<std::string>> expand_hostlist(const std::string& list, std::size_t max_hosts) {
  std::vector<Item> items;
  try {
    items = parse(list);
  } catch (const Malformed& malformed) {
    return unexpected(malformed.why);
  }
  std::size_t total = 0;
  for (const Item& item : items) {
    const std::size_t n = item_size(item);
    if (n > max_hosts || total + n > max_hosts) {
      return unexpected("hostlist '" + list + "' names more than " + std::to_string(max_hosts) + " hosts");
    }
    total += n;
  }
  std::vector<std::string> hosts;
  hosts.reserve(total);
  for (const Item& item : items) {
    const std::size_t n = item_size(item);
    for (std::size_t i = 0; i < n; ++i) hosts.push_back(item_host(item, i));
  }
  return hosts;
}

Expected<std::string> first_host(const std::string& list) {
  try {
    return item_host(parse(list).front(), 0);
  } catch (const Malformed& malformed) {
    return unexpected(malformed.why);
  }
}

std::vector<std::string> add_slurm_values(RawValues& raw, const EnvLookup& env) {
  const char* job_id = get(env, "SLURM_JOB_ID");
  if (job_id == nullptr || raw.flag("standalone")) return {};
  SlurmSource slurm{raw, env, {}};
  const long nodes = slurm.add_nodes();
  slurm.add_node_rank();
  slurm.supply("rdzv_id", trim(job_id), "SLURM_JOB_ID", "SLURM_JOB_ID");
  slurm.add_rendezvous(nodes);
  slurm.add_workers();
  slurm.add_grace();
  return std::move(slurm.added);
}

}  // namespace ddp::launcher
