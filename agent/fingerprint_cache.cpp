#include "agent/fingerprint_cache.h"

#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <filesystem>
#include <fstream>
#include <iomanip>
#include <sstream>

#include "agent/sha256.h"

extern char** environ;

namespace ddp::agent::fingerprint_detail {
namespace fs = std::filesystem;
using nlohmann::json;

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

std::map<std::string, std::string> environment_of(bool use_process_environment,
                                                  const std::map<std::string, std::string>& overrides) {
  std::map<std::string, std::string> env;
  for (char** e = use_process_environment ? environ : nullptr; e && *e; ++e) {
    std::string kv = *e;
    auto eq = kv.find('=');
    if (eq != std::string::npos) env[kv.substr(0, eq)] = kv.substr(eq + 1);
  }
  for (const auto& [k, v] : overrides) env[k] = v;
  env.emplace("PATH", "/usr/local/bin:/usr/bin:/bin");  // only when absent
  return env;
}

std::string getenv_or(const std::map<std::string, std::string>& env, const std::string& key,
                      const std::string& fallback) {
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

std::string cache_dir_of(const std::string& configured, const std::map<std::string, std::string>& env) {
  if (!configured.empty()) return configured;
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

HashCache::HashCache(std::string path) : path_(std::move(path)) {
  entries_ = load_json(path_);
  if (!entries_.is_object()) entries_ = json::object();
}
Expected<std::string> HashCache::hash(const std::string& file) {
  std::string stamp = file_stamp(file);
  auto it = entries_.find(file);
  if (!stamp.empty() && it != entries_.end() && it->is_object() &&
      it->value("stamp", "") == stamp) {
    return it->value("sha256", "");
  }
  Expected<std::string> h = sha256_file(file);
  if (h && !stamp.empty()) {
    entries_[file] = {{"stamp", stamp}, {"sha256", *h}};
    dirty_ = true;
  }
  return h;
}
void HashCache::save() {
  if (!dirty_) return;
  for (auto it = entries_.begin(); it != entries_.end();) {
    if (file_stamp(it.key()).empty()) it = entries_.erase(it);
    else ++it;
  }
  store_json(path_, entries_);
}

}  // namespace ddp::agent::fingerprint_detail
