#include "agent/fingerprint.h"

#include "agent/child_process.h"
#include "agent/fingerprint_cache.h"
#include "agent/gpus.h"
#include "agent/sha256.h"
#include "rendezvous/fingerprint_schema.h"

#include <fcntl.h>
#include <gnu/libc-version.h>
#include <poll.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/utsname.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iomanip>
#include <sstream>

extern char** environ;

namespace ddp::agent {
namespace fs = std::filesystem;
using nlohmann::json;
using namespace fingerprint_detail;
namespace schema = rdzv::fingerprint;

namespace {

// ---------------------------------------------------------------------------------------------
// The Python probe: one run of the workers' interpreter, printing one JSON line after a marker.

constexpr const char* kProbeMarker = "DDPLAUNCH_FINGERPRINT_PROBE ";
constexpr const char* kProbeScript = R"PY(
import json, os, platform, sys
r = {"version": platform.python_version(), "implementation": platform.python_implementation(),
     "executable": sys.executable, "validators": []}
def stamp(p):
    r["validators"].append(p)
try:
    import torch
    r["torch"] = str(torch.__version__)
    r["torch_cuda"] = torch.version.cuda
    d = os.path.dirname(os.path.abspath(torch.__file__))
    stamp(d)
    stamp(os.path.join(d, "version.py"))
    stamp(os.path.dirname(d))
    if torch.version.cuda:
        try:
            v = torch.cuda.nccl.version()
            r["nccl"] = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
        except Exception as e:
            r["nccl"] = None
        try:
            v = torch.backends.cudnn.version()
            r["cudnn"] = None if v is None else str(v)
        except Exception:
            r["cudnn"] = None
    else:
        r["nccl"] = None
        r["cudnn"] = None
except ImportError as e:
    r["torch"] = None
    r["torch_error"] = "%s: %s" % (type(e).__name__, e)
sys.stdout.write("\nDDPLAUNCH_FINGERPRINT_PROBE " + json.dumps(r) + "\n")
)PY";

json probe_python(const std::string& interpreter, const std::map<std::string, std::string>& env,
                  std::chrono::milliseconds timeout, std::string& error) {
  ChildResult r = run_child({interpreter, "-c", kProbeScript}, env, timeout);
  if (!r.started || r.timed_out || r.exit_code != 0) {
    error = describe_failure("probe of Python interpreter " + interpreter, r, timeout);
    return nullptr;
  }
  auto at = r.out.rfind(kProbeMarker);
  if (at == std::string::npos) {
    error = "probe of Python interpreter " + interpreter + ": no answer on its standard output";
    return nullptr;
  }
  std::string line = r.out.substr(at + std::strlen(kProbeMarker));
  line = line.substr(0, line.find('\n'));
  json j = json::parse(line, nullptr, false);
  if (!j.is_object()) {
    error = "probe of Python interpreter " + interpreter + ": unreadable answer: " + line.substr(0, 200);
    return nullptr;
  }
  return j;
}

json python_fingerprint(const FingerprintOptions& o, const std::map<std::string, std::string>& env,
                        const std::string& cache_dir) {
  json py = json::object();
  std::string resolved = resolve_executable(o.python_exec, getenv_or(env, "PATH"));
  if (resolved.empty()) {
    py["error"] = "Python interpreter '" + o.python_exec + "' not found in PATH";
    return py;
  }
  std::error_code ec;
  std::string real = fs::canonical(resolved, ec).string();
  if (ec) real = resolved;
  // The cache key: the interpreter as named and as resolved, its version on disk, and what
  // decides which torch it imports (PYTHONPATH, PYTHONHOME, VIRTUAL_ENV).
  std::string key = o.python_exec + "\n" + resolved + "\n" + real + "\n" + file_stamp(real) +
                    "\n" + getenv_or(env, "PYTHONPATH") + "\n" + getenv_or(env, "PYTHONHOME") +
                    "\n" + getenv_or(env, "VIRTUAL_ENV");
  std::string cache_file =
      cache_dir.empty() ? std::string() : cache_dir + "/fingerprint-" + sha256_hex(key).substr(0, 24) + ".json";
  json cached = load_json(cache_file);
  if (cached.is_object() && cached.value("key", "") == key && cached.contains("python") &&
      cached.contains("validators") && cached["validators"].is_object()) {
    bool valid = true;  // the torch install on disk is unchanged (pip upgrades rewrite these)
    for (auto& [path, stamp] : cached["validators"].items()) {
      if (file_stamp(path) != stamp.get<std::string>()) { valid = false; break; }
    }
    if (valid) return cached["python"];
  }
  std::string error;
  json answer = probe_python(resolved, env, o.probe_timeout, error);
  if (answer.is_null()) {
    py["executable"] = resolved;
    py["error"] = error;
    return py;  // not cached: the next start tries again
  }
  json validators = json::object();
  if (answer.contains("validators") && answer["validators"].is_array()) {
    for (const auto& p : answer["validators"]) {
      if (p.is_string()) validators[p.get<std::string>()] = file_stamp(p.get<std::string>());
    }
  }
  answer.erase("validators");
  py = answer;
  py["executable"] = resolved;
  store_json(cache_file, {{"key", key}, {"validators", validators}, {"python", py}});
  return py;
}

// ---------------------------------------------------------------------------------------------
// An executable and the shared libraries it loads.

// Parses `ldd` output: "libx.so.1 => /path/libx.so.1 (0x...)", "/lib64/ld-linux.so.2 (0x...)",
// "libmissing.so => not found". vdso lines (no file) are skipped.
std::vector<std::pair<std::string, std::string>> parse_ldd(const std::string& text) {
  std::vector<std::pair<std::string, std::string>> libs;  // name -> path ("" when not found)
  std::stringstream ss(text);
  std::string line;
  while (std::getline(ss, line)) {
    line = trim(line);
    if (line.empty()) continue;
    auto arrow = line.find(" => ");
    if (arrow != std::string::npos) {
      std::string name = line.substr(0, arrow);
      std::string rest = line.substr(arrow + 4);
      if (rest.rfind("not found", 0) == 0) { libs.emplace_back(name, ""); continue; }
      std::string path = trim(rest.substr(0, rest.find(" (")));
      if (!path.empty() && path[0] == '/') libs.emplace_back(name, path);
    } else if (line[0] == '/') {
      std::string path = trim(line.substr(0, line.find(" (")));
      libs.emplace_back(fs::path(path).filename().string(), path);
    }
  }
  return libs;
}

json program_fingerprint(const FingerprintOptions& o, const std::map<std::string, std::string>& env,
                         HashCache& hashes) {
  json prog = json::object();
  if (o.program.empty()) return prog;
  if (o.python && o.module) {
    prog["module"] = o.program;  // resolved by the interpreter at start-up; nothing to hash here
    return prog;
  }
  std::string path = o.python ? o.program : resolve_executable(o.program, getenv_or(env, "PATH"));
  if (path.empty() || !fs::exists(path)) {
    prog["path"] = o.program;
    prog["error"] = "program '" + o.program + "' not found";
    return prog;
  }
  prog["path"] = path;
  if (const Expected<std::string> hash = hashes.hash(path)) {
    prog["sha256"] = *hash;
  } else {
    prog["error"] = hash.error();
  }
  if (o.python) return prog;
  ChildResult r = run_child({"ldd", path}, env, o.probe_timeout);
  json libs = json::object();
  if (r.started && !r.timed_out && r.exit_code == 0) {
    for (const auto& [name, lib] : parse_ldd(r.out)) {
      if (lib.empty()) { libs[name] = "not found"; continue; }
      const Expected<std::string> hash = hashes.hash(lib);
      libs[name] = hash ? *hash : "unreadable: " + hash.error();
    }
  } else if (r.started && !r.timed_out &&
             (r.out + r.err).find("not a dynamic executable") != std::string::npos) {
    // statically linked: the program hash covers everything
  } else {
    prog["libraries_error"] = describe_failure("ldd " + path, r, o.probe_timeout);
  }
  prog["libraries"] = libs;
  return prog;
}

Expected<json> env_lock_fingerprint(const FingerprintOptions& o, const std::map<std::string, std::string>& env) {
  const std::string& spec = o.env_lock;
  if (spec.rfind("cmd:", 0) == 0) {
    std::string command = spec.substr(4);
    if (trim(command).empty()) {
      return unexpected("--env_lock cmd: needs a command after 'cmd:', e.g. 'cmd:conda list --explicit'");
    }
    ChildResult r = run_child({"/bin/sh", "-c", command}, env, o.probe_timeout);
    if (!r.started || r.timed_out || r.exit_code != 0) {
      return unexpected(describe_failure("--env_lock command '" + command + "'", r, o.probe_timeout));
    }
    return json{{"source", spec}, {"sha256", sha256_hex(r.out)}};
  }
  std::error_code ec;
  if (!fs::is_regular_file(spec, ec)) {
    return unexpected("--env_lock " + spec +
                      ": no such file (give a lock file such as requirements.txt, or "
                      "cmd:COMMAND to hash a command's output)");
  }
  const Expected<std::string> hash = sha256_file(spec);
  if (!hash) return unexpected("--env_lock " + hash.error());
  return json{{"source", spec}, {"sha256", *hash}};
}

std::string os_release() {
  std::string text;
  if (!read_file("/etc/os-release", text) && !read_file("/usr/lib/os-release", text)) return "unknown";
  std::stringstream ss(text);
  std::string line, pretty, name, version;
  auto unquote = [](std::string v) {
    v = trim(v);
    if (v.size() >= 2 && (v.front() == '"' || v.front() == '\'')) v = v.substr(1, v.size() - 2);
    return v;
  };
  while (std::getline(ss, line)) {
    if (line.rfind("PRETTY_NAME=", 0) == 0) pretty = unquote(line.substr(12));
    else if (line.rfind("NAME=", 0) == 0) name = unquote(line.substr(5));
    else if (line.rfind("VERSION_ID=", 0) == 0) version = unquote(line.substr(11));
  }
  if (!pretty.empty()) return pretty;
  if (!name.empty()) return trim(name + " " + version);
  return "unknown";
}

}  // namespace

