// The fingerprint's file and cache helpers (agent/fingerprint.cpp): reading files, a file's
// version stamp, the workers' environment, and the on-disk caches (interpreter probe results,
// per-file SHA-256). Agent thread only; a cache that cannot be written is skipped, never an error.
#pragma once

#include <map>
#include <string>

#include <nlohmann/json.hpp>

#include "rendezvous/error.h"

namespace ddp::agent::fingerprint_detail {

std::string trim(std::string s);
bool read_file(const std::string& path, std::string& out);
// Identity of a file's version: inode, size, mtime (ns). Empty when it cannot be stat'ed.
std::string file_stamp(const std::string& path);
// The workers' environment: this process's (when use_process_environment) overlaid with
// `overrides`, and a default PATH when none is set.
std::map<std::string, std::string> environment_of(bool use_process_environment,
                                                  const std::map<std::string, std::string>& overrides);
std::string getenv_or(const std::map<std::string, std::string>& env, const std::string& key,
                      const std::string& fallback = {});
// argv[0]-style lookup: a name with a slash is taken as is; else the first executable in PATH.
std::string resolve_executable(const std::string& name, const std::string& path_var);
// `configured` when set; else $DDPLAUNCH_CACHE_DIR, $XDG_CACHE_HOME/ddplaunch or
// $HOME/.cache/ddplaunch from `env`; empty when none is known.
std::string cache_dir_of(const std::string& configured, const std::map<std::string, std::string>& env);
nlohmann::json load_json(const std::string& path);
// Write-then-rename: concurrent agents on one machine never see a torn file.
void store_json(const std::string& path, const nlohmann::json& j);

// Per-file SHA-256 cache: path -> {stamp, sha256}. Hashing libtorch (hundreds of MB) every start
// would cost seconds; the stamp (device, inode, size, mtime) decides whether it is still valid.
class HashCache {
 public:
  explicit HashCache(std::string path);
  // The file's SHA-256, or why it cannot be read.
  Expected<std::string> hash(const std::string& file);
  // Stores new hashes; entries of files that are gone are dropped so the file stays small.
  void save();

 private:
  std::string path_;
  nlohmann::json entries_;
  bool dirty_ = false;
};

}  // namespace ddp::agent::fingerprint_detail
