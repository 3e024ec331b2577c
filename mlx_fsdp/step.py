"""The sharded optimizer step, as functions over flat lists of arrays.

One step, for each bucket of the plan: pack the gradients into ``(N, cols)``,
reduce-scatter so that each rank keeps its row, average, (optionally) clip by
the global norm, run the wrapped optimizer on this rank's shard, all-gather the
updated shards and unpack them into full parameters.

Everything here is lazy: the functions build the graph and evaluate nothing,
so they also run inside ``mx.compile``.
"""

import functools
from typing import List, Optional, Sequence, Tuple

import mlx.core as mx

from . import clip, collectives, owners
from .plan import Bucket, Plan, Slot


def pack(bucket: Bucket, grads: Sequence[mx.array], n: int) -> mx.array:
    """Lay out a bucket's gradients as ``(n, bucket.cols)``.

    Args:
        bucket (Bucket): The bucket.
        grads (list[array]): The full gradient of every array of the flattened
            tree, indexed by ``Slot.index``.
        n (int): The number of ranks.

    Returns:
        array: Row ``r`` is rank ``r``'s shard of the bucket.
    """
    if bucket.owned:
        return owners.pack(bucket, grads, n)
    parts = []
    for slot in bucket.slots:
        flat = grads[slot.index].reshape(-1)
        pad = n * slot.cols - slot.size
        if pad:
            flat = mx.concatenate([flat, mx.zeros((pad,), flat.dtype)])
        parts.append(flat.reshape(n, slot.cols))
    return parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=1)


def local_piece(slot: Slot, param: mx.array, rank: int) -> mx.array:
    """Rank ``rank``'s ``(slot.cols,)`` piece of one full parameter.

    Args:
        slot (Slot): The parameter's slot.
        param (array): The full parameter.
        rank (int): The row of the ``(N, cols)`` layout to take.

    Returns:
        array: The piece, zero where it is padding.
    """
    start = rank * slot.cols
    stop = min(start + slot.cols, slot.size)
    missing = slot.cols - max(stop - start, 0)
    flat = param.reshape(-1)
    if not missing:
        return flat[start:stop]
    zeros = mx.zeros((missing,), param.dtype)
    return mx.concatenate([flat[start:stop], zeros]) if stop > start else zeros


def unpack(bucket: Bucket, gathered: mx.array) -> List[mx.array]:
    """Split a gathered ``(N, cols)`` bucket back into full arrays.

    Args:
        bucket (Bucket): The bucket.
        gathered (array): The bucket's rows from all ranks.

    Returns:
        list[array]: The arrays in slot order, padding dropped, each in the
        bucket's parameter dtype.
    """
    if bucket.owned:
        return owners.unpack(bucket, gathered)
    dtype = getattr(mx, bucket.param_dtype)
    single = len(bucket.slots) == 1
    out = []
    for slot in bucket.slots:
        block = gathered if single else gathered[:, slot.offset : slot.offset + slot.cols]
        flat = block.reshape(-1)
        if flat.size != slot.size:
            flat = flat[: slot.size]
        a = flat.reshape(slot.shape)
        out.append(a if a.dtype == dtype else a.astype(dtype))
    return out


@functools.lru_cache(maxsize=64)
def buckets_of_optimizer(plan: Plan, num_optimizers: int) -> Tuple[Tuple[int, ...], ...]:
    """For each sub-optimizer, the indices of the buckets it updates."""
    return tuple(
        tuple(i for i, b in enumerate(plan.buckets) if b.optimizer == o)
        for o in range(num_optimizers)
    )


def reduce_gradients(
    plan: Plan,
    grads: Sequence[mx.array],
    group: mx.distributed.Group,
    dp_group: Optional[mx.distributed.Group] = None,
    *,
    method: str = "native",
    stream: Optional[mx.Stream] = None,
) -> List[mx.array]:
    """Reduce-scatter every bucket and average over all data-parallel ranks.

    Args:
        plan (Plan): The plan, built for ``group.size()`` ranks.
        grads (list[array]): The local full gradients in tree order.
        group (mlx.core.distributed.Group): The shard group.
        dp_group (mlx.core.distributed.Group, optional): The replica group of
            hybrid sharding. Default: ``None``.
        method (str): The reduce-scatter method, see
            :func:`mlx_fsdp.collectives.reduce_scatter`. Default: ``"native"``.
        stream (mlx.core.Stream, optional): Communication stream. Default: ``None``.

    Returns:
        list[array]: This rank's averaged gradient shard of each bucket.
    """
    n = plan.world_size
    total = n * (dp_group.size() if dp_group is not None else 1)
    shards = []
    for bucket in plan.buckets:
        x = pack(bucket, grads, n)
        if shards and plan.has_owners:
            x = owners.after(x, shards[-1])
        s = collectives.reduce_scatter(x, group, method=method, stream=stream)
        if dp_group is not None and dp_group.size() > 1:
            s = mx.distributed.all_sum(s, group=dp_group, stream=stream)
        shards.append(s / total)
    return shards


