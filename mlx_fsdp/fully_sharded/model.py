"""The plan of a step on a model whose parameters are (partly) fully sharded.

A gradient of a parameter of a :class:`~.module.FullyShardedModule` is
already reduced and averaged over the shard group, and shaped like what this
rank holds of the parameter, when the step receives it. Such arrays get
buckets with ``sharded_params=True`` (the module's own buckets, cut down to
each sub-optimizer): the step updates what the rank holds and neither
reduce-scatters nor all-gathers them. Every other array of the tree (a
model wrapped only in part) is planned exactly as without ``fully_shard``.
"""

import dataclasses
import functools
from typing import Dict, List, Tuple

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from .. import layout
from ..placement import assign_optimizers, placements, plan_for, resolve
from ..plan import OWNER, Bucket, Plan, dtype_name
from .full import plain_path
from .module import LIVE, FullyShardedModule


def sharded_modules(parameters) -> List[Tuple[str, FullyShardedModule]]:
    """``(path prefix, module)`` of every fully sharded module in ``parameters``.

    Args:
        parameters: A model, or a tree of its parameters (then the modules
            are found by the identity of the arrays they hold).

    Returns:
        list: Prefixes end with ``"."`` (``""`` for a wrapped root).
    """
    if not LIVE:  # no fully sharded module in this process: nothing to look for
        return []
    if isinstance(parameters, nn.Module):
        return [(f"{name}." if name else "", m) for name, m in parameters.named_modules()
                if isinstance(m, FullyShardedModule)]
    where = {id(a): path for path, a in tree_flatten(parameters) if isinstance(a, mx.array)}
    found = []
    for m in list(LIVE.values()):
        held = dict(tree_flatten(m.module.parameters()))
        for local in m._paths:
            path = where.get(id(held.get(local)))
            if path is not None and path.endswith("module." + local):
                found.append((path[:-len("module." + local)], m))
                break
    return found


def step_plan(flat_grads, flat_params, optimizer, world_size: int, communication_size: int,
              placement, parameters) -> Plan:
    """The plan of a sharded step: :func:`mlx_fsdp.placement.plan_for`'s, or, when
    ``parameters`` (a model or its parameters) holds fully sharded modules,
    :func:`model_plan`'s."""
    modules = sharded_modules(parameters)
    if not modules:
        return plan_for(flat_grads, flat_params, optimizer, world_size, communication_size,
                        placement)
    return model_plan(flat_grads, flat_params, optimizer, world_size, communication_size,
                      placement, modules)


def model_plan(flat_grads, flat_params, optimizer, world_size: int, communication_size: int,
               placement, modules) -> Plan:
    """The step's plan when ``modules`` (from :func:`sharded_modules`) hold some arrays.

    Raises:
        ValueError: If a module is sharded over another group size, or an
            optimizer that needs whole arrays (Muon, Adafactor) would update
            axis-0 slices.
    """
    local = {}
    for prefix, m in modules:
        if m.group.size() != world_size:
            raise ValueError(
                f"The fully sharded module at '{prefix or '(root)'}' is sharded over "
                f"{m.group.size()} ranks, but the optimizer's group has {world_size}. Pass the "
                "same group to fully_shard and fsdp_step (group=None is the global group).")
        for b in m.plan.buckets:
            for s in b.slots:
                local[f"{prefix}module.{s.path}"] = (prefix, m, b, s)
    regular = [i for i, (path, _) in enumerate(flat_grads) if path not in local]
    sharded = [i for i, (path, _) in enumerate(flat_grads) if path in local]
    # Filters and placement rules see the paths the model has without
    # fully_shard and the full arrays' shapes (lazy zeros, never evaluated).
    prefixes = sorted((p for p, _ in modules), key=len, reverse=True)
    full = [(plain_path(flat_grads[i][0], prefixes),
             mx.zeros(local[flat_grads[i][0]][3].shape, flat_grads[i][1].dtype)) for i in sharded]
    optimizer_of = assign_optimizers(full, optimizer)
    rules = placements(resolve(optimizer, placement), full, optimizer_of)
    entries = []
    for i, o, rule in zip(sharded, optimizer_of, rules):
        path = flat_grads[i][0]
        prefix, m, b, s = local[path]
        if rule == OWNER and not b.owned:
            raise ValueError(
                f"'{path}' must be updated whole (its optimizer, e.g. Muon or Adafactor, is "
                "not element-wise), but fully_shard keeps it as axis-0 slices, on which it "
                "would silently be another optimizer. Pass the optimizer to fully_shard: "
                "fully_shard(module, placement=optimizer).")
        g = flat_grads[i][1]
        want = layout.held_shape(b, s, m.group.rank())
        if tuple(g.shape) != tuple(want):
            raise ValueError(
                f"The gradient at '{path}' has shape {tuple(g.shape)}, but this rank holds "
                f"{tuple(want)} of the parameter: pass the gradients that nn.value_and_grad "
                "returns for the fully sharded model, unchanged.")
        entries.append((prefix, m.plan.fingerprint, b.index, s.path, i, o, dtype_name(g.dtype),
                        dtype_name(flat_params[i].dtype)))
    base = None
    if regular:
        base = plan_for([flat_grads[i] for i in regular], [flat_params[i] for i in regular],
                        optimizer, world_size, communication_size, placement)
    plans = {fp: m.plan for _, m in modules for fp in [m.plan.fingerprint]}
    return _assemble(base, tuple(regular), tuple(entries), _Plans(plans), world_size,
                     communication_size)


class _Plans(dict):
    """Module plans by fingerprint, hashed by their fingerprints (for the cache)."""

    def __hash__(self):
        return hash(tuple(sorted(self)))

    def __eq__(self, other):
        return isinstance(other, _Plans) and sorted(self) == sorted(other)


@functools.lru_cache(maxsize=64)
def _assemble(base, regular, entries, plans, world_size, communication_size) -> Plan:
    buckets: List[Bucket] = []
    if base is not None:
        for b in base.buckets:
            slots = tuple(dataclasses.replace(s, index=regular[s.index]) for s in b.slots)
            buckets.append(dataclasses.replace(b, index=len(buckets), slots=slots))
    groups: Dict[tuple, list] = {}
    for prefix, fp, b_index, local, i, o, dtype, param_dtype in entries:
        groups.setdefault((prefix, fp, b_index, o, dtype, param_dtype), []).append((local, i))
    for (prefix, fp, b_index, o, dtype, param_dtype), members in groups.items():
        b = plans[fp].buckets[b_index]
        index = dict(members)
        slots = tuple(dataclasses.replace(s, path=f"{prefix}module.{s.path}", index=index[s.path])
                      for s in b.slots if s.path in index)
        buckets.append(dataclasses.replace(b, index=len(buckets), dtype=dtype,
                                           param_dtype=param_dtype, optimizer=o, slots=slots,
                                           sharded_params=True))
    return Plan(world_size, communication_size, tuple(buckets))
