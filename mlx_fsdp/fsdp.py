"""``fsdp_step``: an optimizer wrapper whose state and work are split over ranks."""

from typing import Optional

import mlx.core as mx

from . import _trees
from . import placement as placement_rules
from .hybrid import check_hybrid
from .sharded import (
    apply_sharded,
    check_state_fits,
    plan_for,
    shard_tree,
    sub_optimizers,
    verify_once,
)
from .step import local_piece
from .wrapper import DistributedOptimizer


class ShardedOptimizer(DistributedOptimizer):
    """An optimizer whose state lives in 1/N shards, one per rank.

    Create it with :func:`fsdp_step`. Every rank keeps the full model; the
    gradients are reduce-scattered, each rank updates its shard with the
    wrapped optimizer, and the updated shards are all-gathered.

    The wrapped optimizer's state (``opt.state["optimizer"]``) holds, for each
    sub-optimizer, ``state["shards"][path]``: this rank's ``(cols,)`` piece of
    the parameter at ``path`` (row ``rank`` of its zero-padded ``(N, cols)``
    layout, see :mod:`mlx_fsdp.plan`), so it depends on the world size but not
    on ``communication_size``. With a single process it is exactly the plain
    optimizer's state.
    """

    def __init__(
        self,
        optimizer,
        *,
        group=None,
        dp_group=None,
        communication_size: int = 32 * 1024**2,
        max_norm: Optional[float] = None,
        communication_stream: Optional[mx.Stream] = None,
        master_dtype: Optional[mx.Dtype] = None,
        reduce_dtype: Optional[mx.Dtype] = None,
        grad_accumulation_steps: int = 1,
        accumulation: str = "local",
        placement=None,
    ):
        super().__init__(
            optimizer, group, max_norm, communication_size=communication_size,
            communication_stream=communication_stream, master_dtype=master_dtype,
            reduce_dtype=reduce_dtype, grad_accumulation_steps=grad_accumulation_steps,
            accumulation=accumulation,
        )
        placement_rules.resolve(optimizer, placement)
        check_hybrid(self.group, dp_group)
        self.dp_group = dp_group
        self.placement = placement
        self._verified = set()
        self._plan = None

    @property
    def plan(self):
        """The :class:`~mlx_fsdp.plan.Plan` of the last step (``None`` on one rank)."""
        return self._plan

    def _on_state_set(self):
        self._plan = None

    def _check_same_plan(self, plan):
        if self._plan is None:
            check_state_fits(plan, self.optimizer, self.group.rank())
            self._plan = plan
        elif plan is not self._plan and plan != self._plan:
            raise ValueError(
                "The gradient tree changed since the optimizer state was built: "
                f"it was for {self._plan.num_arrays} arrays ({self._plan.num_elements} "
                f"elements), now there are {plan.num_arrays} ({plan.num_elements}). "
                "The sharded state cannot follow; create a new fsdp_step for the "
                "new tree (or call init with model.trainable_parameters())."
            )

    accumulation_modes = ("local", "sharded")

    def _step(self, gradients, parameters, **accumulate):
        new, norm, _ = apply_sharded(
            gradients,
            parameters,
            self.optimizer,
            group=self.group,
            dp_group=self.dp_group,
            communication_size=self.communication_size,
            max_norm=self.max_norm,
            stream=self.communication_stream,
            verified=self._verified,
            on_plan=self._check_same_plan,
            masters=self._masters(),
            master_dtype=self.master_dtype,
            placement=self.placement,
            **accumulate,
        )
        if new is None:  # a micro-batch of sharded accumulation
            return _trees.like(gradients, _trees.match(gradients, parameters)[1])
        self._set_grad_norm(norm)
        return new

    def init(self, parameters):
        """Initialize this rank's shard of the optimizer state.

        Optional, as with MLX optimizers; useful to see :attr:`state` before the
        first step. Every rank must call it (it checks the plan across ranks).

        Args:
            parameters (dict): The trainable parameters, e.g.
                ``model.trainable_parameters()``.
        """
        n = self.group.size()
        flat, flat_params = _trees.match(parameters, parameters)
        if n * (self.dp_group.size() if self.dp_group is not None else 1) == 1:
            self.optimizer.init(_trees.like(parameters, self._initial_masters(
                [k for k, _ in flat], flat_params)))
            return
        plan = plan_for(
            flat, flat_params, self.optimizer, n, self.communication_size, self.placement
        )
        verify_once(plan, self.group, self.dp_group, self._verified)
        rank = self.group.rank()

        def piece(s):
            p = flat_params[s.index]
            return p if s.owner is not None else local_piece(s, p, rank)

        for o, opt in enumerate(sub_optimizers(self.optimizer)):
            pieces = shard_tree(plan, o, piece, rank)
            steps = self._initial_masters(list(pieces), list(pieces.values()))
            opt.init({"shards": dict(zip(pieces, steps))})
        self._check_same_plan(plan)


