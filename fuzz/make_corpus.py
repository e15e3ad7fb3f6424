#!/usr/bin/env python3
"""Writes the seed corpus of rdzv_fuzz: valid conversations in its input format (rdzv_fuzz.cpp).

Usage: fuzz/make_corpus.py [DIR] (default: fuzz/corpus next to this script). Deterministic."""
import json
import os
import re
import struct
import sys

# The protocol version the server accepts in hello (rendezvous/protocol.h): seeds of an older one
# would be refused at their first message and reach nothing behind it.
with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "rendezvous", "protocol.h")) as _f:
    VERSION = int(re.search(r"kProtocolVersion = (\d+);", _f.read()).group(1))


def frame(msg):
    data = json.dumps(msg, separators=(",", ":")).encode()
    return struct.pack(">I", len(data)) + data


def chunk(conn, data, advance=0):
    """One record: tag (connection, clock advance in 0.1 s), 2-byte length, the bytes."""
    out = b""
    for i in range(0, max(len(data), 1), 65535):
        part = data[i:i + 65535]
        out += bytes([(conn & 3) | (min(advance, 63) << 2)]) + struct.pack(">H", len(part)) + part
        advance = 0
    return out


def hello(job):
    return frame({"type": "hello", "protocol_version": VERSION, "job_id": job, "client_nonce": "00", "proof": ""})


def node(job, host, lo=1, hi=1, workers=2, **extra):
    n = {"job_id": job, "host": host, "addr": "10.0.0.%d" % (sum(map(ord, host)) % 200 + 1), "local_world_size": workers,
         "requested_rank": -1, "min_nodes": lo, "max_nodes": hi, "max_restarts": 1, "master_port": 29500,
         "env_check": "strict", "fingerprint": {"python": {"version": "3.11.2", "torch": "1.13.0"},
                                                "program": {"libraries": {"libc.so.6": "ab"}}},
         "timeouts": {"join_timeout": 5, "last_call_timeout": 0.5, "heartbeat_interval": 1,
                      "heartbeat_timeout": 3, "shutdown_timeout": 1}}
    n.update(extra)
    return n


def join(job, host, **kw):
    return frame({"type": "join", "node": node(job, host, **kw)})


FAILURE = frame({"type": "failure", "failure": {"host": "a", "rank": 1, "local_rank": 1, "exit_code": 3,
                                                "signal": 0, "pid": 42, "timestamp": 1.7e9,
                                                "error_file_message": "RuntimeError: boom"}})
FATAL = frame({"type": "failure", "failure": {"host": "b", "rank": 0, "exit_code": 1,
                                              "fatal": "2 restart(s) in a row made no progress"}})
SEEDS = {
    "one_node_succeeds": chunk(0, hello("j") + join("j", "a") + frame({"type": "success"})),
    "two_nodes_fail_restart_rejoin": (
        chunk(0, hello("j") + join("j", "a", lo=2, hi=2)) + chunk(1, hello("j") + join("j", "b", lo=2, hi=2)) +
        chunk(0, FAILURE) + chunk(0, join("j", "a", lo=2, hi=2)) + chunk(1, join("j", "b", lo=2, hi=2)) +
        chunk(0, frame({"type": "success"})) + chunk(1, frame({"type": "success"}))),
    "fatal_report_fails_an_elastic_job": (
        chunk(0, hello("x") + join("x", "a", lo=1, hi=2)) + chunk(1, hello("x") + join("x", "b", lo=1, hi=2)) +
        chunk(0, FAILURE) + chunk(0, join("x", "a", lo=1, hi=2)) + chunk(1, FATAL) +
        chunk(1, join("x", "b", lo=1, hi=2))),
    "elastic_last_call_then_newcomer": (
        chunk(0, hello("e") + join("e", "a", lo=1, hi=3)) + chunk(1, hello("e") + join("e", "b", lo=1, hi=3)) +
        chunk(2, frame({"type": "heartbeat"}), advance=6) + chunk(2, hello("e") + join("e", "c", lo=1, hi=3)) +
        chunk(0, join("e", "a", lo=1, hi=3)) + chunk(1, join("e", "b", lo=1, hi=3))),
    "status_and_heartbeats": (
        chunk(3, frame({"type": "status", "protocol_version": 2, "client_nonce": "00", "proof": ""})) +
        chunk(0, hello("s") + join("s", "a", lo=2, hi=2)) + chunk(0, frame({"type": "heartbeat"}), advance=10) +
        chunk(0, frame({"type": "status", "protocol_version": 2}))),
    "heartbeats_with_progress": (
        chunk(0, hello("p") + join("p", "a")) +
        chunk(0, frame({"type": "heartbeat", "step": 41, "checkpoint_step": 40, "checkpoint_interval": 90.5})) +
        chunk(0, frame({"type": "heartbeat", "step": 42}), advance=5) +
        chunk(3, frame({"type": "status", "protocol_version": VERSION, "client_nonce": "00", "proof": ""}))),
    "stall_probe_and_silence": (
        chunk(0, hello("s") + join("s", "a", lo=3, hi=3)) + chunk(1, hello("s") + join("s", "b", lo=3, hi=3)) +
        chunk(2, hello("s") + join("s", "c", lo=3, hi=3)) +
        chunk(0, frame({"type": "heartbeat"}), advance=8) + chunk(1, frame({"type": "stall", "stalled_for": 0.4})) +
        chunk(2, frame({"type": "heartbeat"}), advance=1) + chunk(1, frame({"type": "stall", "stalled_for": 2.5}), advance=15) +
        chunk(0, b"", advance=5)),
    "drain_a_node_then_a_spare": (
        chunk(0, hello("d") + join("d", "a", lo=1, hi=2)) + chunk(1, hello("d") + join("d", "b", lo=1, hi=2)) +
        chunk(2, hello("d") + join("d", "c", lo=1, hi=2), advance=6) +
        chunk(3, frame({"type": "drain", "protocol_version": VERSION, "client_nonce": "00", "proof": "",
                        "job": "d", "node": "1", "force": False})) +
        chunk(0, join("d", "a", lo=1, hi=2)) +
        chunk(2, frame({"type": "drain", "protocol_version": VERSION, "job": "d", "node": "c", "force": True}))),
    "fingerprints_differ": (
        chunk(0, hello("f") + join("f", "a", lo=2, hi=2, fingerprint={"a": 1})) +
        chunk(1, hello("f") + join("f", "b", lo=2, hi=2, fingerprint={"a": {"b": [1, 2]}}))),
    "leave_and_heartbeat_timeout": (
        chunk(0, hello("l") + join("l", "a", lo=1, hi=2)) + chunk(1, hello("l") + join("l", "b", lo=1, hi=2)) +
        chunk(1, frame({"type": "leave"}), advance=6) + chunk(0, b"", advance=40)),
    "node_rank_and_split_frames": (
        chunk(0, hello("r")) + chunk(0, join("r", "a", lo=2, hi=2, requested_rank=1)[:7]) +
        chunk(0, join("r", "a", lo=2, hi=2, requested_rank=1)[7:]) +
        chunk(1, hello("r") + join("r", "b", lo=2, hi=2, requested_rank=1))),
}

if __name__ == "__main__":
    out = sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(os.path.abspath(__file__)), "corpus")
    os.makedirs(out, exist_ok=True)
    for name, data in SEEDS.items():
        with open(os.path.join(out, name), "wb") as f:
            f.write(data)
    print(f"wrote {len(SEEDS)} seeds to {out}")
