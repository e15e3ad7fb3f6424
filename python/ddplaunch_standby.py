"""A standby worker of ddplaunch (docs/agent.md, "Standby workers").

ddplaunch starts this file as

    PYTHON -u ddplaunch_standby.py MODE PRELOAD PROGRAM [ARGS...]

(MODE: script, module or run_path; PRELOAD: comma-separated module names, may be empty) with
DDPLAUNCH_STANDBY_FD naming one end of a Unix socket, while the job's workers run. It imports
torch and PRELOAD, then waits for its assignment: the whole environment and working directory
of a worker, and its stdout and stderr (contracts/standby_assignment.h has the format). It
applies them and runs PROGRAM as `PYTHON -u PROGRAM ARGS` (or `-m PROGRAM`) would have. Nothing
of the user's runs before the assignment; an assignment that is not valid, or a socket closed
before one came (the agent is stopping), ends the standby without running anything, exit code 0
when the agent closed the socket and 1 when it sent something wrong.

It imports nothing of the `ddplaunch` package before its assignment: that module reads the
worker's progress slot from the environment when it is first imported.
"""

import os
import socket
import struct
import sys

# The contracts with the agent, as contracts/*.h in the ddplaunch sources define them (the Python
# side's one copy; tests/contracts/test_fixtures.py holds it to contracts/fixtures/).
FRAME_HEADER = struct.Struct("<4sII")  # magic, version, payload length (contracts/frame_header.h)
ASSIGNMENT_MAGIC = b"DDPS"             # contracts/standby_assignment.h
ASSIGNMENT_VERSION = 1
MAX_ASSIGNMENT_PAYLOAD = 4 << 20
MAX_ASSIGNMENT_DEPTH = 2               # an object of objects
WORKER_MAGIC = b"DDPW"                 # contracts/worker_channel.h
WORKER_VERSION = 1


def say(message):
    """One line of ddplaunch's Python helpers inside a worker, on stderr: `ddplaunch (rank R): ...`
    (the agent's own lines are `ddplaunch: ...`)."""
    sys.stderr.write("ddplaunch (rank %s): %s\n" % (os.environ.get("RANK", "?"), message))
    sys.stderr.flush()


class BadAssignment(Exception):
    """The agent's message is not a valid assignment."""


class NoAssignment(Exception):
    """The socket closed before an assignment came: the agent is stopping."""


def _depth(payload, limit):
    """The nesting depth of JSON arrays and objects in `payload` (bytes), strings skipped;
    stops counting past `limit` + 1 (contracts/json_depth.h). Checked before json.loads, which
    recurses."""
    depth = deepest = 0
    in_string = escaped = False
    for byte in payload:
        if in_string:
            if escaped:
                escaped = False
            elif byte == 0x5C:  # backslash
                escaped = True
            elif byte == 0x22:  # quote
                in_string = False
        elif byte == 0x22:
            in_string = True
        elif byte in (0x5B, 0x7B):  # [ {
            depth += 1
            deepest = max(deepest, depth)
            if deepest > limit:
                return deepest
        elif byte in (0x5D, 0x7D):
            depth -= 1
    return deepest


def decode(message):
    """Decodes a whole message (header and payload) into (env, cwd); raises BadAssignment."""
    import json

    header = FRAME_HEADER.size
    if len(message) < header:
        raise BadAssignment("short header: %d of %d bytes" % (len(message), header))
    magic, version, length = FRAME_HEADER.unpack_from(message)
    if magic != ASSIGNMENT_MAGIC:
        raise BadAssignment("bad magic (not a ddplaunch standby assignment)")
    if version != ASSIGNMENT_VERSION:
        raise BadAssignment("version %d, expected %d (ddplaunch and its Python bootstrap come from "
                            "different installs)" % (version, ASSIGNMENT_VERSION))
    if length < 2 or length > MAX_ASSIGNMENT_PAYLOAD:
        raise BadAssignment("payload length %d outside 2..%d" % (length, MAX_ASSIGNMENT_PAYLOAD))
    if len(message) - header != length:
        raise BadAssignment("payload of %d bytes, header says %d" % (len(message) - header, length))
    if _depth(message[header:], MAX_ASSIGNMENT_DEPTH) > MAX_ASSIGNMENT_DEPTH:
        raise BadAssignment("the payload is nested deeper than an object of objects")
    try:
        doc = json.loads(message[header:].decode("utf-8"))
    except (ValueError, RecursionError) as e:
        raise BadAssignment("the payload is not JSON: %s" % e)
    if not isinstance(doc, dict):
        raise BadAssignment("the payload is not a JSON object")
    if set(doc) != {"env", "cwd"}:
        raise BadAssignment("the payload must hold exactly the keys env and cwd")
    env, cwd = doc["env"], doc["cwd"]
    if not isinstance(env, dict):
        raise BadAssignment("env is not an object")
    if not isinstance(cwd, str) or not cwd.startswith("/") or "\0" in cwd:
        raise BadAssignment("cwd is not an absolute path")
    for name, value in env.items():
        if not name:
            raise BadAssignment("an empty variable name")
        if "=" in name:
            raise BadAssignment("variable name %r holds '='" % name)
        if "\0" in name:
            raise BadAssignment("a variable name holds a NUL byte")
        if not isinstance(value, str):
            raise BadAssignment("the value of %s is not a string" % name)
        if "\0" in value:
            raise BadAssignment("the value of %s holds a NUL byte" % name)
    return env, cwd


