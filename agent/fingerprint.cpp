#include "agent/fingerprint.h"

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

// ---------------------------------------------------------------------------------------------
// SHA-256 (FIPS 180-4), written from the standard's description.
namespace {

class Sha256 {
 public:
  Sha256() { reset(); }

  void update(const void* data, std::size_t len) {
    const auto* p = static_cast<const unsigned char*>(data);
    total_ += len;
    if (buffered_ > 0) {
      std::size_t take = std::min(len, std::size_t{64} - buffered_);
      std::memcpy(buffer_ + buffered_, p, take);
      buffered_ += take;
      p += take;
      len -= take;
      if (buffered_ == 64) {
        block(buffer_);
        buffered_ = 0;
      }
    }
    while (len >= 64) {
      block(p);
      p += 64;
      len -= 64;
    }
    if (len > 0) {
      std::memcpy(buffer_, p, len);
      buffered_ = len;
    }
  }

  std::string hex() {
    std::uint64_t bits = total_ * 8;
    unsigned char pad = 0x80;
    update(&pad, 1);
    unsigned char zero = 0;
    while (buffered_ != 56) update(&zero, 1);
    unsigned char length[8];
    for (int i = 0; i < 8; ++i) length[i] = static_cast<unsigned char>(bits >> (56 - 8 * i));
    update(length, 8);
    static const char* digits = "0123456789abcdef";
    std::string out;
    out.reserve(64);
    for (std::uint32_t v : h_) {
      for (int shift = 28; shift >= 0; shift -= 4) out.push_back(digits[(v >> shift) & 0xf]);
    }
    reset();
    return out;
  }

 private:
  static std::uint32_t rotr(std::uint32_t x, int n) { return (x >> n) | (x << (32 - n)); }

  void reset() {
    h_ = {0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a,
          0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19};
    total_ = 0;
    buffered_ = 0;
  }

  void block(const unsigned char* p) {
    static constexpr std::uint32_t k[64] = {
        0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4,
        0xab1c5ed5, 0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe,
        0x9bdc06a7, 0xc19bf174, 0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f,
        0x4a7484aa, 0x5cb0a9dc, 0x76f988da, 0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7,
        0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967, 0x27b70a85, 0x2e1b2138, 0x4d2c6dfc,
        0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85, 0xa2bfe8a1, 0xa81a664b,
        0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070, 0x19a4c116,
        0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3,
        0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7,
        0xc67178f2};
    std::uint32_t w[64];
    for (int i = 0; i < 16; ++i) {
      w[i] = (std::uint32_t{p[4 * i]} << 24) | (std::uint32_t{p[4 * i + 1]} << 16) |
             (std::uint32_t{p[4 * i + 2]} << 8) | std::uint32_t{p[4 * i + 3]};
    }
    for (int i = 16; i < 64; ++i) {
      std::uint32_t s0 = rotr(w[i - 15], 7) ^ rotr(w[i - 15], 18) ^ (w[i - 15] >> 3);
      std::uint32_t s1 = rotr(w[i - 2], 17) ^ rotr(w[i - 2], 19) ^ (w[i - 2] >> 10);
      w[i] = w[i - 16] + s0 + w[i - 7] + s1;
    }
    std::uint32_t a = h_[0], b = h_[1], c = h_[2], d = h_[3], e = h_[4], f = h_[5], g = h_[6],
                  h = h_[7];
    for (int i = 0; i < 64; ++i) {
      std::uint32_t t1 = h + (rotr(e, 6) ^ rotr(e, 11) ^ rotr(e, 25)) + ((e & f) ^ (~e & g)) + k[i] + w[i];
      std::uint32_t t2 = (rotr(a, 2) ^ rotr(a, 13) ^ rotr(a, 22)) + ((a & b) ^ (a & c) ^ (b & c));
      h = g;
      g = f;
      f = e;
      e = d + t1;
      d = c;
      c = b;
      b = a;
      a = t1 + t2;
    }
    h_[0] += a; h_[1] += b; h_[2] += c; h_[3] += d;
    h_[4] += e; h_[5] += f; h_[6] += g; h_[7] += h;
  }

