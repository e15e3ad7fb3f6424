// GPU and CPU probes (agent/devices.h).
#include "agent/devices.h"

#include <dirent.h>
#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <charconv>
#include <cstdlib>
#include <fstream>
#include <set>
#include <sstream>

namespace ddp::agent {
namespace {

std::string trim(const std::string& s) {
  const auto begin = s.find_first_not_of(" \t\r\n");
  if (begin == std::string::npos) return "";
  return s.substr(begin, s.find_last_not_of(" \t\r\n") - begin + 1);
}

std::vector<std::string> split_commas(const std::string& s) {
  std::vector<std::string> parts;
  std::stringstream in(s);
  for (std::string item; std::getline(in, item, ',');) parts.push_back(trim(item));
  if (!s.empty() && s.back() == ',') parts.emplace_back();
  return parts;
}

// A device index of CUDA_VISIBLE_DEVICES: digits only (CUDA reads "+1" or "1x" as invalid).
bool parse_index(const std::string& s, long long& value) {
  if (s.empty()) return false;
  const auto [ptr, ec] = std::from_chars(s.data(), s.data() + s.size(), value);
  return ec == std::errc() && ptr == s.data() + s.size();
}

bool is_uuid(const std::string& entry) { return entry.rfind("GPU-", 0) == 0 || entry.rfind("MIG-", 0) == 0; }

}  // namespace

std::vector<GpuInfo> list_nvidia_gpus(const std::string& nvidia_gpus_dir) {
  std::vector<GpuInfo> gpus;
  if (DIR* dir = ::opendir(nvidia_gpus_dir.c_str())) {
    while (const dirent* entry = ::readdir(dir)) {
      if (entry->d_name[0] == '.') continue;
      GpuInfo gpu{entry->d_name, "", ""};
      std::ifstream info(nvidia_gpus_dir + "/" + gpu.pci_address + "/information");
      for (std::string line; std::getline(info, line);) {
        const auto colon = line.find(':');
        if (colon == std::string::npos) continue;
        const std::string key = trim(line.substr(0, colon));
        if (key == "Model") gpu.model = trim(line.substr(colon + 1));
        if (key == "GPU UUID") gpu.uuid = trim(line.substr(colon + 1));
      }
      gpus.push_back(std::move(gpu));
    }
    ::closedir(dir);
  }
  std::sort(gpus.begin(), gpus.end(),
            [](const GpuInfo& a, const GpuInfo& b) { return a.pci_address < b.pci_address; });
  return gpus;
}

std::vector<GpuInfo> visible_gpus(const std::vector<GpuInfo>& all, const char* cuda_visible_devices) {
  if (cuda_visible_devices == nullptr) return all;
  std::vector<GpuInfo> out;
  std::set<std::string> seen;
  if (trim(cuda_visible_devices).empty()) return out;
  for (const std::string& entry : split_commas(cuda_visible_devices)) {
    const GpuInfo* found = nullptr;
    long long index = 0;
    if (is_uuid(entry)) {
      for (const auto& gpu : all) {
        if (!gpu.uuid.empty() && gpu.uuid.rfind(entry, 0) == 0) found = &gpu;
      }
    } else if (parse_index(entry, index) && index >= 0 && index < static_cast<long long>(all.size())) {
      found = &all[static_cast<std::size_t>(index)];
    }
    if (found == nullptr || !seen.insert(found->pci_address).second) break;
    out.push_back(*found);
  }
  return out;
}

int apply_cuda_visible_devices(int physical, const char* cuda_visible_devices) {
  if (cuda_visible_devices == nullptr) return physical;
  int visible = 0;
  std::set<std::string> seen;
  if (trim(cuda_visible_devices).empty()) return 0;
  for (const std::string& entry : split_commas(cuda_visible_devices)) {
    long long index = 0;
    if (is_uuid(entry)) {
      if (!seen.insert(entry).second) break;
    } else {
      if (!parse_index(entry, index) || index < 0 || index >= physical) break;
      if (!seen.insert(std::to_string(index)).second) break;
    }
    ++visible;
  }
  return std::min(visible, physical);
}

int count_visible_gpus(const std::string& proc_gpus_dir, const std::string& dev_dir,
                       const char* cuda_visible_devices) {
  int physical = static_cast<int>(list_nvidia_gpus(proc_gpus_dir).size());
  if (physical == 0) {
    if (DIR* dir = ::opendir(dev_dir.c_str())) {
      while (const dirent* entry = ::readdir(dir)) {
        const std::string name = entry->d_name;
        if (name.size() > 6 && name.compare(0, 6, "nvidia") == 0 &&
            std::all_of(name.begin() + 6, name.end(),
                        [](char c) { return std::isdigit(static_cast<unsigned char>(c)); })) {
          ++physical;
        }
      }
      ::closedir(dir);
    }
  }
  return apply_cuda_visible_devices(physical, cuda_visible_devices);
}

int count_visible_gpus() {
  return count_visible_gpus("/proc/driver/nvidia/gpus", "/dev", std::getenv("CUDA_VISIBLE_DEVICES"));
}

int count_usable_cpus() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (::sched_getaffinity(0, sizeof set, &set) == 0) {
    const int n = CPU_COUNT(&set);
    if (n > 0) return n;
  }
  const long online = ::sysconf(_SC_NPROCESSORS_ONLN);
  return online > 0 ? static_cast<int>(online) : 1;
}

}  // namespace ddp::agent