def encode_frame(message):
    """One frame of the worker channel (contracts/worker_channel.h): the 12-byte header ("DDPW",
    version 1, the length) and `message` as compact JSON with its keys sorted, the bytes the
    worker SDK's encoder writes for the same message."""
    import json

    payload = json.dumps(message, separators=(",", ":"), sort_keys=True).encode()
    return FRAME_HEADER.pack(WORKER_MAGIC, WORKER_VERSION, len(payload)) + payload


def send_frame(fd, message):
    """Writes encode_frame(message) to `fd`. Raises OSError."""
    os.write(fd, encode_frame(message))


def _say_ready(fd):
    """Tells the agent this standby has imported what it preloads (a `standby_ready` frame): an
    agent that starts joins its job only then. An agent that has gone shows when the assignment
    is read."""
    try:
        send_frame(fd, {"type": "standby_ready"})
    except OSError:
        pass


def _close_fds(fds):
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass


def become(env, cwd, out_fd, err_fd):
    """Makes this process the assignment's worker: `out_fd` and `err_fd` become descriptors 1 and
    2 (and are closed), `env` the whole environment, `cwd` the working directory (OSError when it
    cannot be entered)."""
    os.dup2(out_fd, 1)
    os.dup2(err_fd, 2)
    _close_fds({out_fd, err_fd} - {1, 2})
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)


def receive(fd, keep_open=False):
    """Reads the assignment from the socket `fd` (closed afterwards unless `keep_open`: the
    worker channel of in-memory restart): (env, cwd, stdout_fd, stderr_fd). Raises NoAssignment
    or BadAssignment (any descriptors received are closed)."""
    try:
        sock = socket.socket(fileno=fd)
    except OSError as e:
        raise BadAssignment("descriptor %d is not a socket: %s" % (fd, e))
    fds = []
    try:
        if sock.type != socket.SOCK_STREAM or sock.family != socket.AF_UNIX:
            raise BadAssignment("descriptor %d is not a Unix stream socket" % fd)
        data = b""
        while len(data) < FRAME_HEADER.size:
            try:
                chunk, got, _, _ = socket.recv_fds(sock, FRAME_HEADER.size - len(data), 4)
            except ConnectionResetError:
                # The agent closed its end without reading our standby_ready frame: a reset
                # where an end of file would be.
                if not data and not fds:
                    raise NoAssignment()
                raise BadAssignment("the socket was reset after %d of %d header bytes" %
                                    (len(data), FRAME_HEADER.size))
            fds.extend(got)
            if not chunk:
                if not data and not fds:
                    raise NoAssignment()
                raise BadAssignment("short header: %d of %d bytes" % (len(data), FRAME_HEADER.size))
            data += chunk
        _, _, length = FRAME_HEADER.unpack(data)
        if length > MAX_ASSIGNMENT_PAYLOAD:
            raise BadAssignment("payload length %d over the limit of %d" % (length, MAX_ASSIGNMENT_PAYLOAD))
        parts = [data]
        left = length
        while left > 0:
            try:
                chunk = sock.recv(min(left, 1 << 20))
            except ConnectionResetError:
                chunk = b""  # reported below as a payload cut short
            if not chunk:
                raise BadAssignment("the payload ends after %d of %d bytes" % (length - left, length))
            parts.append(chunk)
            left -= len(chunk)
        env, cwd = decode(b"".join(parts))
        if len(fds) != 2:
            raise BadAssignment("%d descriptors came with the assignment, expected 2 (stdout, stderr)" % len(fds))
        return env, cwd, fds[0], fds[1]
    except BaseException:
        _close_fds(fds)
        raise
    finally:
        if keep_open:
            sock.detach()
        else:
            sock.close()


