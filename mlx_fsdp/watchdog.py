"""A watchdog that ends a rank stuck in a collective, with a message.

A collective waits for every rank of its group. When a peer is stopped
(SIGSTOP, a debugger, a swapped-out host) or skipped a call, the others wait
forever, and a job that hangs without a word wastes the whole allocation. The
watchdog is a daemon thread. The library tells it where the main thread is
about to wait (``waiting``) and when the wait ended (``done``); if one wait
lasts longer than ``timeout`` seconds it prints which rank waited where, and
where the main thread is blocked, then ends the process with exit code
:data:`EXIT_CODE`, so that ``mlx.launch`` or ``mpirun`` stop the whole job.
Before it exits it sends SIGCONT to its own process group, where
``mlx.launch`` keeps its local ranks: a stopped rank ignores the launcher's
SIGTERM until it is continued.

A sharded step's collectives run when the caller evaluates the step (its
``mx.eval``), after ``update`` has returned, so the library does not see
them finish. For that wait the watchdog uses what it can see: the wait
begins when ``update`` returns and ends at the next call into the library
(the next ``update``, ``save_checkpoint``...); it fires only when, in
addition, the main thread has stayed on one line of Python, blocked in a
single call, for the whole timeout. A loop that keeps running Python between
two steps (validation, logging) therefore never trips it; one blocked call
that outlasts the timeout does.

``mlx.core.eval`` releases the GIL while it waits, so the thread runs while
the main thread is blocked in a collective.
"""

import os
import signal
import sys
import threading
import time
from typing import Optional

#: The exit code of a process the watchdog ends (the one ``timeout(1)`` uses).
EXIT_CODE = 124


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
                f"timeout={timeout!r} must be a positive number of seconds (or None to "
                "turn the watchdog off)."
            )
        self.timeout = float(timeout)
        self.rank = rank
        self._exit = exit or os._exit
        self._lock = threading.Lock()
        self._where: Optional[str] = None
        self._since = 0.0
        self._lazy = False
        self._main = threading.main_thread().ident
        self._thread = threading.Thread(target=self._run, name="mlx_fsdp-watchdog", daemon=True)
        self._thread.start()

    def waiting(self, where: str, *, lazy: bool = False):
        """Say that the main thread is about to wait in ``where``.

        Args:
            where (str): What it waits in, for the message, e.g. ``"the
                cross-rank check of step 12"``.
            lazy (bool): The wait happens in the caller's evaluation, after
                this call returns; it ends at the next call of the library.
                Default: ``False``.
        """
        with self._lock:
            self._where, self._since, self._lazy = where, time.monotonic(), lazy

    def done(self):
        """The wait announced by :meth:`waiting` is over."""
        with self._lock:
            self._where = None

    def _main_position(self):
        frame = sys._current_frames().get(self._main)
        if frame is None:
            return None
        return (id(frame), frame.f_lasti, f"{frame.f_code.co_filename}:{frame.f_lineno}")

    def _run(self):
        tick = min(1.0, self.timeout / 20)
        position, still_since = None, time.monotonic()
        while True:
            time.sleep(tick)
            now = time.monotonic()
            current = self._main_position()
            if current is None or position is None or current[:2] != position[:2]:
                position, still_since = current, now
            with self._lock:
                where, since, lazy = self._where, self._since, self._lazy
            if where is None or now - since < self.timeout:
                continue
            if lazy and now - still_since < self.timeout:
                continue
            self._fire(where, now - since, position)
            return

    def _fire(self, where: str, waited: float, position):
        line = f" The main thread is blocked at {position[2]}." if position else ""
        sys.stderr.write(
            f"\n[mlx_fsdp watchdog] rank {self.rank} waited {waited:.0f} s (timeout "
            f"{self.timeout:g} s) in {where}.{line} Its peers did not join: a rank was "
            "stopped or killed, is far behind, or skipped a call that every rank must "
            f"make. Ending this process with exit code {EXIT_CODE} so that the launcher "
            "stops the job.\n"
        )
        sys.stderr.flush()
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


class watch:
    """Context manager: ``with watch(dog, "where"):`` around a blocking wait.

    Accepts ``dog=None`` (no watchdog) so that callers need no branch.
    """

    def __init__(self, dog: Optional[Watchdog], where: str):
        self.dog, self.where = dog, where

    def __enter__(self):
        if self.dog is not None:
            self.dog.waiting(self.where)

    def __exit__(self, *exc):
        if self.dog is not None:
            self.dog.done()
        return False
