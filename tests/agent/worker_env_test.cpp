// Unit tests of agent/worker_env.h, agent/logs.h, agent/failure.h: the pure parts of the agent.
#include <doctest/doctest.h>

#include <signal.h>

#include <map>
#include <stdexcept>
#include <string>
#include <vector>

#include "agent/failure.h"
#include "agent/logs.h"
#include "agent/worker_env.h"

using namespace ddp::agent;

TEST_SUITE("the worker environment follows docs/architecture.md") {
  TEST_CASE("ranks are the rank offset plus the local rank, and every variable is set") {
    RoundEnv round;
    round.assignment.generation = 7;
    round.assignment.group_rank = 1;
    round.assignment.group_world_size = 3;
    round.assignment.world_size = 12;
    round.assignment.rank_offset = 4;
    round.assignment.master_addr = "10.0.0.1";
    round.assignment.master_port = 29501;
    round.assignment.restart_count = 2;
    round.assignment.max_restarts = 5;
    round.local_world_size = 4;
    round.role = "trainer";
    round.run_id = "job42";
    round.set_omp_num_threads = true;
    auto env = worker_env(round, 3, "/logs/error.json", {});
    CHECK(env.at("RANK") == "7");
    CHECK(env.at("LOCAL_RANK") == "3");
    CHECK(env.at("WORLD_SIZE") == "12");
    CHECK(env.at("LOCAL_WORLD_SIZE") == "4");
    CHECK(env.at("GROUP_RANK") == "1");
    CHECK(env.at("GROUP_WORLD_SIZE") == "3");
    CHECK(env.at("ROLE_RANK") == "7");
    CHECK(env.at("ROLE_WORLD_SIZE") == "12");
    CHECK(env.at("ROLE_NAME") == "trainer");
    CHECK(env.at("MASTER_ADDR") == "10.0.0.1");
    CHECK(env.at("MASTER_PORT") == "29501");
    CHECK(env.at("TORCHELASTIC_RESTART_COUNT") == "2");
    CHECK(env.at("TORCHELASTIC_MAX_RESTARTS") == "5");
    CHECK(env.at("TORCHELASTIC_RUN_ID") == "job42");
    CHECK(env.at("TORCHELASTIC_USE_AGENT_STORE") == "False");
    CHECK(env.at("TORCHELASTIC_ERROR_FILE") == "/logs/error.json");
    CHECK(env.at("TORCH_NCCL_ASYNC_ERROR_HANDLING") == "1");
    CHECK(env.at("NCCL_ASYNC_ERROR_HANDLING") == "1");
    CHECK(env.at("OMP_NUM_THREADS") == "1");
    CHECK(env.at("DDPLAUNCH_GENERATION") == "7");
  }

  TEST_CASE("GLOO_SOCKET_IFNAME names the interface towards MASTER_ADDR, never for loopback") {
    RoundEnv round;
    CHECK(worker_env(round, 0, "e", {}).count("GLOO_SOCKET_IFNAME") == 0);
    round.gloo_socket_ifname = "eth7";
    CHECK(worker_env(round, 0, "e", {}).at("GLOO_SOCKET_IFNAME") == "eth7");
    CHECK(interface_towards("127.0.0.1").empty());
    CHECK(interface_towards("127.0.1.1").empty());
    CHECK(interface_towards("::1").empty());
    CHECK(interface_towards("not-an-address").empty());
  }

  TEST_CASE("NCCL error handling keeps a value the user set") {
    RoundEnv round;
    auto env = worker_env(round, 0, "e", {{"NCCL_ASYNC_ERROR_HANDLING", "0"}, {"TORCH_NCCL_ASYNC_ERROR_HANDLING", "3"}});
    CHECK(env.at("NCCL_ASYNC_ERROR_HANDLING") == "0");
    CHECK(env.at("TORCH_NCCL_ASYNC_ERROR_HANDLING") == "3");
  }

  TEST_CASE("OMP_NUM_THREADS is set only when unset and more than one worker runs") {
    CHECK(should_set_omp_num_threads(4, {}));
    CHECK_FALSE(should_set_omp_num_threads(1, {}));
    CHECK_FALSE(should_set_omp_num_threads(4, {{"OMP_NUM_THREADS", "8"}}));
    RoundEnv round;
    round.set_omp_num_threads = false;
    CHECK(worker_env(round, 0, "e", {}).count("OMP_NUM_THREADS") == 0);
  }

  TEST_CASE("workers run as python -u, -m, runpy or directly") {
    WorkerCommand c;
    c.python = "/usr/bin/python3";
    c.program = "train.py";
    c.args = {"--lr", "0.1"};
    CHECK(worker_argv(c) == std::vector<std::string>{"/usr/bin/python3", "-u", "train.py", "--lr", "0.1"});
    c.module = true;
    c.program = "pkg.train";
    CHECK(worker_argv(c) == std::vector<std::string>{"/usr/bin/python3", "-u", "-m", "pkg.train", "--lr", "0.1"});
    c.module = false;
    c.run_path = true;
    c.program = "train.py";
    auto argv = worker_argv(c);
    REQUIRE(argv.size() == 7);
    CHECK(argv[2] == "-c");
    CHECK(argv[3].find("runpy.run_path") != std::string::npos);
    CHECK(argv[4] == "train.py");
    c.run_path = false;
    c.no_python = true;
    c.program = "/bin/echo";
    CHECK(worker_argv(c) == std::vector<std::string>{"/bin/echo", "--lr", "0.1"});
  }

  TEST_CASE("a free port can be bound right after it was picked") {
    int port = pick_free_port("127.0.0.1");
    CHECK(port > 0);
    CHECK(port < 65536);
  }

  TEST_CASE("--virtual_local_rank: LOCAL_RANK 0 and only the worker's own device, as torchrun 2.x") {
    RoundEnv round;
    round.assignment.rank_offset = 4;
    round.local_world_size = 2;
    round.virtual_local_rank = true;
    auto env = worker_env(round, 1, "/e", {{"CUDA_VISIBLE_DEVICES", "4, 6"}});
    CHECK(env["LOCAL_RANK"] == "0");
    CHECK(env["RANK"] == "5");  // ranks keep the real local rank
    CHECK(env["CUDA_VISIBLE_DEVICES"] == "6");
    CHECK(env.count("HIP_VISIBLE_DEVICES") == 0);
    env = worker_env(round, 1, "/e", {});
    CHECK(env["CUDA_VISIBLE_DEVICES"] == "1");
    // ROCm: HIP_VISIBLE_DEVICES is the source when set, and both get the device.
    env = worker_env(round, 0, "/e", {{"HIP_VISIBLE_DEVICES", "2,3"}, {"CUDA_VISIBLE_DEVICES", "0,1"}});
    CHECK(env["CUDA_VISIBLE_DEVICES"] == "2");
    CHECK(env["HIP_VISIBLE_DEVICES"] == "2");
    CHECK_THROWS_AS(worker_env(round, 1, "/e", {{"CUDA_VISIBLE_DEVICES", "4"}}), ddp::LaunchError);
    // Off: the real local rank, the agent's list left alone (inherited, not overridden).
    round.virtual_local_rank = false;
    env = worker_env(round, 1, "/e", {{"CUDA_VISIBLE_DEVICES", "4,6"}});
    CHECK(env["LOCAL_RANK"] == "1");
    CHECK(env.count("CUDA_VISIBLE_DEVICES") == 0);
  }
}

