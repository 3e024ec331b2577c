"""Arrays to a bucket's flat vector and back, and what a rank holds of it.

One interface for flat and owner buckets alike (see :mod:`mlx_fsdp.plan`):
a bucket is a flat vector of ``N * cols`` elements in which each slot is a
contiguous run ``[start, stop)`` and everything else is zero padding; rank
``r``'s shard is ``[r * cols, (r + 1) * cols)``.

What a rank *holds* of a slot is the part of it in the rank's shard: a 1-D
piece of a flat bucket's array (possibly empty, possibly all of it), the
whole array, shaped, of an owner bucket (on its owner only), or its rows,
shaped, of a rows bucket (see :mod:`mlx_fsdp.rows`; a gradient plan may
enumerate a rank's rows column by column, :mod:`mlx_fsdp.columns`). The optimizer updates
held arrays one by one, so its temporaries are as small as an array, and
its state is per array.

* :func:`pack_parts` gives the parts of the whole vector from full arrays
  (the gradients to reduce-scatter);
* :func:`held` cuts what a rank holds out of its shard (the reduced
  gradients), :func:`held_of` out of full arrays (the parameters);
* :func:`range_parts` gives the parts of a rank's shard from full arrays,
  :func:`held_parts` from what it holds (the updated parameters to all-gather);
* :func:`unpack` cuts the whole vector (the gathered parameters) back into
  arrays: slices and reshapes, views with no copy.
"""

from typing import Callable, Dict, List, Optional, Sequence, Tuple

import mlx.core as mx

from . import rows as _rows
from .plan import Bucket, Slot


def flatten(slot: Slot, a: mx.array) -> mx.array:
    """The elements of an array (the slot's, or a block of its rows) in the slot's order.

    Already flat input is returned as it is: its elements are in that order.
    """
    if slot.order == "F" and a.ndim == 2:
        return a.T.reshape(-1)
    return a.reshape(-1)


def unflatten(slot: Slot, flat: mx.array, shape=None) -> mx.array:
    """The array of ``shape`` (default: the slot's) from its elements in the slot's order."""
    shape = slot.shape if shape is None else tuple(shape)
    if slot.order == "F" and len(shape) == 2:
        return flat.reshape(shape[::-1]).T
    return flat.reshape(shape)


def empty_of(a: mx.array) -> mx.array:
    """A ``(0,)`` slice of ``a``: a dependency on ``a`` that holds none of its data.

    The slice is taken before the reshape: reshaping a transposed view (as
    many weight gradients are) first would copy the whole array.
    """
    return a[(slice(0, 0),) * a.ndim].reshape(-1) if a.ndim else a.reshape(-1)[:0]


def held_range(bucket: Bucket, slot: Slot, rank: int) -> Optional[Tuple[int, int]]:
    """``[begin, end)`` of the slot's own elements in ``rank``'s shard, or ``None``."""
    if bucket.by_rows:
        lo, hi = _rows.held_rows(slot.shape, slot.rows, rank)
        size = _rows.row_size(slot.shape)
        return (lo * size, hi * size) if hi > lo and size else None
    lo, hi = bucket.shard(rank)
    begin, end = max(slot.start, lo), min(slot.stop, hi)
    return (begin - slot.start, end - slot.start) if begin < end else None


def held_shape(bucket: Bucket, slot: Slot, rank: int) -> Tuple[int, ...]:
    """The shape of what ``rank`` holds of the slot (``(0,)`` or ``(0, ...)`` if nothing)."""
    if bucket.by_rows:
        return _rows.held_shape(slot.shape, slot.rows, rank)
    r = held_range(bucket, slot, rank)
    if bucket.owned:
        return slot.shape if r is not None else (0,)
    return (r[1] - r[0],) if r is not None else (0,)


def _in_shard(bucket: Bucket, slot: Slot, rank: int, begin: int) -> int:
    """Where element ``begin`` of the slot sits in ``rank``'s shard."""
    if bucket.by_rows:
        return slot.start
    return slot.start + begin - bucket.shard(rank)[0]


