"""A module's parameters gathered for its call, their gradients reduce-scattered back.

The module keeps what its rank holds of each parameter (see
:mod:`mlx_fsdp.rows` and :mod:`mlx_fsdp.owners`). A call all-gathers each
bucket of the module's plan and cuts the full parameters out of it
(:func:`mlx_fsdp.layout.unpack`). The gathering is an ``mx.custom_function``
whose VJP reduce-scatters the full gradients bucket by bucket, as the
sharded step does (:func:`mlx_fsdp.bucketed.reduce_bucket`), and divides
by the group size, so that ``value_and_grad`` returns this rank's part of
the averaged gradient of every parameter, in the parameter's own dtype.

Order and lifetime. Every rank must run the collectives in one order, and
the full arrays should exist only while they are used:

* a gather waits for the module's inputs (``mx.depends``), so a block's
  parameters are gathered when the block runs, not when MLX happens to
  schedule an independent all-gather; on the CPU it also waits for MLX's
  queue to drain (:mod:`mlx_fsdp.pace`);
* the VJP hands every input a zero cotangent that depends on the reduced
  gradients, so the backward pass of the layers before this module waits
  for its reduce-scatter: the full gradients are freed as soon as they are
  summed, and the reduce-scatters run in the backward pass's own order; on
  the CPU they also wait for MLX's queue to drain, so that the earlier
  layers' buffers are not allocated before these are freed;
* the buckets of one module, and all collectives of a group, are chained by
  :class:`mlx_fsdp.order.CollectiveOrder`, as in the sharded step.
"""

from typing import List, Optional, Sequence

import mlx.core as mx

from .. import bucketed, columns
from ..order import CollectiveOrder
from ..pace import paced, pacing
from ..plan import Plan


def gather_buckets(plan: Plan, held: Sequence[mx.array], deps: Sequence[mx.array], group,
                   rank: int, order: CollectiveOrder, stream=None,
                   traced: bool = False) -> List[mx.array]:
    """The full arrays of ``plan`` from what this rank holds, one all-gather per bucket.

    Args:
        plan (Plan): The module's plan (rows or owner buckets).
        held (list[array]): What this rank holds of each array, by ``Slot.index``.
        deps (list[array]): Arrays the first gather waits for (the module's inputs).
        group (mlx.core.distributed.Group): The shard group.
        rank (int): This rank in ``group``.
        order (CollectiveOrder): Chains the collectives.
        stream (mlx.core.Stream, optional): Stream of the collectives. Default: ``None``.
        traced (bool): Whether this runs inside ``mx.compile``. Default: ``False``.

    Returns:
        list[array]: The full arrays, by ``Slot.index``, in each bucket's parameter dtype.
    """
    full: List[Optional[mx.array]] = [None] * len(held)
    for i, b in enumerate(plan.buckets):
        # The first bucket waits for the module's inputs; the later ones for it.
        wait = paced(deps, traced) if deps and i == 0 else ()
        mine = {s.index: held[s.index] for s in b.held(rank)}
        for s, a in zip(b.slots, bucketed.gather_bucket(b, mine, group, order=order,
                                                           stream=stream, wait=wait)):
            full[s.index] = a
    if plan.buckets:  # evaluated with the parameters, the kept token holds nothing
        last = plan.buckets[-1].slots[-1].index
        full[last] = order.settle(full[last])
    return full


