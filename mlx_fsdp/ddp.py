"""``ddp_step``: the data-parallel baseline with the same interface as ``fsdp_step``."""

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
                               dog=self._dog, fused=self._fused)

    def init(self, parameters):
        """Initialize the full optimizer state (as the wrapped optimizer does)."""
        flat, params = match(parameters, parameters)
        paths = [p for p, _ in flat]
        steps = master.initial(paths, params, self._state["master"], self.options.master_dtype)
        self.optimizer.init(tree_unflatten(list(zip(paths, steps))))


def ddp_step(optimizer, **options) -> ReplicatedOptimizer:
    """Wrap an optimizer for plain data parallelism (the baseline of ``fsdp_step``).

    Gradients are averaged with :func:`mlx.nn.average_gradients`, clipped by
    their global norm and given to the plain optimizer, whole, on every
    rank. Like ``fsdp_step``, every step first checks across ranks that all
    ranks take the same step with the same gradient tree and settings, and
    where ``fsdp_step`` compiles the update (a GPU; see
    :mod:`mlx_fsdp.fused`) so does this, so that the two round alike.

    .. code-block:: python

        opt = mlx_fsdp.ddp_step(optim.AdamW(learning_rate=3e-4), max_norm=1.0)

    Args:
        optimizer (mlx.optimizers.Optimizer): Any MLX optimizer.
        **options: The options of :func:`mlx_fsdp.fsdp_step` that data
            parallelism has, with the same meanings and defaults: ``group``,
            ``communication_size`` (the all-reduce's bucket size),
            ``max_norm``, ``communication_stream``, ``master_dtype`` (a full
            master copy of every parameter of another dtype, on every rank),
            ``reduce_dtype``, ``grad_accumulation_steps`` (micro-batch
            gradients summed locally and communicated once; inside
            ``mx.compile``, every micro-batch) and ``timeout``.

    Returns:
        ReplicatedOptimizer: The wrapper.
    """
    return ReplicatedOptimizer(optimizer, make_options(optimizer, sharded=False, **options))
