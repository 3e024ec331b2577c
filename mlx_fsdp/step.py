"""The sharded optimizer step, as functions over flat lists of arrays.

One step: for each bucket of the plan, reduce-scatter the gradients so that
each rank keeps its piece of every array in the bucket, and average; clip the
pieces by the global norm; run the wrapped optimizer on this rank's pieces;
all-gather each bucket's updated pieces and unpack them into full parameters.

The functions build the graph lazily. Given a :class:`Stages`,
:func:`reduce_all` and :func:`finish_step` evaluate it stage by stage when
they run eagerly, so that a bucket's communication buffers are freed before
the next bucket's are made; inside ``mx.compile`` it stays lazy.
"""

import functools
from typing import List, Optional, Sequence, Tuple

import mlx.core as mx

from . import clip, collectives, master, owners
from .plan import Bucket, Plan, Slot


def pack(
    bucket: Bucket, grads: Sequence[mx.array], n: int, last: Optional[mx.array] = None
) -> mx.array:
    """Lay out a bucket's gradients as ``(n, bucket.cols)``.

    Args:
        bucket (Bucket): The bucket.
        grads (list[array]): The full gradient of every array of the flattened
            tree, indexed by ``Slot.index``.
        n (int): The number of ranks.
        last (array, optional): Make the result depend on this array, see
            :func:`order_after`. Default: ``None``.

    Returns:
        array: Row ``r`` is rank ``r``'s shard of the bucket.
    """
    if bucket.owned:
        packed = owners.pack(bucket, grads, n)
        if last is None:
            return packed
        return mx.concatenate(
            [packed, mx.broadcast_to(order_after(last, packed.dtype, 2)[0], (n, 0))], axis=1
        )
    parts = []
    for slot in bucket.slots:
        flat = flatten(slot, grads[slot.index])
        pad = n * slot.cols - slot.size
        if pad:
            flat = mx.concatenate([flat, mx.zeros((pad,), flat.dtype)])
        parts.append(flat.reshape(n, slot.cols))
    if last is not None:
        parts.append(mx.broadcast_to(order_after(last, parts[0].dtype, 2)[0], (n, 0)))
    return parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=1)


def flatten(slot: Slot, a: mx.array) -> mx.array:
    """The elements of a full array in the slot's order (see :mod:`mlx_fsdp.plan`).

    Already flat input is returned as it is: its elements are in that order.
    """
    if slot.order == "F" and a.ndim == 2:
        return a.T.reshape(-1)
    return a.reshape(-1)


def unflatten(slot: Slot, flat: mx.array) -> mx.array:
    """The full array from its ``slot.size`` elements in the slot's order."""
    if slot.order == "F":
        return flat.reshape(slot.shape[::-1]).T
    return flat.reshape(slot.shape)


def local_piece(slot: Slot, param: mx.array, rank: int) -> mx.array:
    """Rank ``rank``'s ``(slot.cols,)`` piece of one full parameter.

    Args:
        slot (Slot): The parameter's slot.
        param (array): The full parameter.
        rank (int): The row of the ``(N, cols)`` layout to take.

    Returns:
        array: The piece, zero where it is padding.
    """
    start = min(rank * slot.cols, slot.size)
    stop = min(rank * slot.cols + slot.cols, slot.size)
    missing = slot.cols - (stop - start)
    flat = flatten(slot, param)[start:stop]
    if not missing:
        return flat
    # Concatenating even an empty slice keeps ``param`` in the graph. When it
    # is a collective's output, every rank must evaluate it, including a rank
    # that holds only padding (a scalar at N > 1); ``mx.depends`` would do the
    # same but gave wrong results under ``mx.compile`` here.
    return mx.concatenate([flat, mx.zeros((missing,), param.dtype)])


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
        a = unflatten(slot, flat)
        out.append(a if a.dtype == dtype else a.astype(dtype))
    return out


@functools.lru_cache(maxsize=256)
def flat_starts(bucket: Bucket) -> Tuple[int, ...]:
    """Where each slot begins in the bucket's unpadded flat concatenation."""
    starts, at = [], 0
    for slot in bucket.slots:
        starts.append(at)
        at += slot.size
    return tuple(starts)


def split_row(bucket: Bucket, row: mx.array) -> List[mx.array]:
    """Cut a bucket's ``(cols,)`` row into the pieces of its slots (views)."""
    if len(bucket.slots) == 1:
        return [row]
    return [row[s.offset : s.offset + s.cols] for s in bucket.slots]


