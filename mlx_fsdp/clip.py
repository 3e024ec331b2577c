"""Global-norm clipping shared by the sharded and the replicated step."""

from typing import List, Sequence

import mlx.core as mx
from mlx.utils import tree_flatten

from ._trees import like


def sum_of_squares(arrays: Sequence[mx.array]) -> mx.array:
    """The sum of squares of all elements, accumulated in float32.

    The sum runs in float32 so that bfloat16 gradients do not lose the norm; for
    float32 gradients the operations are exactly those of
    ``mlx.optimizers.clip_grad_norm``. Zero padding adds nothing.

    Args:
        arrays (list[array]): The arrays.

    Returns:
        array: A float32 scalar.
    """
    total = 0.0
    for a in arrays:
        total = total + a.astype(mx.float32).square().sum()
    return total if isinstance(total, mx.array) else mx.array(total, mx.float32)


def global_norm(arrays: Sequence[mx.array], group=None, *, order=None, stream=None) -> mx.array:
    """The L2 norm of arrays whose elements are split over ``group``.

    Args:
        arrays (list[array]): This rank's part of the elements. Every element
            must be held by exactly one rank of ``group``.
        group (mlx.core.distributed.Group, optional): The group the elements
            are split over; ``None`` means they are all local. Default: ``None``.
        order (CollectiveOrder, optional): Chains the norm's collective after
            the step's previous one (see :mod:`mlx_fsdp.order`).
            Default: ``None``.
        stream (mlx.core.Stream, optional): Stream of the collective.
            Default: ``None``.

    Returns:
        array: The float32 norm, the same on every rank.
    """
    squares = sum_of_squares(arrays)
    if group is not None and group.size() > 1:
        # Every rank sums the same gathered values in the same order, so the
        # norm agrees across ranks. On ring a small all_sum has a fixed cost
        # of several ms that all_gather does not have (see collectives.py).
        if order is not None:
            squares = order.chain(squares)
        squares = mx.distributed.all_gather(squares.reshape(1), group=group, stream=stream)
        if order is not None:
            order.ran(squares)
        squares = squares.sum()
    return mx.sqrt(squares)


def clip_by_norm(
    arrays: Sequence[mx.array], norm: mx.array, max_norm: float
) -> List[mx.array]:
    """Scale ``arrays`` so that a total norm of ``norm`` becomes at most ``max_norm``.

    Uses the same scale as ``mlx.optimizers.clip_grad_norm``:
    ``min(max_norm / (norm + 1e-6), 1)``. A NaN or infinite ``norm`` makes the
    scale NaN or zero, as it does there: the step then writes NaN (or leaves
    the update to the optimizer's other terms), and the norm reports it.

    Args:
        arrays (list[array]): The arrays to scale.
        norm (array): Their total norm, e.g. from :func:`global_norm`.
        max_norm (float): The largest norm allowed.

    Returns:
        list[array]: The scaled arrays, each in its own dtype.
    """
    scale = mx.minimum(max_norm / (norm + 1e-6), 1.0)
    return [(a * scale).astype(a.dtype) for a in arrays]


def clip_tree(tree, max_norm: float):
    """Clip a tree of full (unsharded) arrays by its global norm.

    Args:
        tree: A tree of arrays.
        max_norm (float): The largest norm allowed.

    Returns:
        tuple: The clipped tree and its norm before clipping.
    """
    arrays = [a for _, a in tree_flatten(tree)]
    norm = global_norm(arrays)
    return like(tree, clip_by_norm(arrays, norm, max_norm)), norm
