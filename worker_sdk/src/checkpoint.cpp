#include "ddp/checkpoint.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iomanip>
#include <sstream>

#include "ddp/crc32c.h"
#include "ddp/error.h"

namespace ddp {
namespace fs = std::filesystem;
namespace {

const char* const kPrefix = "ckpt-";
const char* const kSuffix = ".ddpckpt";

std::string sys_error() { return std::strerror(errno); }

void put_u32(char* p, uint32_t v) {
  for (int i = 0; i < 4; ++i) p[i] = static_cast<char>((v >> (8 * i)) & 0xFF);
}
void put_u64(char* p, uint64_t v) {
  for (int i = 0; i < 8; ++i) p[i] = static_cast<char>((v >> (8 * i)) & 0xFF);
}
uint32_t get_u32(const char* p) {
  uint32_t v = 0;
  for (int i = 0; i < 4; ++i) v |= static_cast<uint32_t>(static_cast<unsigned char>(p[i])) << (8 * i);
  return v;
}
uint64_t get_u64(const char* p) {
  uint64_t v = 0;
  for (int i = 0; i < 8; ++i) v |= static_cast<uint64_t>(static_cast<unsigned char>(p[i])) << (8 * i);
  return v;
}

void write_all(int fd, const char* data, size_t size, const std::string& path) {
  while (size > 0) {
    const ssize_t n = ::write(fd, data, size);
    if (n < 0) {
      if (errno == EINTR) continue;
      throw CheckpointError("write checkpoint " + path + ": " + sys_error());
    }
    data += n;
    size -= static_cast<size_t>(n);
  }
}

std::optional<int64_t> step_of(const std::string& filename) {
  const std::string prefix = kPrefix, suffix = kSuffix;
  if (filename.size() <= prefix.size() + suffix.size()) return std::nullopt;
  if (filename.compare(0, prefix.size(), prefix) != 0) return std::nullopt;
  if (filename.compare(filename.size() - suffix.size(), suffix.size(), suffix) != 0) {
    return std::nullopt;
  }
  const std::string digits =
      filename.substr(prefix.size(), filename.size() - prefix.size() - suffix.size());
  if (digits.empty() || digits.size() > 18) return std::nullopt;
  for (char c : digits) {
    if (c < '0' || c > '9') return std::nullopt;
  }
  return std::stoll(digits);
}

// Streams a payload from `produce` into `path` atomically: header placeholder, payload (CRC
// computed while writing), header written in place, fsync, rename, directory fsync.
void write_checkpoint_stream(const std::string& path,
                             const std::function<void(const std::function<void(const char*, size_t)>&)>& produce) {
  const fs::path target(path);
  const fs::path dir = target.has_parent_path() ? target.parent_path() : fs::path(".");
  const std::string tmp =
      (dir / ("." + target.filename().string() + ".tmp." + std::to_string(::getpid()))).string();
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) throw CheckpointError("create checkpoint " + tmp + ": " + sys_error());
  try {
    char header[kCheckpointHeaderSize] = {};
    write_all(fd, header, sizeof header, tmp);
    uint32_t crc = 0;
    uint64_t length = 0;
    produce([&](const char* data, size_t size) {
      crc = crc32c(data, size, crc);
      length += size;
      write_all(fd, data, size, tmp);
    });
    std::memcpy(header, kCheckpointMagic, 8);
    put_u32(header + 8, kCheckpointVersion);
    put_u32(header + 12, crc);
    put_u64(header + 16, length);
    if (::pwrite(fd, header, sizeof header, 0) != static_cast<ssize_t>(sizeof header)) {
      throw CheckpointError("write checkpoint header " + tmp + ": " + sys_error());
    }
    if (::fsync(fd) != 0) throw CheckpointError("fsync checkpoint " + tmp + ": " + sys_error());
  } catch (...) {
    ::close(fd);
    ::unlink(tmp.c_str());
    throw;
  }
  if (::close(fd) != 0) {
    ::unlink(tmp.c_str());
    throw CheckpointError("close checkpoint " + tmp + ": " + sys_error());
  }
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    const std::string err = sys_error();
    ::unlink(tmp.c_str());
    throw CheckpointError("rename checkpoint " + tmp + " -> " + path + ": " + err);
  }
  const int dfd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dfd < 0) throw CheckpointError("open directory " + dir.string() + ": " + sys_error());
  const int rc = ::fsync(dfd);
  const std::string err = sys_error();
  ::close(dfd);
  if (rc != 0) throw CheckpointError("fsync directory " + dir.string() + ": " + err);
}

}  // namespace

void write_checkpoint_file(const std::string& path, const std::string& payload) {
  write_checkpoint_stream(path, [&](const std::function<void(const char*, size_t)>& sink) {
    sink(payload.data(), payload.size());
  });
}

