"""``FullyShardedModule``: a module whose parameters each rank holds only a part of.

It is made by :func:`mlx_fsdp.fully_shard` (:mod:`.wrap`). At construction
it cuts what this rank holds out of each of the module's own floating-point
parameters (a plan of rows and owner buckets, the same on every rank); each
call gathers them (:mod:`.gather`), runs the module and puts the shards back.
"""

import dataclasses
import functools
import inspect
import weakref

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten

from .. import collectives, columns, control, ending, layout, watchdog
from ..accumulate import is_traced
from ..order import CollectiveOrder, start_trace
from ..plan import Plan
from ..rows import row_size
from .gather import gather_buckets, make_gather
from .placement import module_plan, owned_loads
from .remat import remat

#: Every live FullyShardedModule, so that a step can tell shards from full arrays.
LIVE: "weakref.WeakValueDictionary" = weakref.WeakValueDictionary()
#: Fully sharded calls under way (nested modules run inside their parent's).
_CALLS = [0]
#: Group size -> what each rank owns of the modules wrapped so far in the
#: model being wrapped (see ``FullyShardedModule.__init__``); emptied by a
#: root's wrapping and by any fully sharded call.
_BALANCE: dict = {}


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
        # Owners continue the balance of the modules wrapped before this one
        # in the same model (every block's largest matrix would otherwise go
        # to rank 0). The tally follows the wrapping calls, which every rank
        # makes alike, not the modules still alive: a dropped model is freed
        # whenever each rank collects it, and the ranks' plans differed. A
        # module that holds wrapped ones (the root) ends a model.
        loads = _BALANCE.get(n, ())
        plan = module_plan(flat, trainable, placement, n, communication_size, compute_dtype,
                           reduce_dtype, loads)
        root = any(isinstance(m, FullyShardedModule) for m in module.modules())
        dog = watchdog.default(group)
        with watchdog.watch(dog, f"fully_shard({type(module).__name__})"):
            control.agree(group, "fully_shard", {"plan": plan.fingerprint,
                                                 "reshard_after_forward": reshard_after_forward},
                          stream=communication_stream,
                          hint="Wrap the same modules, in the same order, with the same "
                          "arguments on every rank.")
        _BALANCE[n] = () if root else owned_loads(plan, loads)
        ending.register(group)
        # Read from the whole arrays: once cut, a weight this rank owns none of is 1-D here.
        transposed = columns.linear_weights(module, trainable)
        held = _cut(plan, [a for _, a in flat], rank)
        module.update(tree_unflatten([(p, h) for (p, _), h in zip(flat, held)]))
        mx.eval(held)
        self.module = module
        settings = dict(
            plan=plan, group=group, compute_dtype=compute_dtype, reduce_dtype=reduce_dtype,
            reshard_after_forward=reshard_after_forward, communication_stream=communication_stream,
            _paths=[p for p, _ in flat], _dtypes=[a.dtype for _, a in flat],
            _method=collectives.reduce_scatter_method(group), _gathers={}, _dog=dog,
            _columns=transposed)
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
                                 self.communication_stream, self._columns)
            self._gathers[key] = (keep, rest, plans, gather, traced)
        return self._gathers[key]

    def _full(self, held: list, trainable: list, deps: list, parts) -> list:
        """The full parameters, in path order: the frozen ones, then the trainable ones."""
        keep, rest, (_, frozen_plan), gather, traced = parts
        full = [None] * len(held)
        if rest:
            order = CollectiveOrder(self.group, traced)
            frozen = gather_buckets(frozen_plan, [held[i] for i in rest], deps, self.group,
                                    self.group.rank(), order, self.communication_stream, traced)
            for i, a in zip(rest, frozen):
                full[i] = mx.stop_gradient(a)
        if keep:
            for i, a in zip(keep, gather(trainable, deps)):
                full[i] = a
        return full

    def _gathered_call(self, fn, *args, **kwargs):
        if self._dog is not None:  # the gathers run in the caller's next evaluation
            self._dog.forward(f"the collectives of fully sharded {type(self.module).__name__} "
                              "(its forward and backward passes)")
        # Inside mx.compile the parameters are placeholders (evaluating one
        # fails); outside it they are evaluated, so asking costs nothing.
        own = dict(tree_flatten(self.module.filter_and_map(_own)))
        traced = is_traced(own[self._paths[0]])
        if traced and not _CALLS[0]:  # the outermost call of a trace
            start_trace(self.group, own[self._paths[0]])
        parts = self._trainable_plan(frozenset(
            p for p, _ in tree_flatten(self.module.filter_and_map(_own_trainable))), traced)

        def body(params, *args, **kwargs):
            saved = None
            if params is not None:  # a recomputation's inputs
                saved = self.module.trainable_parameters()
                self.module.update(params)
            own = self.module.filter_and_map(_own)
            by_path = dict(tree_flatten(own))
            held = [by_path[p] for p in self._paths]
            deps = [a for _, a in tree_flatten((args, kwargs)) if isinstance(a, mx.array)]
            full = self._full(held, [held[i] for i in parts[0]], deps, parts)
            self.module.update(tree_unflatten(list(zip(self._paths, full))))
            try:
                return fn(*args, **kwargs)
            finally:
                self.module.update(own)
                if saved is not None:
                    self.module.update(saved)

        # A model that runs has been wrapped whole: the next fully_shard
        # starts another model's balance, as after a root. A model wrapped
        # once, with nothing wrapped inside it, has no root to end its tally,
        # and the next model's owners followed it (unlike the planner's).
        _BALANCE.clear()
        _CALLS[0] += 1
        try:
            if self.reshard_after_forward:
                # Free the gathered parameters after the forward pass; the
                # backward pass runs ``body`` again (gathering again). Every
                # trainable array below this module (those of wrapped modules
                # inside it too) is an input, so that the recomputation passes
                # gradients to all of them.
                return remat(body, self.module.trainable_parameters(), *args, **kwargs)
            return body(None, *args, **kwargs)
        finally:
            _CALLS[0] -= 1

    def __call__(self, *args, **kwargs):
        return self._gathered_call(self.module, *args, **kwargs)

    def __getattr__(self, key):
        # What the wrapped module has: its attributes and sub-modules as they
        # are (a parameter is what this rank holds of it), its own methods
        # (an embedding's ``as_linear``) called with the parameters gathered.
        try:
            return super().__getattr__(key)
        except AttributeError:
            inner = dict.get(self, "module")
            if inner is None:
                raise
        value = getattr(inner, key)
        if inspect.ismethod(value) and value.__self__ is inner:
            return functools.partial(self._gathered_call, value)
        return value


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
        slots = [dataclasses.replace(s, index=new[s.index]) for s in b.slots if s.index in new]
        if not slots:
            continue
        cols = b.cols
        if b.by_rows:  # a shard holds its slots' runs end to end: close the dropped ones' gaps
            cols = 0
            for j, s in enumerate(slots):
                slots[j] = dataclasses.replace(s, start=cols)
                cols += s.rows * row_size(s.shape)
        buckets.append(dataclasses.replace(b, index=len(buckets), slots=tuple(slots), cols=cols))
    return Plan(plan.world_size, plan.communication_size, tuple(buckets))
