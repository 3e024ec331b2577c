"""Matching a gradient tree to its parameters, and rebuilding trees."""

from typing import Any, List, Sequence, Tuple

import mlx.core as mx
from mlx.utils import tree_flatten, tree_map


def match(gradients: Any, parameters: Any) -> Tuple[List[Tuple[str, mx.array]], List[mx.array]]:
    """Flatten ``gradients`` and pick the parameter of every gradient.

    ``parameters`` may be a superset of ``gradients`` (a whole model with frozen
    parts), as with :meth:`mlx.optimizers.Optimizer.apply_gradients`.

    Args:
        gradients: A tree of gradient arrays.
        parameters: A tree (or ``mlx.nn.Module``) holding a parameter for every
            gradient path.

    Returns:
        tuple: ``(path, gradient)`` pairs in tree order, and the parameters in
        the same order.
    """
    flat_grads = tree_flatten(gradients)
    by_path = dict(tree_flatten(parameters))
    flat_params = []
    for path, g in flat_grads:
        if not isinstance(g, mx.array):
            raise ValueError(
                f"The gradient at '{path}' is a {type(g).__name__}, not an mx.array; "
                "pass the tree that nn.value_and_grad returns."
            )
        p = by_path.get(path)
        if p is None:
            raise ValueError(
                f"The gradient at '{path}' has no parameter at that path; the "
                "gradient tree must be a subtree of the parameters (check that "
                "both come from the same model)."
            )
        if p.shape != g.shape:
            raise ValueError(
                f"The gradient at '{path}' has shape {tuple(g.shape)} but the "
                f"parameter has shape {tuple(p.shape)}; they must match."
            )
        flat_params.append(p)
    return flat_grads, flat_params


def like(tree: Any, values: Sequence[mx.array]) -> Any:
    """A tree with the structure of ``tree`` whose leaves are ``values`` in order."""
    it = iter(values)
    return tree_map(lambda _: next(it), tree)


def accumulate(carry: dict, items, keep: bool) -> list:
    """Add ``items`` (``(key, array or None)`` pairs) to the sums in ``carry``.

    Used by gradient accumulation for whole gradients and for shard pieces.
    ``carry`` is emptied, then refilled with the sums when ``keep`` is true
    (more micro-batches follow); ``None`` entries (arrays another rank owns)
    are passed through.

    Returns:
        list: The sums, in the order of ``items``.
    """
    items = list(items)
    sums = [a + carry[k] if a is not None and k in carry else a for k, a in items]
    carry.clear()
    if keep:
        carry.update((k, a) for (k, _), a in zip(items, sums) if a is not None)
    return sums
