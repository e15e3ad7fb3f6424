"""Starts `train` workers by hand with the environment ddplaunch gives them (RANK, WORLD_SIZE,
MASTER_ADDR, MASTER_PORT, LOCAL_RANK, ...), waits with deadlines, and always cleans up."""
import os
import signal
import socket
import subprocess
import tempfile
import time

BUILD = os.environ.get("DDPLAUNCH_BUILD_DIR", os.path.join(os.path.dirname(__file__), "..", "..", "build"))
TRAIN = os.path.join(BUILD, "bin", "train")

LAUNCHER_VARS = ["RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                 "GROUP_WORLD_SIZE", "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR",
                 "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS",
                 "TORCHELASTIC_RUN_ID", "TORCHELASTIC_USE_AGENT_STORE", "DDPLAUNCH_GENERATION"]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def clean_env():
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS}
    env["OMP_NUM_THREADS"] = "1"
    return env


class Result:
    def __init__(self, rank, returncode, stdout, stderr):
        self.rank, self.returncode, self.stdout, self.stderr = rank, returncode, stdout, stderr

    def __repr__(self):
        return "rank %d rc %s\n--- stdout\n%s--- stderr\n%s" % (
            self.rank, self.returncode, self.stdout[-3000:], self.stderr[-3000:])


class Workers:
    """`world` train processes of one group. Use as a context manager: leaving it kills any
    worker still running (SIGKILL to its process group)."""

    def __init__(self, world, args, restart_count=0, single=False, extra_env=None, rank_env=None,
                 program=None):
        """`extra_env`: added to every worker's environment; `rank_env`: {rank: variables} added to
        that rank's after it; `program`: run instead of `train`."""
        self.dir = tempfile.TemporaryDirectory(prefix="ddp-sdk-workers-")
        port = free_port()
        self.procs = []
        for rank in range(world):
            env = clean_env()
            if not single:
                env.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world),
                            "LOCAL_WORLD_SIZE": str(world), "GROUP_RANK": "0",
                            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                            "TORCHELASTIC_RESTART_COUNT": str(restart_count),
                            "DDPLAUNCH_GENERATION": str(restart_count)})
            env.update(extra_env or {})
            env.update((rank_env or {}).get(rank, {}))
            out = open(os.path.join(self.dir.name, "out%d" % rank), "w+")
            err = open(os.path.join(self.dir.name, "err%d" % rank), "w+")
            proc = subprocess.Popen([program or TRAIN] + list(args), stdout=out, stderr=err, env=env,
                                    start_new_session=True)
            self.procs.append((proc, out, err))

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.kill()
        for _, out, err in self.procs:
            out.close()
            err.close()
        self.dir.cleanup()

    def kill(self):
        for proc, _, _ in self.procs:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                proc.wait()

    def signal_all(self, sig):
        for proc, _, _ in self.procs:
            if proc.poll() is None:
                os.kill(proc.pid, sig)

    def wait(self, timeout=120, grace_after_failure=20):
        """Waits for every worker. When one fails, the rest get `grace_after_failure` s and
        are then killed (what the launcher does). Raises AssertionError on the deadline."""
        deadline = time.monotonic() + timeout
        failed_at = None
        while True:
            codes = [p.poll() for p, _, _ in self.procs]
            if all(c is not None for c in codes):
                break
            now = time.monotonic()
            if failed_at is None and any(c not in (None, 0) for c in codes):
                failed_at = now
            if failed_at is not None and now - failed_at > grace_after_failure:
                self.kill()
                continue
            if now > deadline:
                self.kill()
                raise AssertionError("workers did not finish within %d s:\n%s" % (
                    timeout, "\n".join(repr(r) for r in self.results())))
            time.sleep(0.05)
        return self.results()

    def results(self):
        results = []
        for rank, (proc, out, err) in enumerate(self.procs):
            out.seek(0)
            err.seek(0)
            results.append(Result(rank, proc.poll(), out.read(), err.read()))
        return results


def run(world, args, timeout=120, **kwargs):
    with Workers(world, args, **kwargs) as workers:
        return workers.wait(timeout)


