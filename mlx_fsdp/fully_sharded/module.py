"""``fully_shard``: a module whose parameters each rank holds only a part of.

A drop-in for ``mlx.nn.fully_shard`` (same call, same ``"module"`` key in
the parameter tree, same gradients where MLX's runs) that also runs on ring
and MPI, takes any shape (padded as the sharded step pads), keeps the
matrices of shape-aware optimizers whole on owner ranks, groups its
collectives into buckets, and can free a block's gathered parameters
between its forward and backward pass (``reshard_after_forward``).
"""

import dataclasses
import weakref
from typing import Optional

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten

from .. import collectives, control, layout
from ..accumulate import is_traced
from ..options import (DEFAULT_SIZE_CPU, DEFAULT_SIZE_GPU, check_dtype, check_group,
                       group_or_global)
from ..order import CollectiveOrder
from ..plan import Plan, ROWS, build_plan, dtype_name
from .gather import gather_buckets, make_gather
from .placement import placement_of
from .remat import remat

#: Every live FullyShardedModule, so that a step can tell shards from full arrays.
LIVE: "weakref.WeakValueDictionary" = weakref.WeakValueDictionary()


def _own(module, key, value):
    # Parameters of this module, not those of fully sharded modules inside it.
    return nn.Module.valid_parameter_filter(module, key, value) and \
        not isinstance(value, FullyShardedModule)


def _own_trainable(module, key, value):
    return _own(module, key, value) and key not in module._no_grad


class FullyShardedModule(nn.Module):
    """A module whose floating-point parameters are split over the ranks of a group.

    Create it with :func:`mlx_fsdp.fully_shard`. The wrapped module is
    ``self.module`` (so parameter paths gain a ``"module"`` key, as with
    ``mlx.nn.fully_shard``) and holds what this rank holds of each
    parameter (see :mod:`mlx_fsdp.rows`). Calling the wrapper gathers the
    full parameters, calls the module and puts the shards back; in a
    ``value_and_grad`` the gradients come back reduce-scattered and averaged
    over the group, shaped like the shards.

    Attributes:
        plan (Plan): Where each of the module's own parameters lives.
        group (mlx.core.distributed.Group): The shard group.
    """

    def __init__(self, module: nn.Module, *, group, compute_dtype, reduce_dtype,
                 communication_size: int, reshard_after_forward: bool, placement,
                 communication_stream=None):
        super().__init__()
        n, rank = group.size(), group.rank()
        trainable = {p for p, _ in tree_flatten(module.filter_and_map(_own_trainable))}
        flat = [(p, a) for p, a in tree_flatten(module.filter_and_map(_own))
                if mx.issubdtype(a.dtype, mx.floating)]
        where = placement_of(placement, [(p, a) for p, a in flat if p in trainable])
        signature = tuple(
            (p, tuple(a.shape), dtype_name(reduce_dtype or compute_dtype or a.dtype),
             dtype_name(compute_dtype or a.dtype), 0, where.get(p, ROWS))
            for p, a in flat)
        plan = build_plan(signature, n, communication_size) if flat else Plan(n, 0, ())
        control.agree(group, "fully_shard", {"plan": plan.fingerprint,
                                             "reshard_after_forward": reshard_after_forward},
                      stream=communication_stream,
                      hint="Wrap the same modules with the same arguments on every rank.")
        held = _cut(plan, [a for _, a in flat], rank)
        module.update(tree_unflatten([(p, h) for (p, _), h in zip(flat, held)]))
        mx.eval(held)
        self.module = module
        settings = dict(
            plan=plan, group=group, compute_dtype=compute_dtype, reduce_dtype=reduce_dtype,
            reshard_after_forward=reshard_after_forward, communication_stream=communication_stream,
            _paths=[p for p, _ in flat], _dtypes=[a.dtype for _, a in flat],
            _method=collectives.reduce_scatter_method(group), _gathers={})
        for k, v in settings.items():  # plain attributes, not children or parameters
            object.__setattr__(self, k, v)
        LIVE[id(self)] = self

    def _extra_repr(self) -> str:
        return (f"num_sharded_params={len(self._paths)}, N={self.group.size()}, "
                f"reshard_after_forward={self.reshard_after_forward}")

    def _trainable_plan(self, trainable: frozenset, traced: bool):
        """The plan and custom gather of the trainable arrays, and the frozen arrays' plan."""
        key = (trainable, traced)
        if key not in self._gathers:
            keep = [i for i, p in enumerate(self._paths) if p in trainable]
            rest = [i for i, p in enumerate(self._paths) if p not in trainable]
            plans = _subplan(self.plan, keep), _subplan(self.plan, rest)
            gather = make_gather(plans[0], self.group, self._method, traced,
                                 self.communication_stream)
            self._gathers[key] = (keep, rest, plans, gather, traced)
        return self._gathers[key]

    def _full(self, held: list, trainable: list, deps: list, parts) -> list:
        """The full parameters, in path order: the frozen ones, then the trainable ones."""
        keep, rest, (_, frozen_plan), gather, traced = parts
        full = [None] * len(held)
        if rest:
            order = CollectiveOrder(self.group, traced)
            frozen = gather_buckets(frozen_plan, [held[i] for i in rest], deps, self.group,
                                    self.group.rank(), order, self.communication_stream)
            for i, a in zip(rest, frozen):
                full[i] = mx.stop_gradient(a)
        if keep:
            for i, a in zip(keep, gather(trainable, deps)):
                full[i] = a
        return full

    def _gathered_call(self, fn, *args, **kwargs):
        own = self.module.filter_and_map(_own)
        by_path = dict(tree_flatten(own))
        held = [by_path[p] for p in self._paths]
        # Inside mx.compile the parameters are placeholders (evaluating one
        # fails); outside it is already evaluated, so asking costs nothing.
        parts = self._trainable_plan(frozenset(
            p for p, _ in tree_flatten(self.module.filter_and_map(_own_trainable))),
            is_traced(held[0]))

        def body(trainable, *args, **kwargs):
            deps = [a for _, a in tree_flatten((args, kwargs)) if isinstance(a, mx.array)]
            full = self._full(held, trainable, deps, parts)
            self.module.update(tree_unflatten(list(zip(self._paths, full))))
            try:
                return fn(*args, **kwargs)
            finally:
                self.module.update(own)

        trainable = [held[i] for i in parts[0]]
        if self.reshard_after_forward:
            # Free the gathered parameters after the forward pass; the backward
            # pass runs ``body`` again (gathering again). The trainable shards
            # are its inputs, so that their gradients flow.
            return remat(body, trainable, *args, **kwargs)
        return body(trainable, *args, **kwargs)

    def __call__(self, *args, **kwargs):
        return self._gathered_call(self.module, *args, **kwargs)

    def as_linear(self, *args, **kwargs):
        """The wrapped embedding's ``as_linear``, with its weight gathered."""
        return self._gathered_call(self.module.as_linear, *args, **kwargs)


