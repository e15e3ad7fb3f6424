#include "agent/fingerprint.h"

#include <sys/stat.h>
#include <sys/utsname.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <system_error>

#include <doctest/doctest.h>

#include <cstdio>

#include "rendezvous/env_check.h"

using nlohmann::json;
using namespace ddp::agent;
namespace fs = std::filesystem;

namespace {

// A fresh directory under /tmp, removed with everything in it at the end of the test.
struct TempDir {
  fs::path path;
  TempDir() {
    std::string tmpl = (fs::temp_directory_path() / "ddp-fingerprint-XXXXXX").string();
    REQUIRE(mkdtemp(tmpl.data()) != nullptr);
    path = tmpl;
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path, ec);
  }
  std::string operator/(const std::string& name) const { return (path / name).string(); }
};

void write_file(const std::string& path, const std::string& text, bool executable = false) {
  {
    std::ofstream out(path, std::ios::binary | std::ios::trunc);
    out << text;
  }
  if (executable) chmod(path.c_str(), 0755);
}

std::string read_text(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

int lines_in(const std::string& path) {
  std::string text = read_text(path);
  int n = 0;
  for (char c : text) n += c == '\n';
  return n;
}

// Moves a file's mtime forward by `seconds`, as an edit or reinstall would.
void bump_mtime(const std::string& path, int seconds) {
  auto t = fs::last_write_time(path);
  fs::last_write_time(path, t + std::chrono::seconds(seconds));
}

// An "interpreter" that answers the probe with a fixed torch version and logs each call.
std::string fake_interpreter(const TempDir& dir, const std::string& torch,
                             const std::string& validator = "") {
  std::string path = dir / ("python-" + torch);
  std::string validators = validator.empty() ? "[]" : "[\"" + validator + "\"]";
  write_file(path,
             "#!/bin/sh\n"
             "echo probe >> '" + dir / "probes.log" + "'\n"
             "echo 'some import-time noise'\n"
             "echo 'DDPLAUNCH_FINGERPRINT_PROBE {\"version\": \"3.11.2\", \"implementation\": \"CPython\", "
             "\"torch\": \"" + torch + "\", \"torch_cuda\": \"11.8\", \"nccl\": \"2.18.1\", "
             "\"cudnn\": \"8700\", \"validators\": " + validators + "}'\n",
             true);
  return path;
}

FingerprintOptions python_options(const std::string& interpreter, const TempDir& cache) {
  FingerprintOptions o;
  o.python_exec = interpreter;
  o.cache_dir = cache / "cache";
  return o;
}

}  // namespace

