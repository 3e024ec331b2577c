"""``ddp_step``: the data-parallel baseline with the same interface as ``fsdp_step``."""

from typing import Optional

import mlx.core as mx
import mlx.nn as nn

from . import clip
from .wrapper import DistributedOptimizer


class ReplicatedOptimizer(DistributedOptimizer):
    """Plain data parallelism: every rank holds the full optimizer state.

    Create it with :func:`ddp_step`. Gradients are all-reduce-averaged in
    buckets by :func:`mlx.nn.average_gradients`, clipped by their global norm
    (accumulated in float32, as in the sharded step) and given to the wrapped
    optimizer whole.
    """

    def __init__(
        self,
        optimizer,
        *,
        group=None,
        communication_size: int = 32 * 1024**2,
        max_norm: Optional[float] = None,
        communication_stream: Optional[mx.Stream] = None,
    ):
        super().__init__(optimizer, group, max_norm)
        self.communication_size = communication_size
        self.communication_stream = communication_stream

    def apply_gradients(self, gradients, parameters):
        """Average ``gradients`` over the group, clip, and apply them.

        Args:
            gradients (dict): This rank's local gradients.
            parameters (dict): The parameters or the model.

        Returns:
            dict: The updated parameters, shaped like ``gradients``.
        """
        gradients = nn.average_gradients(
            gradients, self.group, self.communication_size, self.communication_stream
        )
        if self.max_norm is not None:
            gradients, norm = clip.clip_tree(gradients, self.max_norm)
            self._set_grad_norm(norm)
        return self.optimizer.apply_gradients(gradients, parameters)

    def init(self, parameters):
        """Initialize the full optimizer state (as the wrapped optimizer does)."""
        self.optimizer.init(parameters)


def ddp_step(
    optimizer,
    *,
    group: Optional[mx.distributed.Group] = None,
    communication_size: int = 32 * 1024**2,
    max_norm: Optional[float] = None,
    communication_stream: Optional[mx.Stream] = None,
) -> ReplicatedOptimizer:
    """Wrap an optimizer for plain data parallelism (the baseline of ``fsdp_step``).

    Args:
        optimizer (mlx.optimizers.Optimizer): Any MLX optimizer.
        group (mlx.core.distributed.Group, optional): The data-parallel group;
            ``None`` means the global group. Default: ``None``.
        communication_size (int): Bucket size of the all-reduce in bytes.
            Default: ``32 MiB``.
        max_norm (float, optional): Clip the averaged gradients to this global
            norm; the norm before clipping is then in ``opt.grad_norm``.
            Default: ``None``.
        communication_stream (mlx.core.Stream, optional): Stream for the
            all-reduce. Default: ``None``.

    Returns:
        ReplicatedOptimizer: The wrapper.
    """
    return ReplicatedOptimizer(
        optimizer,
        group=group,
        communication_size=communication_size,
        max_norm=max_norm,
        communication_stream=communication_stream,
    )
