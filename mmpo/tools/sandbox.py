"""Tool calls in a sandbox: a worker process that forks one limited child per call.

Why a worker and a child per call: the trainer holds CUDA, OpenMP and tokenizer threads, so it never
forks (a child forked from a threaded process can deadlock); it starts one small worker interpreter
(``subprocess``, ``python -c``, talking over a socket pair, like the reward worker of
:mod:`mmpo.rewards.worker`) that imports no torch. The worker forks a fresh child for each call
(a few milliseconds), so the limits below hold per call and nothing one call does survives into the next.

What each call's child gets (:class:`SandboxLimits`):

- a wall-clock deadline: a child still running after ``timeout_s`` is killed with its whole process
  group (``killpg(SIGKILL)``) and reaped; the call is a ``timeout``;
- ``RLIMIT_CPU`` (``cpu_time_s``; the kernel kills it at the limit: a ``timeout``), ``RLIMIT_AS``
  (``memory_mb``: an allocation past it raises ``MemoryError`` in the tool: an ``error``),
  ``RLIMIT_FSIZE`` (``max_file_bytes`` per written file) and no core dumps;
- a private temporary working directory, removed after the call; stdin, stdout and stderr on
  ``/dev/null`` (printing megabytes floods nothing);
- its own session and process group (``setsid``): whatever it forked is killed with it when the call ends;
  the worker is a child subreaper (``PR_SET_CHILD_SUBREAPER``), so orphans of a call are reaped, not left
  as zombies; every child and the worker die with their parent (``PR_SET_PDEATHSIG``);
- a Python audit hook (``sys.addaudithook``, irremovable in that child) that refuses: opening a file for
  writing, creating, removing, renaming or changing anything outside the working directory; creating a
  socket (no network) unless ``allow_network``; starting processes (``fork``, ``subprocess``,
  ``os.system``, ``exec``, ``posix_spawn``) unless ``allow_subprocess``;
- an output limit: a result longer than ``max_output_chars`` is an ``error`` ("output too large"), and
  the worker stops reading a child's pipe past a hard cap (the child is killed).

What it does not guarantee: the audit hook and the Python tool's restrictions
(:mod:`mmpo.tools.python_exec`) are Python-level. Native code (a C extension, ``ctypes``) can bypass
them, reading files is allowed, and the process runs as the trainer's user, with its file-system
permissions, in the same network namespace. It contains mistakes and runaway code from a policy, not a
determined attacker; for hostile code run the trainer in a container or VM without network.
"""

from __future__ import annotations

import atexit
import errno
import json
import logging
import os
import pickle
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from multiprocessing.connection import Connection
from typing import Any, Callable

logger = logging.getLogger(__name__)

WORKER_START_TIMEOUT_S = 120.0
"""Deadline for a new worker to start, and for a batch's tool files to load."""
READ_CAP_FACTOR = 4
"""The worker reads at most this many times ``max_output_chars`` bytes (+ 4 KiB) from a child's pipe."""
POLL_INTERVAL_S = 0.02


@dataclass(frozen=True)
class SandboxLimits:
    """Per-call limits of the sandbox (see the module docstring for what each does)."""

    timeout_s: float = 10.0
    """Wall-clock deadline of one call, seconds."""
    cpu_time_s: int = 5
    """CPU seconds one call may use (``RLIMIT_CPU``)."""
    memory_mb: int = 1024
    """Address-space limit of a call's process, MiB (``RLIMIT_AS``)."""
    max_output_chars: int = 4000
    """Longest result text returned to the model; longer is an error."""
    max_file_bytes: int = 16 * 2**20
    """Largest file a call may write (``RLIMIT_FSIZE``)."""
    max_parallel: int = 8
    """Calls running at once."""
    allow_network: bool = False
    """Let tools create sockets."""
    allow_subprocess: bool = False
    """Let tools fork or start processes (they are still killed with the call's process group)."""

    def __post_init__(self) -> None:
        for name in ("timeout_s", "cpu_time_s", "memory_mb", "max_output_chars", "max_file_bytes", "max_parallel"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"SandboxLimits.{name} must be a positive number, got {value!r}")


@dataclass(frozen=True)
class ToolOutcome:
    """The result of one call: ``status`` ``ok`` (``text`` is the tool's output), ``error`` or ``timeout``
    (``text`` says what happened, shortly)."""

    status: str
    text: str

    @property
    def ok(self) -> bool:
        return self.status == "ok"