def reduce_buckets(plan: Plan, grads: Sequence[mx.array], held: Sequence[mx.array], group,
                   rank: int, method: str, order: CollectiveOrder,
                   stream=None, traced: bool = False) -> List[mx.array]:
    """This rank's part of the averaged gradients, one reduce-scatter per bucket.

    The last bucket first: the backward pass computes its gradients first.

    Args:
        plan (Plan): The module's gradient plan (:func:`mlx_fsdp.columns.column_plan`).
        grads (list[array]): The full gradients, by ``Slot.index``.
        held (list[array]): What this rank holds of each parameter (shapes and dtypes).
        group (mlx.core.distributed.Group): The shard group.
        rank (int): This rank in ``group``.
        method (str): The reduce-scatter method (see :mod:`mlx_fsdp.collectives`).
        order (CollectiveOrder): Chains the collectives.
        stream (mlx.core.Stream, optional): Stream of the collectives. Default: ``None``.
        traced (bool): Whether this runs inside ``mx.compile``. Default: ``False``.

    Returns:
        list[array]: Shaped and typed like ``held``; zero-size where this rank holds nothing.
    """
    n = group.size()
    out = [mx.zeros(h.shape, h.dtype) for h in held]
    done = []
    for b in reversed(plan.buckets):
        if pacing():
            # On the CPU, this bucket's buffers only once the last one's are
            # freed, and the first bucket's once its gradients are computed:
            # before that wait MLX queued the whole reduce-scatter with the
            # end of the backward pass: a fully sharded MLP of one layer of
            # 512 peaked at 8.08 MiB in its backward pass, 6.6 layers beyond
            # its shards (5.54 MiB after; benchmarks/bench_plan_phases.py).
            # The token must come first in the bucket's input: behind the
            # gradients (mx.depends puts it there) MLX computed them before
            # the wait, and the main job's GPT peaked 2.4 MiB higher.
            # The first bucket's token waits for the group's last collective
            # too, which it replaces in the chain (the later ones' follow it).
            first = [grads[s.index] for s in b.slots] + order.last()
            order.follow(paced(done or first, traced)[0])
        done = []
        for s, g in bucketed.reduce_bucket(b, grads, group, method=method, order=order,
                                           stream=stream):
            dtype = held[s.index].dtype
            out[s.index] = columns.row_major(g, n, dtype) if s.order == "F" \
                else (g / n).astype(dtype)
            done.append(out[s.index])
    # Inside mx.compile every output follows the module's last collective,
    # those of arrays this rank holds none of too: compile runs only what the
    # outputs need, and with owner placement a rank that owns nothing of a
    # module dropped its reduce-scatters while its peers ran them (silently
    # wrong gradients on ring, a crash on MPI). On the CPU too: the step's
    # update waits for the gradients (mlx_fsdp.pace), and a rank owning
    # nothing of the last module reduced started its update while that
    # reduce-scatter still held its buffers (MLP 2 x 1024, Adafactor, ring
    # N=2: the step peaked at 40.1 MiB, its fuller phase alone at 28.1).
    out = order.after(out, eager=pacing())
    if plan.buckets:
        out[0] = order.settle(out[0])
    return out


def make_gather(plan: Plan, group, method: str, traced: bool, stream=None,
                columns_at: frozenset = frozenset()):
    """The custom function ``gather(held, deps) -> full`` of a module's trainable arrays.

    Args:
        plan (Plan): The plan of the trainable arrays.
        group (mlx.core.distributed.Group): The shard group.
        method (str): The reduce-scatter method of its VJP.
        traced (bool): Whether it runs inside ``mx.compile`` (its collectives
            then chain only to each other; see :class:`mlx_fsdp.order.CollectiveOrder`).
        stream (mlx.core.Stream, optional): Stream of the collectives. Default: ``None``.
        columns_at (frozenset, optional): Paths whose gradients arrive
            transposed, reduce-scattered in column order (see
            :mod:`mlx_fsdp.columns`). Default: none.

    Returns:
        mlx.core.custom_function: ``gather(held, deps)`` with its VJP.
    """
    rank = group.rank()
    grad_plan = columns.column_plan(plan, columns_at)

    @mx.custom_function
    def gather(held, deps):
        order = CollectiveOrder(group, traced)
        return gather_buckets(plan, held, deps, group, rank, order, stream, traced)

    @gather.vjp
    def gather_vjp(primals, cotangents, _):
        held, deps = primals
        order = CollectiveOrder(group, traced)
        grads = reduce_buckets(grad_plan, cotangents, held, group, rank, method, order, stream,
                               traced)
        # What the layers before this module need of their backward pass
        # waits for the reduced gradients (see the module docstring).
        zero = mx.depends(mx.zeros((), mx.float32), paced(grads, traced))
        return grads, [mx.broadcast_to(zero.astype(d.dtype), d.shape) for d in deps]

    return gather
