"""Owner placement: whole arrays on one rank, for shape-aware optimizers.

Muon's Newton-Schulz and Adafactor's factored statistics need a whole matrix,
so an array with the ``"owner"`` placement is not cut into flat pieces: it is
updated whole, by the unmodified optimizer, on one owner rank.

Owners. Ranks get arrays by a longest-processing-time greedy on the update's
cost: arrays sorted by decreasing cost (then bytes, then path), each given to
the rank with the least cost so far (then least bytes, then lowest rank). The
cost of a ``(rows, ...)`` array of >= 2 dimensions is ``rows * cols * min(rows,
cols)`` with ``cols`` the product of the other dimensions (a Newton-Schulz
iteration on the ``(rows, cols)`` view Muon takes), and its size otherwise.
The greedy is deterministic, so every rank computes the same owners.

Layout. An owner bucket is ``(N, cols)`` like any bucket, but row ``r`` holds
the whole (flattened) arrays that rank ``r`` owns, concatenated and
zero-padded to the longest row. The reduce-scatter then leaves each owner
exactly its whole arrays, and the all-gather returns them to every rank. A
slot of such a bucket has ``owner = r``, ``cols = size`` and covers columns
``[offset, offset + size)`` of row ``r``. Arrays enter buckets one per owner
in turn (each owner's arrays in tree order), so that rows of a bucket stay
about equally long and padding stays small.
"""

from typing import Dict, List, Optional, Sequence, Tuple

import mlx.core as mx


def _prod(shape) -> int:
    size = 1
    for d in shape:
        size *= d
    return size


def cost(shape: Tuple[int, ...]) -> int:
    """The balancing weight of updating an array of ``shape`` on its owner.

    Args:
        shape (tuple): The array's shape.

    Returns:
        int: ``rows * cols * min(rows, cols)`` for >= 2 dimensions, the size otherwise.
    """
    if len(shape) >= 2:
        rows, cols = shape[0], _prod(shape[1:])
        return rows * cols * min(rows, cols)
    return _prod(shape)


def assign(arrays: Sequence[Tuple[str, Tuple[int, ...], int]], n: int) -> Dict[str, int]:
    """Owner ranks by a deterministic longest-processing-time greedy.

    Args:
        arrays (list): ``(path, shape, itemsize)`` of every owner-placed array.
        n (int): Number of ranks.

    Returns:
        dict: ``{path: rank}``.
    """
    keyed = sorted(
        (-cost(shape), -_prod(shape) * itemsize, path) for path, shape, itemsize in arrays
    )
    loads = [(0, 0, r) for r in range(n)]
    owner = {}
    for neg_cost, neg_bytes, path in keyed:
        c, b, r = min(loads)
        owner[path] = r
        loads[r] = (c - neg_cost, b - neg_bytes, r)
    return owner


def loads(arrays: Sequence[Tuple[str, Tuple[int, ...], int]], owner: Dict[str, int], n: int) -> List[int]:
    """The total :func:`cost` each rank owns.

    Args:
        arrays (list): ``(path, shape, itemsize)`` of the owner-placed arrays.
        owner (dict): ``{path: rank}`` from :func:`assign`.
        n (int): Number of ranks.

    Returns:
        list[int]: The cost per rank.
    """
    out = [0] * n
    for path, shape, _ in arrays:
        out[owner[path]] += cost(shape)
    return out


def layout(entries: Sequence[tuple], owner: Dict[str, int], n: int, itemsize: int, budget: int):
    """Split owner-placed arrays into buckets whose rows are whole arrays.

    Args:
        entries (list): ``(index, path, shape)`` in tree order, all of one
            sub-optimizer and dtype pair.
        owner (dict): ``{path: rank}``.
        n (int): Number of ranks.
        itemsize (int): Bytes per element of the communication dtype.
        budget (int): Byte budget of a packed ``(n, cols)`` bucket; ``<= 0``
            gives every array its own bucket.

    Returns:
        list: Per bucket, ``(cols, [(index, path, shape, size, owner, offset)])``.
    """
    per_rank = [[] for _ in range(n)]
    for e in entries:
        per_rank[owner[e[1]]].append(e)
    # One array of each owner in turn keeps the rows of a bucket even.
    order = [
        per_rank[r][j]
        for j in range(max(len(q) for q in per_rank))
        for r in range(n)
        if j < len(per_rank[r])
    ]
    buckets, current, rows = [], [], [0] * n
    for index, path, shape in order:
        size, r = _prod(shape), owner[path]
        longest = max(max(rows), rows[r] + size)
        if current and (budget <= 0 or n * longest * itemsize > budget):
            buckets.append((max(rows), current))
            current, rows = [], [0] * n
        current.append((index, path, tuple(shape), size, r, rows[r]))
        rows[r] += size
    buckets.append((max(rows), current))
    return buckets


# The step's side of the layout, for buckets whose ``owned`` is true.


def pack(bucket, grads: Sequence[mx.array], n: int) -> mx.array:
    """Lay out an owner bucket's gradients as ``(n, bucket.cols)``, row ``r`` = rank ``r``'s arrays."""
    rows = [[] for _ in range(n)]
    for slot in bucket.slots:
        rows[slot.owner].append(grads[slot.index].reshape(-1))
    dtype = grads[bucket.slots[0].index].dtype
    return mx.stack([_row(parts, bucket.cols, dtype) for parts in rows])


def _row(parts: List[mx.array], cols: int, dtype) -> mx.array:
    used = sum(p.size for p in parts)
    if used < cols:
        parts = parts + [mx.zeros((cols - used,), dtype)]
    return parts[0] if len(parts) == 1 else mx.concatenate(parts)


def whole(slot, shard: mx.array) -> mx.array:
    """The whole array of an owned slot, cut from the owner's bucket shard."""
    return shard[slot.offset : slot.offset + slot.size].reshape(slot.shape)


def row(bucket, pieces: Sequence[Optional[mx.array]], rank: int) -> mx.array:
    """This rank's ``(bucket.cols,)`` row of updated arrays, to be all-gathered.

    Rows are cast to the bucket's parameter dtype, which unpacking would do
    anyway, so that every rank sends the same dtype. A rank that owns nothing
    in the bucket sends zeros; the step chains every all-gather after the
    previous collective, so it still runs on every rank.

    Args:
        bucket (Bucket): An owner bucket.
        pieces (list): The updated array of each slot this rank owns, ``None``
            for the others.
        rank (int): This rank.

    Returns:
        array: The row.
    """
    dtype = getattr(mx, bucket.param_dtype)
    parts = [
        p.reshape(-1).astype(dtype) for s, p in zip(bucket.slots, pieces) if s.owner == rank
    ]
    return _row(parts, bucket.cols, dtype)


def unpack(bucket, gathered: mx.array) -> List[mx.array]:
    """Split a gathered owner bucket into its arrays, in slot order."""
    dtype = getattr(mx, bucket.param_dtype)
    return [
        gathered[s.owner, s.offset : s.offset + s.size].reshape(s.shape).astype(dtype)
        for s in bucket.slots
    ]