def wait_for(predicate, timeout, what):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.05)
    raise AssertionError("timed out after %d s waiting for %s" % (timeout, what))


def value(output, key):
    """The value of `key=...` in a [train] line."""
    for token in output.split():
        if token.startswith(key + "="):
            return token[len(key) + 1:]
    raise AssertionError("no %s= in output:\n%s" % (key, output))


def read_floats(path):
    import array
    data = array.array("f")
    with open(path, "rb") as f:
        data.frombytes(f.read())
    return data


def read_sample_log(path):
    entries = []
    with open(path) as f:
        for line in f:
            fields = dict(item.split("=", 1) for item in line.split())
            entries.append({"attempt": int(fields["attempt"]), "world": int(fields["world"]),
                            "rank": int(fields["rank"]), "epoch": int(fields["epoch"]),
                            "step": int(fields["step"]),
                            "indices": [int(i) for i in fields["indices"].split(",") if i]})
    return entries


def _crc32c_table():
    table = []
    for i in range(256):
        c = i
        for _ in range(8):
            c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1
        table.append(c)
    return table


_CRC32C = _crc32c_table()


def crc32c(data):
    crc = 0xFFFFFFFF
    table = _CRC32C
    for b in data:
        crc = table[(crc ^ b) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def checkpoint_problem(path):
    """None when `path` is a complete checkpoint file (magic, version 2, payload length and
    CRC-32C as docs/worker-sdk.md describes them), else what is wrong with it."""
    import struct
    with open(path, "rb") as f:
        data = f.read()
    if len(data) < 24:
        return "shorter than the header (%d bytes)" % len(data)
    magic, version, crc, length = struct.unpack("<8sIIQ", data[:24])
    if magic != b"DDPCKPT\0" or version != 2:
        return "bad magic or version"
    if len(data) - 24 != length:
        return "payload is %d bytes, header says %d" % (len(data) - 24, length)
    if crc32c(data[24:]) != crc:
        return "checksum mismatch"
    return None


def checkpoint_scalars(path):
    """{key: value} of a checkpoint's integer, double and byte-string entries (tensors left out),
    read through its index as docs/worker-sdk.md describes it."""
    import struct
    with open(path, "rb") as f:
        data = f.read()
    problem = checkpoint_problem(path)
    assert problem is None, "%s: %s" % (path, problem)
    (index_length,) = struct.unpack_from("<Q", data, 24)
    pos, end = 32, 32 + index_length
    data_start = (end + 63) // 64 * 64
    (count,) = struct.unpack_from("<I", data, pos)
    pos += 4
    values = {}
    for _ in range(count):
        (key_length,) = struct.unpack_from("<I", data, pos)
        key = data[pos + 4:pos + 4 + key_length].decode()
        pos += 4 + key_length
        kind = data[pos]
        pos += 1
        if kind == 0:  # tensor: dtype, ndim, sizes, offset, length
            (ndim,) = struct.unpack_from("<I", data, pos + 1)
            pos += 1 + 4 + 8 * ndim + 16
        elif kind == 1:
            (values[key],) = struct.unpack_from("<q", data, pos)
            pos += 8
        elif kind == 2:
            (values[key],) = struct.unpack_from("<d", data, pos)
            pos += 8
        else:
            offset, length = struct.unpack_from("<QQ", data, pos)
            values[key] = data[data_start + offset:data_start + offset + length]
            pos += 16
    assert pos == end, "%s: the index ends at %d, its length says %d" % (path, pos, end)
    return values


def rename_checkpoint_key(path, old, new):
    """Renames the entry `old` of a checkpoint to `new` (of the same length) and fixes its
    checksum: the file then reads as one that never had `old`."""
    import struct
    assert len(old) == len(new)
    with open(path, "rb") as f:
        data = bytearray(f.read())
    needle = struct.pack("<I", len(old)) + old.encode()
    at = data.find(needle, 32)
    assert at >= 0, "%s has no key %s" % (path, old)
    data[at + 4:at + 4 + len(old)] = new.encode()
    struct.pack_into("<I", data, 12, crc32c(bytes(data[24:])))
    with open(path, "wb") as f:
        f.write(data)