  std::array<std::uint32_t, 8> h_{};
  std::uint64_t total_ = 0;
  unsigned char buffer_[64]{};
  std::size_t buffered_ = 0;
};

// ---------------------------------------------------------------------------------------------
// Child processes with a deadline.

struct ChildResult {
  bool started = false;
  bool timed_out = false;
  int exit_code = -1;  // WEXITSTATUS, or 128+signal
  std::string out;
  std::string err;
  std::string error;   // why it could not start
};

// Runs argv (argv[0] looked up in PATH) with stdin from /dev/null and exactly the environment
// `env`, capturing both outputs. At the deadline the child's process group is killed. Output
// beyond 16 MiB per stream is dropped.
ChildResult run_child(const std::vector<std::string>& argv, const std::map<std::string, std::string>& env,
                      std::chrono::milliseconds timeout) {
  ChildResult r;
  int out_pipe[2], err_pipe[2], exec_pipe[2];
  if (pipe2(out_pipe, O_CLOEXEC) != 0) { r.error = std::strerror(errno); return r; }
  if (pipe2(err_pipe, O_CLOEXEC) != 0) {
    r.error = std::strerror(errno);
    close(out_pipe[0]); close(out_pipe[1]);
    return r;
  }
  if (pipe2(exec_pipe, O_CLOEXEC) != 0) {
    r.error = std::strerror(errno);
    close(out_pipe[0]); close(out_pipe[1]); close(err_pipe[0]); close(err_pipe[1]);
    return r;
  }
  std::vector<char*> cargv;
  for (const auto& a : argv) cargv.push_back(const_cast<char*>(a.c_str()));
  cargv.push_back(nullptr);
  std::vector<std::string> env_strings;
  for (const auto& [k, v] : env) env_strings.push_back(k + "=" + v);
  std::vector<char*> cenv;
  for (auto& e : env_strings) cenv.push_back(e.data());
  cenv.push_back(nullptr);
  pid_t pid = fork();
  if (pid == 0) {
    // Only async-signal-safe calls until exec. The agent may block signals for its own
    // handling; the probe must not inherit that.
    sigset_t none;
    sigemptyset(&none);
    sigprocmask(SIG_SETMASK, &none, nullptr);
    setpgid(0, 0);
    int devnull = open("/dev/null", O_RDONLY | O_CLOEXEC);
    if (devnull >= 0) dup2(devnull, 0);
    dup2(out_pipe[1], 1);
    dup2(err_pipe[1], 2);
    execvpe(cargv[0], cargv.data(), cenv.data());
    int e = errno;
    ssize_t ignored = write(exec_pipe[1], &e, sizeof e);
    (void)ignored;
    _exit(127);
  }
  close(out_pipe[1]);
  close(err_pipe[1]);
  close(exec_pipe[1]);
  if (pid < 0) {
    r.error = std::string("fork: ") + std::strerror(errno);
    close(out_pipe[0]); close(err_pipe[0]); close(exec_pipe[0]);
    return r;
  }
  setpgid(pid, pid);  // also from the parent: no race with the kill below
  int exec_errno = 0;
  bool exec_failed = read(exec_pipe[0], &exec_errno, sizeof exec_errno) == sizeof exec_errno;
  close(exec_pipe[0]);
  r.started = !exec_failed;
  if (exec_failed) r.error = std::string("cannot run ") + argv[0] + ": " + std::strerror(exec_errno);

  const std::size_t limit = 16u << 20;
  auto deadline = std::chrono::steady_clock::now() + timeout;
  pollfd fds[2] = {{out_pipe[0], POLLIN, 0}, {err_pipe[0], POLLIN, 0}};
  std::string* sinks[2] = {&r.out, &r.err};
  int open_fds = 2;
  char buf[65536];
  while (open_fds > 0) {
    auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
        deadline - std::chrono::steady_clock::now());
    if (left.count() <= 0) {
      r.timed_out = true;
      kill(-pid, SIGKILL);
      break;
    }
    int n = poll(fds, 2, static_cast<int>(std::min<long long>(left.count() + 1, 1000)));
    if (n < 0 && errno != EINTR) break;
    for (int i = 0; i < 2 && n > 0; ++i) {
      if (fds[i].fd < 0 || fds[i].revents == 0) continue;
      ssize_t got = read(fds[i].fd, buf, sizeof buf);
      if (got > 0) {
        if (sinks[i]->size() < limit) sinks[i]->append(buf, static_cast<std::size_t>(got));
      } else if (got == 0 || (errno != EINTR && errno != EAGAIN)) {
        close(fds[i].fd);
        fds[i].fd = -1;
        --open_fds;
      }
    }
  }
  for (auto& f : fds) if (f.fd >= 0) close(f.fd);
  int status = 0;
  if (r.timed_out) kill(-pid, SIGKILL);
  while (waitpid(pid, &status, 0) < 0 && errno == EINTR) {}
  if (WIFEXITED(status)) r.exit_code = WEXITSTATUS(status);
  else if (WIFSIGNALED(status)) r.exit_code = 128 + WTERMSIG(status);
  return r;
}

