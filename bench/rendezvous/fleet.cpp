// ddp-rdzv-fleet: K simulated agents in P processes against a ddp-rendezvous daemon it starts
// itself, through a job's whole life at scale: connect (hello, HMAC when --token-file), join (one
// round of K nodes), heartbeats, the daemon SIGKILLed and started again (every agent resumes),
// one agent's death told to every survivor, and leave. Ends with one JSON line:
//   {"agents":K, "procs":P, "connect_s":..., "round_s":..., "round_daemon_cpu_s":..., "resume_s":...,
//    "dead_broadcast_s":..., "rss_kb_per_agent":..., ...}
// and exits 1 when any phase fails or misses its deadline, so a small run is a test.
//
//   ddp-rdzv-fleet --daemon build/bin/ddp-rendezvous --agents 100000
//
// Each process speaks raw frames (the project's codec, no client library) from its own loopback
// source address (127.1.0.N: one address has about 28,000 ephemeral ports), so one host drives
// 100,000 agents. Processes share one clock (CLOCK_MONOTONIC): each reports when its last agent
// heard something, the parent takes the latest. Loopback only; every process it starts dies with
// it (PR_SET_PDEATHSIG) and the run is bounded by --deadline per phase.
//
// The death's broadcast is measured two ways. By default each process reads as it goes, on the
// cores the daemon writes from: the last survivor's read ends it. With --still S every process
// stays still for S seconds around the death (no reads, no heartbeats, none waiting in epoll to
// be woken), as agents on other machines cost the daemon nothing, and then reads what arrived by
// hand: each restart is dated by the kernel's arrival time on the survivor's socket
// (SO_TIMESTAMPNS). On loopback the daemon's sends still run each receiving socket's TCP path.
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <cstdio>
#include <fstream>
#include <iterator>
#include <functional>
#include <memory>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <CLI/CLI.hpp>
#include <boost/asio.hpp>

#include "rendezvous/auth.h"
#include "rendezvous/protocol.h"

namespace asio = boost::asio;
using asio::ip::tcp;
using steady = std::chrono::steady_clock;
using namespace ddp::rdzv;
using ddp::Expected;

namespace {

long long now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(steady::now().time_since_epoch()).count();
}

struct Options {
  std::string daemon, job = "fleet", secret;
  std::vector<std::string> daemon_args;  // more flags for it (--writer_threads 1, ...)
  nlohmann::json fingerprint = nlohmann::json::object();  // what every agent's join carries
  int agents = 1000, procs = 0, port = 0;
  double still = 0;  // s the load stays still around the death (0: it reads as it goes)
  double deadline = 120, heartbeat_interval = 1.0;
  std::size_t window = 0;  // handshakes in flight per process
};

// ---------------------------------------------------------------------------------------------
// One process's agents.

struct Fleet;

struct Agent : std::enable_shared_from_this<Agent> {
  Agent(asio::io_context& io, Fleet& fleet, int index) : socket(io), fleet(fleet), index(index) {}
  tcp::socket socket;
  Fleet& fleet;
  int index;  // in the whole job
  unsigned char header[kFrameHeaderBytes];
  std::string body;
  std::string client_nonce, key;  // this connection's handshake and seal key
  Assignment assignment;          // the round; its secret kept in clear, as an agent keeps it
  bool member = false, resuming = false;
  bool welcomed = false;  // on this connection
  double retry_delay = 0.05;  // as the agent's client: jittered, doubling up to 1 s
  void connect(const tcp::endpoint& to, const asio::ip::address& from);
  void retry_later();
  void read();
  void on(const std::string& type);
  void collect(long long realtime_offset_ns);
  // One write at a time per socket (asio's rule): a heartbeat due while a join is being written waits.
  std::deque<Frame> outbox;
  void send(const Frame& f) {
    outbox.push_back(f);
    if (outbox.size() == 1) write_next();
  }
  void write_next() {
    asio::async_write(socket, asio::buffer(*outbox.front()), [self = shared_from_this()](boost::system::error_code ec,
                                                                                        std::size_t) {
      self->outbox.pop_front();
      if (ec) self->outbox.clear();  // the connection is gone; what it held goes with it
      if (!self->outbox.empty()) self->write_next();
    });
  }
};

