"""A reward worker process that a deadline can really stop.

A thread stuck in a computation cannot be interrupted in Python (math-verify expanding
``10^{10^{10^{10}}}``, a user reward in an endless loop), so reward functions run in one
long-lived worker process. A call that misses its deadline kills that process (SIGKILL, then
``wait``: no zombie) and the next call starts a fresh one; :attr:`RewardWorker.restarts` counts
these. The worker lives between calls, so its start-up (importing sympy and math-verify: about
a second) is paid once per process and again only after a kill, never inside a deadline.

What the worker imports: ``mmpo.rewards`` (the registry, the built-ins, math-verify), and no
torch or transformers. The built-ins run as their torch-free ``worker_form`` (a list of floats,
``mmpo.rewards.registry``) and the trainer turns results into tensors, so a worker running only
them peaks at about 64 MiB of resident memory instead of about 556 MiB with torch (VmHWM after
``accuracy`` + ``format`` on 16 completions). A reward
whose module imports torch (a user's ``file.py:fn``, a registered function of such a module)
makes the worker import torch when it loads that function, still before the deadline starts.

How it starts: a fresh interpreter (``subprocess``, ``python -c`` running :func:`serve`) talking
over a socket pair. Not ``multiprocessing``: its "fork" copies the trainer, which by then runs
CUDA, OpenMP, tokenizer and data-loader threads, and a child forked from a threaded process can
deadlock on a lock one of them held (3.14 dropped fork as the Linux default for that reason);
its "spawn" and "forkserver" re-run the user's ``__main__`` script in every worker (harmless
only behind an ``if __name__ == "__main__"`` guard; without one the worker would start a second
training run). Start-up is the same as "spawn"; once the worker is up a call costs the same for
every start method: pickling the batch (sent once for all the call's functions) and the results.
Measured on a busy 2-core CPU machine, while the worker still imported torch: worker start 2-6 s,
once (without torch, the first call, start included, took 0.7 s); 16 completions, ``accuracy`` +
``format``: 7.6 ms inline vs 9.2 ms in the worker (median), 15.8 ms when each of the 4 prompts
carries a 448x448 image.

What runs in the worker: functions that pickle (by reference: a module-level function, or a
``functools.partial`` of one) and that the worker can import. A user's ``path/file.py:fn``
reward pickles as its spec (``mmpo.rewards.user.UserReward``): the worker loads that file by
its absolute path while loading the call's functions, before the deadline starts. Messages use
plain ``pickle``, so a tensor (in a row, or a result of a reward that uses torch) is copied, never
shared through file descriptors a killed worker would leave behind.
The worker ignores Ctrl-C (the trainer handles it), exits when the trainer closes its end (at
exit, or when the trainer dies while the worker is idle) and, on Linux, is killed by the kernel
when the trainer thread that started it dies (the trainer's main thread in practice), even
while it is stuck in a computation.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import pickle
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

from mmpo.rewards.log_text import shorten

WORKER_START_TIMEOUT_S = 300.0
"""Deadline for a new worker to import its modules, and for a call's functions to load."""

logger = logging.getLogger(__name__)

SHUTDOWN_TIMEOUT_S = 5.0
"""How long :meth:`RewardWorker.shutdown` waits for a clean exit before killing the worker."""


@dataclass
class CallOutcome:
    """What became of one function call in the worker."""

    value: Any = None
    error: str | None = None
    """Why the call gave no value (raised, timed out, worker died, could not load); None if it did."""
    timed_out: bool = False
    unloadable: bool = False
    """The function could not be pickled here or unpickled in the worker: run it elsewhere."""


class WorkerUnavailable(RuntimeError):
    """The worker process could not be started, or the call's arguments cannot be sent to it."""


def _die_with_parent(parent_pid: int, started_by_main_thread: bool) -> None:
    # Kernel-level, so it works even while a reward holds the GIL in C code (a Python watchdog
    # thread could not run then): without it a worker stuck in a computation would outlive a
    # trainer killed with kill -9. The signal follows the thread that started the worker, so
    # only a main thread's worker asks for it (a helper thread's end would kill the worker).
    if started_by_main_thread and sys.platform.startswith("linux"):
        import ctypes

        pr_set_pdeathsig = 1
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)
    if os.getppid() != parent_pid:  # the trainer died before prctl took effect
        os._exit(1)


def _send(conn: Connection, message: tuple) -> None:
    conn.send_bytes(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))