# What a torch 2.x training script imports lazily on its way to its first step, loaded with torch
# so that a worker made from a standby does not pay for it either: every optimizer's constructor
# imports torch._dynamo (1.8 s of the 1.9 s scripts/elastic_ddp.py spends between `import torch`
# and its first step on a 2-core machine; ~80 MiB of the standby's memory), init_process_group
# and DDP torch.distributed and torch.nn.parallel. Failures are silent, as for torch: torch 1.x
# has no _dynamo.
WARM_MODULES = ["torch.distributed", "torch.nn.parallel", "torch._dynamo"]


def _preload(modules):
    """Imports torch, WARM_MODULES and `modules`. Returns the warnings they raised (shown once the
    worker has its stderr, as they would have been in a cold worker's) and what of `modules`
    could not be imported, as lines for the worker (torch or a warm module missing is not worth
    one: the script says so if it needs it)."""
    import importlib
    import warnings

    problems = []
    with warnings.catch_warnings(record=True) as caught:
        warm = [m for m in WARM_MODULES if m not in modules]
        for name in ["torch"] + warm + modules:
            if name in warm and "torch" not in sys.modules:
                continue  # no torch here: nothing of it to warm
            try:
                importlib.import_module(name)
            except BaseException as e:  # noqa: B902 (a module may raise anything, SystemExit included)
                if name in modules:
                    problems.append("ddplaunch standby: --preload: cannot import %s: %s: %s" %
                                    (name, type(e).__name__, e))
    return list(caught), problems


def _master_store_listening(addr, port, deadline):
    """Probes ADDR:PORT every 5 ms until it accepts a connection (closed at once, nothing sent) or
    `deadline` (time.monotonic()) passes."""
    import time

    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        try:
            socket.create_connection((addr, port), timeout=min(left, 1.0)).close()
            return True
        except OSError:
            time.sleep(0.005)


def _probe_before_env_rendezvous():
    """A worker made from a standby starts the moment its round does, so a rank other than 0 asks
    rank 0's TCPStore for a connection before rank 0 listens; torch's client then sleeps ~0.4 s
    (torch 2.15) before it tries again, on every restart. Wrapped here, the env:// rendezvous that
    init_process_group uses by default first waits for MASTER_ADDR:MASTER_PORT to accept (5 ms
    probes, at most the process group's timeout), then goes on as torch's own. Nothing changes
    for rank 0, another init method, or a torch without this handler table."""
    rendezvous = sys.modules.get("torch.distributed.rendezvous")
    handlers = getattr(rendezvous, "_rendezvous_handlers", None)
    original = handlers.get("env") if isinstance(handlers, dict) else None
    if original is None or getattr(original, "ddplaunch_probe", False):
        return

    def env_rendezvous(url, **kwargs):
        import time
        from urllib.parse import parse_qs, urlparse

        try:
            query = parse_qs(urlparse(url).query)
            rank = int(query["rank"][0] if "rank" in query else os.environ.get("RANK", "0"))
            addr, port = os.environ.get("MASTER_ADDR", ""), int(os.environ.get("MASTER_PORT", "0"))
            timeout = kwargs.get("timeout")
            seconds = timeout.total_seconds() if hasattr(timeout, "total_seconds") else 1800.0
        except (ValueError, TypeError, IndexError):
            rank, addr, port, seconds = 0, "", 0, 0  # torch's own handler says what is wrong
        if rank != 0 and addr and 0 < port < 65536 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
            _master_store_listening(addr, port, time.monotonic() + seconds)
        yield from original(url, **kwargs)

    env_rendezvous.ddplaunch_probe = True
    handlers["env"] = env_rendezvous


def _show_warnings(caught):
    import warnings

    for w in caught:
        warnings.showwarning(w.message, w.category, w.filename, w.lineno, None, w.line)


def _user_traceback(tb):
    """The traceback from the user's first frame on (without this file's and runpy's)."""
    own = globals()
    while tb is not None:
        frame_globals = tb.tb_frame.f_globals
        if frame_globals is not own and frame_globals.get("__name__") != "runpy":
            break
        tb = tb.tb_next
    return tb