struct Fleet {
  asio::io_context io{1};
  Options o;
  int first = 0, count = 0;  // this process's agents: indexes first .. first+count-1
  asio::ip::address source;
  tcp::endpoint server;
  std::vector<std::shared_ptr<Agent>> agents;
  std::size_t next = 0, in_handshake = 0;
  int welcomed = 0, rounded = 0, resumed = 0, restarted = 0, errors = 0, retries = 0;
  long long first_join_ns = 0, last_welcome_ns = 0, last_round_ns = 0, last_resumed_ns = 0, last_restart_ns = 0;
  std::string first_error;
  Frame heartbeat = encode(make_heartbeat());

  NodeSpec spec(int index) const {
    NodeSpec s;
    s.job_id = o.job;
    s.host = "fleet" + std::to_string(index);
    s.addr = "127.0.0.1";
    s.min_nodes = s.max_nodes = o.agents;
    s.master_port = 29500;
    s.timeouts.heartbeat_interval = o.heartbeat_interval;
    s.timeouts.heartbeat_timeout = std::max(30.0, o.deadline);  // a loaded host must not look dead
    s.timeouts.last_call_timeout = 0;
    s.fingerprint = o.fingerprint;
    return s;
  }
  void error(const std::string& what) {
    ++errors;
    if (first_error.empty()) first_error = what;
  }
  // Connects agents until `window` handshakes are in flight or all have been started; 256 at a
  // time, so that the challenges of the first are answered while the next connect (as separate
  // hosts would), not after the whole storm has been sent.
  void pump() {
    for (int started = 0; in_handshake < o.window && next < agents.size(); ++started) {
      if (started == 256) return asio::post(io, [this] { pump(); });
      ++in_handshake;
      agents[next++]->connect(server, source);
    }
  }
  void start_connecting() {
    next = 0;
    in_handshake = 0;
    pump();
  }
};

// A frame's type alone, except where the body is needed: a full parse per message would slow the
// measuring side more than the daemon.
std::string type_of(const std::string& body) {
  const auto at = body.find("\"type\":\"");
  if (at == std::string::npos) return "";
  return body.substr(at + 8, body.find('"', at + 8) - at - 8);
}

void Agent::connect(const tcp::endpoint& to, const asio::ip::address& from) {
  boost::system::error_code ec;
  welcomed = false;
  outbox.clear();
  socket = tcp::socket(socket.get_executor());
  socket.open(tcp::v4(), ec);
  const int on = 1;  // the port is chosen at connect, per source address (IP_BIND_ADDRESS_NO_PORT)
  ::setsockopt(socket.native_handle(), IPPROTO_IP, 24, &on, sizeof on);
  if (fleet.o.still > 0) ::setsockopt(socket.native_handle(), SOL_SOCKET, SO_TIMESTAMPNS, &on, sizeof on);
  socket.bind({from, 0}, ec);
  if (ec) {
    fleet.error("bind " + from.to_string() + ": " + ec.message());
    return;
  }
  socket.async_connect(to, [self = shared_from_this()](boost::system::error_code e) {
    if (e == asio::error::connection_refused || e == asio::error::timed_out) return self->retry_later();
    if (e) {
      self->fleet.error("connect: " + e.message());
      return;
    }
    self->socket.set_option(tcp::no_delay(true));
    self->read();
  });
}

void Agent::read() {
  asio::async_read(socket, asio::buffer(header), [self = shared_from_this()](boost::system::error_code ec, std::size_t) {
    // Closed before its welcome (the daemon evicted it in a storm): again later, as an agent's
    // client does. Closed after: the daemon went away or the agent was closed, which the parent's
    // phases handle.
    if (ec && !self->welcomed && self->socket.is_open()) self->retry_later();
    if (ec) return;
    self->body.resize(read_frame_header(self->header));
    asio::async_read(self->socket, asio::buffer(self->body), [self](boost::system::error_code e, std::size_t) {
      if (e) return;
      self->on(type_of(self->body));
      self->read();
    });
  });
}

