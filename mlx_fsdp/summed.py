"""Owner buckets that are mostly padding: all-summed without it.

An owner bucket's vector is ``N`` shards as long as the longest owner's
arrays (:mod:`mlx_fsdp.owners`). An array too large to share a bucket
(more than the budget over ``N``) gets one of its own, and then ``N - 1`` of
its ``N`` shards are zeros: the reduce-scatter takes ``N`` times the array
from every rank, and the all-gather returns ``N`` times it to every rank.
Muon and Adafactor put every large matrix in such a bucket.

A bucket that is more than half padding (:meth:`mlx_fsdp.plan.Bucket.summed`)
is therefore all-summed as its arrays alone, back to back in slot order:

* reduce: every rank all-sums its full gradients; each owner keeps its own
  arrays of the sum (copied out where the rank owns only some of them, so
  that the rest is freed), the other ranks nothing;
* gather: the owner sends its updated arrays and every other rank ``-0.0``,
  the additive identity of IEEE floats (``x + -0.0`` is ``x``, ``-0.0``
  included), so that the sum is the owner's array bit for bit.

For one array of ``S`` elements at ``N`` ranks, a ring all-sum sends about
``2 (N - 1) / N * S`` per rank, where the padded reduce-scatter and
all-gather each send ``(N - 1) * S``; the buffers are ``2 S`` instead of
``N S`` plus the shard. At ``N = 2`` a lone array's bucket is exactly half
padding and both ways send ``S``: there the padded one stays (the two-rank
exchange of :mod:`mlx_fsdp.collectives`).
"""

from typing import Dict, List, Sequence, Tuple

import mlx.core as mx

from . import layout
from .plan import Bucket, Slot


def elements(bucket: Bucket) -> int:
    """Elements of the summed vector: the bucket's arrays, no padding."""
    return sum(s.size for s in bucket.slots)


def gradient_parts(bucket: Bucket, grads: Sequence[mx.array]) -> List[mx.array]:
    """The parts of the vector a rank all-sums in the backward pass: its full gradients."""
    return [layout.flatten(s, grads[s.index]) for s in bucket.slots]


def parameter_parts(bucket: Bucket, mine: Dict[int, mx.array], rank: int,
                    dtype) -> List[mx.array]:
    """The parts of the vector a rank all-sums to gather: its own arrays, ``-0.0`` elsewhere
    (cast to the parameters' dtype where they are joined).

    Args:
        bucket (Bucket): The bucket.
        mine (dict): ``{slot.index: array}`` for the slots ``rank`` owns.
        rank (int): This rank.
        dtype (Dtype): The parameters' dtype.
    """
    return [layout.flatten(s, mine[s.index]) if s.owner == rank
            else mx.full((s.size,), -0.0, dtype) for s in bucket.slots]


def unpack(bucket: Bucket, vector: mx.array) -> List[mx.array]:
    """Every slot's array cut from the summed vector, in slot order (views)."""
    out, at = [], 0
    for s in bucket.slots:
        part = vector if s.size == vector.size else vector[at:at + s.size]
        out.append(layout.unflatten(s, part))
        at += s.size
    return out


def owned(bucket: Bucket, vector: mx.array, rank: int) -> List[Tuple[Slot, mx.array]]:
    """``(slot, array)`` of the arrays ``rank`` owns, cut from the summed vector.

    Copies, unless they are the whole vector: a view would keep the other
    owners' arrays alive until the update.
    """
    mine = [(s, a) for s, a in zip(bucket.slots, unpack(bucket, vector)) if s.owner == rank]
    if sum(s.size for s, _ in mine) == vector.size:
        return mine
    return [(s, a * 1) for s, a in mine]  # a new buffer, exact (-0.0 too)