def update_shards(
    plan: Plan,
    grad_shards: Sequence[mx.array],
    params: Sequence[mx.array],
    optimizers: Sequence,
    rank: int,
) -> List[mx.array]:
    """Run each (sub-)optimizer on this rank's pieces of its parameters.

    The optimizer sees ``{"shards": {path: piece}}``: one ``(cols,)`` piece per
    flat parameter, cut from the bucket shard, and the whole array of every
    parameter this rank owns. Its state is therefore per parameter,
    ``state["shards"][path]``, and depends on the world size but not on the
    bucket budget. Running per parameter also keeps the optimizer's
    temporaries as small as a parameter's piece rather than a whole bucket's.

    Args:
        plan (Plan): The plan.
        grad_shards (list[array]): Gradient shard of every bucket.
        params (list[array]): The full parameters, in tree order.
        optimizers (list[mlx.optimizers.Optimizer]): Indexed by ``Bucket.optimizer``.
        rank (int): This rank in the shard group.

    Returns:
        list[array]: The updated parameter shard of every bucket.
    """
    new_pieces = {}
    for opt, idx in zip(optimizers, buckets_of_optimizer(plan, len(optimizers))):
        grads, pieces = {}, {}
        for i in idx:
            bucket, shard = plan.buckets[i], grad_shards[i]
            single = len(bucket.slots) == 1
            for slot in bucket.slots:
                if slot.owner is not None:
                    # Owned arrays are updated whole, on their owner only.
                    if slot.owner == rank:
                        grads[slot.path] = owners.whole(slot, shard)
                        pieces[slot.path] = params[slot.index]
                    continue
                grads[slot.path] = shard if single else shard[slot.offset : slot.offset + slot.cols]
                pieces[slot.path] = local_piece(slot, params[slot.index], rank)
        new_pieces.update(opt.apply_gradients({"shards": grads}, {"shards": pieces})["shards"])
    return [
        owners.row(b, new_pieces, rank, grad_shards[i])
        if b.owned
        else new_pieces[b.slots[0].path]
        if len(b.slots) == 1
        else mx.concatenate([new_pieces[s.path] for s in b.slots])
        for i, b in enumerate(plan.buckets)
    ]


def sharded_update(
    plan: Plan,
    grads: Sequence[mx.array],
    params: Sequence[mx.array],
    optimizers: Sequence,
    group: mx.distributed.Group,
    dp_group: Optional[mx.distributed.Group] = None,
    *,
    max_norm: Optional[float] = None,
    method: str = "native",
    stream: Optional[mx.Stream] = None,
) -> Tuple[List[mx.array], Optional[mx.array]]:
    """One sharded optimizer step over flat lists of arrays.

    Args:
        plan (Plan): The plan for ``grads``, built for ``group.size()`` ranks.
        grads (list[array]): Local full gradients, in tree order.
        params (list[array]): The matching full parameters.
        optimizers (list[mlx.optimizers.Optimizer]): Indexed by ``Bucket.optimizer``.
        group (mlx.core.distributed.Group): The shard group.
        dp_group (mlx.core.distributed.Group, optional): The replica group.
            Default: ``None``.
        max_norm (float, optional): Clip the averaged gradients to this global
            norm. Default: ``None``.
        method (str): Reduce-scatter method. Default: ``"native"``.
        stream (mlx.core.Stream, optional): Communication stream. Default: ``None``.

    Returns:
        tuple: The new full parameters in tree order, and the global gradient
        norm before clipping (``None`` without ``max_norm``).
    """
    shards = reduce_gradients(plan, grads, group, dp_group, method=method, stream=stream)
    norm = None
    if max_norm is not None:
        # Replicas of a hybrid layout hold equal shards: sum over the shard group only.
        norm = clip.global_norm(shards, group)
        shards = clip.clip_by_norm(shards, norm, max_norm)

    new_shards = update_shards(plan, shards, params, optimizers, group.rank())

    new_params = [None] * len(grads)
    previous = shards
    for bucket, shard in zip(plan.buckets, new_shards):
        if plan.has_owners:
            shard = owners.after(shard, previous)
        gathered = previous = collectives.all_gather(shard, group, stream=stream)
        for slot, p in zip(bucket.slots, unpack(bucket, gathered)):
            new_params[slot.index] = p
    return new_params, norm
