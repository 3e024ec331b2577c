"""Reduce-scatter and all-gather that work on every MLX backend.

NCCL and JACCL implement ``mx.distributed.sum_scatter``; ring and MPI do not,
and they only say so when the graph is evaluated. A group's capability is
therefore learned once, with a tiny evaluated probe, and the step then builds
either the native op or the fallback: all-sum, then keep this rank's part
(:func:`reduce_scatter` takes its row of an ``(N, cols)`` array; the step's
own fallback, :func:`mlx_fsdp.step.reduce_bucket`, skips the packed layout).

A neighbour send/recv ring was tried as the fallback and dropped: on ring N=2
it took 2.2x the time of all_sum for a 32 MB bucket, and on MPI its sends must
run on a second stream (a second thread), which Open MPI without
MPI_THREAD_MULTIPLE answered with a segfault at N=3.
"""

import os
from typing import Optional

import mlx.core as mx

#: Ways to reduce-scatter, in the order :func:`reduce_scatter_method` prefers.
METHODS = ("native", "all_sum")

#: Environment variable that forces one method for every group.
ENV_VAR = "MLX_FSDP_REDUCE_SCATTER"

# Keyed by id(group): Group objects can be neither weak-referenced nor kept
# alive here (on MPI a split group freed after MPI_Finalize aborts the job).
# Every group of a process comes from the same backend, so a reused id cannot
# turn a "no" into a wrong "yes" in practice, and a wrong "yes" would fail loudly.
_native_cache: dict = {}

def _probe_native(group: mx.distributed.Group) -> bool:
    # All ranks reach this point together (first step of the same plan), so on
    # NCCL the probe is a matched collective; on ring/MPI it fails locally at
    # eval, before anything is sent.
    try:
        mx.eval(mx.distributed.sum_scatter(mx.zeros((group.size(),)), group=group))
        return True
    except RuntimeError:
        return False


def supports_sum_scatter(group: mx.distributed.Group) -> bool:
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


def reduce_scatter_method(
    group: mx.distributed.Group, method: Optional[str] = None
) -> str:
    """Choose how to reduce-scatter over ``group``.

    The choice, in order: the ``method`` argument, then the
    ``MLX_FSDP_REDUCE_SCATTER`` environment variable, then ``"native"`` if the
    backend has ``sum_scatter`` and ``"all_sum"`` otherwise.

    Args:
        group (mlx.core.distributed.Group): The group to reduce over.
        method (str, optional): ``"native"``, ``"all_sum"``, ``"auto"`` or
            ``None`` (automatic). Default: ``None``.

    Returns:
        str: The method :func:`reduce_scatter` will use.
    """
    source = "method"
    if method is None:
        method = os.environ.get(ENV_VAR) or None
        source = ENV_VAR
    if method is None or method == "auto":
        return "native" if supports_sum_scatter(group) else "all_sum"
    if method not in METHODS:
        raise ValueError(
            f"{source}={method!r} is not a reduce-scatter method; "
            f"use one of {', '.join(METHODS)} or 'auto'."
        )
    return method


def reduce_scatter(
    x: mx.array,
    group: mx.distributed.Group,
    *,
    method: str = "native",
    stream: Optional[mx.Stream] = None,
) -> mx.array:
    """Sum ``x`` over ``group`` and return this rank's row of the sum.

    Args:
        x (array): An array of shape ``(N, cols)``, ``N`` the group size.
        group (mlx.core.distributed.Group): The group to reduce over.
        method (str): ``"native"`` (``sum_scatter``) or ``"all_sum"``
            (all-reduce, then take this rank's row). Default: ``"native"``.
        stream (mlx.core.Stream, optional): Stream for the communication.
            Default: ``None``.

    Returns:
        array: This rank's row of the sum, shape ``(cols,)``.
    """
    n = group.size()
    if n == 1:
        return x[0]
    if method == "native":
        return mx.distributed.sum_scatter(x, group=group, stream=stream)[0]
    if method == "all_sum":
        return mx.distributed.all_sum(x, group=group, stream=stream)[group.rank()]
    raise ValueError(f"method={method!r} is not one of {', '.join(METHODS)}.")


def all_gather(
    x: mx.array, group: mx.distributed.Group, *, stream: Optional[mx.Stream] = None
) -> mx.array:
    """Gather each rank's ``(cols,)`` shard into an ``(N, cols)`` array.

    Args:
        x (array): This rank's shard, shape ``(cols,)``.
        group (mlx.core.distributed.Group): The group to gather over.
        stream (mlx.core.Stream, optional): Stream for the communication.
            Default: ``None``.

    Returns:
        array: The shards of all ranks stacked in rank order.
    """
    n = group.size()
    if n == 1:
        return x[None]
    return mx.distributed.all_gather(x, group=group, stream=stream).reshape(n, -1)
