"""A drop-in for ``mlx.nn.fsdp_apply_gradients`` (MLX 0.31, removed in 0.32.1)."""

from typing import Any, Optional

import mlx.core as mx

from .hybrid import check_hybrid
from .placement import resolve
from .sharded import apply_sharded, check_state_fits
from .wrapper import group_or_global

# Plans already checked across ranks, per group object (see collectives.py for
# why groups are keyed by id).
_verified: dict = {}


def fsdp_apply_gradients(
    gradients: Any,
    parameters: Any,
    optimizer,
    fsdp_group: Optional[mx.distributed.Group] = None,
    dp_group: Optional[mx.distributed.Group] = None,
    communication_size: int = 32 * 1024**2,
    communication_stream: Optional[mx.Stream] = None,
    max_norm: Optional[float] = None,
    placement=None,
):
    """Sharded optimizer step with the arguments and returns of MLX 0.31's function.

    Code written for ``mlx.nn.fsdp_apply_gradients`` keeps working after
    changing only the import. Unlike the original, array sizes need not divide
    by the world size, gradients may mix dtypes, and it runs on every backend
    (ring and MPI through a fallback for the reduce-scatter, see :mod:`mlx_fsdp.collectives`).

    The optimizer keeps this rank's shard state between calls, so pass the same
    optimizer every step. :func:`mlx_fsdp.fsdp_step` is the same step behind an
    optimizer-like object.

    Args:
        gradients (Any): This rank's local gradients.
        parameters (Any): The full parameters (a superset of the gradients).
        optimizer (mlx.optimizers.Optimizer): Any MLX optimizer; shape-aware
            ones (Muon, Adafactor) update whole arrays on owner ranks.
        fsdp_group (mlx.core.distributed.Group, optional): The shard group.
            ``None`` means the global group. Default: ``None``.
        dp_group (mlx.core.distributed.Group, optional): The replica group of
            hybrid sharding. Default: ``None``.
        communication_size (int): Bucket byte budget. Default: ``32 MiB``.
        communication_stream (mlx.core.Stream, optional): Stream for the
            collectives. Default: ``None``.
        max_norm (float, optional): Clip to this global norm. Default: ``None``.
        placement (optional): ``"flat"``, ``"owner"``, a callable or a list per
            sub-optimizer, as in :func:`mlx_fsdp.fsdp_step`. Default: ``None``
            (decided from the optimizer).

    Returns:
        The updated parameters (shaped like ``gradients``), or
        ``(parameters, grad_norm)`` when ``max_norm`` is given, ``grad_norm``
        being the global norm before clipping.
    """
    group = group_or_global(fsdp_group)
    check_hybrid(group, dp_group)
    resolve(optimizer, placement)
    new, norm, _ = apply_sharded(
        gradients,
        parameters,
        optimizer,
        group=group,
        dp_group=dp_group,
        communication_size=communication_size,
        max_norm=max_norm,
        stream=communication_stream,
        verified=_verified.setdefault(id(group), set()),
        on_plan=lambda plan: check_state_fits(plan, optimizer, group.rank()),
        placement=placement,
    )
    return new if max_norm is None else (new, norm)
