"""A watchdog, on by default, that ends a rank stuck in a collective, with a message.

A collective waits for every rank of its group. When a peer is stopped
(SIGSTOP, a debugger, a swapped-out host) or skipped a call, the others wait
forever, and a job that hangs without a word wastes the whole allocation. The
watchdog is a daemon thread. The library tells it where the main thread is
about to wait (``waiting``) and when the wait ended (``done``); if a wait
outlasts the timeout it prints which rank waited where, and where the main
thread is blocked, then ends the process with exit code :data:`EXIT_CODE`, so
that ``mlx.launch`` or ``mpirun`` stop the whole job.

The timeout is the ``timeout`` argument of the wrappers, else the environment
variable :data:`ENV` (one setting for every wrapper of a job), else
:data:`DEFAULT_TIMEOUT`; ``0`` turns the watchdog off (:func:`resolve_timeout`).

What a job sees, and the waits measured: docs/reliability.md#the-watchdog.
There are three kinds of wait:

* *exact*: a collective the library makes and waits for itself (the
  cross-rank check of a step, the agreements of ``save_checkpoint``,
  ``load_checkpoint``, ``init`` and ``fully_shard``). It fires after the
  timeout, plus an allowance for the file I/O the peers do meanwhile.
* *lazy*: a step's collectives run when the caller evaluates the step (its
  ``mx.eval``), after ``update`` returned, so the library does not see them
  finish. That wait begins when ``update`` returns and ends at the next call
  into the library. It fires only when nothing moved for the whole timeout:
  the main thread stayed in one call without running (its CPU time did not
  grow) and MLX's active memory did not change. A computing rank allocates
  and frees arrays, a loop of evaluations runs Python between them, a
  compilation runs on the main thread; a rank blocked in a collective does
  none of these. A step of any length, a compilation, a validation loop
  between steps therefore never trip it.
* *forward*: the collectives of a fully sharded module's forward and backward
  passes (:func:`mlx_fsdp.fully_shard`), armed when the module is called and
  nothing else is watched (the first step, an evaluation without an
  optimizer). It fires like a lazy wait, and ends at the next call into the
  library or when an evaluation seen computing (the main thread blocked in
  one call while MLX's memory changed) returns.

``mlx.core.eval`` releases the GIL while it waits, so the thread runs while
the main thread is blocked in a collective.
"""

import ctypes
import math
import os
import signal
import sys
import threading
import time
from typing import Optional

import mlx.core as mx

#: The exit code of a process the watchdog ends (the one ``timeout(1)`` uses).
EXIT_CODE = 124
#: Seconds a rank may wait for its peers unless told otherwise: the longest
#: time one rank may spend alone between two collectives while the others
#: wait (rank 0 evaluating or saving by itself); the library's own long waits
#: make progress or get an allowance (docs/reliability.md#the-watchdog measures them).
#: PyTorch's NCCL watchdog uses the same 10 minutes.
DEFAULT_TIMEOUT = 600.0
#: The environment variable that sets the timeout of every wrapper of a job.
ENV = "MLX_FSDP_TIMEOUT"
#: Main-thread CPU seconds per tick above which it counts as running, not blocked.
CPU_SLACK = 0.002
#: The line a script can look for in a job's output: a rank failed.
FAILED = "[mlx_fsdp] FAILED:"


def resolve_timeout(timeout: Optional[float] = None) -> Optional[float]:
    """The watchdog's timeout in seconds, or ``None`` when it is off.

    Args:
        timeout (float, optional): A wrapper's ``timeout`` argument: seconds
            (> 0), or ``0`` to turn the watchdog off. ``None`` reads
            :data:`ENV` (same meaning), and without it uses
            :data:`DEFAULT_TIMEOUT`. Default: ``None``.

    Raises:
        ValueError: For a negative, infinite or non-numeric value, naming it
            (and the environment variable it came from).
    """
    name, value = "timeout", timeout
    if timeout is None:
        text = os.environ.get(ENV, "").strip()
        if not text:
            return DEFAULT_TIMEOUT
        name = ENV
        try:
            value = float(text)
        except ValueError:
            value = text
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not number or not math.isfinite(value) or value < 0:
        raise ValueError(
            f"{name}={value!r} must be a number of seconds >= 0: how long a rank may wait "
            "for its peers in a collective before the watchdog ends the job (0 turns the "
            f"watchdog off; without timeout= or {ENV}, it is {DEFAULT_TIMEOUT:g} s).")
    return float(value) if value > 0 else None


