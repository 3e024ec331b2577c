"""Reduce-scatter and all-gather of a bucket's flat vector, on every MLX backend.

NCCL and JACCL implement ``mx.distributed.sum_scatter``; ring and MPI do not,
and they only say so when the graph is evaluated. A group's capability is
therefore learned once, with a tiny evaluated probe, and the step then uses
one of three methods on the same input, the bucket's flat vector of
``N * cols`` elements (see :mod:`mlx_fsdp.plan`):

* ``"native"``: ``sum_scatter`` of the vector.
* ``"exchange"``, for a group of two ranks: each rank all-gathers the half it
  does not keep, so it receives exactly the peer's contribution to its own
  half and adds it. That is a true reduce-scatter: it moves half the bytes of
  an all-sum, and on the ring backend it also avoids ``all_sum``'s fixed cost
  (ring N=2 on the 2-core development machine: 3.7 ms for a 32 KiB
  ``all_sum`` against 0.4 ms for an ``all_gather``;
  ``benchmarks/bench_collectives.py``). Two-term sums do not depend on the
  order, so it is bit-identical to ``all_sum``.
* ``"all_sum"``, for any size: all-sum the vector, keep this rank's shard.

A neighbour send/recv ring was tried as the fallback and dropped: on ring N=2
it took 2.2x the time of all_sum for a 32 MB bucket, and on MPI its sends must
run on a second stream (a second thread), which Open MPI without
MPI_THREAD_MULTIPLE answered with a segfault at N=3.

A bucket's collectives, built from these, are in :mod:`mlx_fsdp.bucketed`.
"""

import os
from typing import Optional

import mlx.core as mx


#: Ways to reduce-scatter, in the order :func:`reduce_scatter_method` prefers.
METHODS = ("native", "exchange", "all_sum")

#: Environment variable that forces one method for every group.
ENV_VAR = "MLX_FSDP_REDUCE_SCATTER"

# Keyed by id(group): Group objects can be neither weak-referenced nor kept
# alive here (on MPI a split group freed after MPI_Finalize aborts the job).
# Every group of a process comes from the same backend, so a reused id cannot
# turn a "no" into a wrong "yes" in practice, and a wrong "yes" would fail loudly.
_native_cache: dict = {}


def _probe_native(group) -> bool:
    # All ranks reach this point together (first step of a plan), so on NCCL
    # the probe is a matched collective; on ring/MPI it fails locally at
    # eval, before anything is sent.
    try:
        mx.eval(mx.distributed.sum_scatter(mx.zeros((group.size(),)), group=group))
        return True
    except RuntimeError:
        return False


def supports_sum_scatter(group) -> bool:
    """Whether ``group``'s backend implements ``sum_scatter``.

    The answer is probed once per group (one tiny collective) and cached.

    Args:
        group (mlx.core.distributed.Group): The group to ask about.

    Returns:
        bool: ``True`` on backends with a native reduce-scatter (NCCL, JACCL).
    """
    key = id(group)
    if key not in _native_cache:
        _native_cache[key] = _probe_native(group)
    return _native_cache[key]


def reduce_scatter_method(group, method: Optional[str] = None) -> str:
    """Choose how to reduce-scatter over ``group``.

    The choice, in order: the ``method`` argument, then the
    ``MLX_FSDP_REDUCE_SCATTER`` environment variable, then automatically:
    ``"native"`` if the backend has ``sum_scatter``, else ``"exchange"`` for a
    group of two ranks and ``"all_sum"`` for larger groups.

    Args:
        group (mlx.core.distributed.Group): The group to reduce over.
        method (str, optional): ``"native"``, ``"exchange"`` (two ranks only),
            ``"all_sum"``, ``"auto"`` or ``None`` (automatic). Default: ``None``.

    Returns:
        str: The method :func:`reduce_scatter` will use.
    """
    source = "method"
    if method is None:
        method = os.environ.get(ENV_VAR) or None
        source = ENV_VAR
    if method is None or method == "auto":
        if group.size() > 1 and supports_sum_scatter(group):
            return "native"
        return "exchange" if group.size() == 2 else "all_sum"
    if method not in METHODS:
        raise ValueError(
            f"{source}={method!r} is not a reduce-scatter method; "
            f"use one of {', '.join(METHODS)} or 'auto'."
        )
    if method == "exchange" and group.size() != 2:
        raise ValueError(
            f"{source}='exchange' needs a group of exactly 2 ranks, but this group "
            f"has {group.size()}; use 'all_sum' or 'auto'."
        )
    return method


def reduce_scatter(vector: mx.array, group, *, method: str = "native",
                   stream: Optional[mx.Stream] = None) -> mx.array:
    """Sum a flat vector over ``group`` and return this rank's shard of the sum.

    Args:
        vector (array): ``N * cols`` elements, ``N`` the group size; rank
            ``r``'s shard is elements ``[r * cols, (r + 1) * cols)``.
        group (mlx.core.distributed.Group): The group to reduce over.
        method (str): ``"native"``, ``"exchange"`` (two ranks) or
            ``"all_sum"``, see the module docstring. Default: ``"native"``.
        stream (mlx.core.Stream, optional): Stream for the communication.
            Default: ``None``.

    Returns:
        array: This rank's ``(cols,)`` shard of the sum.
    """
    n, rank = group.size(), group.rank()
    if n == 1:
        return vector
    cols = vector.shape[0] // n
    if method == "native":
        return mx.distributed.sum_scatter(vector, group=group, stream=stream)
    if method == "exchange":
        peer = 1 - rank
        theirs = exchange(vector[peer * cols:(peer + 1) * cols], group, stream=stream)
        return vector[rank * cols:(rank + 1) * cols] + theirs
    if method == "all_sum":
        return mx.distributed.all_sum(vector, group=group, stream=stream)[rank * cols:(rank + 1) * cols]
    raise ValueError(f"method={method!r} is not one of {', '.join(METHODS)}.")


def exchange(x: mx.array, group, *, stream: Optional[mx.Stream] = None) -> mx.array:
    """Send ``x`` to the other rank of a two-rank group and return what it sent.

    Built on ``all_gather``, which every backend has: of the two gathered
    halves, this rank keeps the peer's.

    Args:
        x (array): A 1-D array; the peer must pass one of the same shape and dtype.
        group (mlx.core.distributed.Group): A group of exactly two ranks.
        stream (mlx.core.Stream, optional): Stream for the communication.
            Default: ``None``.

    Returns:
        array: The peer's ``x``.
    """
    if group.size() != 2:
        raise ValueError(
            f"exchange needs a group of exactly 2 ranks, but this group has "
            f"{group.size()}; use all_sum or all_gather for larger groups."
        )
    both = mx.distributed.all_gather(x, group=group, stream=stream)
    return both[x.shape[0]:] if group.rank() == 0 else both[:x.shape[0]]


def all_gather(shard: mx.array, group, *, stream: Optional[mx.Stream] = None) -> mx.array:
    """Every rank's ``(cols,)`` shard, concatenated in rank order: the flat vector.

    Args:
        shard (array): This rank's shard.
        group (mlx.core.distributed.Group): The group to gather over.
        stream (mlx.core.Stream, optional): Stream for the communication.
            Default: ``None``.

    Returns:
        array: The ``N * cols`` vector.
    """
    if group.size() == 1:
        return shard
    return mx.distributed.all_gather(shard, group=group, stream=stream)