class SandboxUnavailable(RuntimeError):
    """No worker process could be started."""


# ------------------------------------------------------------------------------------------ in the child

_PROCESS_EVENTS = ("os.fork", "os.forkpty", "os.system", "os.exec", "os.posix_spawn", "os.spawn", "subprocess.Popen",
                   "os.startfile", "pty.spawn")
_PATH_EVENTS = ("os.remove", "os.rename", "os.rmdir", "os.mkdir", "os.chmod", "os.chown", "os.link", "os.symlink",
                "os.truncate", "os.utime", "shutil.rmtree", "shutil.move", "shutil.copyfile", "shutil.copytree",
                "os.chdir", "os.chroot", "os.mkfifo", "os.mknod")
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND


def _inside(path: Any, root: str) -> bool:
    if isinstance(path, int):
        return True  # an already-open descriptor: its opening was checked
    if isinstance(path, bytes):
        path = os.fsdecode(path)
    resolved = os.path.realpath(os.path.join(root, os.fspath(path)))
    return resolved == root or resolved.startswith(root + os.sep)


def _audit_hook(root: str, limits: SandboxLimits) -> Callable[[str, tuple], None]:
    def hook(event: str, args: tuple) -> None:
        if event == "open":
            path, mode, flags = (tuple(args) + (None, None, None))[:3]
            writes = (isinstance(mode, str) and any(c in mode for c in "wax+")) or (
                isinstance(flags, int) and bool(flags & _WRITE_FLAGS))
            if writes and path is not None and not _inside(path, root):
                raise PermissionError(f"writing outside the tool's directory is not allowed: {path!r}")
        elif event in _PATH_EVENTS:
            for path in args[:2] if event in ("os.rename", "shutil.move", "os.link", "os.symlink",
                                              "shutil.copyfile", "shutil.copytree") else args[:1]:
                if isinstance(path, (str, bytes, os.PathLike)) and not _inside(path, root):
                    raise PermissionError(f"{event} outside the tool's directory is not allowed: {path!r}")
        elif event.startswith("socket.") and not limits.allow_network:
            raise PermissionError(f"network access is not allowed in tools ({event})")
        elif event in _PROCESS_EVENTS and not limits.allow_subprocess:
            raise PermissionError(f"starting processes is not allowed in tools ({event})")

    return hook


def _set_death_signal() -> None:
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _run_child(function: Callable, arguments: dict, limits: SandboxLimits, workdir: str, write_fd: int) -> None:
    """In the forked child: limits, directory, audit hook, then the call; writes one JSON reply and exits."""
    import resource

    code = 0
    try:
        os.setsid()
        _set_death_signal()
        cpu = int(limits.cpu_time_s)
        resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
        memory = int(limits.memory_mb) * 2**20
        resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
        resource.setrlimit(resource.RLIMIT_FSIZE, (int(limits.max_file_bytes),) * 2)
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        null = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(null, fd)
        os.chdir(workdir)
        sys.dont_write_bytecode = True
        sys.addaudithook(_audit_hook(os.path.realpath(workdir), limits))
        try:
            value = function(**arguments)
            text = value if isinstance(value, str) else json.dumps(value, default=str)
            if len(text) > limits.max_output_chars:
                reply = ["error", f"output too large: {len(text)} characters > {limits.max_output_chars}"]
            else:
                reply = ["ok", text]
        except BaseException as exc:  # noqa: BLE001 - any failure of the tool is a message to the model
            reply = ["error", f"{type(exc).__name__}: {exc}"[:500]]
        data = json.dumps(reply).encode()
        view = memoryview(data)
        while view:
            view = view[os.write(write_fd, view):]
    except BaseException:  # noqa: BLE001 - nothing may escape a forked child
        code = 1
    finally:
        os._exit(code)


# ------------------------------------------------------------------------------------------ in the worker

@dataclass
class _Running:
    index: int
    pid: int
    read_fd: int
    started: float
    workdir: str
    chunks: list[bytes]
    size: int = 0


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _reap_orphans(reaped: dict[int, int]) -> None:
    """Reap every exited child (orphans of calls included); statuses go to ``reaped`` (a call's child
    may be among them: its status is read from there)."""
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        reaped[pid] = status


def _drain(entry: _Running, cap: int) -> bool:
    """Read what the child wrote so far; False when it passed the cap."""
    while True:
        try:
            chunk = os.read(entry.read_fd, 65536)
        except BlockingIOError:
            return True
        except OSError as exc:
            if exc.errno == errno.EAGAIN:
                return True
            raise
        if not chunk:
            return True
        entry.chunks.append(chunk)
        entry.size += len(chunk)
        if entry.size > cap:
            return False