def _run(mode, program, args):
    import runpy

    if mode == "module":
        sys.argv = [program] + args  # runpy sets argv[0] to the module's file, as -m does
        sys.path[0] = os.getcwd()
        runpy._run_module_as_main(program, alter_argv=True)
    elif mode == "run_path":
        # torchrun --run_path: `python -u -c <runpy.run_path(PROGRAM)> PROGRAM ARGS`.
        sys.argv = [program] + args
        sys.path[0] = ""
        runpy.run_path(program, run_name="__main__")
    else:
        _run_script(program, args)


def _run_script(program, args):
    """`python -u PROGRAM ARGS`: sys.argv[0] as given, __main__ a fresh module whose __file__ is
    absolute (Python >= 3.9), sys.path[0] the script's directory with links resolved. A directory
    or zip file with a __main__.py goes through runpy.run_path (argv[0] then absolute)."""
    import builtins
    import importlib.machinery
    import io
    import types

    path = os.path.join(os.getcwd(), program)
    sys.argv = [program] + args
    sys.path[0] = os.path.dirname(os.path.realpath(path))
    if not os.path.isfile(path) or path.endswith(".zip"):
        import runpy

        sys.path[0] = path
        runpy.run_path(path, run_name="__main__")
        return
    with io.open_code(path) as f:
        source = f.read()
    main = types.ModuleType("__main__")
    main.__file__ = path
    main.__builtins__ = builtins
    main.__loader__ = importlib.machinery.SourceFileLoader("__main__", path)
    main.__spec__ = None
    main.__package__ = None
    main.__cached__ = None
    main.__annotations__ = {}
    sys.modules["__main__"] = main
    exec(compile(source, path, "exec"), main.__dict__)


def main():
    if len(sys.argv) < 4 or sys.argv[1] not in ("script", "module", "run_path"):
        sys.stderr.write("ddplaunch standby: usage: ddplaunch_standby.py script|module|run_path PRELOAD PROGRAM "
                         "[ARGS...] (started by ddplaunch --standby)\n")
        return 2
    mode, preload, program, args = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4:]
    fd_text = os.environ.get("DDPLAUNCH_STANDBY_FD", "")
    if not fd_text.isdigit() or int(fd_text) < 3:
        sys.stderr.write("ddplaunch standby: DDPLAUNCH_STANDBY_FD=%r is not a descriptor number >= 3; "
                         "not running %s\n" % (fd_text, program))
        return 1
    import ddplaunch_autostart  # beside this file; before torch is imported (python/sitecustomize.py's work)
    ddplaunch_autostart.install()
    caught, problems = _preload([m for m in preload.split(",") if m])
    _say_ready(int(fd_text))
    try:
        # With in-memory restart the agent keeps this socket as the worker's channel
        # (DDPLAUNCH_WORKER_FD names it in the assignment; python/ddplaunch/restart.py).
        fd = int(fd_text)
        env, cwd, out_fd, err_fd = receive(fd, keep_open=True)
        if env.get("DDPLAUNCH_WORKER_FD") == fd_text:
            os.set_inheritable(fd, False)
        else:
            os.close(fd)
    except NoAssignment:
        # The agent is stopping, or gave up on this standby: not an error of the standby's.
        sys.stderr.write("ddplaunch standby (pid %d): the agent closed the socket before an assignment came; "
                         "exiting without running %s\n" % (os.getpid(), program))
        return 0
    except BadAssignment as e:
        sys.stderr.write("ddplaunch standby (pid %d): bad assignment from the agent: %s; exiting without running "
                         "%s\n" % (os.getpid(), e, program))
        return 1
    # From here on this process is the worker, as if just started.
    try:
        become(env, cwd, out_fd, err_fd)
    except OSError as e:
        sys.stderr.write("ddplaunch standby: cannot enter the working directory %s: %s\n" % (cwd, e))
        return 1
    if env.get("PYTHONFAULTHANDLER"):
        import faulthandler
        faulthandler.enable()
    _show_warnings(caught)
    for line in problems:
        sys.stderr.write(line + "\n")
    _probe_before_env_rendezvous()
    try:
        _run(mode, program, args)
    except (SystemExit, KeyboardInterrupt):
        raise  # exit code, message, or death by SIGINT: as the interpreter does for a script
    except BaseException as e:  # noqa: B902
        # An uncaught exception: its traceback through sys.excepthook, exit code 1.
        # The default hook prints the exception's own traceback: it must hold the trimmed one.
        tb = _user_traceback(e.__traceback__)
        sys.excepthook(type(e), e.with_traceback(tb), tb)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
