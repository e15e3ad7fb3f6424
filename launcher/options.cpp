// The option table and --help (launcher/options.h).
#include "launcher/options.h"

#include <algorithm>
#include <cctype>
#include <sstream>

#ifndef DDPLAUNCH_VERSION
#define DDPLAUNCH_VERSION "unknown"
#endif

namespace ddp::launcher {
namespace {

// clang-format off
const std::vector<OptionSpec> kOptions = {
  // Workers
  {"nnodes", 0, false, "N|MIN:MAX", "1",
   Group::kWorkers, "Number of nodes, or the elastic range MIN:MAX (1 <= MIN <= MAX)."},
  {"nproc_per_node", 0, false, "N|auto|cpu|gpu|xpu", "1",
   Group::kWorkers, "Workers per node: a count, 'gpu' (visible GPUs, honouring "
   "CUDA_VISIBLE_DEVICES), 'cpu' (usable CPUs), or 'auto' (GPUs when any, else CPUs). "
   "'xpu' (Intel GPUs) is refused: ddplaunch counts NVIDIA GPUs only."},
  {"node_rank", 0, false, "N", "0 with the static backend, else assigned by the rendezvous",
   Group::kWorkers, "Rank of this node (0 <= N < MAX nodes). Required by the static backend "
   "on more than one node."},
  {"module", 'm', true, nullptr, nullptr,
   Group::kWorkers, "Run PROGRAM as a Python module, like 'python -m'."},
  {"no_python", 0, true, nullptr, nullptr,
   Group::kWorkers, "Execute PROGRAM directly instead of through the Python interpreter."},
  {"run_path", 0, true, nullptr, nullptr,
   Group::kWorkers, "Run PROGRAM (an absolute path to a Python script) as runpy.run_path "
   "would; takes precedence over --no_python."},
  {"python", 0, false, "PATH", "$PYTHON_EXEC, else python3 (pip's: its environment's)",
   Group::kWorkers, "Interpreter that runs Python workers (as 'PATH -u PROGRAM ARGS')."},
  {"role", 0, false, "NAME", "default",
   Group::kWorkers, "Role of the workers (ROLE_NAME, the log prefix)."},
  {"virtual_local_rank", 0, true, nullptr, nullptr,
   Group::kWorkers, "Each worker sees LOCAL_RANK=0 and only its own GPU: CUDA_VISIBLE_DEVICES "
   "narrowed to entry LOCAL_RANK of ddplaunch's own list (torchrun 2.x)."},
  {"numa_binding", 0, false, "node|socket|exclusive|core-complex", "none",
   Group::kWorkers, "Bind each worker's CPUs (and preferred memory) to the NUMA node of its "
   "GPU (local rank N uses GPU N; without GPUs, local ranks go round-robin over the NUMA "
   "nodes). 'socket': every node of that socket; 'exclusive': the node's cores split among "
   "its workers; 'core-complex': one last-level-cache group each."},
  {"standby", 0, false, "off|on|auto", "auto",
   Group::kWorkers, "Keep one standby process per local rank, started and loaded (import torch, or "
   "libtorch for a worker SDK program), that becomes the next round's worker in place of a cold "
   "start. 'auto': for Python programs and worker SDK programs, from the first round's first step "
   "on (the first round starts cold); other programs start cold. 'on': the same, and the first "
   "round's workers come from standbys too (start-up waits for them to load). Each standby holds "
   "about 370 MiB of memory for Python, 190 MiB for a worker SDK program; '--standby=off' saves it "
   "(docs/agent.md)."},
  {"in_memory_restart", 0, false, "off|on|auto", "auto",
   Group::kWorkers, "At a restart, keep healthy workers that can wait (worker SDK programs, Python "
   "scripts with ddplaunch.restartable or ddplaunch.InMemoryRestart) instead of stopping them: they "
   "park with their state and take the next round's assignment. 'auto': on for those, off for the "
   "others (docs/restartable.md)."},
  {"preload", 0, false, "MODULE,MODULE,...", "none",
   Group::kWorkers, "Modules a standby imports besides torch before its assignment (with "
   "--standby)."},
  {"start_method", 0, false, "spawn|fork|forkserver", "spawn",
   Group::kWorkers, "Accepted for torchrun compatibility; workers are always new processes."},
  {"master_addr", 0, false, "HOST", "127.0.0.1",
   Group::kWorkers, "Address of the rank-0 node, static backend only (IPv6 as [::1])."},
  {"master_port", 0, false, "PORT", "29500 for the static backend on several nodes; a single-node "
   "job picks a free port for each round, and a rendezvous job takes the one its rank-0 node offers",
   Group::kWorkers, "MASTER_PORT: the port on the rank-0 node; 0 picks a free port."},
  {"local_addr", 0, false, "ADDR", "the address used to reach the rendezvous",
   Group::kWorkers, "Address other nodes reach this node at (becomes MASTER_ADDR when this "
   "node is group rank 0)."},
  // Rendezvous
  {"rdzv_backend", 0, false, "static|c10d|ddp|etcd|etcd-v2", "static",
   Group::kRendezvous, "Rendezvous backend. 'c10d' and 'ddp' both mean the ddp-rendezvous "
   "daemon at --rdzv_endpoint; 'static' needs no daemon (fixed --nnodes and --node_rank); "
   "'etcd' and 'etcd-v2' need no daemon either: --rdzv_endpoint is etcd's (port 2379) and the "
   "job's agents host the rendezvous, electing its leader through etcd (docs/etcd.md)."},
  {"rdzv_endpoint", 0, false, "HOST[:PORT][,HOST[:PORT]...]", "none; PORT defaults to 29400",
   Group::kRendezvous, "Where the rendezvous daemon listens; a comma-separated list names "
   "standby daemons, tried in order when one is lost. With the static backend it "
   "replaces --master_addr:--master_port."},
  {"rdzv_id", 0, false, "ID", "none",
   Group::kRendezvous, "Job id: every node of one job gives the same id."},
  {"spare", 0, true, nullptr, nullptr,
   Group::kRendezvous, "Join as a spare node: wait beside the job's round, never counted toward "
   "--nnodes, and take the place of a node that fails, is lost or is drained (docs/maintenance.md). "
   "Needs a rendezvous daemon (--rdzv_backend=c10d)."},
  {"rdzv_conf", 0, false, "KEY=VALUE,...", "none",
   Group::kRendezvous, "Rendezvous settings, in seconds where they are times: join_timeout "
   "(600), last_call_timeout (30), heartbeat_interval (1), heartbeat_timeout (5), "
   "probe_timeout (0.3: a node that does not answer a probe this long while the job stalls is "
   "lost; 0 = heartbeat_timeout only), shutdown_timeout (30), reconnect_timeout (60: how long workers keep running while no "
   "rendezvous answers), read_timeout, timeout; token_file=PATH; is_host=true|false. "
   "With etcd backends: protocol=http, etcd_prefix (/ddplaunch/jobs), etcd_lease_ttl (5), "
   "etcd_timeout (10), etcd_user, etcd_password_file; timeout is the join timeout. "
   "Other keys are ignored with a warning."},
  {"standalone", 0, true, nullptr, nullptr,
   Group::kRendezvous, "Single-node job on a private local rendezvous: sets the c10d backend, "
   "a loopback endpoint and a random run id, ignoring any --rdzv_* values given."},
  // Fault tolerance
  {"max_restarts", 0, false, "N", "0",
   Group::kFaultTolerance, "Restarts of the worker group after a failure before the job fails "
   "(counted per job across nodes)."},
  {"monitor_interval", 0, false, "SECONDS", "0.1",
   Group::kFaultTolerance, "Accepted for torchrun compatibility; worker exits are events, "
   "not polled."},
  {"shutdown_timeout", 0, false, "SECONDS", "30",
   Group::kFaultTolerance, "Grace between SIGTERM and SIGKILL when workers are stopped."},
  {"hang_timeout", 0, false, "SECONDS|auto", "off",
   Group::kFaultTolerance, "A rank that reported a step (every optimizer.step() of a Python "
   "worker, or ddplaunch.step(); every step of the worker SDK) and then reports none for SECONDS "
   "hangs: its stacks are dumped and the group restarts. 'auto': 5 x the slowest step seen, at "
   "least 60 s (docs/agent.md)."},
  {"straggler", 0, false, "off|report|replace", "report",
   Group::kFaultTolerance, "What the rendezvous does about a straggler: a node whose busy time per "
   "step (the time its ranks do not wait for the others) stays at --straggler_factor x the other "
   "nodes' median or more for --straggler_window: 'report' names it (event, metric, a status "
   "line), 'replace' also drains it onto a waiting --spare node (docs/maintenance.md). The job's "
   "policy: every node gives the same."},
  {"straggler_factor", 0, false, "X", "1.5",
   Group::kFaultTolerance, "Busy time over the other nodes' median that makes a node slow (1.05 to 100)."},
  {"straggler_window", 0, false, "SECONDS", "60",
   Group::kFaultTolerance, "How long a node stays slow before it is named a straggler, and below half "
   "the excess before it is cleared."},
  {"crash_loop_limit", 0, false, "N", "0 (off)",
   Group::kFaultTolerance, "Fail the job after N restarts in a row in which no rank reported a "
   "step or checkpoint beyond the best seen so far."},
  {"no_restart_exit_codes", 0, false, "CODE,CODE,...", "none",
   Group::kFaultTolerance, "A worker exiting with one of these codes ends the job at once, "
   "without a restart (e.g. a configuration error)."},
  {"check_health", 0, false, "CMD|gpu", "none",
   Group::kFaultTolerance, "Shell command run before this node joins each round (it stays out "
   "until CMD exits 0) and every --check_health_interval while training (a failure stops this "
   "node's workers as a failure). With GPUs visible a built-in GPU check runs first; 'gpu' "
   "runs only that."},
  {"check_health_interval", 0, false, "SECONDS", "30",
   Group::kFaultTolerance, "Period of --check_health while training, and of its retries while "
   "it fails."},
  {"signals_to_handle", 0, false, "SIGNALS", "SIGTERM,SIGINT,SIGHUP,SIGQUIT",
   Group::kFaultTolerance, "Signals forwarded to the workers (names or numbers, comma "
   "separated); ddplaunch then exits 128+N."},
  // Logs
  {"log_dir", 0, false, "DIR", "a new temporary directory when logs are written",
   Group::kLogs, "Base directory of worker logs: DIR/RUN_ID/attempt_N/LOCAL_RANK/"
   "{stdout,stderr}.log."},
  {"redirects", 'r', false, "0-3|RANK:V,...", "0",
   Group::kLogs, "Send worker streams to log files instead of the console: 0 none, 1 stdout, "
   "2 stderr, 3 both; or per local rank, e.g. 0:3,1:1."},
  {"tee", 't', false, "0-3|RANK:V,...", "0",
   Group::kLogs, "Copy worker streams to log files and to the console, each console line "
   "prefixed like [default0]: (same forms as --redirects)."},
  {"local_ranks_filter", 0, false, "RANKS", "all local ranks",
   Group::kLogs, "Comma list of local ranks whose output reaches the console (log files "
   "are not filtered)."},
  {"log_dedup", 0, true, nullptr, nullptr,
   Group::kLogs, "Write a line that several local ranks print alike within "
   "--log_dedup_window once, as [ranks 0-3] LINE; other lines keep their [default0]: prefix. "
   "With a rendezvous server, one node of the job prints a restart's reason and the failure "
   "summary. Log files stay complete (docs/agent.md)."},
  {"log_dedup_window", 0, false, "SECONDS", "0.25",
   Group::kLogs, "How long --log_dedup holds a line for the other ranks to print it too."},
  {"duplicate_stdout_filters", 0, false, "TEXT,TEXT,...", "none",
   Group::kLogs, "Also copy worker stdout lines containing any TEXT into one combined file "
   "(',,' is a literal comma; torchrun 2.x)."},
  {"duplicate_stderr_filters", 0, false, "TEXT,TEXT,...", "none",
   Group::kLogs, "The same for stderr lines."},
  {"logs_specs", 0, false, "NAME", "DefaultLogsSpecs",
   Group::kLogs, "torchrun's Python plug-in for the log layout; only the default layout "
   "exists here, so only 'DefaultLogsSpecs' (or 'default') is accepted."},
  {"event_log_handler", 0, false, "NAME", "null",
   Group::kLogs, "torchrun's event handler: 'console' writes the lifecycle events as JSON "
   "lines to stderr (like --event_log=-), 'null' and 'dynamic_rendezvous' record none."},
  {"event_log", 0, false, "FILE", "none",
   Group::kLogs, "Append one JSON line per lifecycle event (round, worker started/exited "
   "with cause, restart, job end) to FILE; '-' = stderr (docs/metrics.md)."},
  {"metrics_port", 0, false, "PORT", "off",
   Group::kLogs, "Serve Prometheus /metrics, /healthz and /readyz on PORT (0 = a free "
   "port, printed) (docs/metrics.md)."},
  {"metrics_addr", 0, false, "ADDR", "127.0.0.1",
   Group::kLogs, "Address the metrics server listens on (it has no authentication)."},
  // Environment check
  {"env_check", 0, false, "strict|warn|off", "strict",
   Group::kEnvCheck, "What to do when the nodes' software differs: refuse the round (exit 3), "
   "log and go on, or skip the check."},
  {"env_lock", 0, false, "FILE", "none",
   Group::kEnvCheck, "A lock file (requirements.txt, environment.yml, ...) whose hash must "
   "match on every node."},
  {"check_env", 0, true, nullptr, nullptr,
   Group::kEnvCheck, "Print this node's software fingerprint and a verdict; with --rdzv_endpoint "
   "and --rdzv_id, compare it with the job's nodes (without PROGRAM, what depends on the program "
   "is not compared). Exits 0 when this node can run (and join) the job, 2 when it cannot run "
   "it (the workers' Python has no torch), 3 on a breaking difference. PROGRAM is not needed."},
};
// clang-format on

const OptionSpec kHelp{"help", 'h', true, nullptr, nullptr, Group::kWorkers, "Print the help."};
const OptionSpec kVersion{"version", 0, true, nullptr, nullptr, Group::kWorkers, "Print the version."};

std::string section_title(Group group) {
  switch (group) {
    case Group::kWorkers: return "Workers";
    case Group::kRendezvous: return "Rendezvous";
    case Group::kFaultTolerance: return "Fault tolerance";
    case Group::kLogs: return "Logs";
    case Group::kEnvCheck: return "Environment check";
  }
  return "";
}

// Wraps `text` at `width` columns, each line starting with `indent` spaces.
std::string wrap(const std::string& text, std::size_t indent, std::size_t width = 79) {
  std::string out;
  std::string line(indent, ' ');
  std::istringstream words(text);
  std::string word;
  bool line_empty = true;
  while (words >> word) {
    if (!line_empty && line.size() + 1 + word.size() > width) {
      out += line + "\n";
      line.assign(indent, ' ');
      line_empty = true;
    }
    if (!line_empty) line += ' ';
    line += word;
    line_empty = false;
  }
  if (!line_empty) out += line + "\n";
  return out;
}

const std::vector<OptionAlias> kAliases = {
    {"health_check", "check_health"},
    {"health_check_interval", "check_health_interval"},
    {"max_restarts_without_progress", "crash_loop_limit"},
};

// " Also --health_check, --health-check (exact)." for an option with an alias, else "".
std::string alias_text(const OptionSpec& spec) {
  std::string text;
  for (const OptionAlias& a : kAliases) {
    if (std::string(a.name) == spec.name) text += std::string(" Also --") + a.alias + ", --" + dash_spelling(a.alias);
  }
  return text.empty() ? text : text + " (exact names only).";
}

std::string option_names(const OptionSpec& spec) {
  std::string names;
  if (spec.short_name != 0) names += std::string("-") + spec.short_name + ", ";
  names += std::string("--") + spec.name;
  const std::string dashed = dash_spelling(spec.name);
  if (dashed != spec.name) names += ", --" + dashed;
  if (spec.value_name != nullptr) names += std::string(" ") + spec.value_name;
  return names;
}


// Options that yield a shared prefix to the option it also starts (see find_long_option): added
// after users' command lines came to rely on such a prefix meaning the older option.
const char* const kPrefixYielding[] = {"standby", "preload", "in_memory_restart"};

}  // namespace

const std::vector<OptionSpec>& option_table() { return kOptions; }

const std::vector<OptionAlias>& option_aliases() { return kAliases; }

std::string dash_spelling(const std::string& name) {
  std::string out = name;
  std::replace(out.begin(), out.end(), '_', '-');
  return out;
}

std::string env_name(const std::string& name) {
  std::string out = "PET_";
  for (char c : name) out += static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  return out;
}

const OptionSpec* find_long_option(const std::string& name, std::vector<std::string>& candidates) {
  candidates.clear();
  std::vector<const OptionSpec*> all{&kHelp, &kVersion};
  for (const OptionSpec& spec : kOptions) all.push_back(&spec);
  for (const OptionSpec* spec : all) {
    if (name == spec->name || name == dash_spelling(spec->name)) return spec;
  }
  for (const OptionAlias& a : kAliases) {
    if (name != a.alias && name != dash_spelling(a.alias)) continue;
    for (const OptionSpec& spec : kOptions) {
      if (std::string(a.name) == spec.name) return &spec;
    }
  }
  if (name.empty()) return nullptr;
  std::vector<const OptionSpec*> matches;
  for (const OptionSpec* spec : all) {
    const std::string under = spec->name;
    const std::string dash = dash_spelling(under);
    if (under.compare(0, name.size(), name) == 0 || dash.compare(0, name.size(), name) == 0) {
      matches.push_back(spec);
    }
  }
  if (matches.size() == 1) return matches.front();
  // ddplaunch's own options added since never take a prefix from the others: `--stand` stays
  // torchrun's --standalone although --standby starts the same way.
  std::vector<const OptionSpec*> older;
  for (const OptionSpec* spec : matches) {
    if (std::none_of(std::begin(kPrefixYielding), std::end(kPrefixYielding),
                     [&](const char* n) { return std::string(n) == spec->name; })) {
      older.push_back(spec);
    }
  }
  if (older.size() == 1) return older.front();
  for (const OptionSpec* spec : matches) candidates.push_back(std::string("--") + spec->name);
  return nullptr;
}

namespace {

// Optimal string alignment distance: insertions, deletions, substitutions and swaps of two
// neighbouring letters each cost 1.
std::size_t edit_distance(const std::string& a, const std::string& b) {
  std::vector<std::vector<std::size_t>> d(a.size() + 1, std::vector<std::size_t>(b.size() + 1));
  for (std::size_t i = 0; i <= a.size(); ++i) d[i][0] = i;
  for (std::size_t j = 0; j <= b.size(); ++j) d[0][j] = j;
  for (std::size_t i = 1; i <= a.size(); ++i) {
    for (std::size_t j = 1; j <= b.size(); ++j) {
      const std::size_t cost = a[i - 1] == b[j - 1] ? 0 : 1;
      d[i][j] = std::min({d[i - 1][j] + 1, d[i][j - 1] + 1, d[i - 1][j - 1] + cost});
      if (i > 1 && j > 1 && a[i - 1] == b[j - 2] && a[i - 2] == b[j - 1]) d[i][j] = std::min(d[i][j], d[i - 2][j - 2] + 1);
    }
  }
  return d[a.size()][b.size()];
}

}  // namespace

std::vector<std::string> closest_long_options(const std::string& name) {
  // Compared in the underscore spelling, case-insensitively: --Nproc-Per-Node is one typo away.
  std::string wanted;
  for (char c : name) wanted += c == '-' ? '_' : static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  if (wanted.empty()) return {};
  // A third of the name, at least 1 and at most 3 edits: "--nodes" -> --nnodes, not --role.
  const std::size_t limit = std::clamp<std::size_t>(wanted.size() / 3, 1, 3);
  std::vector<std::pair<std::size_t, std::string>> scored;
  std::vector<const OptionSpec*> all{&kHelp, &kVersion};
  for (const OptionSpec& spec : kOptions) all.push_back(&spec);
  for (const OptionSpec* spec : all) {
    const std::size_t distance = edit_distance(wanted, spec->name);
    if (distance <= limit) scored.emplace_back(distance, std::string("--") + spec->name);
  }
  std::stable_sort(scored.begin(), scored.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
  std::vector<std::string> out;
  for (const auto& [distance, spelling] : scored) {
    if (out.size() == 3) break;
    out.push_back(spelling);
  }
  return out;
}

const OptionSpec* find_short_option(char letter) {
  if (letter == kHelp.short_name) return &kHelp;
  for (const OptionSpec& spec : kOptions) {
    if (spec.short_name == letter) return &spec;
  }
  return nullptr;
}

std::string version_text() { return std::string("ddplaunch ") + DDPLAUNCH_VERSION; }

std::string help_text() {
  std::string h;
  h += "NAME\n    ddplaunch - launch and supervise distributed PyTorch training\n\n";
  h += "SYNOPSIS\n"
       "    ddplaunch [OPTIONS] PROGRAM [ARGS...]\n"
       "    ddplaunch [OPTIONS] -m MODULE [ARGS...]\n"
       "    ddplaunch [OPTIONS] --no_python EXECUTABLE [ARGS...]\n"
       "    ddplaunch --check_env [--rdzv_endpoint HOST:PORT --rdzv_id ID]\n\n";
  h += "DESCRIPTION\n";
  h += wrap("Starts --nproc_per_node workers on this node, each with the torchrun environment "
            "(RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, ...), watches them, and "
            "restarts the whole group up to --max_restarts times when one fails. With no "
            "rendezvous flags it runs a single-node job; with --rdzv_backend=c10d and "
            "--rdzv_endpoint it joins the other nodes of job --rdzv_id at a ddp-rendezvous "
            "daemon.", 4);
  h += "\n";
  h += wrap("PROGRAM is a Python script run as 'python3 -u PROGRAM ARGS' (a .py or .pyc file, "
            "or a #! line naming python), a module with -m, or an executable run directly: an "
            "ELF binary or a script whose #! names another interpreter, or anything with "
            "--no_python. A bare name not in the current directory is looked up on PATH. "
            "Everything after PROGRAM belongs to it, flags included. Unique prefixes of long "
            "options are accepted (--nnode 2), as argparse does. Every option has two spellings (--nproc_per_node, --nproc-per-node) and "
            "can also be set as PET_<NAME> in the environment (PET_NPROC_PER_NODE=4); the "
            "command line wins. For a flag, PET_<NAME>=1 turns it on.", 4);
  h += "\nOPTIONS\n";
  h += "    -h, --help\n        Print this help and exit 0.\n";
  h += "    --version\n        Print the version and exit 0.\n";
  for (Group group : {Group::kWorkers, Group::kRendezvous, Group::kFaultTolerance, Group::kLogs,
                      Group::kEnvCheck}) {
    h += "\n  " + section_title(group) + "\n";
    for (const OptionSpec& spec : kOptions) {
      if (spec.group != group) continue;
      h += "    " + option_names(spec) + "\n";
      std::string text = spec.help + alias_text(spec);
      if (spec.default_text != nullptr) text += std::string(" Default: ") + spec.default_text + ".";
      text += " Env: " + env_name(spec.name) + ".";
      h += wrap(text, 8);
    }
  }
  h += "\nEXIT STATUS\n"
       "    0      the job succeeded on every node (also --help, --version, and\n"
       "           --check_env when this node can run and join the job)\n"
       "    1      the job failed: workers failed past the restart budget\n"
       "           (--max_restarts)\n"
       "    2      usage or configuration error (bad flag, bad value, missing program,\n"
       "           a workers' Python that cannot import torch); nothing was started\n"
       "    3      rendezvous failed: timeout, connection closed or refused, protocol\n"
       "           version, token, or software mismatch between nodes (--env_check)\n"
       "    128+N  ddplaunch received signal N (SIGINT 130, SIGTERM 143), forwarded\n"
       "           it to the workers and stopped them\n";
  h += "\nENVIRONMENT\n"
       "    PET_<NAME>\n"
       "        Default for option --<name>: PET_NNODES, PET_NPROC_PER_NODE,\n"
       "        PET_RDZV_ENDPOINT, PET_MAX_RESTARTS, PET_STANDALONE=1, ...\n"
       "        The command line wins; an empty variable counts as unset.\n"
       "    PYTHON_EXEC\n"
       "        Interpreter for Python workers when neither --python nor PET_PYTHON\n"
       "        is given (else python3; installed by pip, its environment's).\n"
       "    CUDA_VISIBLE_DEVICES\n"
       "        Limits the GPUs counted by --nproc_per_node=gpu|auto; passed on to\n"
       "        the workers unchanged.\n"
       "    TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE\n"
       "        Prefix of tee'd console lines; ${role_name}, ${rank} and\n"
       "        ${local_rank} are replaced. Default: [${role_name}${local_rank}]:\n"
       "    TORCH_ELASTIC_SHUTDOWN_TIMEOUT\n"
       "        SIGTERM-to-SIGKILL grace when --shutdown_timeout and the --rdzv_conf\n"
       "        key shutdown_timeout are not given (else 30 seconds).\n"
       "    OMP_NUM_THREADS\n"
       "        Set to 1 for the workers when unset and more than one worker runs\n"
       "        per node.\n"
       "    SLURM_JOB_ID, SLURM_NNODES, SLURM_NODEID, SLURM_*NODELIST, SLURM_*GPUS*\n"
       "        Inside a Slurm allocation: defaults for --nnodes, --node_rank,\n"
       "        --rdzv_id, the rendezvous endpoint (first node of the list),\n"
       "        --nproc_per_node and --shutdown_timeout (25), after PET_<NAME>.\n";
  h += "\nEXAMPLES\n"
       "    One node, four workers:\n"
       "        ddplaunch --nproc_per_node=4 train.py --epochs 3\n"
       "    One worker per visible GPU, a module, restarts on failure:\n"
       "        ddplaunch --standalone --nproc_per_node=gpu --max_restarts=3 \\\n"
       "                  -m pkg.train\n"
       "    Two to four nodes at a rendezvous daemon (on head: ddp-rendezvous\n"
       "    --port 29400), run on every node:\n"
       "        ddplaunch --nnodes=2:4 --nproc_per_node=8 --rdzv_backend=c10d \\\n"
       "                  --rdzv_endpoint=head:29400 --rdzv_id=job42 train.py\n"
       "    Two nodes without a daemon (static), run on each node with its rank:\n"
       "        ddplaunch --nnodes=2 --node_rank=0 --master_addr=10.0.0.1 \\\n"
       "                  --master_port=29500 --nproc_per_node=4 train.py\n"
       "    A C++ program (run directly), logs of rank 0 only on the console,\n"
       "    all in files:\n"
       "        ddplaunch --nproc_per_node=4 --tee=3 --log_dir=logs \\\n"
       "                  --local_ranks_filter=0 ./train\n"
       "\nSEE ALSO\n"
       "    ddp-rendezvous(1), docs/cli.md, docs/exit-codes.md\n";
  return h;
}

}  // namespace ddp::launcher
