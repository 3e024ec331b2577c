"""One bucket's collectives: its gradients reduced, summed over replicas, its arrays gathered.

Built on the methods of :mod:`mlx_fsdp.collectives` and the layout of
:mod:`mlx_fsdp.layout`, for the sharded step (:mod:`mlx_fsdp.step`) and
the fully sharded modules (:mod:`mlx_fsdp.fully_sharded.gather`) alike. An
owner bucket that is mostly padding is all-summed without it instead
(:mod:`mlx_fsdp.summed`). The order in which a step's collectives run is
kept by :class:`mlx_fsdp.order.CollectiveOrder`.
"""

from typing import Optional

import mlx.core as mx

from . import columns, layout, summed
from .collectives import all_gather, exchange, reduce_scatter
from .order import CollectiveOrder


def reduce_bucket(bucket, grads, group, *, method: str, order: CollectiveOrder,
                  stream: Optional[mx.Stream] = None, dp_group=None) -> list:
    """Reduce-scatter one bucket: the summed gradient of what this rank holds.

    Args:
        bucket (Bucket): The bucket (see :mod:`mlx_fsdp.plan`).
        grads (list[array]): This rank's full gradients, indexed by ``Slot.index``.
        group (mlx.core.distributed.Group): The shard group.
        method (str): ``"native"``, ``"exchange"`` or ``"all_sum"``.
        order (CollectiveOrder): Chains the collectives of the step.
        stream (mlx.core.Stream, optional): Stream for the communication.
            Default: ``None``.
        dp_group (mlx.core.distributed.Group, optional): Replicas to all-sum
            over as well (hybrid sharding). Default: ``None``.

    Returns:
        list: ``(slot, summed gradient)`` for what this rank holds of each
        slot (see :func:`mlx_fsdp.layout.held`), summed over all ranks.
    """
    n, rank = group.size(), group.rank()
    dtype = getattr(mx, bucket.dtype)
    # Empty slices of every gradient of the bucket, last array first: the
    # input then waits for all of them, computed in the same order on every
    # rank (the backward pass's own order). Without them each rank computes
    # the part it sends first, and a rank that sends the first layers' half
    # runs nearly the whole backward pass while its peer waits, then waits in
    # turn: the one-graph step ran 1.24x DDP's time on a 12.9M GPT on the CPU.
    ready = [layout.empty_of(grads[s.index]) for s in reversed(bucket.slots)] \
        if len(bucket.slots) > 1 else []
    if bucket.summed(n):
        vector = order.join(ready + summed.gradient_parts(bucket, grads), dtype)
        total = mx.distributed.all_sum(vector, group=group, stream=stream)
        held = summed.owned(bucket, total, rank)
        order.ran(mx.concatenate([layout.empty_of(total)] + [layout.empty_of(a) for _, a in held]))
    elif method == "exchange" and n == 2:
        # Send only the half the peer keeps; add what comes back to this rank's
        # own pieces one by one, so that neither the whole bucket nor this
        # rank's half is ever copied into a vector of its own.
        sent = order.join(ready + layout.range_parts(bucket, grads, 1 - rank, dtype), dtype)
        got = exchange(sent, group, stream=stream)
        # ``theirs + own``, not ``own + theirs`` (the same sum, bit for bit):
        # with the gradient listed first, MLX ran part of the backward pass
        # out of the order the send sets, and one rank of two peaked 1.3 MiB
        # higher on the main job's GPT (0.13M parameters).
        held = [(s, columns.add(s, theirs, own)) for (s, own), (_, theirs) in
                zip(layout.held_of(bucket, grads, rank), layout.held(bucket, got, rank))]
        # Until the sums are computed, this rank's own pieces (views) keep its
        # whole local gradients alive, and the received half stays too. Chaining the next collective after the sums computes
        # them now, so only the reduced half outlives the bucket.
        order.ran(mx.concatenate([layout.empty_of(got)] + [layout.empty_of(a) for _, a in held]))
    else:
        vector = order.join(ready + layout.pack_parts(bucket, grads, n), dtype)
        shard = reduce_scatter(vector, group, method=method, stream=stream)
        if method == "all_sum" and n > 1:
            # A slice of the all-sum would keep all N shards of it alive until
            # the update; a copy of this rank's, made now, frees the rest
            # (1.1M MLP, MPI N=4: peak 0.74x -> 0.70x DDP's).
            shard = shard * 1
        held = layout.held(bucket, order.ran(shard), rank)
    return sum_over_replicas(bucket, held, rank, dp_group, order=order, stream=stream)


