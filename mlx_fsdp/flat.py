"""Flat placement: every rank holds 1/N of a bucket, for element-wise optimizers.

A flat bucket packs its arrays back to back, flattened, and pads at the end,
so an array may straddle two ranks' shards. An element-wise optimizer then
updates what a rank holds of each array exactly.

Element order. With ``N > 1`` a 2-D array of a flat bucket is enumerated
column by column (``Slot.order == "F"``), every other array row by row. MLX
returns the gradient of a ``Linear`` weight as a transposed view of a
row-major buffer; in column order that view flattens without a strided copy,
and the gathered weight comes back as a transposed view of the bucket. The
order is the plan's, never the memory layout's, so results do not depend on
how an array happens to be stored.
"""

from math import prod
from typing import List, Tuple


def layout(entries, n: int, itemsize: int, budget: int) -> List[Tuple[int, list]]:
    """Split arrays, in tree order, into flat buckets.

    Greedy: a bucket is closed before an array that would take it past
    ``budget`` bytes, so an array larger than the budget gets a bucket of its own.

    Args:
        entries (list): ``(index, path, shape)`` in tree order.
        n (int): Number of ranks.
        itemsize (int): Bytes per element of the communication dtype.
        budget (int): Byte budget of a bucket; ``<= 0`` gives every array its own.

    Returns:
        list: Per bucket, ``(cols, [(index, path, shape, size, start, order)])``.
    """
    groups, current, used = [], [], 0
    for entry in entries:
        nbytes = prod(entry[2]) * itemsize
        if current and (budget <= 0 or used + nbytes > budget):
            groups.append(current)
            current, used = [], 0
        current.append(entry)
        used += nbytes
    if current:
        groups.append(current)
    out = []
    for group in groups:
        placed, at = [], 0
        for index, path, shape in group:
            order = "F" if len(shape) == 2 and n > 1 else "C"
            placed.append((index, path, tuple(shape), prod(shape), at, order))
            at += prod(shape)
        out.append((-(-at // n), placed))
    return out