def order_after(x: Optional[mx.array], dtype: mx.Dtype, ndim: int = 1) -> List[mx.array]:
    """An empty array that depends on ``x``: a part to concatenate into a
    collective's input so that the collective runs after ``x`` is computed.

    All ranks must run their collectives in the same order. Independent
    collectives in one graph (one per bucket) are scheduled by MLX as it sees
    fit, and since one rank's graph differs slightly from another's (only some
    ranks hold padding), the orders can differ and the collectives mismatch:
    seen under ``mx.compile`` and in unstaged eager steps. Chaining each
    collective's input to the previous collective's output fixes one order on
    every rank. ``mx.depends`` did not keep that order in the same tests; an
    empty slice in a concatenation does, and costs nothing where the input is
    concatenated anyway.

    Returns:
        list[array]: ``[]`` for ``x=None``, else one empty array of ``dtype``
        with ``ndim`` dimensions.
    """
    if x is None:
        return []
    return [x.reshape(-1)[:0].astype(dtype).reshape((1,) * (ndim - 1) + (0,))]


def join_pieces(pieces: Sequence[mx.array], last: Optional[mx.array] = None) -> mx.array:
    """Concatenate 1-D pieces (the inverse of :func:`split_row`), after ``last``."""
    parts = list(pieces) + order_after(last, pieces[0].dtype)
    return parts[0] if len(parts) == 1 else mx.concatenate(parts)


def reduce_bucket(
    bucket: Bucket,
    grads: Sequence[mx.array],
    group: mx.distributed.Group,
    dp_group: Optional[mx.distributed.Group] = None,
    *,
    method: str = "native",
    stream: Optional[mx.Stream] = None,
    last: Optional[mx.array] = None,
) -> Tuple[List[Optional[mx.array]], mx.array]:
    """Reduce-scatter one bucket and average over all data-parallel ranks.

    With a native ``sum_scatter`` the bucket is packed as ``(N, cols)`` and each
    rank receives its row. The fallbacks skip that packed copy:

    * ``"exchange"`` (two ranks) sends only the peer's pieces (views of a
      lone, unpadded array; one concatenation otherwise) and adds what the
      peer sends back to this rank's own pieces;
    * ``"all_sum"`` receives the whole sum anyway: it reduces the plain
      concatenation of the gradients (a contiguous copy, or none for a single
      array) and cuts this rank's pieces out of the result.

    Args:
        bucket (Bucket): The bucket.
        grads (list[array]): The local full gradients, in tree order.
        group (mlx.core.distributed.Group): The shard group.
        dp_group (mlx.core.distributed.Group, optional): The replica group of
            hybrid sharding. Default: ``None``.
        method (str): ``"native"``, ``"exchange"`` or ``"all_sum"``, see
            :func:`mlx_fsdp.collectives.reduce_scatter`. Default: ``"native"``.
        stream (mlx.core.Stream, optional): Communication stream. Default: ``None``.
        last (array, optional): Run the collective only after this array
            (the previous collective's output) is computed, see
            :func:`order_after`. Default: ``None``.

    Returns:
        tuple: This rank's averaged ``(cols,)`` piece of each slot (for an
        owner bucket: the whole gradient of each array this rank owns, and
        ``None`` for the others), and an array that depends on the
        collective, to chain the next one after.
    """
    n = group.size()
    replicas = dp_group.size() if dp_group is not None else 1
    total = n * replicas
    if method in ("exchange", "all_sum") and n > 1 and not bucket.owned:
        rank = group.rank()
        # Flatten once: an array stored in another order than its slot's
        # would be copied by every flatten.
        flats = [flatten(s, grads[s.index]) for s in bucket.slots]
        if method == "exchange":
            theirs = join_pieces(
                [local_piece(s, f, 1 - rank) for s, f in zip(bucket.slots, flats)], last
            )
            got = split_row(bucket, collectives.exchange(theirs, group, stream=stream))
            pieces = [local_piece(s, f, rank) + g for s, f, g in zip(bucket.slots, flats, got)]
        else:
            flat = join_pieces(flats, last)
            summed = mx.distributed.all_sum(flat, group=group, stream=stream)
            pieces = [
                local_piece(s, summed[start : start + s.size], rank)
                for s, start in zip(bucket.slots, flat_starts(bucket))
            ]
        if replicas == 1:
            pieces = [p / total for p in pieces]
            return pieces, pieces[0]
        row = join_pieces(pieces)
    else:
        row = collectives.reduce_scatter(
            pack(bucket, grads, n, last), group, method=method, stream=stream
        )
    if replicas > 1:
        row = mx.distributed.all_sum(row, group=dp_group, stream=stream)
    row = row / total
    if bucket.owned:
        rank = group.rank()
        pieces = [owners.whole(s, row) if s.owner == rank else None for s in bucket.slots]
        # A rank may own nothing here; the row still carries the collective.
        return pieces, row[:1]
    pieces = split_row(bucket, row)
    return pieces, pieces[0]