def say(text: str):
    """Write ``text`` to stderr at once (the launcher may stop this process soon)."""
    sys.stderr.write(text if text.endswith("\n") else text + "\n")
    sys.stderr.flush()


def _thread_cpu(ident: int):
    """A function giving thread ``ident``'s CPU seconds, or ``None`` where there is none.

    A main thread blocked in an evaluation sleeps; one that runs Python
    between evaluations uses CPU, even when every sample of its position
    (taken when it releases the GIL, that is in an evaluation) is the same.
    """
    try:  # Linux and most Unix
        clock = time.pthread_getcpuclockid(ident)
        return lambda: time.clock_gettime(clock)
    except (AttributeError, OSError):
        pass
    try:  # macOS: the Mach thread's user and system time
        libc = ctypes.CDLL(None)
        port = libc.pthread_mach_thread_np(ctypes.c_void_p(ident))
    except (OSError, AttributeError):
        return None

    def mach():
        info, count = (ctypes.c_int * 10)(), ctypes.c_uint(10)  # THREAD_BASIC_INFO
        if libc.thread_info(port, 3, info, ctypes.byref(count)):
            return None
        return info[0] + info[2] + (info[1] + info[3]) / 1e6
    return mach if mach() is not None else None


class _Wait:
    """One announced wait: where, since when, its kind and the allowance on top of the timeout."""

    def __init__(self, where: str, kind: str, allowance: float = 0.0):
        self.where, self.kind, self.allowance = where, kind, allowance
        self.since = time.monotonic()
        self.worked_at = None  # where the main thread was blocked while MLX computed