def _finish(entry: _Running, status: int | None, limits: SandboxLimits) -> ToolOutcome:
    data = b"".join(entry.chunks)
    if status is not None and os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        if sig == signal.SIGXCPU:
            return ToolOutcome("timeout", f"exceeded the CPU time limit of {limits.cpu_time_s} s")
        return ToolOutcome("error", f"the tool process was killed by signal {signal.Signals(sig).name}")
    try:
        status_text, text = json.loads(data.decode())
    except (ValueError, UnicodeDecodeError):
        return ToolOutcome("error", "the tool process ended without a result")
    return ToolOutcome(str(status_text), str(text))


def run_calls_here(calls: Sequence[tuple[Callable, dict]], limits: SandboxLimits) -> list[ToolOutcome]:
    """Run ``function(**arguments)`` for each call, each in a forked, limited child (at most
    ``limits.max_parallel`` at once). Called in the worker process (it forks: never in the trainer)."""
    outcomes: list[ToolOutcome | None] = [None] * len(calls)
    cap = READ_CAP_FACTOR * limits.max_output_chars + 4096
    pending = list(range(len(calls)))
    running: dict[int, _Running] = {}
    reaped: dict[int, int] = {}
    while pending or running:
        while pending and len(running) < limits.max_parallel:
            index = pending.pop(0)
            function, arguments = calls[index]
            workdir = tempfile.mkdtemp(prefix="mmpo_tool_")
            read_fd, write_fd = os.pipe()
            pid = os.fork()
            if pid == 0:
                os.close(read_fd)
                _run_child(function, arguments, limits, workdir, write_fd)
            os.close(write_fd)
            os.set_blocking(read_fd, False)
            running[pid] = _Running(index, pid, read_fd, time.monotonic(), workdir, [])
        select.select([e.read_fd for e in running.values()], [], [], POLL_INTERVAL_S)
        now = time.monotonic()
        for pid, entry in list(running.items()):
            outcome: ToolOutcome | None = None
            within_cap = _drain(entry, cap)
            done, status = (pid, reaped.pop(pid)) if pid in reaped else os.waitpid(pid, os.WNOHANG)
            if not within_cap:
                outcome = ToolOutcome("error", f"output too large (more than {limits.max_output_chars} characters)")
            elif done:
                _drain(entry, cap)
                outcome = _finish(entry, status, limits)
            elif now - entry.started > limits.timeout_s:
                outcome = ToolOutcome("timeout", f"did not finish within {limits.timeout_s} s")
            if outcome is None:
                continue
            _kill_group(pid)  # the child if still running, and whatever it forked
            if not done:
                os.waitpid(pid, 0)
            reaped.pop(pid, None)
            os.close(entry.read_fd)
            shutil.rmtree(entry.workdir, ignore_errors=True)
            outcomes[entry.index] = outcome
            del running[pid]
        _reap_orphans(reaped)
    return [outcome for outcome in outcomes if outcome is not None]


def serve(fd: int, parent_pid: int, started_by_main_thread: bool) -> None:
    """Worker loop: ``("run", sys_path, [(spec, arguments)], limits dict)`` -> ``("done", [(status, text)])``."""
    from mmpo.tools.functions import load_tool_function

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if started_by_main_thread:
        _set_death_signal()
    if os.getppid() != parent_pid:
        os._exit(1)
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(36, 1)  # PR_SET_CHILD_SUBREAPER: orphans of a call come here
    conn = Connection(fd)
    conn.send_bytes(pickle.dumps(("ready",)))
    while True:
        try:
            message = pickle.loads(conn.recv_bytes())
        except EOFError:
            return
        if message[0] == "stop":
            return
        _, path, calls, limits = message
        sys.path[:] = path
        limits = SandboxLimits(**limits)
        resolved: list[tuple[Callable, dict]] = []
        failed: dict[int, ToolOutcome] = {}
        for index, (spec, arguments) in enumerate(calls):
            try:
                resolved.append((load_tool_function(spec), arguments))
            except Exception as exc:  # noqa: BLE001 - reported as the call's error
                failed[index] = ToolOutcome("error", f"the tool cannot be loaded: {exc}")
        ran = iter(run_calls_here(resolved, limits))
        outcomes = [failed[i] if i in failed else next(ran) for i in range(len(calls))]
        conn.send_bytes(pickle.dumps(("done", [(o.status, o.text) for o in outcomes])))