// After the process was still: reads by hand what arrived meanwhile (asio's pending read of the
// next header then finds nothing). The restart is dated by the kernel's arrival time of the last
// data read: the restart's, or that of a frame after it (an answer to a heartbeat sent before the
// stillness), which can only make the figure larger.
void Agent::collect(long long realtime_offset_ns) {
  FrameReader frames;
  long long arrived_ns = 0;
  char data[65536];
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(timespec))];
  for (;;) {
    iovec iov{data, sizeof data};
    msghdr m{};
    m.msg_iov = &iov;
    m.msg_iovlen = 1;
    m.msg_control = control;
    m.msg_controllen = sizeof control;
    const ssize_t n = ::recvmsg(socket.native_handle(), &m, MSG_DONTWAIT);
    if (n <= 0) break;
    frames.feed(data, static_cast<std::size_t>(n));
    for (cmsghdr* c = CMSG_FIRSTHDR(&m); c; c = CMSG_NXTHDR(&m, c)) {
      if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_TIMESTAMPNS) continue;
      timespec ts;
      std::memcpy(&ts, CMSG_DATA(c), sizeof ts);
      arrived_ns = ts.tv_sec * 1000000000LL + ts.tv_nsec - realtime_offset_ns;
    }
  }
  bool told = false;
  std::string payload;
  FrameReader::Result r;
  while ((r = frames.next(payload)) == FrameReader::Result::frame) told = told || type_of(payload) == "restart";
  if (r == FrameReader::Result::error) return fleet.error("still: " + frames.error().message);
  if (frames.buffered()) return fleet.error("still: a frame was cut in two (" + std::to_string(frames.buffered()) + " bytes left)");
  if (!told) return fleet.error("still: no restart arrived within --still (raise it)");
  if (arrived_ns == 0) return fleet.error("still: the kernel gave no arrival time (SO_TIMESTAMPNS)");
  member = false;
  ++fleet.restarted;
  fleet.last_restart_ns = std::max(fleet.last_restart_ns, arrived_ns);
}

void Agent::retry_later() {
  ++fleet.retries;
  boost::system::error_code ignored;
  socket.close(ignored);
  auto timer = std::make_shared<asio::steady_timer>(socket.get_executor());
  const double jitter = 0.5 + static_cast<double>(std::rand()) / RAND_MAX;
  timer->expires_after(std::chrono::duration_cast<steady::duration>(std::chrono::duration<double>(retry_delay * jitter)));
  retry_delay = std::min(retry_delay * 2, 1.0);
  timer->async_wait([self = shared_from_this(), timer](boost::system::error_code) {
    self->connect(self->fleet.server, self->fleet.source);
  });
}

void Agent::on(const std::string& type) {
  Fleet& f = fleet;
  if (type == "challenge") {
    Hello h;
    h.job_id = f.o.job;
    h.client_nonce = client_nonce = random_hex(16);
    const std::string server_nonce = nlohmann::json::parse(body).value("nonce", "");
    if (!f.o.secret.empty()) {
      h.proof = auth_proof(f.o.secret, "hello", server_nonce, client_nonce, h.job_id);
      key = seal_key(f.o.secret, server_nonce, client_nonce, h.job_id);
    }
    send(encode(make_hello(h)));
  } else if (type == "welcome") {
    welcomed = true;
    retry_delay = 0.05;
    f.last_welcome_ns = now_ns();
    --f.in_handshake;
    f.pump();
    if (!resuming) {
      ++f.welcomed;
      return;
    }
    ResumeRequest r;
    r.job_id = f.o.job;
    r.node = f.spec(index);
    r.assignment = assignment;
    r.secret = key.empty() ? assignment.secret : seal_hex(key, assignment.secret);
    send(encode(make_resume_message(r)));
  } else if (type == "round") {
    Decoded d = decode(body);
    if (!d.message) return f.error("round: " + d.error->message);
    assignment = std::get<Assignment>(d.message->body);
    if (!key.empty()) assignment.secret = seal_hex(key, assignment.secret);  // unsealed: kept in clear
    member = true;
    ++f.rounded;
    f.last_round_ns = now_ns();
  } else if (type == "resumed") {
    member = true;
    ++f.resumed;
    f.last_resumed_ns = now_ns();
  } else if (type == "restart") {
    member = false;
    ++f.restarted;
    f.last_restart_ns = now_ns();
  } else if (type == "error") {
    f.error("error: " + nlohmann::json::parse(body).value("message", std::string()));
  }
}

