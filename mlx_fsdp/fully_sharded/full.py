"""The whole model from its shards: plain parameter paths and gathered values.

``fully_shard`` puts a wrapped module under the key ``"module"``, so
``layers.0.weight`` becomes ``layers.0.module.weight`` (and
``module.layers.0.module.weight`` once the root is wrapped too). A
checkpoint or an exported model uses the plain paths, the ones the model
has without ``fully_shard`` (and at one process, where ``fully_shard``
leaves the model as it is), so that it loads into either.
"""

import dataclasses
from typing import Dict, List, Tuple

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten

from ..order import CollectiveOrder
from ..plan import Plan, dtype_name
from .gather import gather_buckets
from .module import FullyShardedModule


def _wrappers(model: nn.Module) -> List[Tuple[str, FullyShardedModule]]:
    # Innermost first: their prefixes are the longest.
    found = [(f"{name}." if name else "", m) for name, m in model.named_modules()
             if isinstance(m, FullyShardedModule)]
    return sorted(found, key=lambda pm: -len(pm[0]))


def plain_path(path: str, prefixes: List[str]) -> str:
    """``path`` without the ``"module"`` keys of the wrappers at ``prefixes`` (innermost first)."""
    for prefix in prefixes:
        if path.startswith(prefix + "module."):
            path = prefix + path[len(prefix) + len("module."):]
    return path


def plain_paths(model: nn.Module) -> Dict[str, str]:
    """``{path in model: plain path}`` for every parameter of ``model``."""
    prefixes = [p for p, _ in _wrappers(model)]
    return {p: plain_path(p, prefixes) for p, _ in tree_flatten(model.parameters())}


def full_parameters(model: nn.Module) -> dict:
    """Every parameter of ``model``, whole, under its plain path (a nested dict).

    A collective: every rank must call it, at the same point, and it returns
    once the gathers are done. Every rank gets the whole model (one
    all-gather per bucket of each wrapped module), evaluated, which must fit
    in its memory; a model without ``fully_shard`` is returned as its
    parameters, with no communication.

    Args:
        model (mlx.nn.Module): The model.

    Returns:
        dict: The parameters, as ``model.parameters()`` of the model without
        ``fully_shard`` would give them.
    """
    wrappers = _wrappers(model)
    prefixes = [p for p, _ in wrappers]
    whole = dict(tree_flatten(model.parameters()))
    for prefix, m in sorted(wrappers, key=lambda pm: len(pm[0])):
        held = dict(tree_flatten(m.module.parameters()))
        order = CollectiveOrder(m.group)
        full = gather_buckets(_own_dtype_plan(m), [held[p] for p in m._paths], [], m.group,
                              m.group.rank(), order, m.communication_stream)
        for local, a, dtype in zip(m._paths, full, m._dtypes):
            whole[f"{prefix}module.{local}"] = a.astype(dtype)
    # Evaluated here, on every rank: left lazy, the all-gathers would run
    # only where the result is used (rank 0 saving it), and the others hang.
    mx.eval(list(whole.values()))
    return tree_unflatten([(plain_path(p, prefixes), a) for p, a in whole.items()])


def _own_dtype_plan(m: FullyShardedModule) -> Plan:
    """``m.plan``, gathering in the dtype the shards are kept in, not in ``compute_dtype``.

    A bucket whose arrays differ in dtype moves the widest, which holds the
    others exactly.
    """
    buckets = []
    for b in m.plan.buckets:
        dtypes = {m._dtypes[s.index] for s in b.slots}
        widest = max(dtypes, key=lambda d: d.size)
        buckets.append(dataclasses.replace(b, param_dtype=dtype_name(widest)))
    return dataclasses.replace(m.plan, buckets=tuple(buckets))
