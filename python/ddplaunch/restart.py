"""In-memory restart for Python DDP programs run by ddplaunch (docs/agent.md, "In-memory restart";
): when a peer fails or a node joins, a healthy worker does not exit. It tears down its
process group, tells its agent the step it holds, waits for the next round's assignment, joins
the new process group and goes on with its model and optimizer as they were; a rank that holds
nothing (a replacement) receives the state from one that does, over the new group, instead of
reading a checkpoint.

    restart = ddplaunch.InMemoryRestart()
    model, optimizer, held = build(), ..., -1       # held: the step they are at (-1: fresh)
    while True:
        try:
            restart.init_process_group("gloo")      # dist.init_process_group, watched
            step, state = restart.agree(held, lambda: {"model": ..., "optimizer": ..., ...})
            # state None: read the newest checkpoint, or start at step 0; a step other than
            # held: load state (a replacement received it)
            ddp = DistributedDataParallel(model)
            ... train, setting `held` after each optimizer step ...
            break
        except Exception as e:
            if not restart.recoverable(e):
                raise
        restart.park(held)                          # outside the handler: the old DDP is freed
    restart.close()

Under another launcher, with in-memory restart off, or with a backend other than Gloo,
`enabled` is False: init_process_group and agree do what a plain program would (agree returns
(-1, None) so that the program reads its checkpoint) and recoverable is always False.

How a blocked collective is ended: Gloo's abort does not interrupt a collective that waits on a
peer (torch 2.15), and destroying the process group does not close its connections while DDP
still holds it. So the sockets that init_process_group opened (the store's and Gloo's pairs,
told apart from the program's own by what was open before the call) are shut down, never
closed, when the agent abandons the round: every collective of this rank fails at once, and so
do the peers' collectives that wait on this rank. A watcher thread reads the agent's word
(`abandoned()`, the progress slot) every 20 ms.
"""

import os
import socket
import sys
import threading
import time

import ddplaunch_standby  # the assignment's decoder and the channel's frames, installed beside this package

from . import abandoned, enabled as _progress_enabled

__all__ = ["InMemoryRestart"]

_WATCH_PERIOD = 0.02               # seconds between looks at the agent's word
_WORD_WAIT = 60.0                  # how long a failed collective waits for the agent's word
_STUCK_DUMP = 2.0                  # seconds after the round's end before a worker not parked dumps its stacks
_STUCK_CPU = 0.04                  # CPU seconds the training thread may use in those 2 s and still count as blocked


def _socket_fds():
    """{fd: inode} of this process's sockets."""
    found = {}
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:
        return found
    for name in names:
        try:
            target = os.readlink("/proc/self/fd/" + name)
        except OSError:
            continue
        if target.startswith("socket:["):
            found[int(name)] = target
    return found


def _socket_copy(fd):
    """A socket object on a duplicate of `fd` (closing it leaves `fd` open), or None when `fd` is
    not a socket."""
    try:
        copy = os.dup(fd)
    except OSError:
        return None
    try:
        return socket.socket(fileno=copy)
    except OSError:
        os.close(copy)
        return None


def _is_connected_tcp(fd):
    s = _socket_copy(fd)
    if s is None:
        return False
    try:
        if s.family not in (socket.AF_INET, socket.AF_INET6) or s.type != socket.SOCK_STREAM:
            return False
        return not s.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN)
    except OSError:
        return False
    finally:
        s.close()


def _thread_cpu(tid):
    """CPU seconds (user + system) thread `tid` of this process has used; None when /proc cannot
    tell."""
    try:
        with open("/proc/self/task/%d/stat" % tid) as f:
            fields = f.read().rsplit(")", 1)[1].split()
        # After the command's closing parenthesis: state is field 3, utime 14 and stime 15.
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, TypeError, ValueError, IndexError):
        return None


def _looks_like_communication_error(error):
    """A Gloo or store failure (a peer gone, a connection reset), as torch raises them: what a
    failed peer causes. A bug of the program's own is not waited for."""
    import torch.distributed as dist

    dist_error = getattr(dist, "DistError", None)
    if dist_error is not None and isinstance(error, dist_error):
        return True
    if not isinstance(error, RuntimeError):
        return False
    text = str(error)
    return any(k in text for k in ("gloo", "Gloo", "Connection", "connection", "Socket", "socket", "timed out",
                                   "Timed out", "Broken pipe"))


