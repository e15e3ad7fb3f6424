"""A fake worker SDK program for the in-memory restart tests (test_in_memory_restart.py): it
speaks the worker channel (contracts/worker_channel.h) without torch. Run by ddplaunch --no_python.

Each time it starts work (cold, or from an assignment) it appends a record to
$OUT_DIR/records.jsonl: pid, RANK, TORCHELASTIC_RESTART_COUNT, DDPLAUNCH_WORKER_FD, how it
started. Then it says restartable=true and writes ready_<restart>_<rank>. What it does next in
round 0, by $INMEM_MODE_<rank> (default "park"; later rounds park):
  park        waits for its abandoned word, says parked, waits for its assignment on the channel
              and applies it (environment, stdout/stderr), then starts again
  never_park  says restartable, then never parks (waits to be stopped)
  garbage     writes bytes that are no frame on its channel, then waits like park would
Rank $INMEM_FAIL_RANK exits 1 in round 0 once every rank of that round is ready (after creating
$INMEM_HOLD, when set). In round $INMEM_FINISH_AT (default 1) every rank exits 0 once all are
ready, and so in any round of $INMEM_FINISH_WORLD workers or more. Every wait has a deadline
(exit 3).
"""

import json
import os
import socket
import struct
import sys
import time

sys.path.insert(0, os.environ["INMEM_PYTHON_DIR"])
import ddplaunch  # noqa: E402

OUT = os.environ["OUT_DIR"]
DEADLINE = 120


def wait(condition):
    end = time.monotonic() + DEADLINE
    while not condition():
        if time.monotonic() > end:
            sys.exit(3)
        time.sleep(0.01)


def frame(obj):
    payload = json.dumps(obj).encode()
    return struct.pack("<4sII", b"DDPW", 1, len(payload)) + payload


def recv_exact(sock, n):
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            sys.exit(0)  # the agent is gone
        data += chunk
    return data


def receive_assignment(sock):
    """The DDPS assignment: header with two descriptors attached, then the JSON payload."""
    data, ancillary, _, _ = sock.recvmsg(12, socket.CMSG_SPACE(2 * 4))
    fds = []
    for level, kind, raw in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds += list(struct.unpack("%di" % (len(raw) // 4), raw[:len(raw) - len(raw) % 4]))
    if not data:
        sys.exit(0)
    data += recv_exact(sock, 12 - len(data))
    magic, version, length = struct.unpack("<4sII", data)
    assert magic == b"DDPS" and version == 1, data
    assignment = json.loads(recv_exact(sock, length))
    return assignment, fds


def main():
    fd = int(os.environ["DDPLAUNCH_WORKER_FD"])
    sock = socket.socket(fileno=fd)
    how = "cold"
    while True:
        rank = int(os.environ["RANK"])
        world = int(os.environ["WORLD_SIZE"])
        restart = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
        mode = os.environ.get("INMEM_MODE_%d" % rank, "park") if restart == 0 else "park"
        with open(os.path.join(OUT, "records.jsonl"), "a") as f:
            f.write(json.dumps({"pid": os.getpid(), "rank": rank, "restart": restart, "how": how,
                                "world": world, "worker_fd": os.environ.get("DDPLAUNCH_WORKER_FD"),
                                "generation": os.environ.get("DDPLAUNCH_GENERATION")}) + "\n")
        sock.sendall(frame({"type": "restartable", "value": True}))
        if mode == "garbage":
            sock.sendall(b"GET / HTTP/1.1\r\n\r\n")
        open(os.path.join(OUT, "ready_%d_%d" % (restart, rank)), "w").close()

        def all_ready():
            return all(os.path.exists(os.path.join(OUT, "ready_%d_%d" % (restart, r))) for r in range(world))

        if rank == int(os.environ.get("INMEM_FAIL_RANK", "-1")) and restart == 0:
            wait(all_ready)
            if os.environ.get("INMEM_HOLD"):
                open(os.environ["INMEM_HOLD"], "w").close()
            sys.exit(1)
        if restart >= int(os.environ.get("INMEM_FINISH_AT", "1")) or \
                world >= int(os.environ.get("INMEM_FINISH_WORLD", "1000000")):
            wait(all_ready)
            sock.sendall(frame({"type": "restartable", "value": False}))
            return 0
        if mode == "never_park":
            wait(lambda: False)
        wait(ddplaunch.abandoned)
        sock.sendall(frame({"type": "parked", "step": 100 * (restart + 1)}))
        open(os.path.join(OUT, "parked_%d" % os.getpid()), "w").close()
        assignment, fds = receive_assignment(sock)
        os.environ.clear()
        os.environ.update(assignment["env"])
        os.chdir(assignment["cwd"])
        sys.stdout.flush()
        os.dup2(fds[0], 1)
        os.dup2(fds[1], 2)
        for extra in fds:
            os.close(extra)
        ddplaunch._open()  # the progress slot of the new round
        how = "in_memory"


if __name__ == "__main__":
    sys.exit(main())
