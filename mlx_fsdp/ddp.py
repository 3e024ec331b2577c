"""``ddp_step``: the data-parallel baseline with the same interface as ``fsdp_step``."""

from typing import Optional

import mlx.core as mx
from mlx.utils import tree_unflatten

from . import master
from ._trees import match
from .options import make_options
from .plain import replicated_step
from .wrapper import DistributedOptimizer


class ReplicatedOptimizer(DistributedOptimizer):
    """Plain data parallelism: every rank holds the full optimizer state.

    Create it with :func:`ddp_step`. Gradients are all-reduce-averaged in
    buckets by :func:`mlx.nn.average_gradients`, clipped by their global norm
    (accumulated in float32, as in the sharded step) and given to the wrapped
    optimizer whole. With ``master_dtype``, ``state["master"][path]`` holds the
    full master copy of every parameter of another dtype.
    """

    def _step(self, gradients, parameters):
        return replicated_step(self.options, self.optimizer, self._state, gradients, parameters,
                               dog=self._dog)

    def init(self, parameters):
        """Initialize the full optimizer state (as the wrapped optimizer does)."""
        flat, params = match(parameters, parameters)
        paths = [p for p, _ in flat]
        steps = master.initial(paths, params, self._state["master"], self.options.master_dtype)
        self.optimizer.init(tree_unflatten(list(zip(paths, steps))))


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
    timeout: Optional[float] = None,
) -> ReplicatedOptimizer:
    """Wrap an optimizer for plain data parallelism (the baseline of ``fsdp_step``).

    Every step checks across ranks, like ``fsdp_step``, that all ranks take
    the same step with the same gradient tree and settings.

    Args:
        optimizer (mlx.optimizers.Optimizer): Any MLX optimizer.
        group (mlx.core.distributed.Group, optional): The data-parallel group;
            ``None`` means the global group. Default: ``None``.
        communication_size (int): Bucket size of the all-reduce in bytes.
            Default: ``32 MiB``.
        max_norm (float, optional): Clip the averaged gradients to this global
            norm (> 0); the norm before clipping is then in ``opt.grad_norm``.
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
            are summed locally and communicated once (inside ``mx.compile``,
            every micro-batch). Default: ``1``.
        timeout (float, optional): Watchdog timeout in seconds, as in
            :func:`mlx_fsdp.fsdp_step`. Default: ``None``.

    Returns:
        ReplicatedOptimizer: The wrapper.
    """
    return ReplicatedOptimizer(optimizer, make_options(
        optimizer, sharded=False, group=group, communication_size=communication_size,
        max_norm=max_norm, communication_stream=communication_stream,
        master_dtype=master_dtype, reduce_dtype=reduce_dtype,
        grad_accumulation_steps=grad_accumulation_steps, timeout=timeout))
