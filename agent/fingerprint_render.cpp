// render_fingerprint_table(): the readable table of `ddplaunch --check_env`.
#include <string>

#include "agent/fingerprint.h"
#include "rendezvous/fingerprint_schema.h"

namespace ddp::agent {
using nlohmann::json;

namespace {
// Labels come from the fingerprint's schema, so the table and the mismatch messages agree.
std::string L(std::string_view path) { return std::string(rdzv::fingerprint::label(path, path)); }
}  // namespace

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
  rows.emplace_back(L("machine.arch"), field(m, "arch", "unknown"));
  rows.emplace_back(L("machine.os"), field(m, "os", "unknown"));
  rows.emplace_back(L("machine.glibc"), field(m, "glibc", "unknown"));
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
  if (g.is_object() && !g.value("driver", json()).is_null()) rows.emplace_back(L("gpu.driver"), field(g, "driver"));
  if (fp.contains("python")) {
    const json& py = fp["python"];
    rows.emplace_back(L("python.version"), field(py, "executable", "?") + " (" + field(py, "version", "version unknown") + ")");
    if (py.contains("error")) {
      rows.emplace_back("Python error", field(py, "error"));
    } else {
      std::string torch = field(py, "torch", "not installed");
      if (py.contains("torch_error")) torch += " (" + field(py, "torch_error") + ")";
      rows.emplace_back(L("python.torch"), torch);
      if (py.contains("torch") && !py["torch"].is_null()) {  // without torch these say nothing
        rows.emplace_back("CUDA (torch)", field(py, "torch_cuda", "none (CPU build)"));
        rows.emplace_back(L("python.nccl"), field(py, "nccl"));
        rows.emplace_back(L("python.cudnn"), field(py, "cudnn"));
      }
    }
  }
  if (fp.contains("program")) {
    const json& p = fp["program"];
    if (p.contains("module")) {
      rows.emplace_back("program", "module " + field(p, "module"));
    } else {
      rows.emplace_back("program", field(p, "path", "?") + (p.contains("sha256") ? "  sha256 " + field(p, "sha256").substr(0, 16) : ""));
      if (p.contains("error")) rows.emplace_back(L("program.error"), field(p, "error"));
      if (p.contains("libraries")) {
        int missing = 0;
        for (const auto& [name, h] : p["libraries"].items()) missing += h == "not found";
        rows.emplace_back("shared libraries", std::to_string(p["libraries"].size()) + " hashed" +
                                                  (missing ? ", " + std::to_string(missing) + " NOT FOUND" : ""));
      }
    }
  }
  if (fp.contains("env_lock")) {
    rows.emplace_back(L("env_lock.source"), field(fp["env_lock"], "source") + "  sha256 " + field(fp["env_lock"], "sha256").substr(0, 16));
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
