#include "agent/gpus.h"

#include <cctype>
#include <sstream>
#include <vector>

#include "agent/devices.h"
#include "agent/fingerprint_cache.h"

namespace ddp::agent {
using nlohmann::json;
using fingerprint_detail::read_file;

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
  // The GPUs and CUDA_VISIBLE_DEVICES by the launcher's rules (agent/devices.h): one probe, so
  // --nproc_per_node=gpu and the fingerprint never count differently.
  const std::vector<GpuInfo> visible = visible_gpus(list_nvidia_gpus(nvidia_proc_dir + "/gpus"), cuda_visible_devices);
  g["count"] = visible.size();
  for (const GpuInfo& gpu : visible) g["models"].push_back(gpu.model);
  return g;
}

}  // namespace ddp::agent