def sum_over_replicas(bucket, held: list, rank: int, dp_group, *, order: CollectiveOrder,
                      stream: Optional[mx.Stream] = None) -> list:
    """``held`` summed over the replica group of hybrid sharding (one all-sum).

    Args:
        bucket (Bucket): The bucket.
        held (list): ``(slot, array)`` of what this rank holds (see
            :func:`mlx_fsdp.layout.held`).
        rank (int): This rank in the shard group.
        dp_group (mlx.core.distributed.Group, optional): The replica group;
            ``None`` returns ``held`` as it is.
        order (CollectiveOrder): Chains the collectives of the step.
        stream (mlx.core.Stream, optional): Stream for the communication.
            Default: ``None``.

    Returns:
        list: ``(slot, summed array)``, shaped like ``held``.
    """
    if dp_group is None:
        return held
    dtype = getattr(mx, bucket.dtype)
    values = {s.index: a for s, a in held}
    total = order.ran(mx.distributed.all_sum(
        order.join(layout.held_parts(bucket, values, rank, dtype), dtype),
        group=dp_group, stream=stream))
    return layout.held(bucket, total, rank)


def gather_bucket(bucket, mine: dict, group, *, order: CollectiveOrder,
                  stream: Optional[mx.Stream] = None, wait=()) -> list:
    """Every array of ``bucket``, whole, from what each rank holds of them: one collective.

    An all-gather of the ranks' shards, or, for an owner bucket that is
    mostly padding, an all-sum of the owners' arrays (:mod:`mlx_fsdp.summed`).

    Args:
        bucket (Bucket): The bucket.
        mine (dict): ``{slot.index: array}``: what this rank holds of each
            slot it holds (see :func:`mlx_fsdp.layout.held`).
        group (mlx.core.distributed.Group): The shard group.
        order (CollectiveOrder): Chains the collectives of the step.
        stream (mlx.core.Stream, optional): Stream for the communication.
            Default: ``None``.
        wait (list[array], optional): What the collective's input must
            follow. Default: nothing.

    Returns:
        list[array]: The arrays in slot order, in the bucket's parameter dtype
        (views of the collective's output where possible, see :func:`mlx_fsdp.layout.unpack`).
    """
    rank, dtype = group.rank(), getattr(mx, bucket.param_dtype)
    whole = bucket.summed(group.size())
    parts = summed.parameter_parts(bucket, mine, rank, dtype) if whole \
        else layout.held_parts(bucket, mine, rank)
    x = order.join(parts, dtype)
    if wait:
        x = mx.depends(x, list(wait))
    if whole:
        return summed.unpack(bucket, order.ran(mx.distributed.all_sum(x, group=group,
                                                                      stream=stream)))
    vector = order.ran(all_gather(x, group, stream=stream))
    out = layout.unpack(bucket, vector)
    if layout.copies_out(bucket, group.size()) and not order.traced:
        # The next gather waits for the copies, which free this vector: MLX
        # would run them as late as their consumers allow, at the step's
        # end, with every gathered vector alive (the MLP 16 x 256 with
        # Adafactor in 256 KiB buckets, ring N=2, bench_plan_memory.py:
        # 16.31 MiB, 10.82 so).
        # Eagerly only: a compiled step is planned, and was measured, without.
        order.follow(mx.depends([vector], out)[0])
    return out