def fsdp_step(
    optimizer,
    *,
    group: Optional[mx.distributed.Group] = None,
    dp_group: Optional[mx.distributed.Group] = None,
    communication_size: int = 32 * 1024**2,
    max_norm: Optional[float] = None,
    communication_stream: Optional[mx.Stream] = None,
    master_dtype: Optional[mx.Dtype] = None,
    reduce_dtype: Optional[mx.Dtype] = None,
    grad_accumulation_steps: int = 1,
    accumulation: str = "local",
    placement=None,
) -> ShardedOptimizer:
    """Wrap an optimizer so that its state and its work are sharded over ranks.

    The result is used like the optimizer itself, and gives the same training
    result as data parallelism with the plain optimizer on averaged gradients:

    .. code-block:: python

        opt = mlx_fsdp.fsdp_step(optim.AdamW(learning_rate=3e-4), max_norm=1.0)
        loss, grads = nn.value_and_grad(model, loss_fn)(model, x, y)
        opt.update(model, grads)
        mx.eval(model.parameters(), opt.state)

    Each step buckets the gradients by dtype (at most ``communication_size``
    bytes per bucket), lays every array out as ``(N, cols)`` with zero padding,
    reduce-scatters each bucket, clips by the global norm, runs the optimizer on
    this rank's shard and all-gathers the updated parameters. The first step
    checks across ranks that every rank built the same plan.

    Element-wise optimizers (SGD, RMSprop, Adagrad, AdaDelta, Adam, AdamW,
    Adamax, Lion, and Muon on 0-D/1-D arrays) run on flat ``1/N`` pieces of
    every array. Shape-aware ones (Muon on >= 2-D arrays, Adafactor, and any
    optimizer class mlx_fsdp does not know) run unmodified on whole arrays,
    each kept on one owner rank chosen to balance the work (see
    :mod:`mlx_fsdp.owners`). Both are exact.

    Args:
        optimizer (mlx.optimizers.Optimizer): Any MLX optimizer, or a
            ``MultiOptimizer`` (its filters see full paths and full arrays).
        group (mlx.core.distributed.Group, optional): The shard group. ``None``
            means the global group. Default: ``None``.
        dp_group (mlx.core.distributed.Group, optional): The replica group for
            hybrid sharding (see :func:`mlx_fsdp.hybrid_groups`); gradients are
            also summed over it. Default: ``None``.
        communication_size (int): Byte budget of a bucket; ``<= 0`` puts every
            array in its own bucket. Default: ``32 MiB``.
        max_norm (float, optional): Clip the averaged gradients to this global
            norm; the norm before clipping is then in ``opt.grad_norm``.
            Default: ``None``.
        communication_stream (mlx.core.Stream, optional): Stream for the
            collectives. Default: ``None``.
        master_dtype (Dtype, optional): Keep master copies of this dtype (e.g.
            ``mx.float32``) of this rank's pieces of every parameter of
            another dtype, run the optimizer on them in that dtype, and
            all-gather the result in the parameter's dtype. Each rank holds
            1/N of the masters DDP holds. Default: ``None``.
        reduce_dtype (Dtype, optional): Reduce-scatter the gradients in this
            dtype, e.g. ``mx.float32`` to sum bfloat16 gradients without
            rounding (at twice the bytes). Default: ``None`` (their own dtype).
        grad_accumulation_steps (int): Average the gradients of this many
            calls of ``update`` (micro-batches) and step on the last one.
            Default: ``1``.
        accumulation (str): ``"local"`` sums the micro-batch gradients on
            each rank and communicates once (a full-size buffer);
            ``"sharded"`` reduce-scatters every micro-batch and keeps only
            this rank's 1/N of the sum (k times the communication).
            Default: ``"local"``.
        placement (str, callable or list, optional): How arrays are placed:
            ``"flat"`` (element-wise optimizers: 1/N of every array per rank),
            ``"owner"`` (whole arrays on owner ranks), a callable
            ``(path, shape) -> "flat" | "owner"``, or a list with one of those
            (or ``None``) per sub-optimizer of a ``MultiOptimizer``. ``None``
            decides from the optimizer's class (see
            :func:`mlx_fsdp.register_placement`). Default: ``None``.

    Returns:
        ShardedOptimizer: The wrapper.
    """
    return ShardedOptimizer(
        optimizer,
        group=group,
        dp_group=dp_group,
        communication_size=communication_size,
        max_norm=max_norm,
        communication_stream=communication_stream,
        master_dtype=master_dtype,
        reduce_dtype=reduce_dtype,
        grad_accumulation_steps=grad_accumulation_steps,
        accumulation=accumulation,
        placement=placement,
    )
