"""Where each array is updated, and the plan of a tree: the rules that build it.

Each array is updated as flat shards on every rank, or whole on one owner.

An element-wise optimizer updates every element from that element's gradient
and state alone, so running it on any slice of a flattened array is exact:
its arrays get the ``"flat"`` placement. Shape-aware optimizers (Muon's
Newton-Schulz, Adafactor's factored second moment and its per-array RMS) need
whole arrays: theirs get the ``"owner"`` placement, kept whole on one rank.

The placement is decided per sub-optimizer and per array, from a small
registry keyed by the optimizer's exact class (a subclass may override
``apply_single`` with shape-aware math, so it does not inherit its parent's
entry). An optimizer missing from the registry gets ``"owner"``, the choice
that is exact for any per-array update, and a warning once per class.

:func:`plan_for` applies these rules (and a ``MultiOptimizer``'s filters) to
a gradient tree and builds its :class:`~mlx_fsdp.plan.Plan`.
"""

import warnings
from typing import Callable, List, Sequence, Tuple, Union

import mlx.core as mx
import mlx.optimizers as optim

from .plan import FLAT, OWNER, Plan, Signature, build_plan, dtype_name

#: A placement: ``"flat"``, ``"owner"``, or ``rule(path, shape) -> "flat" | "owner"``.
Rule = Union[str, Callable[[str, Tuple[int, ...]], str]]


def _muon(path, shape):
    # Muon orthogonalizes only arrays with >= 2 dimensions; on 0-D and 1-D
    # arrays it is momentum SGD, which is element-wise.
    return OWNER if len(shape) >= 2 else FLAT


_registry = {
    optim.SGD: FLAT,
    optim.RMSprop: FLAT,
    optim.Adagrad: FLAT,
    optim.AdaDelta: FLAT,
    optim.Adam: FLAT,
    optim.AdamW: FLAT,
    optim.Adamax: FLAT,
    optim.Lion: FLAT,
    optim.Muon: _muon,
    # Adafactor factors the second moment of >= 2-D arrays and, for every
    # array, scales by the parameter's RMS and clips by the update's RMS.
    optim.Adafactor: OWNER,
}

_warned = set()


def check_rule(rule, what: str):
    if rule in (FLAT, OWNER) or callable(rule):
        return
    raise ValueError(
        f"{what}={rule!r} is not a placement; use 'flat' (element-wise "
        "optimizers), 'owner' (shape-aware ones: whole arrays on one rank), "
        "None (decide from the optimizer) or a callable (path, shape) -> "
        "'flat' | 'owner'."
    )


def register_placement(optimizer_class: type, rule: Rule):
    """Declare how arrays updated by ``optimizer_class`` are placed.

    Args:
        optimizer_class (type): An ``mlx.optimizers.Optimizer`` subclass. Only
            this exact class is affected, not its subclasses.
        rule (str or callable): ``"flat"`` if its update is element-wise (exact
            on any slice of a flattened array), ``"owner"`` if it needs whole
            arrays, or ``rule(path, shape)`` returning one of those per array.
    """
    if not (isinstance(optimizer_class, type) and issubclass(optimizer_class, optim.Optimizer)):
        raise ValueError(
            f"optimizer_class={optimizer_class!r} is not an mlx.optimizers.Optimizer "
            "subclass; pass the class itself, e.g. register_placement(MyOpt, 'owner')."
        )
    check_rule(rule, "rule")
    _registry[optimizer_class] = rule


def _rule_of(optimizer) -> Rule:
    cls = type(optimizer)
    if cls in _registry:
        return _registry[cls]
    if cls not in _warned:
        _warned.add(cls)
        warnings.warn(
            f"mlx_fsdp: {cls.__name__} is not known to be element-wise, so each "
            "array it updates is kept whole on one owner rank (exact for any "
            "per-array update). If its update is element-wise, pass "
            "placement='flat' or call mlx_fsdp.register_placement("
            f"{cls.__name__}, 'flat') to shard it evenly.",
            stacklevel=5,
        )
    return OWNER


def resolve(optimizer, placement=None) -> list:
    """One placement rule per sub-optimizer, validated.

    Args:
        optimizer (mlx.optimizers.Optimizer): The wrapped optimizer.
        placement (str, callable or list, optional): ``None`` decides from the
            registry; one rule applies to every sub-optimizer; a list gives one
            rule (or ``None``) per sub-optimizer of a ``MultiOptimizer``.
            Default: ``None``.

    Returns:
        list: A rule (``"flat"``, ``"owner"`` or a callable) per sub-optimizer.
    """
    multi = isinstance(optimizer, optim.MultiOptimizer)
    parts = list(optimizer.optimizers) if multi else [optimizer]
    for o in parts:
        if isinstance(o, optim.MultiOptimizer):
            raise ValueError(
                "A MultiOptimizer nested inside a MultiOptimizer would call its "
                "filters on the sharded step's inner tree, not on your parameters' "
                "paths and full arrays. Flatten it into one MultiOptimizer with "
                "all the filters."
            )
    if isinstance(placement, (list, tuple)):
        if len(placement) != len(parts):
            raise ValueError(
                f"placement has {len(placement)} entries but the optimizer has "
                f"{len(parts)} sub-optimizers; give one entry (or None) per "
                "sub-optimizer, in the MultiOptimizer's order."
            )
        rules = list(placement)
    else:
        rules = [placement] * len(parts)
    for r in rules:
        if r is not None:
            check_rule(r, "placement")
    return [_rule_of(o) if r is None else r for o, r in zip(parts, rules)]