// ---------------------------------------------------------------------------------------------
// A child process: runs its agents' io loop without pause and obeys one-line commands from the
// parent on `in`, answering one line each on `out` ("ok key value ..." or "fail why") when what
// the command waits for has happened.

class Child {
 public:
  Child(Fleet& f, int in, int out) : f_(f), commands_(f.io, in), out_(out), poll_(f.io), beat_(f.io) {}

  void run() {
    read_command();
    f_.io.run();
  }

 private:
  void read_command() {
    asio::async_read_until(commands_, input_, '\n', [this](boost::system::error_code ec, std::size_t) {
      if (ec) return f_.io.stop();  // the parent is gone
      std::string line;
      std::istream is(&input_);
      std::getline(is, line);
      obey(line);
      read_command();
    });
  }

  void obey(const std::string& command) {
    if (command == "connect") {
      f_.start_connecting();
      wait([this] { return f_.welcomed == f_.count; },
           [this] { return "ok " + std::to_string(f_.last_welcome_ns) + " " + std::to_string(f_.retries); });
    } else if (command == "join") {
      f_.first_join_ns = now_ns();
      for (auto& a : f_.agents) a->send(encode(make_join(f_.spec(a->index))));
      wait([this] { return f_.rounded == f_.count; }, [this] {
        start_beating();
        return "ok " + std::to_string(f_.first_join_ns) + " " + std::to_string(f_.last_round_ns);
      });
    } else if (command == "drop") {  // the daemon was killed: every connection is dead
      beat_.cancel();
      for (auto& a : f_.agents) {
        a->member = false;
        a->resuming = true;
        a->socket.close();
      }
      answer("ok");
    } else if (command == "resume") {
      f_.start_connecting();
      wait([this] { return f_.resumed == f_.count; }, [this] {
        start_beating();
        return "ok " + std::to_string(f_.last_resumed_ns) + " " + std::to_string(f_.restarted);
      });
    } else if (command == "hush") {  // --still: from now until after the death
      answer("ok");
      keep_still();
    } else if (command == "kill") {  // the first agent of this process dies: its socket closes
      const long long t = now_ns();
      f_.agents.front()->member = false;
      f_.agents.front()->socket.close();
      answer("ok " + std::to_string(t));
      if (f_.o.still > 0) keep_still();
    } else if (command == "await_restart") {
      const int survivors = static_cast<int>(std::count_if(f_.agents.begin(), f_.agents.end(),
                                                           [](const auto& a) { return a->socket.is_open(); }));
      wait([this, survivors] { return f_.restarted >= survivors; },
           [this] { return "ok " + std::to_string(f_.last_restart_ns); });
    } else if (command == "leave") {
      beat_.cancel();
      for (auto& a : f_.agents) {
        if (a->socket.is_open()) a->send(encode(make_leave()));
      }
      answer("ok");
    } else {
      answer("fail unknown command " + command);
    }
  }

  // Answers `reply()` once `done()`, checking every millisecond (the times in the answer were
  // taken as things happened, so the check's period does not enter them); "fail" at an error.
  void wait(std::function<bool()> done, std::function<std::string()> reply) {
    if (f_.errors) return answer("fail " + f_.first_error);
    if (done()) return answer(reply());
    poll_.expires_after(std::chrono::milliseconds(1));
    poll_.async_wait([this, done = std::move(done), reply = std::move(reply)](boost::system::error_code ec) mutable {
      if (!ec) wait(std::move(done), std::move(reply));
    });
  }

