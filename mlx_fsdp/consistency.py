"""Checking, before the first step, that every rank built the same plan.

Ranks whose trees differ would issue collectives of different sizes and hang,
or silently add unrelated numbers. One fixed-size all-gather of a plan summary
turns that into an error on every rank.
"""

import mlx.core as mx

from .plan import Plan


def _summary(plan: Plan):
    digest = plan.fingerprint()
    # int32 keeps the gather portable across backends.
    return [
        int(digest[0:7], 16),
        int(digest[7:14], 16),
        plan.num_arrays % (1 << 31),
        plan.num_elements % (1 << 31),
    ]


def verify_plan(plan: Plan, group: mx.distributed.Group, group_name: str = "group"):
    """Raise on every rank if the ranks of ``group`` built different plans.

    This evaluates one small all-gather, so every rank of ``group`` must call it
    at the same point.

    Args:
        plan (Plan): This rank's plan.
        group (mlx.core.distributed.Group): The ranks that must agree.
        group_name (str): How the error names the group. Default: ``"group"``.

    Raises:
        ValueError: If any rank's plan differs from rank 0's.
    """
    if group.size() == 1:
        return
    local = mx.array(_summary(plan), dtype=mx.int32)
    rows = mx.distributed.all_gather(local[None], group=group).tolist()
    bad = [r for r, row in enumerate(rows) if row != rows[0]]
    if bad:
        details = ", ".join(
            f"rank {r}: {row[2]} arrays, {row[3]} elements" for r, row in enumerate(rows)
        )
        raise ValueError(
            f"The gradient trees differ across the ranks of the {group_name} "
            f"(ranks {bad} built a different plan than rank 0; {details}). Every "
            "rank must pass gradients with the same paths, shapes and dtypes, and "
            "the same communication_size."
        )
