"""The sharded step over trees: what ``fsdp_step`` and ``fsdp_apply_gradients`` share."""

from typing import Any, Callable, Optional, Set, Tuple

import mlx.core as mx
import mlx.optimizers as optim
from mlx.utils import tree_flatten, tree_map

from . import _trees, collectives
from . import placement as placement_rules
from .consistency import verify_plan
from .plan import Plan, build_plan, signature_of
from .plain import plain_step
from .step import Stages, finish_step, reduce_all


def sub_optimizers(optimizer) -> list:
    """The optimizers that update buckets: a ``MultiOptimizer``'s parts, or itself."""
    if isinstance(optimizer, optim.MultiOptimizer):
        return list(optimizer.optimizers)
    return [optimizer]


def assign_optimizers(flat_grads, optimizer) -> list:
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
            if chosen:
                out.append(i)
                break
    return out


def plan_for(
    flat_grads,
    flat_params,
    optimizer,
    world_size: int,
    communication_size: int,
    placement=None,
) -> Plan:
    """The (cached) plan for a flat gradient tree.

    ``placement`` is the ``placement=`` argument of :func:`mlx_fsdp.fsdp_step`
    (see :func:`mlx_fsdp.placement.resolve`).
    """
    optimizer_of = assign_optimizers(flat_grads, optimizer)
    rules = placement_rules.resolve(optimizer, placement)
    placement_of = placement_rules.placements(rules, flat_grads, optimizer_of)
    return build_plan(
        signature_of(flat_grads, flat_params, optimizer_of, placement_of),
        world_size,
        communication_size,
    )


def shard_tree(plan: Plan, optimizer_index: int, values, rank: Optional[int] = None) -> dict:
    """``{path: values(slot)}`` for the parameters one sub-optimizer updates.

    With ``rank``, arrays owned by other ranks are left out: they have no
    state on this rank.
    """
    return {
        s.path: values(s)
        for b in plan.buckets
        if b.optimizer == optimizer_index
        for s in b.slots
        if rank is None or s.owner is None or s.owner == rank
    }


def _fits(value: mx.array, slot) -> bool:
    # A flat piece is (cols,). An owned array's state is the plain optimizer's
    # for the whole array: shaped like it, or like it with dimensions dropped
    # (Adafactor's row and column statistics).
    if value.ndim == 0:
        return True
    if slot.owner is None:
        return value.shape[0] == slot.cols
    dims = iter(slot.shape)
    return all(any(d == e for e in dims) for d in value.shape)


def verify_once(plan: Plan, group, dp_group, verified: Set[str]):
    """Check across ranks that they built the same plan, once per plan."""
    key = plan.fingerprint()
    if key not in verified:
        verify_plan(plan, group, "shard group")
        if dp_group is not None:
            verify_plan(plan, dp_group, "replica group (dp_group)")
        verified.add(key)


def check_state_fits(plan: Plan, optimizer, rank: Optional[int] = None):
    """Raise if the optimizer holds shard state made for a different plan.

    A state made for another tree or world size has pieces of other lengths,
    which would fail deep inside the update or, worse, broadcast silently.
    State of an owned array must be on its owner only (checked when ``rank``
    is given) and shaped for the whole array.
    """
    for o, opt in enumerate(sub_optimizers(optimizer)):
        states = opt.state.get("shards")
        if states is None:
            continue
        expected = shard_tree(plan, o, lambda s: s)
        if rank is None:
            required = {p for p, s in expected.items() if s.owner is None}
            allowed = set(expected)
        else:
            required = allowed = set(shard_tree(plan, o, lambda s: s, rank))
        if not (required <= set(states) <= allowed) or any(
            not _fits(v, expected[path])
            for path, s in states.items()
            for v in s.values()
            if isinstance(v, mx.array)
        ):
            raise ValueError(
                "The optimizer state does not fit this step's plan "
                f"({plan.num_arrays} arrays sharded over N={plan.world_size}); it "
                "was made for another gradient tree or world size. Keep those "
                "fixed for one optimizer, or start from a fresh optimizer."
            )


