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

Layout. An owner bucket's flat vector is ``N`` shards of ``cols`` elements,
like any bucket's, but shard ``r`` holds the whole (flattened) arrays that
rank ``r`` owns, back to back, zero-padded to the longest shard. The
reduce-scatter then leaves each owner exactly its whole arrays, and the
all-gather returns them to every rank. Arrays enter buckets one per owner in
turn (each owner's arrays in tree order), so that the shards of a bucket stay
about equally long and padding stays small.
"""

from math import prod
from typing import Dict, Sequence, Tuple


def cost(shape: Tuple[int, ...]) -> int:
    """The balancing weight of updating an array of ``shape`` on its owner.

    Args:
        shape (tuple): The array's shape.

    Returns:
        int: ``rows * cols * min(rows, cols)`` for >= 2 dimensions, the size otherwise.
    """
    if len(shape) >= 2:
        rows, cols = shape[0], prod(shape[1:])
        return rows * cols * min(rows, cols)
    return prod(shape)


def assign(arrays: Sequence[Tuple[str, Tuple[int, ...], int]], n: int,
           start: Sequence[Tuple[int, int]] = ()) -> Dict[str, int]:
    """Owner ranks by a deterministic longest-processing-time greedy.

    Args:
        arrays (list): ``(path, shape, itemsize)`` of every owner-placed array.
        n (int): Number of ranks.
        start (list, optional): ``(cost, bytes)`` each rank already owns (of
            modules wrapped before, with :func:`mlx_fsdp.fully_shard`), so
            that one module after the other balances the whole model.
            Default: none.

    Returns:
        dict: ``{path: rank}``.
    """
    keyed = sorted(
        (-cost(shape), -prod(shape) * itemsize, path) for path, shape, itemsize in arrays
    )
    loads = [(*(start[r] if start else (0, 0)), r) for r in range(n)]
    owner = {}
    for neg_cost, neg_bytes, path in keyed:
        c, b, r = min(loads)
        owner[path] = r
        loads[r] = (c - neg_cost, b - neg_bytes, r)
    return owner


def layout(entries: Sequence[tuple], owner: Dict[str, int], n: int, itemsize: int, budget: int):
    """Split owner-placed arrays into buckets whose shards are whole arrays.

    Args:
        entries (list): ``(index, path, shape)`` in tree order, all of one
            sub-optimizer and dtype pair.
        owner (dict): ``{path: rank}``.
        n (int): Number of ranks.
        itemsize (int): Bytes per element of the communication dtype.
        budget (int): Byte budget of a bucket's ``n * cols`` elements; ``<= 0``
            gives every array its own bucket.

    Returns:
        list: Per bucket, ``(cols, [(index, path, shape, size, owner, offset)])``,
        ``offset`` being where the array starts in its owner's shard.
    """
    per_rank = [[] for _ in range(n)]
    for e in entries:
        per_rank[owner[e[1]]].append(e)
    # One array of each owner in turn keeps the shards of a bucket even.
    order = [
        per_rank[r][j]
        for j in range(max(len(q) for q in per_rank))
        for r in range(n)
        if j < len(per_rank[r])
    ]
    buckets, current, rows = [], [], [0] * n
    for index, path, shape in order:
        size, r = prod(shape), owner[path]
        longest = max(max(rows), rows[r] + size)
        if current and (budget <= 0 or n * longest * itemsize > budget):
            buckets.append((max(rows), current))
            current, rows = [], [0] * n
        current.append((index, path, tuple(shape), size, r, rows[r]))
        rows[r] += size
    buckets.append((max(rows), current))
    return buckets
