// etcd_probe: one call of rendezvous/etcd.* from the command line, for the tests against a real
// etcd cluster (tests/rendezvous/test_etcd_client.py). Prints one JSON object; exit 0 when the
// call succeeded, 1 when it failed (the object's "error" says why), 2 on usage.
//
//   etcd_probe --endpoints http://127.0.0.1:P1,http://127.0.0.1:P2 [--user U --password P]
//              [--cacert F --cert F --key F] [--timeout S] COMMAND ARGS...
//   put KEY VALUE [LEASE] | get KEY | prefix PREFIX | create KEY VALUE [LEASE]
//   cas KEY VALUE MOD_REVISION | grant TTL | keepalive ID | revoke ID
//   watch KEY EVENTS: prints {"created":...,"events":[...]} per answer, one a line, until EVENTS
//   events were seen (exit 0) or the stream ended (exit 1, the last line says why);
//   --stop-after S stops it from another thread after S seconds (exit 1, "stopped").
#include <chrono>
#include <cstdio>
#include <iostream>
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "rendezvous/etcd.h"

using ddp::rdzv::EtcdClient;
using ddp::rdzv::EtcdCompare;
using ddp::rdzv::EtcdOp;
using ddp::rdzv::EtcdOptions;
using ddp::rdzv::EtcdRange;
using ddp::rdzv::EtcdStatus;
using nlohmann::json;

namespace {

json kvs_json(const EtcdRange& r) {
  json out = json::array();
  for (const auto& kv : r.kvs) {
    out.push_back({{"key", kv.key}, {"value", kv.value}, {"create_revision", kv.create_revision},
                   {"mod_revision", kv.mod_revision}, {"version", kv.version}, {"lease", kv.lease}});
  }
  return out;
}

int emit(const EtcdStatus& s, json out) {
  if (!s.ok()) {
    out["error"] = s.error;
    out["code"] = s.code;
  }
  std::cout << out.dump() << std::endl;
  return s.ok() ? 0 : 1;
}

int usage(const std::string& why) {
  std::cerr << "etcd_probe: " << why << "\n";
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  EtcdOptions options;
  double stop_after = 0;
  std::vector<std::string> args;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto value = [&]() -> std::string { return i + 1 < argc ? argv[++i] : ""; };
    if (a == "--endpoints") {
      std::string list = value();
      for (std::size_t start = 0; start <= list.size();) {
        auto comma = list.find(',', start);
        if (comma == std::string::npos) comma = list.size();
        if (comma > start) options.endpoints.push_back(list.substr(start, comma - start));
        start = comma + 1;
      }
    } else if (a == "--user") {
      options.user = value();
    } else if (a == "--password") {
      options.password = value();
    } else if (a == "--cacert") {
      options.ca_file = value();
    } else if (a == "--cert") {
      options.cert_file = value();
    } else if (a == "--key") {
      options.key_file = value();
    } else if (a == "--stop-after") {
      stop_after = std::stod(value());
    } else if (a == "--timeout") {
      options.call_timeout = std::stod(value());
    } else {
      args.push_back(a);
    }
  }
  if (args.empty()) return usage("no command");
  EtcdClient client(options);
  const std::string& cmd = args[0];
  auto arg = [&](std::size_t i) { return i < args.size() ? args[i] : std::string(); };
  auto number = [&](std::size_t i) -> std::int64_t { return i < args.size() ? std::stoll(args[i]) : 0; };
  if (cmd == "put" && args.size() >= 3) {
    auto s = client.put(arg(1), arg(2), number(3));
    return emit(s, {{"endpoint", client.last_endpoint()}});
  }
  if ((cmd == "get" || cmd == "prefix") && args.size() == 2) {
    auto r = cmd == "get" ? client.range(arg(1)) : client.range(arg(1), ddp::rdzv::prefix_range_end(arg(1)));
    return emit(r.status, {{"revision", r.revision}, {"kvs", kvs_json(r)}, {"endpoint", client.last_endpoint()}});
  }
  if ((cmd == "create" && args.size() >= 3) || (cmd == "cas" && args.size() == 4)) {
    ddp::rdzv::EtcdTxn txn;
    EtcdCompare c;
    c.key = arg(1);
    c.target = cmd == "create" ? EtcdCompare::Target::create_revision : EtcdCompare::Target::mod_revision;
    c.number = cmd == "create" ? 0 : number(3);
    txn.compare.push_back(c);
    EtcdOp put;
    put.kind = EtcdOp::Kind::put;
    put.key = arg(1);
    put.value = arg(2);
    put.lease = cmd == "create" ? number(3) : 0;
    txn.success.push_back(put);
    EtcdOp get;
    get.key = arg(1);
    txn.failure.push_back(get);
    auto r = client.txn(txn);
    json out = {{"succeeded", r.succeeded}, {"revision", r.revision}};
    if (!r.ranges.empty()) out["current"] = kvs_json(r.ranges[0]);
    return emit(r.status, out);
  }
  if (cmd == "grant" && args.size() == 2) {
    auto l = client.lease_grant(number(1));
    return emit(l.status, {{"id", l.id}, {"ttl", l.ttl}});
  }
  if (cmd == "keepalive" && args.size() == 2) {
    auto l = client.lease_keepalive(number(1));
    return emit(l.status, {{"id", l.id}, {"ttl", l.ttl}});
  }
  if (cmd == "watch" && args.size() == 3) {
    ddp::rdzv::EtcdWatchRequest request;
    request.key = arg(1);
    request.establish_timeout = options.call_timeout;
    const auto wanted = number(2);
    std::int64_t seen = 0;
    ddp::rdzv::EtcdWatchStop stop;
    std::thread stopper;
    if (stop_after > 0) {
      stopper = std::thread([&stop, stop_after] {
        std::this_thread::sleep_for(std::chrono::duration<double>(stop_after));
        stop.stop();
      });
    }
    auto s = client.watch(
        request,
        [&](const ddp::rdzv::EtcdWatchResponse& r) {
          json events = json::array();
          for (const auto& e : r.events) {
            events.push_back({{"type", e.type == ddp::rdzv::EtcdWatchEvent::Type::del ? "DELETE" : "PUT"},
                              {"key", e.kv.key}, {"value", e.kv.value}, {"mod_revision", e.kv.mod_revision}});
          }
          std::cout << json{{"created", r.created}, {"revision", r.revision}, {"events", events}}.dump() << std::endl;
          seen += static_cast<std::int64_t>(r.events.size());
          if (seen >= wanted) stop.stop();
        },
        stop);
    if (stopper.joinable()) stopper.join();
    if (seen >= wanted && wanted > 0) return 0;
    return emit(s.ok() ? EtcdStatus{"ended without an error", 0} : s, json::object());
  }
  if (cmd == "revoke" && args.size() == 2) return emit(client.lease_revoke(number(1)), json::object());
  return usage("unknown command or wrong arguments: " + cmd);
}