def placements(rules: Sequence[Rule], flat_grads, optimizer_of: Sequence[int]) -> list:
    """``"flat"`` or ``"owner"`` for every array.

    Args:
        rules (list): From :func:`resolve`, indexed by sub-optimizer.
        flat_grads (list): ``(path, gradient)`` pairs.
        optimizer_of (list[int]): The sub-optimizer of each array.

    Returns:
        list[str]: The placement of each array.
    """
    out = []
    for (path, g), o in zip(flat_grads, optimizer_of):
        rule = rules[o]
        p = rule(path, tuple(g.shape)) if callable(rule) else rule
        if p not in (FLAT, OWNER):
            raise ValueError(
                f"The placement rule of sub-optimizer {o} returned {p!r} for "
                f"'{path}'; it must return 'flat' or 'owner'."
            )
        out.append(p)
    return out


def sub_optimizers(optimizer) -> list:
    """The optimizers that update buckets: a ``MultiOptimizer``'s parts, or itself."""
    if isinstance(optimizer, optim.MultiOptimizer):
        return list(optimizer.optimizers)
    return [optimizer]


def assign_optimizers(flat_grads, optimizer) -> List[int]:
    """Which sub-optimizer updates each array.

    ``MultiOptimizer`` filters are called with the full path and the full
    gradient, exactly as ``MultiOptimizer`` itself calls them, never with a
    shard. A filter must decide from the path and the shape: its answer fixes
    the sharding plan, so an answer computed from the gradient's values (an
    ``mx.array``) is refused.
    """
    if not isinstance(optimizer, optim.MultiOptimizer):
        return [0] * len(flat_grads)
    out = []
    for path, g in flat_grads:
        for i, fn in enumerate(optimizer.filters):
            chosen = fn(path, g)
            if isinstance(chosen, mx.array):
                raise ValueError(
                    f"MultiOptimizer filter {i} returned an mx.array for '{path}', "
                    "so it depends on the gradient's values. The sharded step "
                    "fixes which sub-optimizer (and which rank) updates each array "
                    "once; decide from the path and the shape, e.g. "
                    "lambda path, g: g.ndim >= 2 and 'embed' not in path."
                )
            if chosen:  # MLX appends a filter that accepts everything
                out.append(i)
                break
    return out


def signature_of(flat_grads, flat_params, optimizer_of=None, placement_of=None) -> Signature:
    """The hashable description of a flat gradient tree that a plan is built from.

    Args:
        flat_grads (list): ``(path, gradient)`` pairs from ``tree_flatten``.
        flat_params (list): The matching parameters, in the same order.
        optimizer_of (list[int], optional): Sub-optimizer index of each array.
            Default: all ``0``.
        placement_of (list[str], optional): ``"flat"`` or ``"owner"`` for each
            array. Default: all ``"flat"``.

    Returns:
        tuple: The signature.
    """
    optimizer_of = optimizer_of or [0] * len(flat_grads)
    placement_of = placement_of or [FLAT] * len(flat_grads)
    return tuple(
        (path, tuple(g.shape), dtype_name(g.dtype), dtype_name(p.dtype), o, where)
        for (path, g), p, o, where in zip(flat_grads, flat_params, optimizer_of, placement_of)
    )


def plan_for(flat_grads, flat_params, optimizer, world_size: int, communication_size: int,
             placement=None) -> Plan:
    """The (cached) plan for a flat gradient tree and an optimizer.

    Args:
        flat_grads (list): ``(path, gradient)`` pairs.
        flat_params (list): The matching parameters.
        optimizer (mlx.optimizers.Optimizer): Decides each array's
            sub-optimizer (``MultiOptimizer`` filters) and placement.
        world_size (int): Number of ranks.
        communication_size (int): Bucket byte budget.
        placement (optional): The ``placement=`` argument of
            :func:`mlx_fsdp.fsdp_step`. Default: ``None`` (the registry).

    Returns:
        Plan: The plan.
    """
    optimizer_of = assign_optimizers(flat_grads, optimizer)
    placement_of = placements(resolve(optimizer, placement), flat_grads, optimizer_of)
    return build_plan(signature_of(flat_grads, flat_params, optimizer_of, placement_of),
                      world_size, communication_size)
