"""A drop-in for ``mlx.nn.fsdp_apply_gradients`` (MLX 0.31, removed in 0.32.1)."""

from typing import Any, Optional

import mlx.core as mx

from .fsdp import ShardedOptimizer
from .options import make_options

# One wrapper per optimizer (by id): it keeps what the step needs besides the
# optimizer's own state (the plan, the micro-step counter), and is replaced
# when the call's options change.
_wrappers: dict = {}


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
    (ring and MPI through a fallback for the reduce-scatter, see
    :mod:`mlx_fsdp.collectives`). Its arguments are validated like those of
    :func:`mlx_fsdp.fsdp_step`.

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
        max_norm (float, optional): Clip to this global norm (> 0). Default: ``None``.
        placement (optional): ``"flat"``, ``"owner"``, a callable or a list per
            sub-optimizer, as in :func:`mlx_fsdp.fsdp_step`. Default: ``None``
            (decided from the optimizer).

    Returns:
        The updated parameters (shaped like ``gradients``), or
        ``(parameters, grad_norm)`` when ``max_norm`` is given, ``grad_norm``
        being the global norm before clipping.
    """
    options = make_options(
        optimizer, sharded=True, group=fsdp_group, dp_group=dp_group,
        communication_size=communication_size, communication_stream=communication_stream,
        max_norm=max_norm, placement=placement)
    wrapper = _wrappers.get(id(optimizer))
    if wrapper is None or wrapper.optimizer is not optimizer or wrapper.options != options:
        wrapper = _wrappers[id(optimizer)] = ShardedOptimizer(optimizer, options)
    new = wrapper.apply_gradients(gradients, parameters)
    return new if max_norm is None else (new, wrapper.grad_norm)