  // --still: this process's thread sleeps (its agents read nothing, send nothing, and nothing
  // waits in epoll to be woken), then reads by hand what arrived meanwhile, by arrival time.
  void keep_still() {
    beat_.cancel();
    std::this_thread::sleep_for(std::chrono::duration<double>(f_.o.still));
    timespec real{}, mono{};
    clock_gettime(CLOCK_REALTIME, &real);
    clock_gettime(CLOCK_MONOTONIC, &mono);  // steady_clock's, in libstdc++
    const long long offset = (real.tv_sec - mono.tv_sec) * 1000000000LL + (real.tv_nsec - mono.tv_nsec);
    for (auto& a : f_.agents) {
      if (a->socket.is_open()) a->collect(offset);
    }
  }

  // Every member heartbeats once per interval, spread evenly over it, as agents started at
  // different moments do.
  void start_beating() {
    beat_start_ = steady::now();
    beats_sent_ = 0;
    beat();
  }
  void beat() {
    const double elapsed = std::chrono::duration<double>(steady::now() - beat_start_).count();
    const auto due = static_cast<std::size_t>(elapsed / f_.o.heartbeat_interval * f_.count);
    for (; beats_sent_ < due; ++beats_sent_) {
      auto& a = f_.agents[beats_sent_ % f_.agents.size()];
      if (a->member) a->send(f_.heartbeat);
    }
    beat_.expires_after(std::chrono::milliseconds(10));
    beat_.async_wait([this](boost::system::error_code ec) {
      if (!ec) beat();
    });
  }

  void answer(const std::string& line) {
    const std::string l = line + "\n";
    if (::write(out_, l.data(), l.size()) < 0) f_.io.stop();
  }

  Fleet& f_;
  asio::posix::stream_descriptor commands_;
  asio::streambuf input_;
  int out_;
  asio::steady_timer poll_, beat_;
  steady::time_point beat_start_;
  std::size_t beats_sent_ = 0;
};

// ---------------------------------------------------------------------------------------------
// The parent: starts the daemon and the children, drives the phases, prints the JSON line.

struct Proc {
  pid_t pid = 0;
  int to = -1, from = -1;
  std::string pending;  // bytes read but not yet a whole line
};

[[noreturn]] void fail(const std::string& why) {
  std::fprintf(stderr, "ddp-rdzv-fleet: %s\n", why.c_str());
  std::exit(1);
}