TEST_SUITE("the worker environment follows docs/architecture.md") {
  TEST_CASE("a worker gets the agent's environment, its round, its heartbeat slot, the timer file and the Python helpers") {
    RoundEnv round;
    round.assignment.rank_offset = 4;
    round.assignment.world_size = 8;
    round.local_world_size = 4;
    round.set_omp_num_threads = true;
    round.gloo_socket_ifname = "eth1";
    WorkerSetup setup;
    setup.progress_file = "/proc/1/fd/7";
    setup.timer_file = "/tmp/timer.fifo";
    setup.python_helper_dir = "/opt/ddplaunch/python";
    setup.fault_handler = true;
    const std::map<std::string, std::string> inherited = {
        {"HOME", "/home/u"}, {"PYTHONPATH", "/mine"}, {"RANK", "stale"}};
    auto env = build_worker_env(round, setup, 2, "/logs/error.json", inherited);
    CHECK(env.at("HOME") == "/home/u");
    CHECK(env.at("RANK") == "6");  // the round's, over the agent's
    CHECK(env.at("WORLD_SIZE") == "8");
    CHECK(env.at("TORCHELASTIC_ERROR_FILE") == "/logs/error.json");
    CHECK(env.at("OMP_NUM_THREADS") == "1");
    CHECK(env.at("GLOO_SOCKET_IFNAME") == "eth1");
    CHECK(env.at("DDPLAUNCH_PROGRESS_FILE") == "/proc/1/fd/7");
    CHECK(env.at("DDPLAUNCH_PROGRESS_SLOT") == "2");
    CHECK(env.at("TORCHELASTIC_TIMER_FILE") == "/tmp/timer.fifo");
    CHECK(env.at("PYTHONPATH") == "/opt/ddplaunch/python:/mine");
    CHECK(env.at("PYTHONFAULTHANDLER") == "1");
    CHECK(env.count("DDPLAUNCH_WORKER_FD") == 0);
    CHECK(env.count("DDPLAUNCH_STANDBY_FD") == 0);
  }

  TEST_CASE("Python variables are for Python workers, and the user's PYTHONFAULTHANDLER wins") {
    RoundEnv round;
    WorkerSetup setup;
    setup.progress_file = "/p";
    setup.python_helper_dir = "/helpers";
    setup.fault_handler = true;
    auto env = build_worker_env(round, setup, 0, "/e", {{"PYTHONFAULTHANDLER", "0"}});
    CHECK(env.at("PYTHONPATH") == "/helpers");
    CHECK(env.at("PYTHONFAULTHANDLER") == "0");
    CHECK(env.count("TORCHELASTIC_TIMER_FILE") == 0);  // no file timer asked
    setup.fault_handler = false;  // no --hang_timeout: no faulthandler
    CHECK(build_worker_env(round, setup, 0, "/e", {}).count("PYTHONFAULTHANDLER") == 0);
    setup.python = false;  // --no_python: neither
    env = build_worker_env(round, setup, 0, "/e", {{"PYTHONPATH", "/mine"}});
    CHECK(env.at("PYTHONPATH") == "/mine");
    CHECK(env.count("PYTHONFAULTHANDLER") == 0);
    CHECK(env.at("DDPLAUNCH_PROGRESS_SLOT") == "0");  // every worker has its slot
  }

  TEST_CASE("a standby gets what every worker gets before torch loads, its socket, and nothing of any round") {
    WorkerSetup setup;
    setup.progress_file = "/p";
    setup.timer_file = "/t";
    setup.python_helper_dir = "/helpers";
    setup.fault_handler = true;
    auto env = build_standby_env(setup, 4, 9, {{"HOME", "/home/u"}});
    CHECK(env.at("HOME") == "/home/u");
    CHECK(env.at("OMP_NUM_THREADS") == "1");
    CHECK(env.at("PYTHONPATH") == "/helpers");
    CHECK(env.at("PYTHONFAULTHANDLER") == "1");
    CHECK(env.at("DDPLAUNCH_STANDBY_FD") == "9");
    for (const char* round_variable : {"RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "DDPLAUNCH_GENERATION",
                                       "DDPLAUNCH_PROGRESS_SLOT", "TORCHELASTIC_TIMER_FILE"}) {
      CHECK_MESSAGE(env.count(round_variable) == 0, round_variable);
    }
    CHECK(build_standby_env(setup, 1, 9, {}).count("OMP_NUM_THREADS") == 0);
    CHECK(build_standby_env(setup, 4, 9, {{"OMP_NUM_THREADS", "8"}}).at("OMP_NUM_THREADS") == "8");
  }

  TEST_CASE("every worker and standby gets the environment digest and the check mode, when there is one") {
    RoundEnv round;
    WorkerSetup setup;
    setup.python = false;  // not only Python workers: an SDK program records it too
    CHECK(build_worker_env(round, setup, 0, "/e", {}).count("DDPLAUNCH_ENV_FINGERPRINT") == 0);
    CHECK(build_worker_env(round, setup, 0, "/e", {}).count("DDPLAUNCH_ENV_CHECK") == 0);
    CHECK(build_worker_env(round, setup, 0, "/e", {{"DDPLAUNCH_ENV_FINGERPRINT", "outer"}})
              .count("DDPLAUNCH_ENV_FINGERPRINT") == 0);  // an outer launcher's is not this job's
    setup.env_digest = std::string(64, 'a');
    setup.env_check = "strict";
    auto env = build_worker_env(round, setup, 0, "/e", {{"DDPLAUNCH_ENV_FINGERPRINT", "stale"}});
    CHECK(env.at("DDPLAUNCH_ENV_FINGERPRINT") == std::string(64, 'a'));
    CHECK(env.at("DDPLAUNCH_ENV_CHECK") == "strict");
    auto standby = build_standby_env(setup, 1, 9, {});
    CHECK(standby.at("DDPLAUNCH_ENV_FINGERPRINT") == std::string(64, 'a'));
    CHECK(standby.at("DDPLAUNCH_ENV_CHECK") == "strict");
  }

  TEST_CASE("the worker channel's descriptor is named, renamed and removed") {
    std::map<std::string, std::string> env = {{"HOME", "/home/u"}};
    set_worker_channel(env, 12);
    CHECK(env.at("DDPLAUNCH_WORKER_FD") == "12");
    set_worker_channel(env, 5);
    CHECK(env.at("DDPLAUNCH_WORKER_FD") == "5");
    set_worker_channel(env, -1);
    CHECK(env.count("DDPLAUNCH_WORKER_FD") == 0);
    CHECK(env.size() == 1);
  }
}