std::string describe_failure(const std::string& what, const ChildResult& r,
                             std::chrono::milliseconds timeout) {
  if (!r.started) return what + ": " + r.error;
  if (r.timed_out) {
    return what + ": no answer within " + std::to_string(timeout.count() / 1000.0).substr(0, 5) +
           " s (killed)";
  }
  std::string tail = r.err.size() > 400 ? r.err.substr(r.err.size() - 400) : r.err;
  while (!tail.empty() && (tail.back() == '\n' || tail.back() == ' ')) tail.pop_back();
  return what + ": exit code " + std::to_string(r.exit_code) + (tail.empty() ? "" : ": " + tail);
}

// ---------------------------------------------------------------------------------------------
// Files, environment, cache.

std::string trim(std::string s) {
  auto not_space = [](unsigned char c) { return !std::isspace(c); };
  s.erase(s.begin(), std::find_if(s.begin(), s.end(), not_space));
  s.erase(std::find_if(s.rbegin(), s.rend(), not_space).base(), s.end());
  return s;
}

bool read_file(const std::string& path, std::string& out) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return false;
  std::ostringstream ss;
  ss << in.rdbuf();
  out = ss.str();
  return true;
}

// Identity of a file's version: inode, size, mtime (ns). Empty when it cannot be stat'ed.
std::string file_stamp(const std::string& path) {
  struct stat st {};
  if (stat(path.c_str(), &st) != 0) return {};
  std::ostringstream ss;
  ss << st.st_dev << ':' << st.st_ino << ':' << st.st_size << ':' << st.st_mtim.tv_sec << '.'
     << std::setw(9) << std::setfill('0') << st.st_mtim.tv_nsec;
  return ss.str();
}

std::map<std::string, std::string> environment_of(const FingerprintOptions& o) {
  std::map<std::string, std::string> env;
  for (char** e = o.use_process_environment ? environ : nullptr; e && *e; ++e) {
    std::string kv = *e;
    auto eq = kv.find('=');
    if (eq != std::string::npos) env[kv.substr(0, eq)] = kv.substr(eq + 1);
  }
  for (const auto& [k, v] : o.environment) env[k] = v;
  env.emplace("PATH", "/usr/local/bin:/usr/bin:/bin");  // only when absent
  return env;
}

std::string getenv_or(const std::map<std::string, std::string>& env, const std::string& key,
                      const std::string& fallback = {}) {
  auto it = env.find(key);
  return it == env.end() ? fallback : it->second;
}

// argv[0]-style lookup: a name with a slash is taken as is; else the first executable in PATH.
std::string resolve_executable(const std::string& name, const std::string& path_var) {
  if (name.find('/') != std::string::npos) return name;
  std::stringstream ss(path_var.empty() ? "/usr/local/bin:/usr/bin:/bin" : path_var);
  std::string dir;
  while (std::getline(ss, dir, ':')) {
    std::string candidate = (dir.empty() ? "." : dir) + "/" + name;
    if (access(candidate.c_str(), X_OK) == 0 && fs::is_regular_file(candidate)) return candidate;
  }
  return {};
}

std::string cache_dir_of(const FingerprintOptions& o, const std::map<std::string, std::string>& env) {
  if (!o.cache_dir.empty()) return o.cache_dir;
  if (auto d = getenv_or(env, "DDPLAUNCH_CACHE_DIR"); !d.empty()) return d;
  if (auto d = getenv_or(env, "XDG_CACHE_HOME"); !d.empty()) return d + "/ddplaunch";
  if (auto d = getenv_or(env, "HOME"); !d.empty()) return d + "/.cache/ddplaunch";
  return {};
}

json load_json(const std::string& path) {
  std::string text;
  if (path.empty() || !read_file(path, text)) return nullptr;
  json j = json::parse(text, nullptr, /*allow_exceptions=*/false);
  return j.is_discarded() ? json(nullptr) : j;
}

