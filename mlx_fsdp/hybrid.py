"""Hybrid sharding: shard within groups of ranks, replicate across them (HSDP)."""

from typing import Optional, Tuple

import mlx.core as mx

from .options import group_or_global


def hybrid_groups(
    shard_size: int, group: Optional[mx.distributed.Group] = None
) -> Tuple[mx.distributed.Group, mx.distributed.Group]:
    """Split ``group`` into shard groups of ``shard_size`` ranks and replica groups.

    Ranks ``[k * shard_size, (k + 1) * shard_size)`` form shard group ``k`` (on
    one machine, if the launcher places consecutive ranks together); ranks with
    the same position in their shard group form a replica group.

    .. code-block:: python

        shard, replica = mlx_fsdp.hybrid_groups(2)   # 4 ranks: 2 x 2
        opt = mlx_fsdp.fsdp_step(optim.AdamW(1e-3), group=shard, dp_group=replica)

    Needs ``Group.split`` (MPI, NCCL); on MPI, drop the groups before the
    process exits. Both explained in docs/hybrid.md.

    Args:
        shard_size (int): Ranks per shard group; must divide the group size.
        group (mlx.core.distributed.Group, optional): The group to split.
            Default: ``None`` (the global group).

    Returns:
        tuple: ``(shard_group, replica_group)``.
    """
    group = group_or_global(group)
    n = group.size()
    if not isinstance(shard_size, int) or shard_size < 1 or n % shard_size:
        raise ValueError(
            f"shard_size={shard_size!r} must be a positive integer that divides the "
            f"group size {n}; pick one of {[d for d in range(1, n + 1) if n % d == 0]}."
        )
    r = group.rank()
    try:
        shard = group.split(r // shard_size)
        replica = group.split(r % shard_size)
    except RuntimeError as e:
        raise RuntimeError(
            f"This backend cannot split a group ({e}); hybrid sharding needs "
            "Group.split, which MPI and NCCL have and ring and JACCL do not. "
            "Launch with MPI or NCCL, or shard over all ranks (no dp_group)."
        ) from e
    return shard, replica