TEST_SUITE("worker logs are laid out and prefixed as documented") {
  TEST_CASE("log directories are <log_dir>/<run_id>/attempt_<n>/<local_rank>") {
    CHECK(worker_log_dir("/tmp/logs", "job", 2, 3) == "/tmp/logs/job/attempt_2/3");
    CHECK(worker_log_dir("/tmp/logs/", "job", 0, 0) == "/tmp/logs/job/attempt_0/0");
  }

  TEST_CASE("the default prefix is [<role><local_rank>]: and templates expand their variables") {
    CHECK(line_prefix("", "default", 5, 1) == "[default1]:");
    CHECK(line_prefix("[${role_name}|${rank}|${local_rank}] ", "trainer", 9, 1) == "[trainer|9|1] ");
    CHECK(line_prefix("${rank}${rank}$x${", "r", 2, 0) == "22$x${");
  }

  TEST_CASE("the line splitter hands over whole lines, whatever the pieces") {
    std::vector<std::string> lines;
    LineSplitter s([&](std::string_view l) { lines.emplace_back(l); });
    s.feed("hel");
    s.feed("lo\nwor");
    CHECK(lines == std::vector<std::string>{"hello\n"});
    s.feed("ld\n\nlast");
    CHECK(lines == std::vector<std::string>{"hello\n", "world\n", "\n"});
    CHECK(s.pending() == 4);
    s.finish();
    CHECK(lines.back() == "last");
    CHECK(s.pending() == 0);
  }

  TEST_CASE("a line longer than the limit is handed over in bounded pieces") {
    std::vector<std::string> lines;
    LineSplitter s([&](std::string_view l) { lines.emplace_back(l); }, 4);
    s.feed("abcdefghij\n");
    // The whole-line fast path needs no buffering; only partial data is bounded.
    CHECK(lines == std::vector<std::string>{"abcdefghij\n"});
    lines.clear();
    s.feed("abcdefghij");
    CHECK(lines == std::vector<std::string>{"abcd", "efgh"});
    CHECK(s.pending() == 2);
  }
}