class InMemoryRestart:
    def __init__(self):
        self._fd = None
        self._sockets = {}          # this round's sockets ({fd: "socket:[inode]"}), shut when it is abandoned
        self._lock = threading.Lock()
        self._watcher = None
        self._said_restartable = False
        self._parking = False       # between park() and the next init_process_group
        self._round = 0             # init_process_group calls so far
        self._round_tid = None      # the thread that called init_process_group last
        self._dump_armed = False
        self.parked = 0             # rounds continued after parking
        self.plain_init = None      # torch's init_process_group, when the name is taken (ddplaunch.restartable)
        text = os.environ.get("DDPLAUNCH_WORKER_FD", "")
        # The agent's word comes through the progress slot: without it nothing could say park.
        if text.isdigit() and int(text) >= 3 and _progress_enabled():
            fd = int(text)
            s = _socket_copy(fd)
            ok = s is not None and s.family == socket.AF_UNIX and s.type == socket.SOCK_STREAM
            if s is not None:
                s.close()
            if ok:
                os.set_inheritable(fd, False)
                self._fd = fd

    @property
    def enabled(self):
        """True when this worker can park: ddplaunch gave it a channel and its backend is Gloo."""
        return self._fd is not None

    def _say_restartable(self, value):
        try:
            ddplaunch_standby.send_frame(self._fd, {"type": "restartable", "value": bool(value)})
        except OSError:
            self._fd = None  # the agent is gone: nothing to park for
            return
        self._said_restartable = bool(value)

    def init_process_group(self, backend="gloo", **kwargs):
        """torch.distributed.init_process_group(backend, **kwargs), recording the sockets it
        opens; a rank other than 0 first waits for rank 0's store (5 ms probes) instead of
        torch's ~0.4 s sleep after a refused connection."""
        import torch.distributed as dist

        if self._fd is not None and str(backend).lower() != "gloo":
            ddplaunch_standby.say("in-memory restart needs the Gloo backend (not %s): this worker is "
                                  "stopped and started again at a restart" % backend)
            self._say_restartable(False)
            self._fd = None
        init = self.plain_init or dist.init_process_group
        if self._fd is None:
            init(backend, **kwargs)
            return
        ddplaunch_standby._probe_before_env_rendezvous()
        before = _socket_fds()
        init(backend, **kwargs)
        after = _socket_fds()
        mine = {fd: inode for fd, inode in after.items() if before.get(fd) != inode and _is_connected_tcp(fd)}
        with self._lock:
            self._sockets = mine
            self._parking = False
            self._round += 1
            self._round_tid = threading.get_native_id()  # the thread that trains, and would park
        if not self._said_restartable:
            self._say_restartable(True)
        if self._watcher is None and self._fd is not None:
            self._watcher = threading.Thread(target=self._watch, name="ddplaunch-restart-watch", daemon=True)
            self._watcher.start()

    def _shut_down_round(self):
        with self._lock:
            fds, self._sockets = self._sockets, {}
        for fd, inode in fds.items():
            # Gloo closes a pair's socket once it failed, and the number may since name another
            # file of the program's: only the very socket init_process_group opened is shut.
            try:
                if os.readlink("/proc/self/fd/%d" % fd) != inode:
                    continue
            except OSError:
                continue
            s = _socket_copy(fd)
            if s is None:
                continue
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            finally:
                s.close()

    def _watch(self):
        import faulthandler

        stuck_check = None  # (when, the training thread's CPU seconds at the shutdown, round): a park overdue
        while True:
            time.sleep(_WATCH_PERIOD)
            if self._sockets and abandoned():
                self._shut_down_round()
                # A worker that has not parked 2 s later is stuck where the shut sockets do not
                # reach: its threads' stacks go to stderr (faulthandler's own thread, no GIL
                # needed), before the agent's park deadline stops it. park() disarms it.
                with self._lock:
                    if not self._parking:
                        faulthandler.dump_traceback_later(_STUCK_DUMP, exit=False)
                        self._dump_armed = True
                        stuck_check = (time.monotonic() + _STUCK_DUMP, _thread_cpu(self._round_tid), self._round)
            elif stuck_check is not None and (self._parking or self._fd is None or stuck_check[2] != self._round):
                stuck_check = None
            elif stuck_check is not None and time.monotonic() >= stuck_check[0]:
                _, cpu_then, round_then = stuck_check
                stuck_check = None
                cpu_now = _thread_cpu(self._round_tid)
                # Unknown CPU time (no /proc) is not taken for "blocked": the park deadline stays.
                if cpu_then is not None and cpu_now is not None and cpu_now - cpu_then < _STUCK_CPU:
                    self._give_up_parking(round_then)

    def _give_up_parking(self, round_then):
        """Every connection of the abandoned round `round_then` is shut, yet the training thread still
        waits, using no CPU: a Gloo collective can wait on a buffer that no closed pair signals,
        until the group's timeout (30 min), and nothing in this process ends that wait. Told that
        this worker is no longer restartable, the agent stops it now, and the next round gives
        its rank to a standby or a fresh process (which receives the state from a survivor)
        instead of waiting for the park deadline."""
        with self._lock:
            if self._parking or self._fd is None or self._round != round_then:
                return
            ddplaunch_standby.say("still in a collective %.0f s after the round was abandoned, with every "
                                  "connection of the round shut and no CPU used: this process cannot park; "
                                  "a fresh one takes its rank" % _STUCK_DUMP)
            self._say_restartable(False)

    def recoverable(self, error):
        """Whether `error` ended this round because the agent abandoned it (a peer failed, a node
        joined): then park(). A communication error that comes before the agent's word waits for
        it (up to 60 s); any other error, or no in-memory restart, is the program's own: False."""
        if self._fd is None or not self._said_restartable:
            return False
        if abandoned():
            return True
        if not _looks_like_communication_error(error):
            return False
        deadline = time.monotonic() + _WORD_WAIT
        while time.monotonic() < deadline:
            if abandoned():
                return True
            time.sleep(0.005)
        return False

    def park(self, step):
        """Leaves the round (its process group destroyed, its connections shut down), tells the
        agent this worker holds its state at `step` (-1: none), and waits for the next round's
        assignment: its environment, working directory, stdout and stderr replace this
        process's. Returns then; the caller calls init_process_group again. When the agent ends
        the job instead, this process ends (SIGTERM, or exit 0 when the channel closes)."""
        import faulthandler
        import torch.distributed as dist

        with self._lock:
            self._parking = True
            if self._dump_armed:
                faulthandler.cancel_dump_traceback_later()
                self._dump_armed = False
        self._shut_down_round()
        try:
            if dist.is_initialized():
                dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - the group is broken; what is left of it is let go
            pass
        sys.stdout.flush()
        sys.stderr.flush()
        step = max(-1, min(int(step), (1 << 53) - 1))
        try:
            ddplaunch_standby.send_frame(self._fd, {"type": "parked", "step": step})
            env, cwd, out_fd, err_fd = ddplaunch_standby.receive(self._fd, keep_open=True)
        except (OSError, ddplaunch_standby.NoAssignment):
            ddplaunch_standby.say("the agent closed this worker's channel while it was parked; exiting")
            os._exit(0)
        except ddplaunch_standby.BadAssignment as e:
            ddplaunch_standby.say("bad assignment from the agent while parked: %s; exiting" % e)
            os._exit(1)
        try:
            ddplaunch_standby.become(env, cwd, out_fd, err_fd)
        except OSError as e:
            ddplaunch_standby.say("cannot enter the working directory %s: %s; exiting" % (cwd, e))
            os._exit(1)
        self.parked += 1

    def agree(self, step, state):
        """After init_process_group: the ranks agree on the newest step any of them holds.
        Returns (step, state): (-1, None) when no rank holds one (read the checkpoint); this
        rank's own (step, state()) when it holds the newest; else the newest step and the state
        the lowest rank holding it sent (torch.save bytes, broadcast over the new group).
        `state` is a callable returning the picklable state, called only where needed."""
        import torch
        import torch.distributed as dist

        if not dist.is_initialized():
            return (step, state()) if step >= 0 else (-1, None)
        rank, world = dist.get_rank(), dist.get_world_size()
        span = torch.tensor([step, -step], dtype=torch.int64)
        dist.all_reduce(span, op=dist.ReduceOp.MAX)
        newest, oldest = int(span[0]), -int(span[1])
        if newest < 0:
            return -1, None
        if oldest == newest:
            return step, state()
        holder = torch.tensor([rank if step == newest else world], dtype=torch.int64)
        dist.all_reduce(holder, op=dist.ReduceOp.MIN)
        src = int(holder[0])
        import io

        held = state() if step == newest else None
        if rank == src:
            buffer = io.BytesIO()
            torch.save(held, buffer)
            data = torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)
            size = torch.tensor([data.numel()], dtype=torch.int64)
        else:
            size = torch.zeros(1, dtype=torch.int64)
        dist.broadcast(size, src)
        if rank != src:
            data = torch.empty(int(size[0]), dtype=torch.uint8)
        dist.broadcast(data, src)
        if step == newest:
            return step, held
        received = torch.load(io.BytesIO(data.numpy().tobytes()), map_location="cpu", weights_only=False)
        ddplaunch_standby.say("received the state rank %d sent (step %d, %d bytes), no checkpoint read"
                              % (src, newest, int(size[0])))
        return newest, received

    def close(self):
        """Training is over: at a restart from now on, stop this worker as any other."""
        if self._fd is not None and self._said_restartable:
            self._say_restartable(False)
