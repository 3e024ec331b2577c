"""Row placement: every rank holds its axis-0 slice of an array.

This is the layout :func:`mlx_fsdp.fully_shard` keeps parameters in, the
one ``mlx.nn.fully_shard`` uses: an array of ``R`` rows is cut into ``N``
chunks of ``k = ceil(R / N)`` rows, rank ``r`` holding rows
``[r * k, min((r + 1) * k, R))``. When ``R`` does not divide by ``N`` the
last ranks hold fewer rows, possibly none; a scalar counts as one row,
held by rank 0.

In a bucket's flat vector (see :mod:`mlx_fsdp.plan`) every rank's shard
gives each array a run of ``k`` rows, the rows it holds followed by zero
padding, so that the shards of all ranks are equally long. All-gathering
the shards gives an ``(N, cols)`` matrix whose column block of an array,
read row by row, is the array with its padding rows at the end.
"""

from math import prod
from typing import List, Tuple

#: Layout of one array in a bucket: ``(index, path, shape, size, rows, offset)``,
#: ``rows`` being ``k`` and ``offset`` where its run starts in every shard.
Entry = Tuple[int, str, Tuple[int, ...], int, int, int]


def num_rows(shape: Tuple[int, ...]) -> int:
    """The rows an array is cut into: its axis 0, or 1 for a scalar."""
    return shape[0] if shape else 1


def row_size(shape: Tuple[int, ...]) -> int:
    """Elements per row."""
    return prod(shape[1:])


def chunk(shape: Tuple[int, ...], n: int) -> int:
    """``k``: rows per rank, the last ranks' chunks padded to it."""
    return -(-num_rows(shape) // n)


def held_rows(shape: Tuple[int, ...], k: int, rank: int) -> Tuple[int, int]:
    """``[lo, hi)``: the rows ``rank`` holds (``lo == hi`` when it holds none)."""
    rows = num_rows(shape)
    lo = min(rank * k, rows)
    return lo, min(lo + k, rows)


def holds(shape: Tuple[int, ...], k: int, rank: int) -> bool:
    """Whether ``rank`` holds any row."""
    lo, hi = held_rows(shape, k, rank)
    return hi > lo


def held_shape(shape: Tuple[int, ...], k: int, rank: int) -> Tuple[int, ...]:
    """The shape of what ``rank`` holds: ``(hi - lo, *shape[1:])``.

    A scalar is held whole by rank 0; the other ranks hold an empty ``(0,)``.
    """
    lo, hi = held_rows(shape, k, rank)
    if not shape:
        return () if hi > lo else (0,)
    return (hi - lo,) + tuple(shape[1:])


def layout(entries, n: int, itemsize: int, budget: int) -> List[Tuple[int, List[Entry]]]:
    """Split arrays, in tree order, into buckets of row-sharded arrays.

    A bucket is closed before an array whose padded size would take it past
    ``budget`` bytes, as flat buckets are.

    Args:
        entries (list): ``(index, path, shape)`` in tree order.
        n (int): Number of ranks.
        itemsize (int): Bytes per element of the communication dtype.
        budget (int): Byte budget of a bucket's ``n * cols`` elements; ``<= 0``
            gives every array its own bucket.

    Returns:
        list: Per bucket, ``(cols, entries)``.
    """
    buckets, current, cols = [], [], 0
    for index, path, shape in entries:
        k = chunk(shape, n)
        run = k * row_size(shape)
        if current and (budget <= 0 or n * (cols + run) * itemsize > budget):
            buckets.append((cols, current))
            current, cols = [], 0
        size = num_rows(shape) * row_size(shape)
        current.append((index, path, tuple(shape), size, k, cols))
        cols += run
    if current:
        buckets.append((cols, current))
    return buckets
