"""Recompute a function in the backward pass, once its output's cotangents exist.

``mx.checkpoint`` recomputes a function in the backward pass, but its
recomputation depends only on the function's outputs, so MLX may run it as
soon as the forward pass has: the recomputed activations (and the
parameters a fully sharded block gathers again) can then exist for several
blocks at once. Here the recomputation depends on the cotangents, which
exist only once the backward pass has reached the function. On a chain of 8
blocks of three 1024 x 512 activations whose gradients are consumed in order
(as fully sharded blocks consume them, see :mod:`.gather`), the backward
pass peaked at 29 MiB against 39 MiB with ``mx.checkpoint`` and 100 MiB
without recomputation (CPU, memory limit 1 MiB, so that evaluation does not
allocate ahead; 72, 78 and 134 MiB without the limit):
``benchmarks/bench_remat.py``.
"""

from typing import Any, Callable

import mlx.core as mx
from mlx.utils import tree_flatten, tree_map


class _Slot:
    """Where an array was in a tree whose arrays must not be kept alive."""


def _arrays(tree) -> list:
    return [v for _, v in tree_flatten(tree) if isinstance(v, mx.array)]


def _with_arrays(tree, arrays):
    """``tree`` with its arrays (or slots), in ``tree_flatten`` order, replaced by ``arrays``."""
    it = iter(arrays)
    return tree_map(lambda v: next(it) if isinstance(v, (mx.array, _Slot)) else v, tree)


def remat(fn: Callable, *args, **kwargs) -> Any:
    """``fn(*args, **kwargs)``, recomputed in the backward pass when it is needed.

    Gradients flow to every array in ``args`` and ``kwargs`` (nested in
    lists, tuples and dicts); everything else is passed as it is.
    """
    inputs = (args, kwargs)
    template = {}

    def flat(*arrays):
        a, k = _with_arrays(inputs, arrays)
        out = fn(*a, **k)
        # The structure only: the recomputation's arrays must not outlive it.
        template["out"] = tree_map(lambda v: _Slot() if isinstance(v, mx.array) else v, out)
        return _arrays(out)

    @mx.custom_function
    def run(*arrays):
        return flat(*arrays)

    @run.vjp
    def run_vjp(primals, cotangents, _):
        cotangents = list(cotangents) if isinstance(cotangents, (list, tuple)) else [cotangents]
        primals = mx.depends(list(primals), cotangents)
        # Integer inputs (token ids) pass through: MLX has no gradient for them.
        wrt = [i for i, p in enumerate(primals) if mx.issubdtype(p.dtype, mx.inexact)]

        def of_floating(*arrays):
            every = list(primals)
            for i, a in zip(wrt, arrays):
                every[i] = a
            return flat(*every)

        grads = [mx.zeros_like(p) for p in primals]
        for i, g in zip(wrt, mx.vjp(of_floating, [primals[i] for i in wrt], cotangents)[1]):
            grads[i] = g
        return tuple(grads)

    outputs = run(*_arrays(inputs))
    outputs = outputs if isinstance(outputs, (list, tuple)) else [outputs]
    return _with_arrays(template["out"], outputs)