json machine_fingerprint() {
  json m = json::object();
  utsname u{};
  m["arch"] = uname(&u) == 0 ? std::string(u.machine) : std::string("unknown");
  m["os"] = os_release();
  m["glibc"] = std::string(gnu_get_libc_version());
  return m;
}

json interpreter_fingerprint(const FingerprintOptions& options) {
  auto env = environment_of(options.use_process_environment, options.environment);
  return python_fingerprint(options, env, cache_dir_of(options.cache_dir, env));
}

Expected<json> environment_fingerprint(const FingerprintOptions& options) {
  auto env = environment_of(options.use_process_environment, options.environment);
  json fp = json::object();
  if (options.python) fp[std::string(schema::kPython)] = python_fingerprint(options, env, cache_dir_of(options.cache_dir, env));
  if (!options.env_lock.empty()) {
    Expected<json> lock = env_lock_fingerprint(options, env);
    if (!lock) return lock;
    fp[std::string(schema::kEnvLock)] = std::move(*lock);
  }
  return fp;
}

std::string environment_digest(const json& fingerprint) {
  // One "path=value" line per breaking fact in schema order, so that the same software gives the
  // same digest whichever of the two functions above made the fingerprint.
  std::string lines;
  for (const schema::Field& f : schema::kFields) {
    if (f.kind != schema::Kind::breaking || f.path.rfind(schema::kProgram, 0) == 0) continue;
    const std::size_t dot = f.path.find('.');
    auto section = fingerprint.find(std::string(f.path.substr(0, dot)));
    if (section == fingerprint.end() || !section->is_object()) continue;
    auto value = section->find(std::string(f.path.substr(dot + 1)));
    if (value == section->end()) continue;
    lines.append(f.path).append("=").append(value->dump()).append("\n");
  }
  return lines.empty() ? std::string() : sha256_hex(lines);
}

