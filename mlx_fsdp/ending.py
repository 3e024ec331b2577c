"""What a rank does when its script ends, so that a failed job ends on every rank, soon.

Registered by the wrappers and fully sharded modules of more than one rank
(:func:`register`):

* A rank that an uncaught exception ended prints a line starting with
  :data:`mlx_fsdp.watchdog.FAILED`, as the watchdog does when it ends one:
  ``mlx.launch`` exits with 0 even when a rank failed, so that line is what
  a script checks.
* Under MPI, ``MPI_Finalize`` waits for every rank of the job. A rank that
  finalizes while its peers are still in a collective leaves them waiting
  without a word (MPI does not tell them that it is gone), and when they are
  ended (an error, the watchdog), Open MPI 4.1's ``mpirun`` then hangs or
  crashes in its own shutdown (``PMIx_server_finalize``) in about one run in
  ten. So before MLX finalizes, a rank whose script ended agrees with the
  ranks it trained with (operation ``"exit"`` of
  :func:`mlx_fsdp.control.agree`, over each group it used): when all of
  them are ending, MPI finalizes as usual; when some are still in
  ``update`` or ``save_checkpoint``, every rank gets the same
  :class:`~mlx_fsdp.control.RankMismatch` at once, and this rank leaves
  without finalizing. A rank that an exception ended leaves at once without
  finalizing. ``mpirun`` sees a failed rank in both cases and stops the job
  within seconds.
"""

import atexit
import ctypes
import os
import sys
import time

from . import control
from .options import group_or_global
from .watchdog import FAILED, say

#: The groups of the wrappers and fully sharded modules of this process, by id.
_groups = {}

#: How MLX names the MPI library (``MLX_MPI_LIBNAME`` first).
_MPI_NAMES = ("libmpi.so", "libmpi.dylib", "libmpi.40.dylib", "libmpi.so.40", "libmpi.so.12")


def register(*groups):
    """Arm the end-of-script hook of this process for the ``groups`` of a wrapper or module.

    At exit the ranks agree over each group of more than one rank that a
    wrapper or fully sharded module used: the ranks that trained together,
    not ranks that never used mlx_fsdp.
    """
    for group in groups:
        if group is not None and group.size() > 1 and id(group) not in _groups:
            if not _groups:
                atexit.register(_at_exit)
            _groups[id(group)] = group


def mpi_in_use():
    """The MPI library MLX loaded, if MPI is initialized and not finalized; else ``None``."""
    noload = getattr(os, "RTLD_NOLOAD", None)
    if noload is None:
        return None
    for name in filter(None, (os.environ.get("MLX_MPI_LIBNAME"), *_MPI_NAMES)):
        try:
            lib = ctypes.CDLL(name, mode=noload | ctypes.RTLD_GLOBAL)  # only if already loaded
        except OSError:
            continue
        initialized, finalized = ctypes.c_int(0), ctypes.c_int(0)
        if lib.MPI_Initialized(ctypes.byref(initialized)) or lib.MPI_Finalized(
                ctypes.byref(finalized)):
            return None
        return lib if initialized.value and not finalized.value else None
    return None


def _leave(code: int):
    """End the process without MPI_Finalize (see the module docstring)."""
    if "logging" in sys.modules:
        sys.modules["logging"].shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _at_exit():
    try:
        _end()
    finally:
        # A split group's communicator must be freed before MPI_Finalize: keep none alive.
        _groups.clear()


def _end():
    rank = group_or_global(None).rank()
    error = getattr(sys, "last_value", None)  # set when an uncaught exception ended the script
    if error is not None:
        first = (str(error).splitlines() or [""])[0][:300]
        say(f"{FAILED} rank {rank} exits with {type(error).__name__}: {first}")
    if mpi_in_use() is None:
        return
    if error is not None or control.LEFT:
        _leave(1)  # the others may still be in a collective, or a peer is gone
    try:
        for group in _groups.values():
            control.agree(group, "exit", {})
    except (control.RankMismatch, control.PeerLost) as e:
        say(f"rank {rank}: {type(e).__name__}: {e}\n{FAILED} rank {rank} exits with code 1.")
        time.sleep(1.0)  # the others print the same error before mpirun stops them
        _leave(1)