def gather_bucket(
    bucket: Bucket,
    pieces: Sequence[mx.array],
    group: mx.distributed.Group,
    *,
    stream: Optional[mx.Stream] = None,
    last: Optional[mx.array] = None,
) -> List[mx.array]:
    """All-gather one bucket's updated pieces into full parameters.

    Args:
        bucket (Bucket): The bucket.
        pieces (list[array]): This rank's updated piece of each slot
            (``None`` for arrays owned by other ranks).
        group (mlx.core.distributed.Group): The shard group.
        stream (mlx.core.Stream, optional): Communication stream. Default: ``None``.
        last (array, optional): Run the collective only after this array
            (the previous collective's output) is computed, see
            :func:`order_after`. Default: ``None``.

    Returns:
        list[array]: The full parameters in slot order, in the parameter dtype.
    """
    if bucket.owned:
        row = owners.row(bucket, pieces, group.rank())
        gathered = collectives.all_gather(join_pieces([row], last), group, stream=stream)
    else:
        gathered = collectives.all_gather(join_pieces(pieces, last), group, stream=stream)
    return unpack(bucket, gathered)


@functools.lru_cache(maxsize=64)
def buckets_of_optimizer(plan: Plan, num_optimizers: int) -> Tuple[Tuple[int, ...], ...]:
    """For each sub-optimizer, the indices of the buckets it updates."""
    return tuple(
        tuple(i for i, b in enumerate(plan.buckets) if b.optimizer == o)
        for o in range(num_optimizers)
    )


def update_shards(
    plan: Plan,
    grad_pieces: Sequence[Sequence[mx.array]],
    params: Sequence[mx.array],
    optimizers: Sequence,
    rank: int,
    masters: Optional[dict] = None,
    master_dtype: Optional[mx.Dtype] = None,
) -> List[List[mx.array]]:
    """Run each (sub-)optimizer on this rank's pieces of its parameters.

    The optimizer sees ``{"shards": {path: piece}}``: one ``(cols,)`` piece per
    parameter. Its state is therefore per parameter, ``state["shards"][path]``,
    and depends on the world size but not on the bucket budget. Running per
    parameter also keeps the optimizer's temporaries as small as a parameter's
    piece rather than a whole bucket's.

    Args:
        plan (Plan): The plan.
        grad_pieces (list[list[array]]): For every bucket, the gradient piece
            of each of its slots.
        params (list[array]): The full parameters, in tree order.
        optimizers (list[mlx.optimizers.Optimizer]): Indexed by ``Bucket.optimizer``.
        rank (int): This rank in the shard group.
        masters (dict, optional): ``{path: piece}`` master copies, updated in
            place, see :mod:`mlx_fsdp.master`. Default: ``None``.
        master_dtype (Dtype, optional): Step low-precision parameters through
            masters of this dtype. Default: ``None``.

    Returns:
        list[list[array]]: For every bucket, the updated piece of each slot,
        in the parameter's dtype (``None`` for arrays owned by other ranks).
    """
    masters = {} if masters is None else masters
    new_pieces = {}
    for opt, idx in zip(optimizers, buckets_of_optimizer(plan, len(optimizers))):
        paths, pieces, grads = [], [], []
        for i in idx:
            for slot, g in zip(plan.buckets[i].slots, grad_pieces[i]):
                if slot.owner is None:
                    pieces.append(local_piece(slot, params[slot.index], rank))
                elif slot.owner == rank:
                    pieces.append(params[slot.index])  # updated whole, here only
                else:
                    continue
                paths.append(slot.path)
                grads.append(g)
        if not paths:
            continue
        steps, grads = master.lift(paths, pieces, grads, masters, master_dtype)
        new = opt.apply_gradients(
            {"shards": dict(zip(paths, grads))}, {"shards": dict(zip(paths, steps))}
        )["shards"]
        new = master.lower(
            paths, [new[p] for p in paths], [p.dtype for p in pieces], masters, master_dtype
        )
        new_pieces.update(zip(paths, new))
    return [[new_pieces.get(s.path) for s in b.slots] for b in plan.buckets]


def clip_pieces(
    pieces: Sequence[Sequence[mx.array]],
    group: mx.distributed.Group,
    max_norm: float,
    last: Optional[mx.array] = None,
) -> Tuple[List[List[mx.array]], mx.array]:
    """Clip every bucket's pieces by the global norm of all of them.

    Replicas of a hybrid layout hold equal pieces, so the norm is summed over
    the shard group only. ``last`` orders the norm's collective after the last
    reduce-scatter even on a rank that holds no piece of that bucket.

    Returns:
        tuple: The clipped pieces, bucket by bucket, and the norm before clipping.
    """
    flat = [p for b in pieces for p in b if p is not None]
    norm = clip.global_norm(flat + order_after(last, mx.float32), group)
    scaled = iter(clip.clip_by_norm(flat, norm, max_norm))
    return [[None if p is None else next(scaled) for p in b] for b in pieces], norm


