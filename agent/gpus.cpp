#include "agent/gpus.h"

#include <algorithm>
#include <cctype>
#include <filesystem>
#include <sstream>
#include <vector>

#include "agent/fingerprint_cache.h"

namespace ddp::agent {
namespace fs = std::filesystem;
using nlohmann::json;
using fingerprint_detail::read_file;
using fingerprint_detail::trim;

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

}  // namespace ddp::agent
