"""The whole model from its shards: plain parameter paths and gathered values.

``fully_shard`` puts a wrapped module under the key ``"module"``, so
``layers.0.weight`` becomes ``layers.0.module.weight`` (and
``module.layers.0.module.weight`` once the root is wrapped too). A
checkpoint or an exported model uses the plain paths, the ones the model
has without ``fully_shard`` (and at one process, where ``fully_shard``
leaves the model as it is), so that it loads into either.
"""

import dataclasses
from typing import Callable, Dict, Iterator, List, Optional, Tuple

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
    in its memory (:func:`gathered_by_module` needs one module's); a model
    without ``fully_shard`` is returned as its parameters, with no communication.

    Args:
        model (mlx.nn.Module): The model.

    Returns:
        dict: The parameters, as ``model.parameters()`` of the model without
        ``fully_shard`` would give them.
    """
    whole = {}
    for part in gathered_by_module(model):
        whole.update(part)
    return tree_unflatten([(p, whole[p]) for p in plain_paths(model).values()])


def gathered_by_module(model: nn.Module, keep: Optional[Callable[[str], bool]] = None
                       ) -> Iterator[Dict[str, mx.array]]:
    """The whole parameters of ``model`` one wrapped module at a time, by plain path.

    Yields first the parameters no wrapper shards (those of a model without
    ``fully_shard``, integer weights), then each wrapped module's gathered,
    outermost first, all evaluated; so a rank holds one module whole at a
    time beside its shards, if the caller drops each part before asking for
    the next. A collective: every rank must run the generator to its end.

    Args:
        model (mlx.nn.Module): The model.
        keep (Callable, optional): ``plain path -> bool``: the parameters to
            yield; the rest are gathered (the buckets move them together) and
            dropped at once. Default: ``None`` (all).
    """
    keep = keep or (lambda path: True)
    wrappers = _wrappers(model)
    prefixes = [p for p, _ in wrappers]
    flat = dict(tree_flatten(model.parameters()))
    sharded = {f"{prefix}module.{local}" for prefix, m in wrappers for local in m._paths}
    alone = {plain_path(p, prefixes): a for p, a in flat.items()
             if p not in sharded and keep(plain_path(p, prefixes))}
    if alone:
        mx.eval(list(alone.values()))
        yield alone
    del flat
    for prefix, m in sorted(wrappers, key=lambda pm: len(pm[0])):
        held = dict(tree_flatten(m.module.parameters()))
        order = CollectiveOrder(m.group)
        full = gather_buckets(_own_dtype_plan(m), [held[p] for p in m._paths], [], m.group,
                              m.group.rank(), order, m.communication_stream)
        del held
        part = {}
        for local, a, dtype in zip(m._paths, full, m._dtypes):
            path = plain_path(f"{prefix}module.{local}", prefixes)
            if keep(path):
                part[path] = a.astype(dtype)
        # Evaluated here, on every rank, with what is dropped: left lazy, the
        # all-gathers would run only where the result is used (rank 0
        # saving it), and the others would hang.
        mx.eval(list(part.values()) + list(full))
        del full
        yield part


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
