"""``ddp_step``: the data-parallel baseline with the same interface as ``fsdp_step``."""

from typing import Optional

import mlx.core as mx
import mlx.nn as nn

from . import _trees
from .plain import plain_step
from .wrapper import DistributedOptimizer


class ReplicatedOptimizer(DistributedOptimizer):
    """Plain data parallelism: every rank holds the full optimizer state.

    Create it with :func:`ddp_step`. Gradients are all-reduce-averaged in
    buckets by :func:`mlx.nn.average_gradients`, clipped by their global norm
    (accumulated in float32, as in the sharded step) and given to the wrapped
    optimizer whole. With ``master_dtype``, ``state["master"][path]`` holds the
    full master copy of every parameter of another dtype.
    """

    def __init__(
        self,
        optimizer,
        *,
        group=None,
        communication_size: int = 32 * 1024**2,
        max_norm: Optional[float] = None,
        communication_stream: Optional[mx.Stream] = None,
        master_dtype: Optional[mx.Dtype] = None,
        reduce_dtype: Optional[mx.Dtype] = None,
        grad_accumulation_steps: int = 1,
    ):
        super().__init__(
            optimizer, group, max_norm, communication_size=communication_size,
            communication_stream=communication_stream, master_dtype=master_dtype,
            reduce_dtype=reduce_dtype, grad_accumulation_steps=grad_accumulation_steps,
        )

    def _step(self, gradients, parameters):
        gradients = nn.average_gradients(
            gradients, self.group, self.communication_size, self.communication_stream
        )
        new, norm = plain_step(
            gradients,
            parameters,
            self.optimizer,
            max_norm=self.max_norm,
            masters=self._masters(),
            master_dtype=self.master_dtype,
        )
        self._set_grad_norm(norm)
        return new

    def init(self, parameters):
        """Initialize the full optimizer state (as the wrapped optimizer does)."""
        flat, flat_params = _trees.match(parameters, parameters)
        self.optimizer.init(
            _trees.like(parameters, self._initial_masters([k for k, _ in flat], flat_params))
        )


def ddp_step(
    optimizer,
    *,
    group: Optional[mx.distributed.Group] = None,
    communication_size: int = 32 * 1024**2,
    max_norm: Optional[float] = None,
    communication_stream: Optional[mx.Stream] = None,
    master_dtype: Optional[mx.Dtype] = None,
    reduce_dtype: Optional[mx.Dtype] = None,
    grad_accumulation_steps: int = 1,
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
        master_dtype (Dtype, optional): Keep a full master copy of every
            parameter of another dtype (e.g. float32 masters of a bfloat16
            model) on every rank and run the optimizer on it. Default: ``None``.
        reduce_dtype (Dtype, optional): All-reduce the gradients in this dtype.
            Default: ``None`` (their own dtype).
        grad_accumulation_steps (int): Average the gradients of this many
            calls of ``update`` (micro-batches) and step on the last one; they
            are summed locally and communicated once. Default: ``1``.

    Returns:
        ReplicatedOptimizer: The wrapper.
    """
    return ReplicatedOptimizer(
        optimizer,
        group=group,
        communication_size=communication_size,
        max_norm=max_norm,
        communication_stream=communication_stream,
        master_dtype=master_dtype,
        reduce_dtype=reduce_dtype,
        grad_accumulation_steps=grad_accumulation_steps,
    )