def serve(fd: int, parent_pid: int, started_by_main_thread: bool) -> None:
    """Worker loop on the socket ``fd``: ``("run", sys_path, [(name, pickled fn)], args)`` ->
    ``("loaded", {name: error})``, then ``("result", name, ok, value or error text)`` per loaded
    function, in order; ``("stop",)`` or a closed socket ends it."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _die_with_parent(parent_pid, started_by_main_thread)
    conn = Connection(fd)
    import mmpo.rewards  # noqa: F401  (math-verify and the built-ins, no torch, before any deadline runs)

    _send(conn, ("ready",))
    while True:
        try:
            message = pickle.loads(conn.recv_bytes())
        except EOFError:  # the trainer closed its end or is gone
            return
        except Exception as exc:  # noqa: BLE001 - e.g. a row of a class this process cannot import
            _send(conn, ("unreadable", f"{type(exc).__name__}: {exc}"))
            continue
        if message[0] == "stop":
            return
        _, path, calls, args = message
        sys.path[:] = path  # modules the trainer made importable after this worker started
        functions: dict[str, Callable] = {}
        load_errors: dict[str, str] = {}
        for name, blob in calls:
            try:
                functions[name] = pickle.loads(blob)
            except Exception as exc:  # noqa: BLE001 - reported; the trainer runs it itself
                load_errors[name] = f"{type(exc).__name__}: {exc}"
        _send(conn, ("loaded", load_errors))
        for name, function in functions.items():
            try:
                reply = ("result", name, True, function(*args))
                blob = pickle.dumps(reply, protocol=pickle.HIGHEST_PROTOCOL)
            except BaseException as exc:  # noqa: BLE001 - a reward's failure is a counted error
                blob = pickle.dumps(("result", name, False, f"{type(exc).__name__}: {exc}"))
            conn.send_bytes(blob)


_BOOTSTRAP = (
    "import json, sys; sys.path[:] = json.loads(sys.argv[1]); "
    "from mmpo.rewards.worker import serve; serve(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == '1')"
)


class RewardWorker:
    """One worker process running reward functions under a deadline; thread-safe (calls queue)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._process = None
        self._conn = None
        self.restarts = 0
        """Workers killed (missed deadline) or found dead and replaced, since this object was made."""

    @property
    def pid(self) -> int | None:
        """The live worker's process id, or None when none runs."""
        return self._process.pid if self._process is not None else None

    def start(self) -> None:
        """Start the worker process now if none runs (otherwise the first call starts it): a trainer
        calls this before its first step, so the start-up is not paid inside the step.
        Raises :class:`WorkerUnavailable` when no process can be started."""
        with self._lock:
            self._ensure_started()

    def run(self, calls: Sequence[tuple[str, Callable]], args: tuple, timeout_s: float) -> dict[str, CallOutcome]:
        """Run ``fn(*args)`` for each ``(name, fn)`` in the worker, each within ``timeout_s`` seconds.

        A call that misses its deadline kills the worker; the calls after it go to a fresh one.
        Functions that cannot be pickled are returned as ``unloadable`` without being sent.

        Raises:
            WorkerUnavailable: no worker could be started, or ``args`` cannot be pickled.
        """
        outcomes: dict[str, CallOutcome] = {}
        pending: list[tuple[str, bytes]] = []
        for name, function in calls:
            try:
                pending.append((name, pickle.dumps(function, protocol=pickle.HIGHEST_PROTOCOL)))
            except Exception as exc:  # noqa: BLE001 - lambdas, closures, bound methods of odd objects
                outcomes[name] = CallOutcome(error=f"cannot be pickled: {type(exc).__name__}: {exc}", unloadable=True)
        if not pending:
            return outcomes
        with self._lock:
            while pending:
                pending = self._run_batch(pending, args, timeout_s, outcomes)
        return outcomes

    def _run_batch(self, pending: list[tuple[str, bytes]], args: tuple, timeout_s: float,
                   outcomes: dict[str, CallOutcome]) -> list[tuple[str, bytes]]:
        """Send ``pending`` to the worker and collect outcomes; return the calls still to run
        (those after one that killed the worker)."""
        conn = self._ensure_started()
        try:
            request = pickle.dumps(("run", list(sys.path), pending, args), protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as exc:  # noqa: BLE001 - e.g. a row holding an open file
            raise WorkerUnavailable(f"the reward arguments cannot be sent to the worker: {exc}") from exc
        try:
            conn.send_bytes(request)
            loaded = self._receive(conn, WORKER_START_TIMEOUT_S)
        except (OSError, EOFError, TimeoutError) as exc:
            self._replace(f"while loading: {exc}")
            for name, _ in pending:
                outcomes[name] = CallOutcome(error=f"the reward worker failed while loading the functions: {exc}")
            return []
        if loaded[0] == "unreadable":  # the worker cannot unpickle the arguments: run them elsewhere
            for name, _ in pending:
                outcomes[name] = CallOutcome(error=f"the worker cannot read the arguments: {loaded[1]}",
                                             unloadable=True)
            return []
        load_errors: dict[str, str] = loaded[1]
        for name, _ in pending:
            if name in load_errors:
                outcomes[name] = CallOutcome(error=f"the worker cannot load it: {load_errors[name]}", unloadable=True)
        to_run = [call for call in pending if call[0] not in load_errors]
        for index, (name, _) in enumerate(to_run):
            try:
                reply = self._receive_bytes(conn, timeout_s)
            except TimeoutError:
                self._replace("missed its deadline")
                outcomes[name] = CallOutcome(error=f"did not finish within {timeout_s} s", timed_out=True)
                return to_run[index + 1:]
            except (OSError, EOFError) as exc:
                code = self._process.poll() if self._process is not None else None
                self._replace("died")
                outcomes[name] = CallOutcome(error=f"the reward worker process died (exit code {code}): {exc!r}")
                return to_run[index + 1:]
            try:
                _, result_name, ok, payload = pickle.loads(reply)
            except Exception as exc:  # noqa: BLE001 - e.g. an object of a class only the worker imports
                outcomes[name] = CallOutcome(error=f"returned a value this process cannot read: {exc}")
                continue
            assert result_name == name, (result_name, name)
            outcomes[name] = CallOutcome(value=payload) if ok else CallOutcome(error=f"raised {payload}")
        return []

    @staticmethod
    def _receive_bytes(conn: Connection, timeout_s: float) -> bytes:
        if not conn.poll(timeout_s):
            raise TimeoutError(f"no reply within {timeout_s} s")
        return conn.recv_bytes()

    def _receive(self, conn: Connection, timeout_s: float) -> tuple:
        return pickle.loads(self._receive_bytes(conn, timeout_s))

    def _ensure_started(self) -> Connection:
        if self._process is not None and self._process.poll() is None:
            return self._conn
        if self._process is not None:
            self._replace("found dead")
        parent_sock, child_sock = socket.socketpair()
        main_thread = threading.current_thread() is threading.main_thread()
        command = [sys.executable, "-c", _BOOTSTRAP, json.dumps(sys.path), str(child_sock.fileno()), str(os.getpid()),
                   "1" if main_thread else "0"]
        try:
            process = subprocess.Popen(command, pass_fds=(child_sock.fileno(),), stdin=subprocess.DEVNULL)
        except Exception as exc:  # noqa: BLE001 - no processes allowed, no executable ...
            parent_sock.close()
            raise WorkerUnavailable(f"cannot start the reward worker process: {exc}") from exc
        finally:
            child_sock.close()
        self._process, self._conn = process, Connection(parent_sock.detach())
        started = time.monotonic()
        try:
            ready = self._receive(self._conn, WORKER_START_TIMEOUT_S)
        except (OSError, EOFError, TimeoutError) as exc:
            self._stop_process(kill=True)
            raise WorkerUnavailable(
                f"the reward worker did not start within {WORKER_START_TIMEOUT_S} s "
                f"({time.monotonic() - started:.1f} s): {shorten(repr(exc))}") from exc
        assert ready == ("ready",), ready
        return self._conn

    def _replace(self, reason: str) -> None:
        # The next call starts a fresh worker (lazily, in _ensure_started).
        pid = self.pid
        self._stop_process(kill=True)
        self.restarts += 1
        logger.warning("reward worker (pid %s) %s: killed; the next call starts a fresh one (%d restarts so far)",
                       pid, reason, self.restarts)

    def _stop_process(self, *, kill: bool) -> None:
        process, conn = self._process, self._conn
        self._process = self._conn = None
        if process is None:
            return
        if not kill:
            try:
                _send(conn, ("stop",))
                process.wait(SHUTDOWN_TIMEOUT_S)
            except (OSError, subprocess.TimeoutExpired):
                pass
        if process.poll() is None:
            process.kill()
        process.wait()  # reaps it: no zombie
        conn.close()

    def shutdown(self) -> None:
        """Stop the worker (asked first, killed after ``SHUTDOWN_TIMEOUT_S``); the next call starts a new one."""
        with self._lock:
            self._stop_process(kill=False)


_WORKER: RewardWorker | None = None
_WORKER_LOCK = threading.Lock()


def get_reward_worker() -> RewardWorker:
    """The process-wide reward worker (created on first use; its process starts on the first call)."""
    global _WORKER
    with _WORKER_LOCK:
        if _WORKER is None:
            _WORKER = RewardWorker()
            atexit.register(_WORKER.shutdown)  # a clean stop at interpreter exit
        return _WORKER


def shutdown_reward_worker() -> None:
    """Stop the process-wide reward worker if one runs (also done at interpreter exit)."""
    with _WORKER_LOCK:
        worker = _WORKER
    if worker is not None:
        worker.shutdown()