def _runs(bucket: Bucket, lo: int, hi: int, part: Callable, dtype) -> List[mx.array]:
    """Parts of elements ``[lo, hi)`` of the vector: ``part(slot, begin, end)`` and zero gaps."""
    if bucket.by_rows:
        return [p for r in range(lo // bucket.cols, hi // bucket.cols)
                for p in _row_runs(bucket, r, part, dtype)]
    parts, at = [], lo
    for s in bucket.slots:
        if s.stop <= lo or s.start >= hi:
            continue
        if s.start > at:
            parts.append(mx.zeros((s.start - at,), dtype))
        begin, end = max(s.start, lo), min(s.stop, hi)
        p = part(s, begin - s.start, end - s.start)
        parts.append(p if p.dtype == dtype else p.astype(dtype))
        at = end
    if at < hi:
        parts.append(mx.zeros((hi - at,), dtype))
    return parts


def _row_runs(bucket: Bucket, rank: int, part: Callable, dtype) -> List[mx.array]:
    """Parts of ``rank``'s shard of a rows bucket: each slot's rows, then its padding rows."""
    parts = []
    for s in bucket.slots:
        run = s.rows * _rows.row_size(s.shape)
        r = held_range(bucket, s, rank)
        if r is not None:
            p = part(s, *r)
            parts.append(p if p.dtype == dtype else p.astype(dtype))
        if run > (r[1] - r[0] if r else 0):
            parts.append(mx.zeros((run - (r[1] - r[0] if r else 0),), dtype))
    return parts


def _slice_of(arrays):
    def part(s: Slot, begin: int, end: int) -> mx.array:
        if s.rows:
            # A block of rows: a view even of a transposed array, flattened alone
            # (in column order, see :mod:`mlx_fsdp.columns`, without a strided copy).
            size = _rows.row_size(s.shape)
            a = arrays[s.index]
            return flatten(s, a if not s.shape else a[begin // size:end // size])
        flat = flatten(s, arrays[s.index])
        return flat if (begin, end) == (0, s.size) else flat[begin:end]
    return part


def join(parts: List[mx.array], dtype) -> mx.array:
    """Concatenate ``parts`` (one part: itself, no copy), cast to ``dtype``."""
    parts = [p if p.dtype == dtype else p.astype(dtype) for p in parts]
    return parts[0] if len(parts) == 1 else mx.concatenate(parts)


def pack_parts(bucket: Bucket, arrays: Sequence[mx.array], world_size: int) -> List[mx.array]:
    """The parts whose concatenation is the bucket's flat vector.

    Args:
        bucket (Bucket): The bucket.
        arrays (list[array]): The full arrays of the flattened tree, indexed
            by ``Slot.index`` (gradients).
        world_size (int): The number of ranks.

    Returns:
        list[array]: 1-D parts in the bucket's dtype: the arrays (views) and
        zero padding. A lone array without padding is one part.
    """
    return _runs(bucket, 0, world_size * bucket.cols, _slice_of(arrays), getattr(mx, bucket.dtype))


def pack(bucket: Bucket, arrays: Sequence[mx.array], world_size: int) -> mx.array:
    """The bucket's flat vector of ``world_size * bucket.cols`` elements (see :func:`pack_parts`)."""
    return join(pack_parts(bucket, arrays, world_size), getattr(mx, bucket.dtype))


def held(bucket: Bucket, shard: mx.array, rank: int) -> List[Tuple[Slot, mx.array]]:
    """What ``rank`` holds of each slot, cut from its ``(cols,)`` shard of the vector.

    Returns:
        list: ``(slot, array)`` for every slot with elements in the shard: a
        1-D piece (flat bucket) or the whole array, shaped (owner bucket).
        Views of ``shard``.
    """
    out = []
    for s in bucket.slots:
        r = held_range(bucket, s, rank)
        if r is not None:
            at = _in_shard(bucket, s, rank, r[0])
            piece = shard[at:at + r[1] - r[0]]
            out.append((s, piece if not (bucket.owned or bucket.by_rows)
                        else unflatten(s, piece, held_shape(bucket, s, rank))))
    return out


def held_of(bucket: Bucket, arrays: Sequence[mx.array], rank: int) -> List[Tuple[Slot, mx.array]]:
    """What ``rank`` holds of each slot, cut from full arrays (see :func:`held`).

    In a bucket with ``sharded_params`` the model holds only those parts,
    and ``arrays`` are they.
    """
    part = _slice_of(arrays)
    out = []
    for s in bucket.slots:
        r = held_range(bucket, s, rank)
        if r is None:
            continue
        a = arrays[s.index]
        if bucket.by_rows and s.shape and not bucket.sharded_params:
            a = a[r[0] // _rows.row_size(s.shape):r[1] // _rows.row_size(s.shape)]
        out.append((s, a if bucket.owned or bucket.by_rows else part(s, *r)))
    return out


def held_parts(bucket: Bucket, values: Dict[int, mx.array], rank: int,
               dtype: Optional[mx.Dtype] = None) -> List[mx.array]:
    """The parts whose concatenation is ``rank``'s shard, from what it holds.

    Args:
        bucket (Bucket): The bucket.
        values (dict): ``{slot.index: array}`` for every slot ``rank`` holds,
            as :func:`held` gives them (pieces or whole arrays).
        rank (int): The rank.
        dtype (Dtype, optional): The parts' dtype. Default: the bucket's
            parameter dtype.

    Returns:
        list[array]: 1-D parts, zero where the shard is padding.
    """
    lo, hi = bucket.shard(rank)
    return _runs(bucket, lo, hi, lambda s, b, e: flatten(s, values[s.index]),
                 dtype or getattr(mx, bucket.param_dtype))


def range_parts(bucket: Bucket, arrays: Sequence[mx.array], rank: int, dtype) -> List[mx.array]:
    """The parts whose concatenation is ``rank``'s shard, from full arrays.

    Args:
        bucket (Bucket): The bucket.
        arrays (list[array]): Full arrays indexed by ``Slot.index``.
        rank (int): The shard to build.
        dtype (Dtype): The parts' dtype.

    Returns:
        list[array]: 1-D parts (views where possible), zero where the shard is padding.
    """
    lo, hi = bucket.shard(rank)
    return _runs(bucket, lo, hi, _slice_of(arrays), dtype)


def copies_out(bucket: Bucket, world_size: int) -> bool:
    """Whether :func:`unpack` copies a flat or owner bucket's arrays out of its
    gathered vector (a quarter or more of it padding) instead of returning views."""
    return not bucket.by_rows and 4 * bucket.padding(world_size) > world_size * bucket.cols


def unpack(bucket: Bucket, vector: mx.array) -> List[mx.array]:
    """The bucket's arrays, in slot order, cut from its whole flat vector.

    Views of the vector, so no copy, except where most of the vector is
    padding: the views would keep it all alive for as long as the
    parameters live. That happens in an owner bucket whose arrays are uneven
    (one large array: ``N`` times its size), and there the arrays are copied
    out so that the vector is freed. An array of a rows bucket with others
    beside it is ``N`` runs of the vector, and is copied out too.

    Args:
        bucket (Bucket): The bucket.
        vector (array): The vector (the all-gathered shards).

    Returns:
        list[array]: The arrays, in the bucket's parameter dtype.
    """
    dtype = getattr(mx, bucket.param_dtype)
    if bucket.by_rows:
        return [a if a.dtype == dtype else a.astype(dtype) for a in _unpack_rows(bucket, vector)]
    copy = copies_out(bucket, vector.size // bucket.cols)
    out = []
    for s in bucket.slots:
        part = vector if (s.start, s.size) == (0, vector.size) else vector[s.start:s.stop]
        a = unflatten(s, part)
        if a.dtype != dtype:
            a = a.astype(dtype)
        elif copy:
            a = a * 1  # a new buffer (``mx.contiguous`` keeps a contiguous view); exact, -0.0 too
        out.append(a)
    return out


def _unpack_rows(bucket: Bucket, vector: mx.array) -> List[mx.array]:
    if any(s.order == "F" for s in bucket.slots):
        raise ValueError("A rows bucket in column order is a gradient plan; gather the "
                         "parameters with the plan in row order (see mlx_fsdp.columns).")
    n = vector.size // bucket.cols
    if len(bucket.slots) == 1:
        blocks = [vector]
    else:
        matrix = vector.reshape(n, bucket.cols)
        blocks = [matrix[:, s.start:s.start + s.rows * _rows.row_size(s.shape)]
                  for s in bucket.slots]
    out = []
    for s, block in zip(bucket.slots, blocks):
        if not s.shape:
            out.append(block.reshape(-1)[0])
            continue
        rows = block.reshape((n * s.rows,) + tuple(s.shape[1:]))
        out.append(rows if n * s.rows == s.shape[0] else rows[:s.shape[0]])
    return out