// Write-then-rename: concurrent agents on one machine never see a torn file. Best effort: a
// cache that cannot be written only costs the next start another probe.
void store_json(const std::string& path, const json& j) {
  if (path.empty()) return;
  std::error_code ec;
  fs::create_directories(fs::path(path).parent_path(), ec);
  std::string tmp = path + ".tmp." + std::to_string(getpid());
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    if (!out) return;
    out << j.dump();
    if (!out) { fs::remove(tmp, ec); return; }
  }
  fs::rename(tmp, path, ec);
  if (ec) fs::remove(tmp, ec);
}

// Per-file SHA-256 cache: path -> {stamp, sha256}. Hashing libtorch (hundreds of MB) every start
// would cost seconds; the stamp (device, inode, size, mtime) decides whether it is still valid.
class HashCache {
 public:
  explicit HashCache(std::string path) : path_(std::move(path)) {
    entries_ = load_json(path_);
    if (!entries_.is_object()) entries_ = json::object();
  }
  std::string hash(const std::string& file) {
    std::string stamp = file_stamp(file);
    auto it = entries_.find(file);
    if (!stamp.empty() && it != entries_.end() && it->is_object() &&
        it->value("stamp", "") == stamp) {
      return it->value("sha256", "");
    }
    std::string h = sha256_file(file);
    if (!stamp.empty()) {
      entries_[file] = {{"stamp", stamp}, {"sha256", h}};
      dirty_ = true;
    }
    return h;
  }
  // Stores new hashes; entries of files that are gone are dropped so the file stays small.
  void save() {
    if (!dirty_) return;
    for (auto it = entries_.begin(); it != entries_.end();) {
      if (file_stamp(it.key()).empty()) it = entries_.erase(it);
      else ++it;
    }
    store_json(path_, entries_);
  }