_BOOTSTRAP = (
    "import json, sys; sys.path[:] = json.loads(sys.argv[1]); "
    "from mmpo.tools.sandbox import serve; serve(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == '1')"
)


class ToolSandbox:
    """Runs tool calls in the worker process (started on first use, replaced when it dies or hangs)."""

    def __init__(self, limits: SandboxLimits = SandboxLimits()) -> None:
        self.limits = limits
        self._lock = threading.Lock()
        self._process: subprocess.Popen | None = None
        self._conn: Connection | None = None
        self.restarts = 0

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process is not None else None

    def run(self, calls: Sequence[tuple[str, dict]]) -> list[ToolOutcome]:
        """``[(tool spec, arguments)]`` -> one :class:`ToolOutcome` per call, in order. Never raises for a
        tool's failure; a worker that dies or does not answer in time is replaced and its calls are errors."""
        if not calls:
            return []
        rounds = -(-len(calls) // self.limits.max_parallel)
        deadline = WORKER_START_TIMEOUT_S + rounds * (self.limits.timeout_s + 1.0)
        with self._lock:
            conn = self._ensure_started()
            try:
                conn.send_bytes(pickle.dumps(("run", list(sys.path), [(s, dict(a)) for s, a in calls],
                                              asdict(self.limits))))
                if not conn.poll(deadline):
                    raise TimeoutError(f"no answer within {deadline:.0f} s")
                _, results = pickle.loads(conn.recv_bytes())
            except (OSError, EOFError, TimeoutError) as exc:
                self._replace(str(exc))
                return [ToolOutcome("error", "the tool sandbox failed; try again") for _ in calls]
        return [ToolOutcome(status, text) for status, text in results]

    def _ensure_started(self) -> Connection:
        if self._process is not None and self._process.poll() is None:
            assert self._conn is not None
            return self._conn
        if self._process is not None:
            self._replace("found dead")
        parent_sock, child_sock = socket.socketpair()
        main_thread = threading.current_thread() is threading.main_thread()
        command = [sys.executable, "-c", _BOOTSTRAP, json.dumps(sys.path), str(child_sock.fileno()), str(os.getpid()),
                   "1" if main_thread else "0"]
        try:
            process = subprocess.Popen(command, pass_fds=(child_sock.fileno(),), stdin=subprocess.DEVNULL)
        except Exception as exc:  # noqa: BLE001
            parent_sock.close()
            raise SandboxUnavailable(f"cannot start the tool worker process: {exc}") from exc
        finally:
            child_sock.close()
        self._process, self._conn = process, Connection(parent_sock.detach())
        if not self._conn.poll(WORKER_START_TIMEOUT_S):
            self._stop(kill=True)
            raise SandboxUnavailable(f"the tool worker did not start within {WORKER_START_TIMEOUT_S} s")
        assert pickle.loads(self._conn.recv_bytes()) == ("ready",)
        return self._conn

    def _replace(self, reason: str) -> None:
        pid = self.pid
        self._stop(kill=True)
        self.restarts += 1
        logger.warning("tool worker (pid %s) %s: killed; the next call starts a fresh one", pid, reason)

    def _stop(self, *, kill: bool) -> None:
        process, conn = self._process, self._conn
        self._process = self._conn = None
        if process is None:
            return
        if not kill and conn is not None:
            try:
                conn.send_bytes(pickle.dumps(("stop",)))
                process.wait(5.0)
            except (OSError, subprocess.TimeoutExpired):
                pass
        if process.poll() is None:
            process.kill()
        process.wait()
        if conn is not None:
            conn.close()

    def shutdown(self) -> None:
        """Stop the worker (the next call starts a new one)."""
        with self._lock:
            self._stop(kill=False)


_SANDBOXES: dict[SandboxLimits, ToolSandbox] = {}
_SANDBOX_LOCK = threading.Lock()


def get_sandbox(limits: SandboxLimits = SandboxLimits()) -> ToolSandbox:
    """The process-wide sandbox for ``limits`` (its worker starts on first use and stops at exit)."""
    with _SANDBOX_LOCK:
        sandbox = _SANDBOXES.get(limits)
        if sandbox is None:
            sandbox = _SANDBOXES[limits] = ToolSandbox(limits)
            atexit.register(sandbox.shutdown)
        return sandbox