pid_t start_daemon(const Options& o, const std::string& log) {
  const pid_t pid = fork();
  if (pid == 0) {
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    const int fd = ::open(log.c_str(), O_WRONLY | O_CREAT | O_APPEND, 0644);
    if (fd >= 0) {
      dup2(fd, STDOUT_FILENO);
      dup2(fd, STDERR_FILENO);
    }
    std::vector<std::string> args = {o.daemon, "--host", "127.0.0.1", "--port", std::to_string(o.port), "--quiet-joins",
                                     "--max-connections", std::to_string(o.agents + 1024)};
    if (!o.secret.empty()) args.insert(args.end(), {"--token-file", log + ".token"});
    args.insert(args.end(), o.daemon_args.begin(), o.daemon_args.end());
    std::vector<char*> argv;
    for (auto& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    execv(argv[0], argv.data());
    _exit(127);
  }
  return pid;
}

bool listening(int port) {
  asio::io_context io;
  tcp::socket s(io);
  boost::system::error_code ec;
  s.connect({asio::ip::make_address("127.0.0.1"), static_cast<unsigned short>(port)}, ec);
  return !ec;
}

// Waits (up to `seconds`) until the daemon listens; the moment it was seen listening.
long long await_listening(const Options& o, pid_t daemon, double seconds) {
  const auto until = steady::now() + std::chrono::duration<double>(seconds);
  while (!listening(o.port)) {
    if (waitpid(daemon, nullptr, WNOHANG) == daemon) fail("the daemon exited at start (see its log)");
    if (steady::now() > until) fail("the daemon did not listen within " + std::to_string(seconds) + " s");
    ::usleep(200);
  }
  return now_ns();
}

long rss_kb(pid_t pid) {
  std::ifstream f("/proc/" + std::to_string(pid) + "/status");
  std::string line;
  while (std::getline(f, line)) {
    if (line.rfind("VmRSS:", 0) == 0) return std::stol(line.substr(6));
  }
  return -1;
}

// The CPU seconds (user + system) a process has used so far, from /proc/PID/stat: on a machine
// whose cores the load processes share, the daemon's own cost of a phase.
double cpu_s(pid_t pid) {
  std::ifstream f("/proc/" + std::to_string(pid) + "/stat");
  std::string stat((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  std::istringstream rest(stat.substr(stat.rfind(')') + 2));  // the name may hold spaces
  std::string field;
  unsigned long long utime = 0, stime = 0;
  for (int i = 3; i <= 13; ++i) rest >> field;  // state .. cmajflt
  rest >> utime >> stime;
  return static_cast<double>(utime + stime) / static_cast<double>(sysconf(_SC_CLK_TCK));
}

// One answer line from a child, within the deadline; its words after "ok".
std::vector<long long> answer_of(Proc& p, const Options& o, const std::string& command) {
  const auto until = steady::now() + std::chrono::duration<double>(o.deadline);
  std::size_t eol;
  while ((eol = p.pending.find('\n')) == std::string::npos) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(until - steady::now()).count();
    pollfd pfd{p.from, POLLIN, 0};
    if (left <= 0 || ::poll(&pfd, 1, static_cast<int>(left)) <= 0) {
      fail(command + ": no answer within " + std::to_string(o.deadline) + " s (raise --deadline)");
    }
    char buf[512];
    const ssize_t n = ::read(p.from, buf, sizeof buf);
    if (n <= 0) fail(command + ": a load process died");
    p.pending.append(buf, static_cast<std::size_t>(n));
  }
  std::istringstream line(p.pending.substr(0, eol));
  p.pending.erase(0, eol + 1);
  std::string word;
  line >> word;
  if (word != "ok") fail(command + ": " + line.str());
  std::vector<long long> values;
  long long v;
  while (line >> v) values.push_back(v);
  return values;
}

void tell(Proc& p, const std::string& command) {
  const std::string l = command + "\n";
  if (::write(p.to, l.data(), l.size()) < 0) fail(command + ": a load process died");
}

// Sends `command` to every child and collects their answers.
std::vector<std::vector<long long>> all(std::vector<Proc>& procs, const Options& o, const std::string& command) {
  for (auto& p : procs) tell(p, command);
  std::vector<std::vector<long long>> answers;
  for (auto& p : procs) answers.push_back(answer_of(p, o, command));
  return answers;
}

long long latest(const std::vector<std::vector<long long>>& answers, std::size_t at) {
  long long t = 0;
  for (const auto& a : answers) t = std::max(t, a.at(at));
  return t;
}

double seconds(long long from_ns, long long to_ns) { return static_cast<double>(to_ns - from_ns) / 1e9; }

std::vector<Proc> start_children(const Options& o) {
  std::vector<Proc> procs;
  for (int c = 0; c < o.procs; ++c) {
    int down[2], up[2];
    if (pipe2(down, O_CLOEXEC) != 0 || pipe2(up, O_CLOEXEC) != 0) fail("pipe: out of descriptors");
    const pid_t pid = fork();
    if (pid == 0) {
      prctl(PR_SET_PDEATHSIG, SIGKILL);
      for (auto& p : procs) ::close(p.to), ::close(p.from);
      ::close(down[1]);
      ::close(up[0]);
      Fleet f;
      f.o = o;
      f.first = static_cast<int>(static_cast<long long>(o.agents) * c / o.procs);
      f.count = static_cast<int>(static_cast<long long>(o.agents) * (c + 1) / o.procs) - f.first;
      f.source = asio::ip::make_address("127.1." + std::to_string(c / 250) + "." + std::to_string(c % 250 + 1));
      f.server = {asio::ip::make_address("127.0.0.1"), static_cast<unsigned short>(o.port)};
      for (int i = 0; i < f.count; ++i) f.agents.push_back(std::make_shared<Agent>(f.io, f, f.first + i));
      Child(f, down[0], up[1]).run();
      _exit(0);
    }
    ::close(down[0]);
    ::close(up[1]);
    procs.push_back({pid, down[1], up[0], ""});
  }
  return procs;
}

void raise_descriptor_limit(const Options& o) {
  // The daemon holds one descriptor per agent, each process one per agent of its own.
  const rlim_t want = static_cast<rlim_t>(o.agents) + 256;
  rlimit r{};
  getrlimit(RLIMIT_NOFILE, &r);
  if (r.rlim_cur >= want) return;
  rlimit raised{want, std::max(r.rlim_max, want)};
  if (setrlimit(RLIMIT_NOFILE, &raised) != 0) {
    fail("needs " + std::to_string(want) + " open files (ulimit -n is " + std::to_string(r.rlim_cur) + ", hard " +
         std::to_string(r.rlim_max) + "): run as root or raise the hard limit");
  }
}

int free_port() {
  asio::io_context io;
  tcp::acceptor a(io, {asio::ip::make_address("127.0.0.1"), 0});
  return a.local_endpoint().port();
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"ddp-rdzv-fleet: K simulated agents in P processes through a job's life against a ddp-rendezvous"};
  Options o;
  std::string token_file, log = "/dev/null";
  bool no_resume = false;
  app.add_option("--daemon", o.daemon, "the ddp-rendezvous binary to start")->required();
  app.add_option("--agents", o.agents)->capture_default_str()->check(CLI::Range(2, 1000000));
  app.add_option("--procs", o.procs, "load processes (default: one per 20,000 agents, at least 2)");
  bool storm = false;
  app.add_option("--window", o.window, "handshakes in flight per process (default: 768 over all processes, "
                                       "well under the daemon's max_unauthenticated)");
  app.add_flag("--storm", storm, "every agent connects at once (no window): a join storm; an agent the daemon "
                                 "closes before its welcome connects again later, as the agent's client does");
  app.add_option("--deadline", o.deadline, "seconds each phase may take")->capture_default_str();
  app.add_option("--token-file", token_file, "a cluster secret: the daemon requires it, every agent proves it");
  app.add_option("--daemon-log", log, "the daemon's output")->capture_default_str();
  app.add_flag("--no-resume", no_resume, "skip the daemon restart");
  app.add_option("--still", o.still,
                 "the load stays still for this many seconds around one agent's death, then dates each "
                 "survivor's restart by its arrival on the socket (the kernel's time), as agents on other "
                 "machines would cost the daemon nothing; 0: the load reads as it goes")
      ->check(CLI::Range(0.0, 10.0));
  bool real_fingerprint = false;
  app.add_flag("--fingerprint", real_fingerprint,
               "every join carries a GPU node's environment fingerprint (as bench/envcheck's Python node; "
               "the same on every agent), as real agents' joins do");
  app.add_option("--daemon-arg", o.daemon_args, "one more flag for the daemon (repeat for more)")->allow_extra_args(false);
  CLI11_PARSE(app, argc, argv);
  if (o.procs <= 0) o.procs = std::max(2, (o.agents + 19999) / 20000);
  if (o.agents / o.procs > 25000) fail("at most 25,000 agents per process (one source address's ports): raise --procs");
  if (o.window == 0) o.window = storm ? static_cast<std::size_t>(o.agents) : std::max<std::size_t>(8, 768 / static_cast<std::size_t>(o.procs));
  if (real_fingerprint) {
    o.fingerprint = {
        {"machine", {{"arch", "x86_64"}, {"os", "Ubuntu 22.04.4 LTS"}, {"glibc", "2.35"}}},
        {"gpu", {{"count", 8}, {"models", std::vector<std::string>(8, "NVIDIA H100 80GB HBM3")}, {"driver", "535.104.05"}}},
        {"python",
         {{"version", "3.10.12"}, {"implementation", "CPython"}, {"executable", "/opt/conda/envs/train/bin/python3"},
          {"torch", "2.3.1+cu121"}, {"torch_cuda", "12.1"}, {"nccl", "2.18.1"}, {"cudnn", "8902"}}},
        {"program", {{"path", "/shared/jobs/llm/train.py"}, {"sha256", std::string(64, 'a')}}},
        {"env_lock", {{"source", "cmd:conda list --explicit"}, {"sha256", std::string(64, 'b')}}},
        {"env", {{"CUDA_VISIBLE_DEVICES", "0,1,2,3,4,5,6,7"}, {"NCCL_SOCKET_IFNAME", "ens"}, {"NCCL_DEBUG", "WARN"}}},
    };
  }
  o.agents = std::max(o.agents, 2);
  o.procs = std::min(o.procs, o.agents);  // every process has an agent
  if (!token_file.empty()) {
    if (log == "/dev/null") fail("--token-file needs --daemon-log (the daemon's copy of the secret goes beside it)");
    Expected<std::string> secret = read_secret_file(token_file);
    if (!secret) fail("--token-file: " + secret.error());
    o.secret = *secret;
    std::ofstream(log + ".token") << o.secret << "\n";  // the daemon's copy, beside its log
  }
  raise_descriptor_limit(o);
  signal(SIGPIPE, SIG_IGN);
  o.port = free_port();
  pid_t daemon = start_daemon(o, log);
  await_listening(o, daemon, 10);
  std::vector<Proc> procs = start_children(o);
  const long rss_idle = rss_kb(daemon);

  const long long t_connect = now_ns();
  const auto connected = all(procs, o, "connect");
  const long rss_connected = rss_kb(daemon);
  const double cpu_before_round = cpu_s(daemon);
  const auto joined = all(procs, o, "join");
  const double round_cpu = cpu_s(daemon) - cpu_before_round;
  long long first_join = joined.front().at(0);
  for (const auto& a : joined) first_join = std::min(first_join, a.at(0));
  const long rss = rss_kb(daemon);
  long long retries = 0;
  for (const auto& a : connected) retries += a.at(1);
  std::printf("{\"agents\":%d,\"procs\":%d,\"connect_s\":%.3f,\"connect_retries\":%lld,\"round_s\":%.3f", o.agents,
              o.procs, seconds(t_connect, latest(connected, 0)), retries, seconds(first_join, latest(joined, 1)));
  std::printf(",\"round_daemon_cpu_s\":%.3f", round_cpu);

  if (!no_resume) {
    kill(daemon, SIGKILL);
    waitpid(daemon, nullptr, 0);
    all(procs, o, "drop");
    daemon = start_daemon(o, log);
    const long long t_listen = await_listening(o, daemon, 10);
    const auto resumed = all(procs, o, "resume");
    long long restarts = 0;
    for (const auto& a : resumed) restarts += a.at(1);
    if (restarts) fail(std::to_string(restarts) + " agents were told to restart after the daemon's restart");
    std::printf(",\"resume_s\":%.3f", seconds(t_listen, latest(resumed, 0)));
  }

  if (o.still > 0) {  // every other process still first, then the death in the first
    for (std::size_t i = 1; i < procs.size(); ++i) tell(procs[i], "hush");
    for (std::size_t i = 1; i < procs.size(); ++i) answer_of(procs[i], o, "hush");
  }
  tell(procs.front(), "kill");
  const long long t_death = answer_of(procs.front(), o, "kill").at(0);
  const auto told = all(procs, o, "await_restart");
  if (o.still > 0) std::printf(",\"load_still_s\":%.2f", o.still);
  std::printf(",\"dead_broadcast_s\":%.4f,\"rss_kb_per_agent\":%.2f,\"rss_idle_kb\":%ld,\"rss_connected_kb\":%ld,"
              "\"rss_kb\":%ld}\n",
              seconds(t_death, latest(told, 0)), static_cast<double>(rss) / o.agents, rss_idle, rss_connected, rss);
  all(procs, o, "leave");
  for (auto& p : procs) ::close(p.to);  // a child stops when its command pipe closes
  for (auto& p : procs) waitpid(p.pid, nullptr, 0);
  kill(daemon, SIGTERM);
  waitpid(daemon, nullptr, 0);
  return 0;
}