def _cut(plan: Plan, arrays: list, rank: int) -> list:
    """What ``rank`` holds of each array, each in a buffer of its own (the full ones can go)."""
    held = [None] * len(arrays)
    for b in plan.buckets:
        got = {s.index: a for s, a in layout.held_of(b, arrays, rank)}
        for s in b.slots:
            a = arrays[s.index]
            if s.index not in got:
                held[s.index] = mx.zeros(layout.held_shape(b, s, rank), a.dtype)
            else:  # a whole owned array stays as it is; a slice is copied out of it
                held[s.index] = a if got[s.index] is a else got[s.index] * 1
    return held


def _subplan(plan: Plan, indices: list) -> Plan:
    """The buckets of ``plan`` cut down to the arrays at ``indices``, re-indexed in that order."""
    new = {i: j for j, i in enumerate(indices)}
    buckets = []
    for b in plan.buckets:
        slots = tuple(dataclasses.replace(s, index=new[s.index]) for s in b.slots if s.index in new)
        if slots:
            buckets.append(dataclasses.replace(b, index=len(buckets), slots=slots))
    return Plan(plan.world_size, plan.communication_size, tuple(buckets))


def fully_shard(module: nn.Module, *, group: Optional[mx.distributed.Group] = None,
                compute_dtype: Optional[mx.Dtype] = None,
                reduce_dtype: Optional[mx.Dtype] = None,
                communication_size: Optional[int] = None,
                reshard_after_forward: bool = False,
                placement=None,
                communication_stream: Optional[mx.Stream] = None) -> nn.Module:
    """Split the parameters of ``module`` over the ranks of ``group`` (ZeRO-3).

    A drop-in for ``mlx.nn.fully_shard``: the same call, the wrapped module
    under ``"module"`` in the parameter tree, and after ``nn.value_and_grad``
    each parameter's gradient is this rank's axis-0 slice of the gradient
    averaged over the ranks, as data parallelism averages it. Unlike MLX's,
    it runs on every backend (ring and MPI through the reduce-scatter of
    :mod:`mlx_fsdp.collectives`), takes any parameter (axis 0 not divisible by
    N, 1-D, scalars, mixed dtypes: the last ranks hold fewer rows, possibly
    none), groups its collectives into buckets of ``communication_size``
    bytes, and keeps the matrices of Muon and Adafactor whole on owner ranks
    when ``placement`` says so.

    .. code-block:: python

        for i, block in enumerate(model.layers):
            model.layers[i] = mlx_fsdp.fully_shard(block, reshard_after_forward=True)
        model = mlx_fsdp.fully_shard(model)       # the rest: embeddings, head
        opt = mlx_fsdp.fsdp_step(optim.AdamW(learning_rate=3e-4), max_norm=1.0)
        loss, grads = nn.value_and_grad(model, loss_fn)(model, x, y)
        opt.update(model, grads)                  # updates the shards where they are

    Calling the wrapper all-gathers the module's parameters (one collective
    per bucket, once the module's inputs exist), calls the module and puts
    the shards back. In the backward pass the full gradients are
    reduce-scattered, one bucket at a time, before the layers in front of the
    module continue their backward pass, so they are freed as they come.
    Wrap each transformer block, then the whole model: a block's full
    parameters exist only while the block runs (and, without
    ``reshard_after_forward``, until its backward pass). Floating-point
    parameters are sharded; others (quantized weights) stay whole on every
    rank. Frozen parameters are gathered too, without a reduce-scatter.

    Args:
        module (mlx.nn.Module): The module to shard. Every rank must pass the
            same module (same paths, shapes and dtypes) with the same values.
        group (mlx.core.distributed.Group, optional): The ranks to shard over.
            ``None`` means the global group. Default: ``None``.
        compute_dtype (Dtype, optional): Gather the parameters in this dtype
            (e.g. ``mx.bfloat16``): the forward and backward pass run in it,
            the all-gather and reduce-scatter move it, and each rank keeps its
            shards and their gradients in the parameters' own dtype.
            Default: ``None`` (the parameters' dtype).
        reduce_dtype (Dtype, optional): Reduce-scatter the gradients in this
            dtype, e.g. ``mx.float32`` under a bfloat16 ``compute_dtype``.
            Default: ``None`` (``compute_dtype``, else the parameters' dtype).
        communication_size (int, optional): Byte budget of a bucket (one
            all-gather in the forward pass, one reduce-scatter in the
            backward pass); ``<= 0`` gives every parameter its own.
            Default: ``None``: 32 MiB on a GPU, 4 MiB on the CPU, as
            :func:`mlx_fsdp.fsdp_step`.
        reshard_after_forward (bool): Free the gathered parameters after the
            forward pass and gather them again for the backward pass. In MLX
            that recomputes the module's forward pass in the backward pass,
            as ``mx.checkpoint`` does (the module's activations are freed as
            well), so it costs a second all-gather and a second forward pass
            of the module. Default: ``False``.
        placement (optional): ``None`` or ``"flat"``: every rank holds its
            axis-0 slice of every parameter; ``"owner"``: whole parameters on
            owner ranks; a callable ``(path, shape) -> "flat" | "owner"``; or
            the optimizer that will train the module, whose needs decide
            (Muon keeps its matrices whole, Adafactor all its arrays). An
            optimizer that is not element-wise needs whole arrays:
            :func:`mlx_fsdp.fsdp_step` refuses to update axis-0 slices with
            it. Default: ``None``.
        communication_stream (mlx.core.Stream, optional): Stream of the
            collectives. Default: ``None``.

    Returns:
        mlx.nn.Module: The :class:`FullyShardedModule`, or ``module`` itself
        with one process, for a module already wrapped, or one without
        floating-point parameters of its own.
    """
    _check_arguments(module, group, compute_dtype, reduce_dtype, communication_size,
                     reshard_after_forward, communication_stream)
    group = group_or_global(group)
    if group.size() == 1 or isinstance(module, FullyShardedModule):
        return module
    if communication_size is None:
        communication_size = DEFAULT_SIZE_GPU if mx.default_device() == mx.gpu else DEFAULT_SIZE_CPU
    wrapped = FullyShardedModule(
        module, group=group, compute_dtype=compute_dtype, reduce_dtype=reduce_dtype,
        communication_size=communication_size, reshard_after_forward=reshard_after_forward,
        placement=placement, communication_stream=communication_stream)
    return wrapped if wrapped._paths else module


def _check_arguments(module, group, compute_dtype, reduce_dtype, communication_size,
                     reshard_after_forward, communication_stream):
    if not isinstance(module, nn.Module):
        raise ValueError(f"module={module!r} is not an mlx.nn.Module; pass the layer or model "
                         "whose parameters to shard.")
    check_group("group", group)
    check_dtype("compute_dtype", compute_dtype)
    check_dtype("reduce_dtype", reduce_dtype)
    if communication_size is not None and (not isinstance(communication_size, int)
                                           or isinstance(communication_size, bool)):
        raise ValueError(f"communication_size={communication_size!r} must be an int number of "
                         "bytes (<= 0 gives every parameter its own bucket), or None.")
    if not isinstance(reshard_after_forward, bool):
        raise ValueError(f"reshard_after_forward={reshard_after_forward!r} must be True or False.")
    if communication_stream is not None and not isinstance(communication_stream, mx.Stream):
        raise ValueError(f"communication_stream={communication_stream!r} must be an mx.Stream, "
                         "e.g. mx.new_stream(mx.default_device()), or None.")