TEST_CASE("sha256 matches the FIPS 180-4 test vectors") {
  CHECK(sha256_hex("") == "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
  CHECK(sha256_hex("abc") == "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
  CHECK(sha256_hex("abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq") ==
        "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1");
  CHECK(sha256_hex(std::string(1000000, 'a')) ==
        "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0");
  TempDir dir;
  std::string big(3 * 1048576 + 77, 'x');  // crosses the file reader's 1 MiB buffer
  write_file(dir / "big", big);
  CHECK(sha256_file(dir / "big").value() == sha256_hex(big));
  CHECK(sha256_file(dir / "missing").error().find("missing: No such file") != std::string::npos);
}

TEST_CASE("the machine part names this machine's architecture, OS and glibc") {
  json m = machine_fingerprint();
  utsname u{};
  REQUIRE(uname(&u) == 0);
  CHECK(m["arch"] == std::string(u.machine));
  CHECK(m["os"].get<std::string>() != "unknown");
  CHECK(m["os"].get<std::string>().size() > 3);
  CHECK(m["glibc"].get<std::string>().rfind("2.", 0) == 0);
}

// What /usr/bin/python3 itself says, asked independently of the probe: "VERSION TORCH CUDA".
std::string ask_python(const char* code) {
  std::string out;
  FILE* p = ::popen((std::string("/usr/bin/python3 -c '") + code + "' 2>/dev/null").c_str(), "r");
  REQUIRE(p != nullptr);
  char buf[256];
  while (std::fgets(buf, sizeof buf, p)) out += buf;
  ::pclose(p);
  while (!out.empty() && out.back() == '\n') out.pop_back();
  return out;
}

TEST_CASE("the Python probe of /usr/bin/python3 finds the Python and torch that it really has") {
  const std::string version = ask_python("import platform; print(platform.python_version())");
  const std::string torch = ask_python("import torch; print(torch.__version__)");
  const std::string cuda = ask_python("import torch; print(torch.version.cuda)");
  if (torch.empty()) {
    MESSAGE("skipped: /usr/bin/python3 cannot import torch here (apt: python3-torch)");
    return;
  }
  TempDir dir;
  auto o = python_options("/usr/bin/python3", dir);
  json fp = compute_fingerprint(o).value();
  INFO(fp.dump(2));
  REQUIRE(fp.contains("python"));
  CHECK_FALSE(fp["python"].contains("error"));
  CHECK(fp["python"]["torch"] == torch);
  CHECK(fp["python"]["version"] == version);
  if (cuda == "None") {
    CHECK(fp["python"]["torch_cuda"].is_null());
  } else {
    CHECK(fp["python"]["torch_cuda"] == cuda);
  }
  CHECK(fp["python"]["executable"] == "/usr/bin/python3");
  CHECK(fp["machine"]["glibc"].is_string());
  // A second start reads the cache (same answer) instead of probing again.
  json again = compute_fingerprint(o).value();
  CHECK(again == fp);
  CHECK(render_fingerprint_table(fp).find("torch") != std::string::npos);
}

TEST_CASE("the probe runs with the workers' environment: PYTHONPATH decides which torch is seen") {
  TempDir dir;
  fs::create_directories(dir / "site/torch");
  write_file(dir / "site/torch/__init__.py", "__version__ = '9.9.9'\nclass version:\n    cuda = None\n");
  auto o = python_options("/usr/bin/python3", dir);
  o.environment["PYTHONPATH"] = dir / "site";
  json fp = compute_fingerprint(o).value();
  INFO(fp.dump(2));
  CHECK(fp["python"]["torch"] == "9.9.9");
}

TEST_CASE("a wrapper reporting another torch gives a fingerprint that env_check refuses") {
  TempDir dir;
  json real = compute_fingerprint(python_options("/usr/bin/python3", dir)).value();
  json fake = compute_fingerprint(python_options(fake_interpreter(dir, "2.1.0+cu118"), dir)).value();
  CHECK(fake["python"]["torch"] == "2.1.0+cu118");
  CHECK(fake["python"]["nccl"] == "2.18.1");
  auto result = ddp::rdzv::compare_fingerprints(
      {{"a", "10.0.0.1", real}, {"b", "10.0.0.2", fake}, {"c", "10.0.0.3", real}});
  REQUIRE(result.has_breaking());
  CHECK(result.message(true).find("node b (10.0.0.2) has torch 2.1.0+cu118; nodes a, c have " +
                                  real["python"]["torch"].get<std::string>()) != std::string::npos);
}

TEST_CASE("the probe runs once; the cache is invalidated when the interpreter or torch changes") {
  TempDir dir;
  std::string validator = dir / "torch-version.py";
  write_file(validator, "__version__ = '2.1.0'\n");
  std::string python = fake_interpreter(dir, "2.1.0", validator);
  auto o = python_options(python, dir);
  std::string log = dir / "probes.log";

  json first = compute_fingerprint(o).value();
  CHECK(lines_in(log) == 1);
  json second = compute_fingerprint(o).value();
  CHECK(lines_in(log) == 1);  // hit: no second probe
  CHECK(second == first);

  bump_mtime(python, 10);  // the interpreter was replaced
  compute_fingerprint(o).value();
  CHECK(lines_in(log) == 2);
  compute_fingerprint(o).value();
  CHECK(lines_in(log) == 2);

  write_file(validator, "__version__ = '2.1.1'  # pip upgraded torch\n");
  compute_fingerprint(o).value();
  CHECK(lines_in(log) == 3);

  FingerprintOptions other_path = o;  // PYTHONPATH decides which torch is imported
  other_path.environment["PYTHONPATH"] = dir / "elsewhere";
  compute_fingerprint(other_path).value();
  CHECK(lines_in(log) == 4);
}

TEST_CASE("an interpreter that does not answer within the deadline is recorded as an error") {
  TempDir dir;
  std::string python = dir / "python-hangs";
  write_file(python, "#!/bin/sh\nexec sleep 30\n", true);
  auto o = python_options(python, dir);
  o.probe_timeout = std::chrono::milliseconds(300);
  auto start = std::chrono::steady_clock::now();
  json fp = compute_fingerprint(o).value();
  CHECK(std::chrono::steady_clock::now() - start < std::chrono::seconds(10));
  REQUIRE(fp["python"].contains("error"));
  CHECK(fp["python"]["error"].get<std::string>().find("no answer within") != std::string::npos);

  o.python_exec = "ddplaunch-no-such-python";
  fp = compute_fingerprint(o).value();
  CHECK(fp["python"]["error"].get<std::string>().find("'ddplaunch-no-such-python' not found") !=
        std::string::npos);
  write_file(python, "#!/bin/sh\necho 'Traceback: boom' >&2\nexit 1\n", true);
  o.python_exec = python;
  fp = compute_fingerprint(o).value();
  CHECK(fp["python"]["error"].get<std::string>().find("exit code 1: Traceback: boom") != std::string::npos);
}

TEST_CASE("an executable's hash and its shared libraries change when the binary changes") {
  TempDir dir;
  std::string program = dir / "prog";
  fs::copy_file("/bin/true", program);
  FingerprintOptions o;
  o.python = false;
  o.program = program;
  o.cache_dir = dir / "cache";
  json a = compute_fingerprint(o).value();
  INFO(a.dump(2));
  CHECK_FALSE(a.contains("python"));
  CHECK(a["program"]["sha256"] == sha256_file("/bin/true").value());
  REQUIRE(a["program"]["libraries"].contains("libc.so.6"));
  CHECK(a["program"]["libraries"]["libc.so.6"].get<std::string>().size() == 64);

  { std::ofstream(program, std::ios::app) << "changed"; }
  json b = compute_fingerprint(o).value();
  CHECK(b["program"]["sha256"] != a["program"]["sha256"]);
  CHECK(b["program"]["libraries"] == a["program"]["libraries"]);
  auto r = ddp::rdzv::compare_fingerprints({{"a", "", a}, {"b", "", b}});
  CHECK(r.has_breaking());
  CHECK(r.differences[0].field == "program.sha256");

  o.program = dir / "nonexistent";
  json c = compute_fingerprint(o).value();
  CHECK(c["program"]["error"].get<std::string>().find("not found") != std::string::npos);
}

TEST_CASE("a Python script is hashed; a module is named, not hashed") {
  TempDir dir;
  std::string script = dir / "train.py";
  write_file(script, "print('hi')\n");
  auto o = python_options(fake_interpreter(dir, "2.1.0"), dir);
  o.program = script;
  json fp = compute_fingerprint(o).value();
  CHECK(fp["program"]["sha256"] == sha256_hex("print('hi')\n"));
  CHECK_FALSE(fp["program"].contains("libraries"));
  o.module = true;
  o.program = "mypkg.train";
  fp = compute_fingerprint(o).value();
  CHECK(fp["program"]["module"] == "mypkg.train");
  CHECK_FALSE(fp["program"].contains("sha256"));
}

TEST_CASE("--env_lock hashes a file or a command's output, and names what is wrong") {
  TempDir dir;
  FingerprintOptions o;
  o.python = false;
  o.cache_dir = dir / "cache";
  write_file(dir / "requirements.txt", "torch==2.1.0\n");
  o.env_lock = dir / "requirements.txt";
  json fp = compute_fingerprint(o).value();
  CHECK(fp["env_lock"]["sha256"] == sha256_hex("torch==2.1.0\n"));
  CHECK(fp["env_lock"]["source"] == o.env_lock);

  o.env_lock = "cmd:printf 'numpy==1.26\\n'";
  fp = compute_fingerprint(o).value();
  CHECK(fp["env_lock"]["sha256"] == sha256_hex("numpy==1.26\n"));

  o.env_lock = dir / "missing.yml";
  CHECK(compute_fingerprint(o).error().find("missing.yml: no such file") != std::string::npos);
  o.env_lock = "cmd:echo oops >&2; exit 4";
  CHECK(compute_fingerprint(o).error().find("exit code 4: oops") != std::string::npos);
  o.env_lock = "cmd:";
  CHECK_FALSE(compute_fingerprint(o));
}

TEST_CASE("the environment digest is one node's and one alone's alike, and changes with the software only") {
  TempDir dir;
  FingerprintOptions o = python_options("/usr/bin/python3", dir);
  write_file(dir / "requirements.txt", "torch==2.1.0\n");
  o.env_lock = dir / "requirements.txt";
  write_file(dir / "train.py", "print(1)\n");
  o.program = dir / "train.py";
  const std::string node = environment_digest(compute_fingerprint(o).value());
  const std::string alone = environment_digest(environment_fingerprint(o).value());
  CHECK(node.size() == 64);
  CHECK(node == alone);
  write_file(dir / "train.py", "print(2)\n");  // a new program: the same environment
  CHECK(environment_digest(compute_fingerprint(o).value()) == node);
  write_file(dir / "requirements.txt", "torch==2.2.0\n");  // new software: another digest
  CHECK(environment_digest(environment_fingerprint(o).value()) != node);
  json fake = environment_fingerprint(python_options(fake_interpreter(dir, "2.1.0+cu118"), dir)).value();
  CHECK(environment_digest(fake) != environment_digest(environment_fingerprint(python_options("/usr/bin/python3", dir)).value()));
  FingerprintOptions none;  // an executable with no --env_lock: nothing to record
  none.python = false;
  none.cache_dir = dir / "cache";
  CHECK(environment_digest(environment_fingerprint(none).value()).empty());
}

TEST_CASE("NCCL_* and CUDA_VISIBLE_DEVICES settings are recorded, other variables are not") {
  TempDir dir;
  FingerprintOptions o;
  o.python = false;
  o.cache_dir = dir / "cache";
  o.use_process_environment = false;
  o.environment = {{"NCCL_SOCKET_IFNAME", "eth0"}, {"NCCL_DEBUG", "INFO"},
                   {"CUDA_VISIBLE_DEVICES", "0,1"}, {"HOME", "/root"}, {"MY_NCCL", "x"}};
  json fp = compute_fingerprint(o).value();
  CHECK(fp["env"] == json{{"NCCL_SOCKET_IFNAME", "eth0"}, {"NCCL_DEBUG", "INFO"},
                          {"CUDA_VISIBLE_DEVICES", "0,1"}});
  std::string table = render_fingerprint_table(fp);
  CHECK(table.find("NCCL_DEBUG=INFO NCCL_SOCKET_IFNAME=eth0") != std::string::npos);
  CHECK(table.find("0,1") != std::string::npos);
}

TEST_CASE("GPUs are read from the driver's /proc files and CUDA_VISIBLE_DEVICES is honoured") {
  TempDir dir;
  std::string root = dir / "nvidia";
  CHECK(gpu_fingerprint(root, nullptr)["count"] == 0);  // no driver
  fs::create_directories(root + "/gpus/0000:3b:00.0");
  fs::create_directories(root + "/gpus/0000:1a:00.0");
  write_file(root + "/version",
             "NVRM version: NVIDIA UNIX x86_64 Kernel Module  535.104.05  Sat Aug 19 01:15:15 UTC 2023\n"
             "GCC version:  gcc version 12.2.0\n");
  write_file(root + "/gpus/0000:1a:00.0/information",
             "Model: \t\t NVIDIA H100 80GB HBM3\nIRQ:   \t\t 16\nGPU UUID: \t GPU-aaaa1111-0000\n");
  write_file(root + "/gpus/0000:3b:00.0/information",
             "Model: \t\t NVIDIA A100-SXM4-40GB\nIRQ:   \t\t 17\nGPU UUID: \t GPU-bbbb2222-0000\n");
  json all = gpu_fingerprint(root, nullptr);
  CHECK(all["count"] == 2);
  CHECK(all["driver"] == "535.104.05");
  CHECK(all["models"] == json{"NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-40GB"});  // PCI order
  CHECK(gpu_fingerprint(root, "1")["models"] == json{"NVIDIA A100-SXM4-40GB"});
  CHECK(gpu_fingerprint(root, "1,0")["count"] == 2);
  CHECK(gpu_fingerprint(root, "")["count"] == 0);
  CHECK(gpu_fingerprint(root, "-1")["count"] == 0);
  CHECK(gpu_fingerprint(root, "0,7,1")["count"] == 1);  // the list ends at an unknown device
  CHECK(gpu_fingerprint(root, "GPU-bbbb")["models"] == json{"NVIDIA A100-SXM4-40GB"});

  FingerprintOptions o;
  o.python = false;
  o.cache_dir = dir / "cache";
  o.nvidia_proc_dir = root;
  o.use_process_environment = false;
  json fp = compute_fingerprint(o).value();
  std::string table = render_fingerprint_table(fp);
  CHECK(table.find("2 (1 x NVIDIA A100-SXM4-40GB, 1 x NVIDIA H100 80GB HBM3)") != std::string::npos);
  CHECK(table.find("535.104.05") != std::string::npos);
}

TEST_CASE("the --check_env table says plainly when no GPU is seen and which versions are there") {
  json fp = {{"machine", {{"arch", "x86_64"}, {"os", "Debian GNU/Linux 12 (bookworm)"}, {"glibc", "2.36"}}},
             {"gpu", {{"count", 0}, {"models", json::array()}, {"driver", nullptr},
                      {"note", "no NVIDIA driver"}}},
             {"python", {{"executable", "/usr/bin/python3"}, {"version", "3.11.2"}, {"torch", "1.13.0a0"},
                         {"torch_cuda", nullptr}, {"nccl", nullptr}, {"cudnn", nullptr}}},
             {"env", json::object()}};
  std::string table = render_fingerprint_table(fp);
  INFO(table);
  CHECK(table.find("GPUs                  none seen (no NVIDIA driver)") != std::string::npos);
  CHECK(table.find("torch                 1.13.0a0") != std::string::npos);
  CHECK(table.find("CUDA (torch)          none (CPU build)") != std::string::npos);
  CHECK(table.find("Python                /usr/bin/python3 (3.11.2)") != std::string::npos);
  CHECK(table.find("NCCL_* settings       (none set)") != std::string::npos);
  CHECK(table.find("CUDA_VISIBLE_DEVICES  (unset)") != std::string::npos);
}

// Not a test: a measurement, skipped by default (timings are not asserted). Run it with
//   fingerprint_test --no-skip --test-case='benchmark*'
TEST_CASE("benchmark: fingerprint of /usr/bin/python3, first start versus cached" * doctest::skip()) {
  TempDir dir;
  auto o = python_options("/usr/bin/python3", dir);
  for (std::string when : {"first start (probe)", "next start (cache hit)", "next start (cache hit)"}) {
    auto start = std::chrono::steady_clock::now();
    json fp = compute_fingerprint(o).value();
    double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
    MESSAGE(when << ": " << ms << " ms (torch " << fp["python"].value("torch", "?") << ")");
  }
}