class Watchdog:
    """Ends the process if one wait in a collective lasts longer than ``timeout``.

    Args:
        timeout (float): Seconds a rank may wait. Must be > 0.
        rank (int): This rank, for the message. Default: ``0``.
        exit (callable, optional): Called with the exit code instead of
            ``os._exit`` (for tests). Default: ``None``.
    """

    def __init__(self, timeout: float, rank: int = 0, exit=None):
        if not isinstance(timeout, (int, float)) or isinstance(timeout, bool) or not timeout > 0:
            raise ValueError(
                f"timeout={timeout!r} must be a positive number of seconds (or 0 to "
                "turn the watchdog off).")
        self.timeout = float(timeout)
        self.rank = rank
        self._exit = exit or os._exit
        self._lock = threading.Lock()
        self._wait: Optional[_Wait] = None
        self._main = threading.main_thread().ident
        self._tick = min(1.0, self.timeout / 20)
        self._thread = threading.Thread(target=self._run, name="mlx_fsdp-watchdog", daemon=True)
        self._thread.start()

    def waiting(self, where: str, *, lazy: bool = False, allowance: float = 0.0):
        """Say that the main thread is about to wait in ``where``.

        Args:
            where (str): What it waits in, for the message, e.g. ``"the
                cross-rank check of step 12"``.
            lazy (bool): The wait happens in the caller's evaluation, after
                this call returns; it ends at the next call of the library.
                Default: ``False``.
            allowance (float): Seconds added to the timeout of an exact wait:
                the time the peers may legitimately spend meanwhile (writing
                a checkpoint). Default: ``0``.
        """
        with self._lock:
            self._wait = _Wait(where, "lazy" if lazy else "exact", allowance)

    def forward(self, where: str):
        """Watch collectives that the caller's next evaluation runs, unless a wait is watched.

        For a fully sharded module's gathers: they end with the evaluation
        that runs them (see the module docstring).
        """
        with self._lock:
            if self._wait is None:
                self._wait = _Wait(where, "forward")

    def done(self):
        """The wait announced by :meth:`waiting` is over."""
        with self._lock:
            self._wait = None

    def _main_position(self):
        frame = sys._current_frames().get(self._main)
        if frame is None:
            return None
        return (id(frame), frame.f_lasti, f"{frame.f_code.co_filename}:{frame.f_lineno}")

    def _run(self):
        cpu = _thread_cpu(self._main)
        position, memory, used_cpu, still_since = None, None, None, time.monotonic()
        while True:
            time.sleep(self._tick)
            now, current, used = time.monotonic(), self._main_position(), mx.get_active_memory()
            ran = cpu() if cpu is not None else None
            # Python ran on the main thread (a loop of short evaluations included),
            # or it stayed blocked in one call while MLX computed.
            moved = (current is None or position is None or current[:2] != position[:2]
                     or (ran is not None and used_cpu is not None and ran - used_cpu > CPU_SLACK))
            computing = not moved and used != memory
            if moved or computing:
                still_since = now
            position, memory, used_cpu = current, used, ran
            with self._lock:
                wait = self._wait
                if wait is not None and wait.kind == "forward":
                    if computing:
                        wait.worked_at = current[:2]
                    elif wait.worked_at is not None and moved:
                        self._wait = wait = None  # that evaluation returned
            if wait is None or now - wait.since < self.timeout + wait.allowance:
                continue
            if wait.kind != "exact" and now - still_since < self.timeout:
                continue
            self._fire(wait.where, now - wait.since, position)
            return

    def _fire(self, where: str, waited: float, position):
        line = f" The main thread is blocked at {position[2]}." if position else ""
        say(f"\n[mlx_fsdp watchdog] rank {self.rank} waited {waited:.0f} s (timeout "
            f"{self.timeout:g} s) in {where}.{line} Its peers did not join: a rank was "
            "stopped or killed, is far behind, or skipped a call that every rank must "
            f"make. Ending this process with exit code {EXIT_CODE} so that the launcher "
            f"stops the job (the timeout is timeout= of fsdp_step and ddp_step, or {ENV}; "
            f"0 turns the watchdog off).\n{FAILED} rank {self.rank} exits with code "
            f"{EXIT_CODE} (watchdog).")
        # The other ranks waiting for the same peer reach their own timeout
        # within a tick or two: let them say so before the launcher stops them.
        time.sleep(min(1.0 + 2 * self._tick, self.timeout))
        _continue_local_peers()
        self._exit(EXIT_CODE)


def _continue_local_peers():
    # A launcher stops a job with SIGTERM, which a stopped process (SIGSTOP,
    # Ctrl-Z) only receives once continued: mlx.launch would then wait for it
    # forever. Local ranks share this process's group; SIGCONT changes nothing
    # for the ones that run and lets the stopped ones be stopped.
    try:
        os.killpg(os.getpgrp(), signal.SIGCONT)
    except (AttributeError, OSError):
        pass


_instances = {}


def get(timeout: Optional[float], rank: int) -> Optional[Watchdog]:
    """The process's watchdog for ``timeout`` (one thread per timeout), or ``None``."""
    if timeout is None:
        return None
    key = (float(timeout), rank)
    if key not in _instances:
        _instances[key] = Watchdog(timeout, rank)
    return _instances[key]


def default(group) -> Optional[Watchdog]:
    """The watchdog of a wait without a wrapper's ``timeout`` (``fully_shard``, a plain
    optimizer's checkpoint): :data:`ENV` or :data:`DEFAULT_TIMEOUT`; ``None`` on one rank."""
    return get(resolve_timeout(None), group.rank()) if group.size() > 1 else None


class watch:
    """Context manager: ``with watch(dog, "where"):`` around a blocking wait.

    Accepts ``dog=None`` (no watchdog) so that callers need no branch.
    """

    def __init__(self, dog: Optional[Watchdog], where: str, allowance: float = 0.0):
        self.dog, self.where, self.allowance = dog, where, allowance

    def __enter__(self):
        if self.dog is not None:
            self.dog.waiting(self.where, allowance=self.allowance)

    def __exit__(self, *exc):
        if self.dog is not None:
            self.dog.done()
        return False
