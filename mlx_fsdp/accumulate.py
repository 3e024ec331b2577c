"""Gradient accumulation: sum the gradients of ``k`` micro-batches, step on the last.

The counter and the sums live in the wrapper's state (``state["micro_step"]``,
``state["accumulated"]``), as arrays, so that a compiled step carries them
and a checkpoint can hold them.

Called eagerly, :func:`add` reads the counter on the host and the step
branches in Python: a micro-batch that does not finish the step only adds its
gradients and communicates nothing more. Inside ``mx.compile`` the step's
Python runs once, while tracing, so it cannot branch on the counter: every
call then runs the whole step, and :func:`select` keeps the old parameters
and optimizer state on the micro-batches that do not finish it. (The first
compiled call starts with no sums and the second finds them, so a compiled
step is traced twice.)
"""

from typing import Any, List, Sequence, Tuple, Union

import mlx.core as mx
from mlx.utils import tree_map

Finish = Union[bool, mx.array]


def is_traced(x: mx.array) -> bool:
    """Whether ``x`` is a value being traced by ``mx.compile`` (it cannot be evaluated)."""
    try:
        mx.eval(x)
        return False
    except ValueError as e:
        if "transformations" not in str(e):
            raise
        return True


def add(state, items: Sequence[Tuple[str, mx.array]], k: int, traced: bool) -> Tuple[List[mx.array], Finish]:
    """Add this micro-batch's ``items`` to the sums in ``state["accumulated"]``.

    Args:
        state (WrapperState): The wrapper's state; its counter and sums are updated.
        items (list): ``(key, array)`` pairs: gradients by path, or shards by
            bucket key. Every call of one step must pass the same keys.
        k (int): Micro-batches per optimizer step.
        traced (bool): Inside ``mx.compile`` (see the module docstring).

    Returns:
        tuple: The sums including this micro-batch, and whether this
        micro-batch finishes the step: a Python bool when eager, a boolean
        array when traced.
    """
    carry = state["accumulated"]
    sums = [carry[key] + a if key in carry else a for key, a in items]
    if traced:
        micro = state["micro_step"] + 1
        finish = micro >= k
        state["micro_step"] = mx.where(finish, 0, micro)
        carry.clear()
        carry.update((key, mx.where(finish, mx.zeros_like(s), s)) for (key, _), s in zip(items, sums))
        return sums, finish
    micro = int(state["micro_step"].item()) + 1
    finish = micro >= k
    state["micro_step"] = mx.array(0 if finish else micro, mx.int32)
    carry.clear()
    if not finish:
        carry.update((key, s) for (key, _), s in zip(items, sums))
    return sums, finish


def select(finish: Finish, new: Any, old: Any) -> Any:
    """``new`` where the step finishes, ``old`` where it does not (leaf by leaf)."""
    if isinstance(finish, bool):
        return new if finish else old
    return tree_map(lambda a, b: mx.where(finish, a, b) if isinstance(a, mx.array) else a, new, old)


def snapshot(tree: Any) -> Any:
    """A copy of a tree's containers holding the same arrays (what :func:`select` keeps)."""
    return tree_map(lambda a: a, tree)


def restore(target: Union[dict, list], values: Union[dict, list]):
    """Put ``values`` (a tree shaped like ``target``) into ``target`` in place.

    Lists are entered too: a ``MultiOptimizer``'s ``state`` is a new dict
    around a new list of its parts' own state dicts, so only those dicts,
    changed in place, reach the optimizer.
    """
    for key, value in values.items() if isinstance(values, dict) else enumerate(values):
        if isinstance(value, (dict, list)) and type(target[key]) is type(value):
            restore(target[key], value)
        else:
            target[key] = value
