"""How ``fully_shard`` keeps each parameter: axis-0 slices, or whole on an owner rank.

Element-wise optimizers update any slice of an array exactly, so by default
every rank holds its axis-0 slice of every parameter, as ``mlx.nn.fully_shard``
does. Muon orthogonalizes whole matrices and Adafactor factors them: on a
slice of rows they would silently be other optimizers. ``placement=`` keeps
such arrays whole, each on one owner rank, so that ``fsdp_step`` updates them
exactly; it takes the optimizer itself, or the rules of ``fsdp_step``'s
``placement``.
"""

from typing import Dict, List, Tuple

import mlx.core as mx
import mlx.optimizers as optim

from .. import placement as _placement
from ..owners import cost
from ..plan import OWNER, ROWS, Plan, build_plan, dtype_name


def placement_of(placement, flat: List[Tuple[str, mx.array]]) -> Dict[str, str]:
    """``{path: "rows" | "owner"}`` for the trainable arrays of a module.

    Args:
        placement: ``None`` or ``"flat"`` (axis-0 slices), ``"owner"`` (whole
            arrays on owner ranks), a callable ``(path, shape) -> "flat" |
            "owner"``, or the ``mlx.optimizers.Optimizer`` that will train
            the module (its arrays are placed as :func:`mlx_fsdp.fsdp_step`
            places them; a ``MultiOptimizer``'s filters see paths relative
            to the wrapped module).
        flat (list): ``(path, array)`` of the trainable floating-point arrays.

    Returns:
        dict: The placement of each array.
    """
    if placement is None:
        return {p: ROWS for p, _ in flat}
    if isinstance(placement, optim.Optimizer):
        rules = _placement.resolve(placement)
        chosen = _placement.placements(rules, flat, _placement.assign_optimizers(flat, placement))
    else:
        _placement.check_rule(placement, "placement")
        chosen = _placement.placements([placement], flat, [0] * len(flat))
    return {p: OWNER if c == OWNER else ROWS for (p, _), c in zip(flat, chosen)}


def module_plan(flat: List[Tuple[str, mx.array]], trainable, placement, world_size: int,
                communication_size: int, compute_dtype=None, reduce_dtype=None,
                owner_loads: tuple = ()) -> Plan:
    """The plan of a module's own floating-point arrays under ``fully_shard``.

    Every array (frozen ones too) is gathered in ``compute_dtype`` (else its
    own) and reduced in ``reduce_dtype`` (else the gathered dtype); trainable
    ones are placed by :func:`placement_of`, frozen ones by rows.

    Args:
        flat (list): ``(path, array)`` of the arrays, in tree order.
        trainable: The paths of the trainable ones.
        placement: As :func:`mlx_fsdp.fully_shard`'s.
        world_size (int): Ranks.
        communication_size (int): Bucket byte budget.
        compute_dtype (Dtype, optional): As ``fully_shard``'s. Default: ``None``.
        reduce_dtype (Dtype, optional): As ``fully_shard``'s. Default: ``None``.
        owner_loads (tuple, optional): What each rank owns already (see
            :func:`owned_loads`). Default: ``()``.

    Returns:
        Plan: The plan (no buckets for no arrays).
    """
    if not flat:
        return Plan(world_size, 0, ())
    where = placement_of(placement, [(p, a) for p, a in flat if p in trainable])
    signature = tuple(
        (p, tuple(a.shape), dtype_name(reduce_dtype or compute_dtype or a.dtype),
         dtype_name(compute_dtype or a.dtype), 0, where.get(p, ROWS)) for p, a in flat)
    return build_plan(signature, world_size, communication_size, owner_loads)


def owned_loads(plan: Plan, start: tuple = ()) -> tuple:
    """``start`` plus the ``(cost, bytes)`` of the arrays each rank owns under ``plan``.

    What the next module's owner placement starts from, so that a model
    wrapped block by block is balanced as a whole.
    """
    loads = [list(start[r]) if start else [0, 0] for r in range(plan.world_size)]
    for b in plan.buckets:
        for s in b.slots:
            if s.owner is not None:
                loads[s.owner][0] += cost(s.shape)
                loads[s.owner][1] += s.size * getattr(mx, b.dtype).size
    return tuple(map(tuple, loads))
