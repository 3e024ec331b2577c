"""The optimizer state a rank holds under a plan: made, described and checked.

Under :func:`mlx_fsdp.fsdp_step` each sub-optimizer's state has an entry per
array the rank holds any of (see :mod:`mlx_fsdp.layout`), shaped like what
it holds: a 1-D piece, a whole owned array, or its rows.
"""

import mlx.core as mx

from . import layout, master
from .placement import sub_optimizers
from .plan import Plan


def init_held(plan: Plan, optimizer, values, rank: int, masters: dict, master_dtype=None):
    """Initialize ``optimizer`` (and ``masters``) on what ``rank`` holds under ``plan``.

    Lazy, like any MLX ``init``: on unevaluated arrays it allocates nothing,
    which is how :mod:`mlx_fsdp.plan_memory` sizes a rank's state.

    Args:
        plan (Plan): The plan.
        optimizer (mlx.optimizers.Optimizer): The wrapped optimizer.
        values (list[array]): The full parameters, indexed by ``Slot.index``.
        rank (int): The rank.
        masters (dict): Receives the masters of what the rank holds.
        master_dtype (Dtype, optional): As for :func:`fsdp_step`. Default: ``None``.
    """
    for o, sub in enumerate(sub_optimizers(optimizer)):
        held = [(s.path, a) for b in plan.buckets if b.optimizer == o
                for s, a in layout.held_of(b, values, rank)]
        steps = master.initial([p for p, _ in held], [a for _, a in held], masters, master_dtype)
        sub.init({p: a for (p, _), a in zip(held, steps)})


def held_shapes(plan: Plan, rank: int, optimizer_index: int) -> dict:
    """``{path: shape}`` of what ``rank`` holds of each array a sub-optimizer updates."""
    return {s.path: layout.held_shape(b, s, rank) for b in plan.buckets
            if b.optimizer == optimizer_index for s in b.held(rank)}


def check_state(plan: Plan, optimizer, rank: int):
    """Raise if ``optimizer`` holds sharded state made for another plan or rank.

    A state made for another tree, world size or budget has pieces of other
    lengths, which would fail deep inside the update or, worse, broadcast
    silently; state of an owned array belongs on its owner only.
    """
    # An owner's state may have other shapes (Adafactor's factors); a
    # piece's or a row block's element-wise state has the held shape.
    whole = {s.path for b in plan.buckets if b.owned for s in b.slots}
    for o, sub in enumerate(sub_optimizers(optimizer)):
        want = held_shapes(plan, rank, o)
        have = {k: v for k, v in sub.state.items() if isinstance(v, dict)}
        bad = sorted(set(have) - set(want))
        bad += [path for path, entries in have.items() if path in want and path not in whole
                for v in entries.values()
                if isinstance(v, mx.array) and v.ndim and v.shape != want[path]]
        if bad:
            raise ValueError(
                f"The optimizer state does not fit this step's plan ({plan.num_arrays} arrays "
                f"sharded over N={plan.world_size}; e.g. {bad[:3]}): it was made for another "
                "gradient tree, world size or communication_size. Keep those fixed for one "
                "optimizer, start from a fresh optimizer, or load a checkpoint, which reshards."
            )
