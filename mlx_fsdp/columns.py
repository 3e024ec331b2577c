"""Column order in rows buckets: reduce-scattering ``Linear`` weight gradients without a transpose.

``fully_shard`` gives every rank its axis-0 rows of a ``Linear`` weight
``W`` of shape ``(out, in)`` (see :mod:`mlx_fsdp.rows`). MLX returns the
weight's gradient as the transpose of an ``(in, out)`` row-major buffer
``G``: rows of ``W`` are columns of ``G``, so cutting the gradient into
rows copies every element through a stride. On the 2-core development CPU
that cut was 89 of the 215 ms the fully sharded MLP (4x2048, ring N=2)
spent above the plain forward and backward pass
(``benchmarks/bench_fully_parts.py``, part "weight gradients to rows").

A rows slot with ``Slot.order == "F"`` lays each rank's run out column by
column instead: the rows a rank holds, transposed, which are contiguous
runs of ``G``, followed by the padding rows' zeros. The reduce-scatter then
moves plain runs; each rank turns only its own ``1/N`` of the summed
gradient into rows (:func:`row_major`). Parameters are gathered in row
order all the same (the forward pass needs ``W`` itself), so the column
order is a property of the gradient plan only (:func:`column_plan`). The
choice is made by the module's type, before anything is evaluated (MLX
lays arrays out at evaluation): a wrong guess costs time, never bits.
"""

import dataclasses
from typing import Iterable

import mlx.core as mx
import mlx.nn as nn

from .plan import Plan, Slot

#: Rows per block of :func:`row_major`'s first pass on the CPU.
_BLOCK = 8


def linear_weights(module: nn.Module, paths: Iterable[str]) -> frozenset:
    """The paths among ``paths`` that are 2-D weights of ``nn.Linear`` layers in ``module``.

    Args:
        module (mlx.nn.Module): The module the paths are relative to.
        paths (iterable of str): Parameter paths, as ``tree_flatten`` names them.

    Returns:
        frozenset: The weights whose gradients MLX returns transposed.
    """
    modules = dict(module.named_modules())
    out = set()
    for path in paths:
        owner, _, key = path.rpartition(".")
        layer = modules.get(owner)
        if key == "weight" and isinstance(layer, nn.Linear) and layer.weight.ndim == 2:
            out.add(path)
    return frozenset(out)


def column_plan(plan: Plan, paths: frozenset) -> Plan:
    """``plan`` with the rows slots at ``paths`` in column order (the gradients' plan).

    Args:
        plan (Plan): A plan whose rows buckets hold the arrays.
        paths (frozenset): Paths of 2-D arrays whose gradients arrive transposed.

    Returns:
        Plan: The same buckets, shards and sizes; only the order within a run differs.
    """
    if not paths:
        return plan
    buckets = tuple(dataclasses.replace(b, slots=tuple(
        dataclasses.replace(s, order="F") if b.by_rows and s.path in paths and len(s.shape) == 2
        else s for s in b.slots)) for b in plan.buckets)
    return dataclasses.replace(plan, buckets=buckets)


def add(slot: Slot, a: mx.array, b: mx.array) -> mx.array:
    """``a + b`` for two arrays a rank holds of ``slot``, computed in the slot's order.

    In column order both are transposed views with different strides.
    Summed as they are, MLX's CPU walks both across strides, element by
    element; transposed back, they are plain runs. The sum is the same, bit for bit.
    """
    if slot.order == "F" and a.ndim == 2:
        return (a.T + b.T).T
    return a + b


def row_major(a: mx.array, divisor: int, dtype: mx.Dtype) -> mx.array:
    """``(a / divisor).astype(dtype)`` in a row-major buffer; ``a`` is a transposed view.

    The optimizer then updates row-major parameters and state with it (a
    transposed gradient tripled an AdamW update's time on the CPU). MLX's
    CPU copy of a transpose goes element by element across strides. Here a
    first pass moves runs of ``_BLOCK`` elements and the division (which
    writes a row-major buffer from any view) transposes blocks that stay in
    the cache, with two buffers alive as for the division and one copy
    (``benchmarks/bench_fully_parts.py``, part "weight gradients, column
    order"). Other devices copy it at once.
    """
    rows, cols = a.shape
    if mx.default_device() != mx.cpu or rows % _BLOCK or rows < 2 * _BLOCK:
        return mx.contiguous((a / divisor).astype(dtype), allow_col_major=False)
    runs = mx.contiguous(a.T.reshape(cols, rows // _BLOCK, _BLOCK).transpose(1, 0, 2))
    return (runs.transpose(0, 2, 1) / divisor).astype(dtype).reshape(rows, cols)