class Stages:
    """Evaluates the step stage by stage, unless it is being traced.

    A single evaluation at the end would keep every bucket's packed, reduced
    and gathered buffers alive at once; evaluating each stage frees them as
    the step goes. Inside ``mx.compile`` (or another transformation) arrays
    cannot be evaluated, and the compiled graph is scheduled as a whole
    anyway, so the first refused evaluation turns staging off for the step.

    Args:
        enabled (bool): Evaluate stages at all. Default: ``True``.
    """

    def __init__(self, enabled: bool = True):
        self.enabled = enabled

    def chain(self, last: Optional[mx.array]) -> Optional[mx.array]:
        """``last`` if the next collective must be chained after it, else ``None``.

        A staged step evaluates one collective at a time, which orders them
        already; chaining (see :func:`order_after`) costs a copy of a lone
        array's input, so only an unstaged (traced) graph gets it.
        """
        return None if self.enabled else last

    def __call__(self, *trees):
        if not self.enabled:
            return
        try:
            mx.eval(*[[a for a in t if a is not None] if isinstance(t, list) else t for t in trees])
        except ValueError as e:
            if "transformations" not in str(e):
                raise
            self.enabled = False


def reduce_all(
    plan: Plan,
    grads: Sequence[mx.array],
    group: mx.distributed.Group,
    dp_group: Optional[mx.distributed.Group] = None,
    *,
    method: str = "native",
    stream: Optional[mx.Stream] = None,
    stage: Optional[Stages] = None,
) -> Tuple[List[List[Optional[mx.array]]], Optional[mx.array]]:
    """Reduce-scatter every bucket, one after the other (see :func:`reduce_bucket`).

    Returns:
        tuple: For every bucket, this rank's averaged gradient piece of each
        slot (see :func:`reduce_bucket`), and an array that depends on the
        last collective (pass it to :func:`finish_step`).
    """
    stage = stage or Stages(False)
    pieces, last = [], None
    for bucket in plan.buckets:
        bucket_pieces, last = reduce_bucket(
            bucket, grads, group, dp_group, method=method, stream=stream,
            last=stage.chain(last),
        )
        pieces.append(bucket_pieces)
        stage(bucket_pieces + [last])
    return pieces, stage.chain(last)


def finish_step(
    plan: Plan,
    pieces: List[List[mx.array]],
    params: Sequence[mx.array],
    optimizers: Sequence,
    group: mx.distributed.Group,
    *,
    max_norm: Optional[float] = None,
    stream: Optional[mx.Stream] = None,
    stage: Optional[Stages] = None,
    masters: Optional[dict] = None,
    master_dtype: Optional[mx.Dtype] = None,
    last: Optional[mx.array] = None,
) -> Tuple[List[mx.array], Optional[mx.array]]:
    """Clip the reduced pieces, update them and all-gather the parameters.

    ``pieces`` is consumed: the list is emptied. ``last`` (from
    :func:`reduce_all`) orders the first all-gather after the last
    reduce-scatter when no norm does.

    Returns:
        tuple: The new full parameters in tree order, and the global gradient
        norm before clipping (``None`` without ``max_norm``).
    """
    stage = stage or Stages(False)
    # Take the caller's list: the reduced gradients are then freed as soon as
    # the update has used them, not when the caller returns.
    pieces, taken = list(pieces), pieces
    taken.clear()
    norm = None
    if max_norm is not None:
        pieces, norm = clip_pieces(pieces, group, max_norm, stage.chain(last))

    new_pieces = update_shards(
        plan, pieces, params, optimizers, group.rank(), masters, master_dtype
    )
    del pieces
    if stage.enabled:
        # Bucket by bucket, so that only one bucket's old and new optimizer
        # state are alive together.
        for bucket, bucket_pieces in zip(plan.buckets, new_pieces):
            shards = optimizers[bucket.optimizer].state.get("shards", {})
            held = [s.path for s in bucket.slots if s.path in shards]
            stage([p for p in bucket_pieces if p is not None], [shards[p] for p in held],
                  [masters[p] for p in held if masters and p in masters])
    stage([p for b in new_pieces for p in b], [o.state for o in optimizers],
          [] if norm is None else norm, masters or [])

    new_params = [None] * plan.num_arrays
    last = norm if norm is not None else last
    for bucket, bucket_pieces in zip(plan.buckets, new_pieces):
        full = gather_bucket(bucket, bucket_pieces, group, stream=stream, last=stage.chain(last))
        last = full[0]
        stage(full)
        for slot, p in zip(bucket.slots, full):
            new_params[slot.index] = p
    return new_params, norm