Expected<json> compute_fingerprint(const FingerprintOptions& options) {
  auto env = environment_of(options.use_process_environment, options.environment);
  std::string cache_dir = cache_dir_of(options.cache_dir, env);
  json fp = json::object();
  fp[std::string(schema::kMachine)] = machine_fingerprint();
  auto cvd = env.find("CUDA_VISIBLE_DEVICES");
  fp[std::string(schema::kGpu)] = gpu_fingerprint(options.nvidia_proc_dir,
                              cvd == env.end() ? nullptr : cvd->second.c_str());
  if (options.python) fp[std::string(schema::kPython)] = python_fingerprint(options, env, cache_dir);
  HashCache hashes(cache_dir.empty() ? std::string() : cache_dir + "/sha256-cache.json");
  json prog = program_fingerprint(options, env, hashes);
  hashes.save();
  if (!prog.empty()) fp[std::string(schema::kProgram)] = prog;
  if (!options.env_lock.empty()) {
    Expected<json> lock = env_lock_fingerprint(options, env);
    if (!lock) return lock;
    fp[std::string(schema::kEnvLock)] = std::move(*lock);
  }
  json settings = json::object();
  for (const auto& [k, v] : env) {
    if (k.rfind("NCCL_", 0) == 0 || k == "CUDA_VISIBLE_DEVICES") settings[k] = v;
  }
  fp[std::string(schema::kEnv)] = settings;
  return fp;
}

}  // namespace ddp::agent