def apply_sharded(
    gradients: Any,
    parameters: Any,
    optimizer,
    *,
    group: mx.distributed.Group,
    dp_group: Optional[mx.distributed.Group],
    communication_size: int,
    max_norm: Optional[float],
    stream: Optional[mx.Stream],
    verified: Set[str],
    on_plan: Optional[Callable[[Plan], None]] = None,
    masters: Optional[dict] = None,
    master_dtype: Optional[mx.Dtype] = None,
    carry: Optional[dict] = None,
    finish: bool = True,
    divide: int = 1,
    placement=None,
) -> Tuple[Any, Optional[mx.array], Optional[Plan]]:
    """One sharded step on trees.

    Args:
        gradients: This rank's local gradients.
        parameters: The parameters (a superset of the gradients' paths).
        optimizer (mlx.optimizers.Optimizer): Holds this rank's shard state.
        group (mlx.core.distributed.Group): The shard group.
        dp_group (mlx.core.distributed.Group, optional): The replica group.
        communication_size (int): Bucket byte budget.
        max_norm (float, optional): Global-norm clipping bound.
        stream (mlx.core.Stream, optional): Communication stream.
        verified (set): Plan fingerprints already checked across ranks; the
            caller keeps it between steps, this function adds to it.
        on_plan (callable, optional): Called with the plan before any update,
            e.g. to check that the optimizer state fits it.
        masters (dict, optional): ``{path: piece}`` master copies, updated in
            place (see :mod:`mlx_fsdp.master`). Default: ``None``.
        master_dtype (Dtype, optional): The masters' dtype. Default: ``None``.
        carry (dict, optional): ``{path: piece}`` reduced gradients of earlier
            micro-batches (sharded gradient accumulation), added to this
            step's and updated in place. Default: ``None``.
        finish (bool): Take the optimizer step; with ``False`` only reduce
            the gradients into ``carry``. Default: ``True``.
        divide (int): Divide the (accumulated) gradients by this before the
            step: the number of micro-batches. Default: ``1``.
        placement (optional): Flat or owner placement per sub-optimizer, see
            :func:`mlx_fsdp.placement.resolve`. Default: ``None`` (registry).

    Returns:
        tuple: The updated parameters (shaped like ``gradients``; ``None``
        when ``finish`` is ``False``), the gradient norm before clipping (or
        ``None``), and the plan (``None`` on one rank).
    """
    n = group.size()
    replicas = dp_group.size() if dp_group is not None else 1
    flat_grads, flat_params = _trees.match(gradients, parameters)
    if n * replicas == 1:
        return _one_process(gradients, parameters, optimizer, max_norm, masters,
                            master_dtype, carry, finish, divide)

    plan = plan_for(flat_grads, flat_params, optimizer, n, communication_size, placement)
    verify_once(plan, group, dp_group, verified)
    if on_plan is not None:
        on_plan(plan)
    stage = Stages()
    pieces, last = reduce_all(
        plan, [g for _, g in flat_grads], group, dp_group,
        method=collectives.reduce_scatter_method(group), stream=stream, stage=stage,
    )
    if carry is not None:
        pieces = _add_carry(plan, pieces, carry, finish, stage)
        if not finish:
            return None, None, plan
    if divide != 1:
        pieces = [[None if p is None else p / divide for p in b] for b in pieces]
    new_params, norm = finish_step(
        plan, pieces, flat_params, sub_optimizers(optimizer), group,
        max_norm=max_norm, stream=stream, stage=stage, masters=masters,
        master_dtype=master_dtype, last=last,
    )
    return _trees.like(gradients, new_params), norm, plan


def _add_carry(plan, pieces, carry, finish, stage):
    """Add the carried pieces; keep the sums in ``carry`` unless this step finishes."""
    items = [(s.path, p) for b, bp in zip(plan.buckets, pieces) for s, p in zip(b.slots, bp)]
    sums = iter(_trees.accumulate(carry, items, keep=not finish))
    if not finish:
        stage(carry)
    return [[next(sums) for _ in bp] for bp in pieces]


def _one_process(gradients, parameters, optimizer, max_norm, masters, master_dtype,
                 carry, finish, divide):
    # One process: exactly the plain optimizer (with masters if asked for).
    if carry is not None:
        summed = _trees.accumulate(carry, tree_flatten(gradients), keep=not finish)
        if not finish:
            return None, None, None
        gradients = _trees.like(gradients, summed)
    if divide != 1:
        gradients = tree_map(lambda g: g / divide, gradients)
    new, norm = plain_step(gradients, parameters, optimizer, max_norm=max_norm,
                           masters=masters, master_dtype=master_dtype)
    return new, norm, None