std::string read_checkpoint_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw CheckpointError("checkpoint " + path + ": cannot open: " + sys_error());
  std::string data((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  if (data.size() < kCheckpointHeaderSize) {
    throw CheckpointError("checkpoint " + path + ": truncated (" + std::to_string(data.size()) +
                          " bytes, shorter than the " + std::to_string(kCheckpointHeaderSize) +
                          "-byte header)");
  }
  if (std::memcmp(data.data(), kCheckpointMagic, 8) != 0) {
    throw CheckpointError("checkpoint " + path + ": not a ddp checkpoint (bad magic)");
  }
  const uint32_t version = get_u32(data.data() + 8);
  if (version != kCheckpointVersion) {
    throw CheckpointError("checkpoint " + path + ": format version " + std::to_string(version) +
                          " is not supported (this SDK reads version " +
                          std::to_string(kCheckpointVersion) + ")");
  }
  const uint32_t expected = get_u32(data.data() + 12);
  const uint64_t length = get_u64(data.data() + 16);
  const uint64_t have = data.size() - kCheckpointHeaderSize;
  if (have != length) {
    throw CheckpointError("checkpoint " + path + ": " +
                          std::string(have < length ? "truncated" : "has trailing bytes") +
                          " (payload is " + std::to_string(have) + " bytes, header says " +
                          std::to_string(length) + ")");
  }
  const uint32_t actual = crc32c(data.data() + kCheckpointHeaderSize, length);
  if (actual != expected) {
    std::ostringstream msg;
    msg << "checkpoint " << path << ": checksum mismatch (CRC-32C " << std::hex << std::setw(8)
        << std::setfill('0') << actual << ", header says " << std::setw(8) << expected << ")";
    throw CheckpointError(msg.str());
  }
  data.erase(0, kCheckpointHeaderSize);
  return data;
}

CheckpointManager::CheckpointManager(CheckpointOptions options, int rank, Log log)
    : options_(std::move(options)), rank_(rank), log_(std::move(log)) {
  if (options_.directory.empty()) throw UsageError("CheckpointManager: empty directory");
  if (options_.keep_last < 1) {
    throw UsageError("CheckpointManager: keep_last must be at least 1, got " +
                     std::to_string(options_.keep_last));
  }
}

std::string CheckpointManager::path_for(int64_t step) const {
  std::ostringstream name;
  name << kPrefix << std::setw(12) << std::setfill('0') << step << kSuffix;
  return (fs::path(options_.directory) / name.str()).string();
}

std::vector<std::pair<int64_t, std::string>> CheckpointManager::list() const {
  std::vector<std::pair<int64_t, std::string>> found;
  std::error_code ec;
  if (!fs::is_directory(options_.directory, ec)) return found;
  for (const auto& entry : fs::directory_iterator(options_.directory, ec)) {
    if (auto step = step_of(entry.path().filename().string())) {
      found.emplace_back(*step, entry.path().string());
    }
  }
  std::sort(found.begin(), found.end(), [](const auto& a, const auto& b) { return a.first > b.first; });
  return found;
}

std::string CheckpointManager::save(int64_t step, torch::serialize::OutputArchive& archive) {
  if (rank_ != 0) return "";
  std::error_code ec;
  fs::create_directories(options_.directory, ec);
  if (ec) {
    throw CheckpointError("create checkpoint directory " + options_.directory + ": " +
                          ec.message());
  }
  if (!cleaned_temporaries_) {
    // Leftovers of a writer that died mid-save; only rank 0 of this job writes here.
    for (const auto& entry : fs::directory_iterator(options_.directory, ec)) {
      const std::string name = entry.path().filename().string();
      if (name.rfind(std::string(".") + kPrefix, 0) == 0 && name.find(".tmp.") != std::string::npos) {
        fs::remove(entry.path(), ec);
      }
    }
    cleaned_temporaries_ = true;
  }
  // Streamed straight to the file: no second in-memory copy of a model-sized payload.
  const std::string path = path_for(step);
  write_checkpoint_stream(path, [&](const std::function<void(const char*, size_t)>& sink) {
    archive.save_to([&sink](const void* data, size_t size) -> size_t {
      sink(static_cast<const char*>(data), size);
      return size;
    });
  });
  auto all = list();
  for (size_t i = static_cast<size_t>(options_.keep_last); i < all.size(); ++i) {
    fs::remove(all[i].second, ec);
    if (ec) log_("warning: could not delete old checkpoint " + all[i].second + ": " + ec.message());
  }
  return path;
}

std::optional<LoadedCheckpoint> CheckpointManager::load_latest(std::optional<int64_t> max_step) {
  std::vector<std::string> skipped;
  for (const auto& [step, path] : list()) {
    if (max_step && step > *max_step) continue;
    try {
      const std::string payload = read_checkpoint_file(path);
      auto archive = std::make_shared<torch::serialize::InputArchive>();
      try {
        archive->load_from(payload.data(), payload.size());
      } catch (const std::exception& e) {
        throw CheckpointError("checkpoint " + path + ": payload does not parse: " + e.what());
      }
      return LoadedCheckpoint{path, step, archive};
    } catch (const CheckpointError& e) {
      log_(std::string("warning: skipping invalid checkpoint: ") + e.what() +
           "; falling back to an older one");
      skipped.push_back(path);
    }
  }
  if (skipped.empty()) {
    log_("no checkpoint in " + options_.directory + "; starting fresh");
  } else {
    log_("no valid checkpoint in " + options_.directory + " (" + std::to_string(skipped.size()) +
         " invalid skipped); starting fresh");
  }
  return std::nullopt;
}

}  // namespace ddp