TEST_SUITE("failures are explained like torchrun") {
  TEST_CASE("the error file of @record with a structured message gives message, traceback and time") {
    auto c = parse_error_file(R"({"message": {"message": "RuntimeError: boom", "extraInfo": {"py_callstack": "Traceback (most recent call last):\n  File x", "timestamp": "1700000000"}}})");
    CHECK(c.present);
    CHECK(c.message == "RuntimeError: boom");
    CHECK(c.traceback.find("Traceback") == 0);
    CHECK(c.timestamp == 1700000000);
    CHECK(summarise_error_file(c) == "RuntimeError: boom\nTraceback (most recent call last):\n  File x");
  }

  TEST_CASE("the string form of an error file is read too") {
    auto c = parse_error_file(R"({"message": "plain failure", "timestamp": 1700000001})");
    CHECK(c.present);
    CHECK(c.message == "plain failure");
    CHECK(c.traceback.empty());
    CHECK(c.timestamp == 1700000001);
  }

  TEST_CASE("an error file that is not PyTorch's is reported as such") {
    auto c = parse_error_file("not json");
    CHECK_FALSE(c.present);
    CHECK(c.problem.find("not a PyTorch error file") != std::string::npos);
    CHECK_FALSE(read_error_file("/nonexistent/error.json").present);
  }

  TEST_CASE("signals are named") {
    CHECK(signal_name(SIGSEGV) == "SIGSEGV");
    CHECK(signal_name(SIGKILL) == "SIGKILL");
  }

  TEST_CASE("the summary names host, rank, local rank, exit code, pid and the error message") {
    ddp::rdzv::WorkerFailure f;
    f.host = "node7";
    f.rank = 5;
    f.local_rank = 1;
    f.exit_code = 3;
    f.pid = 4242;
    f.timestamp = 1700000000;
    f.error_file_message = "ValueError: bad batch";
    auto s = format_failure_summary("train.py", f, "/logs/error.json", {});
    CHECK(s.find("train.py FAILED") != std::string::npos);
    CHECK(s.find("host      : node7") != std::string::npos);
    CHECK(s.find("rank      : 5 (local_rank: 1)") != std::string::npos);
    CHECK(s.find("exitcode  : 3 (pid: 4242)") != std::string::npos);
    CHECK(s.find("error_file: /logs/error.json") != std::string::npos);
    CHECK(s.find("ValueError: bad batch") != std::string::npos);
    CHECK(s.find("<NO_OTHER_FAILURES>") != std::string::npos);
    f.signal = SIGSEGV;
    f.error_file_message.clear();
    s = format_failure_summary("train.py", f, "", {});
    CHECK(s.find("SIGSEGV") != std::string::npos);
    CHECK(s.find("exitcode  : -11") != std::string::npos);
  }
}