 private:
  std::string path_;
  json entries_;
  bool dirty_ = false;
};

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
  try {
    prog["sha256"] = hashes.hash(path);
  } catch (const FingerprintError& e) {
    prog["error"] = e.what();
  }
  if (o.python) return prog;
  ChildResult r = run_child({"ldd", path}, env, o.probe_timeout);
  json libs = json::object();
  if (r.started && !r.timed_out && r.exit_code == 0) {
    for (const auto& [name, lib] : parse_ldd(r.out)) {
      if (lib.empty()) { libs[name] = "not found"; continue; }
      try {
        libs[name] = hashes.hash(lib);
      } catch (const FingerprintError& e) {
        libs[name] = std::string("unreadable: ") + e.what();
      }
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

json env_lock_fingerprint(const FingerprintOptions& o, const std::map<std::string, std::string>& env) {
  const std::string& spec = o.env_lock;
  if (spec.rfind("cmd:", 0) == 0) {
    std::string command = spec.substr(4);
    if (trim(command).empty()) {
      throw FingerprintError("--env_lock cmd: needs a command after 'cmd:', e.g. 'cmd:conda list --explicit'");
    }
    ChildResult r = run_child({"/bin/sh", "-c", command}, env, o.probe_timeout);
    if (!r.started || r.timed_out || r.exit_code != 0) {
      throw FingerprintError(describe_failure("--env_lock command '" + command + "'", r, o.probe_timeout));
    }
    return {{"source", spec}, {"sha256", sha256_hex(r.out)}};
  }
  std::error_code ec;
  if (!fs::is_regular_file(spec, ec)) {
    throw FingerprintError("--env_lock " + spec +
                           ": no such file (give a lock file such as requirements.txt, or "
                           "cmd:COMMAND to hash a command's output)");
  }
  return {{"source", spec}, {"sha256", sha256_file(spec)}};
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

// ---------------------------------------------------------------------------------------------

std::string sha256_hex(std::string_view data) {
  Sha256 s;
  s.update(data.data(), data.size());
  return s.hex();
}

std::string sha256_file(const std::string& path) {
  int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) throw FingerprintError("hash " + path + ": " + std::strerror(errno));
  Sha256 s;
  std::vector<char> buf(1 << 20);
  while (true) {
    ssize_t n = read(fd, buf.data(), buf.size());
    if (n < 0) {
      if (errno == EINTR) continue;
      int e = errno;
      close(fd);
      throw FingerprintError("hash " + path + ": " + std::strerror(e));
    }
    if (n == 0) break;
    s.update(buf.data(), static_cast<std::size_t>(n));
  }
  close(fd);
  return s.hex();
}

json machine_fingerprint() {
  json m = json::object();
  utsname u{};
  m["arch"] = uname(&u) == 0 ? std::string(u.machine) : std::string("unknown");
  m["os"] = os_release();
  m["glibc"] = std::string(gnu_get_libc_version());
  return m;
}

json gpu_fingerprint(const std::string& nvidia_proc_dir, const char* cuda_visible_devices) {
  json g = {{"count", 0}, {"models", json::array()}, {"driver", nullptr}};
  std::string version;
  if (!read_file(nvidia_proc_dir + "/version", version)) {
    g["note"] = "no NVIDIA driver (" + nvidia_proc_dir + "/version not found)";
    return g;
  }
  // "NVRM version: NVIDIA UNIX x86_64 Kernel Module  535.104.05  Sat Aug 19 ..."
  std::stringstream vs(version.substr(0, version.find('\n')));
  std::string word, prev;
  while (vs >> word) {
    if (prev == "Module" && !word.empty() && std::isdigit(static_cast<unsigned char>(word[0]))) {
      g["driver"] = word;
      break;
    }
    prev = word;
  }
  struct Gpu { std::string bus, model, uuid; };
  std::vector<Gpu> gpus;
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(nvidia_proc_dir + "/gpus", ec)) {
    std::string info;
    if (!read_file(entry.path().string() + "/information", info)) continue;
    Gpu gpu{entry.path().filename().string(), "", ""};
    std::stringstream is(info);
    std::string line;
    while (std::getline(is, line)) {
      auto colon = line.find(':');
      if (colon == std::string::npos) continue;
      std::string key = trim(line.substr(0, colon)), value = trim(line.substr(colon + 1));
      if (key == "Model") gpu.model = value;
      else if (key == "GPU UUID") gpu.uuid = value;
    }
    gpus.push_back(gpu);
  }
  // PCI bus order, as CUDA_DEVICE_ORDER=PCI_BUS_ID numbers them (see docs/env-check.md).
  std::sort(gpus.begin(), gpus.end(), [](const Gpu& a, const Gpu& b) { return a.bus < b.bus; });
  std::vector<Gpu> visible;
  if (cuda_visible_devices == nullptr) {
    visible = gpus;
  } else {
    // CUDA's rules: a comma-separated list of indices or UUID prefixes; the list ends at the
    // first entry that names no device; "" hides every device.
    std::stringstream ls(cuda_visible_devices);
    std::string item;
    while (std::getline(ls, item, ',')) {
      item = trim(item);
      const Gpu* found = nullptr;
      if (!item.empty() && std::all_of(item.begin(), item.end(), ::isdigit)) {
        std::size_t idx = std::stoul(item);
        if (idx < gpus.size()) found = &gpus[idx];
      } else if (item.rfind("GPU-", 0) == 0) {
        for (const auto& gpu : gpus) {
          if (gpu.uuid.rfind(item, 0) == 0) { found = &gpu; break; }
        }
      }
      if (found == nullptr) break;
      visible.push_back(*found);
    }
  }
  g["count"] = visible.size();
  for (const auto& gpu : visible) g["models"].push_back(gpu.model);
  return g;
}

json compute_fingerprint(const FingerprintOptions& options) {
  auto env = environment_of(options);
  std::string cache_dir = cache_dir_of(options, env);
  json fp = json::object();
  fp["machine"] = machine_fingerprint();
  auto cvd = env.find("CUDA_VISIBLE_DEVICES");
  fp["gpu"] = gpu_fingerprint(options.nvidia_proc_dir,
                              cvd == env.end() ? nullptr : cvd->second.c_str());
  if (options.python) fp["python"] = python_fingerprint(options, env, cache_dir);
  HashCache hashes(cache_dir.empty() ? std::string() : cache_dir + "/sha256-cache.json");
  json prog = program_fingerprint(options, env, hashes);
  hashes.save();
  if (!prog.empty()) fp["program"] = prog;
  if (!options.env_lock.empty()) fp["env_lock"] = env_lock_fingerprint(options, env);
  json settings = json::object();
  for (const auto& [k, v] : env) {
    if (k.rfind("NCCL_", 0) == 0 || k == "CUDA_VISIBLE_DEVICES") settings[k] = v;
  }
  fp["env"] = settings;
  return fp;
}

// ---------------------------------------------------------------------------------------------

namespace {
std::string text_of(const json& j, const std::string& none = "none") {
  if (j.is_null()) return none;
  if (j.is_string()) return j.get<std::string>().empty() ? none : j.get<std::string>();
  return j.dump();
}
std::string field(const json& obj, const char* key, const std::string& none = "none") {
  if (!obj.is_object() || !obj.contains(key)) return none;
  return text_of(obj[key], none);
}
}  // namespace

std::string render_fingerprint_table(const json& fp) {
  std::vector<std::pair<std::string, std::string>> rows;
  const json empty = json::object();
  const json& m = fp.contains("machine") ? fp["machine"] : empty;
  rows.emplace_back("CPU architecture", field(m, "arch", "unknown"));
  rows.emplace_back("OS", field(m, "os", "unknown"));
  rows.emplace_back("glibc", field(m, "glibc", "unknown"));
  const json& g = fp.contains("gpu") ? fp["gpu"] : empty;
  int count = g.is_object() ? g.value("count", 0) : 0;
  if (count == 0) {
    rows.emplace_back("GPUs", "none seen" + (g.contains("note") ? " (" + field(g, "note") + ")" : std::string()));
  } else {
    std::map<std::string, int> models;
    for (const auto& model : g["models"]) models[text_of(model, "unknown model")]++;
    std::string list;
    for (const auto& [name, n] : models) list += (list.empty() ? "" : ", ") + std::to_string(n) + " x " + name;
    rows.emplace_back("GPUs", std::to_string(count) + " (" + list + ")");
  }
  if (g.is_object() && !g.value("driver", json()).is_null()) rows.emplace_back("NVIDIA driver", field(g, "driver"));
  if (fp.contains("python")) {
    const json& py = fp["python"];
    rows.emplace_back("Python", field(py, "executable", "?") + " (" + field(py, "version", "version unknown") + ")");
    if (py.contains("error")) {
      rows.emplace_back("Python error", field(py, "error"));
    } else {
      std::string torch = field(py, "torch", "not installed");
      if (py.contains("torch_error")) torch += " (" + field(py, "torch_error") + ")";
      rows.emplace_back("torch", torch);
      if (py.contains("torch") && !py["torch"].is_null()) {  // without torch these say nothing
        rows.emplace_back("CUDA (torch)", field(py, "torch_cuda", "none (CPU build)"));
        rows.emplace_back("NCCL", field(py, "nccl"));
        rows.emplace_back("cuDNN", field(py, "cudnn"));
      }
    }
  }
  if (fp.contains("program")) {
    const json& p = fp["program"];
    if (p.contains("module")) {
      rows.emplace_back("program", "module " + field(p, "module"));
    } else {
      rows.emplace_back("program", field(p, "path", "?") + (p.contains("sha256") ? "  sha256 " + field(p, "sha256").substr(0, 16) : ""));
      if (p.contains("error")) rows.emplace_back("program error", field(p, "error"));
      if (p.contains("libraries")) {
        int missing = 0;
        for (const auto& [name, h] : p["libraries"].items()) missing += h == "not found";
        rows.emplace_back("shared libraries", std::to_string(p["libraries"].size()) + " hashed" +
                                                  (missing ? ", " + std::to_string(missing) + " NOT FOUND" : ""));
      }
    }
  }
  if (fp.contains("env_lock")) {
    rows.emplace_back("lock file", field(fp["env_lock"], "source") + "  sha256 " + field(fp["env_lock"], "sha256").substr(0, 16));
  }
  const json& env = fp.contains("env") ? fp["env"] : empty;
  rows.emplace_back("CUDA_VISIBLE_DEVICES", env.contains("CUDA_VISIBLE_DEVICES") ? text_of(env["CUDA_VISIBLE_DEVICES"], "\"\"") : "(unset)");
  std::string nccl;
  for (const auto& [k, v] : env.items()) {
    if (k.rfind("NCCL_", 0) == 0) nccl += (nccl.empty() ? "" : " ") + k + "=" + text_of(v, "");
  }
  rows.emplace_back("NCCL_* settings", nccl.empty() ? "(none set)" : nccl);

  std::size_t width = 0;
  for (const auto& r : rows) width = std::max(width, r.first.size());
  std::string out = "Environment of this node (ddplaunch --check_env)\n";
  for (const auto& [label, value] : rows) {
    out += "  " + label + std::string(width - label.size() + 2, ' ') + value + "\n";
  }
  return out;
}

}  // namespace ddp::agent
