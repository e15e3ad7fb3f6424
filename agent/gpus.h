// The GPUs CUDA would show, read from the NVIDIA driver's /proc files without loading CUDA:
// their count, models and the driver version, honouring CUDA_VISIBLE_DEVICES, as the node
// fingerprint shows them. The GPUs themselves come from agent/devices.h, the probe the
// launcher counts --nproc_per_node=gpu with. Pure function of the files; any thread.
#pragma once

#include <nlohmann/json.hpp>
#include <string>

namespace ddp::agent {

// {"count", "models": [...], "driver"} of the GPUs CUDA would show, honouring
// CUDA_VISIBLE_DEVICES (indices, GPU-UUID prefixes; "" or "-1" hides all). count 0 without
// driver, with a "note" saying why.
nlohmann::json gpu_fingerprint(const std::string& nvidia_proc_dir, const char* cuda_visible_devices);

}  // namespace ddp::agent
