"""``fsdp_step``: an optimizer wrapper whose state and work are split over ranks."""

from typing import Optional

import mlx.core as mx
from mlx.utils import tree_unflatten

from . import control, master
from ._trees import match
from .options import make_options
from .fully_sharded.model import step_plan
from .placement import sub_optimizers
from .plain import replicated_step
from .plan import Plan
from .sharded_state import check_state, init_held
from .state import tree_changed
from .watchdog import watch
from .step import sharded_step
from .wrapper import DistributedOptimizer


class ShardedOptimizer(DistributedOptimizer):
    """An optimizer whose state lives in 1/N shards, one per rank.

    Create it with :func:`fsdp_step`. Every rank keeps the full model; the
    gradients are reduce-scattered, each rank updates its shard with the
    wrapped optimizer, and the updated shards are all-gathered. The
    parameters of modules wrapped with :func:`mlx_fsdp.fully_shard` are
    shards already, with their gradients reduced: those are updated in place.

    The wrapped optimizer's state holds, for each sub-optimizer,
    ``state[path]``: the state of what this rank holds of the array at
    ``path`` (see :mod:`mlx_fsdp.layout`): its 1-D piece of the rank's shard
    of a flat bucket (so ``m`` and ``v`` are pieces), or, for an array this
    rank owns, exactly the plain optimizer's state of the whole array. Arrays
    this rank holds nothing of have no entry. With a single process it is
    exactly the plain optimizer's state.
    """

    def __init__(self, optimizer, options):
        super().__init__(optimizer, options)
        self._plan: Optional[Plan] = None
        # Whether the state is the fresh one of a construction or init, which
        # the first step may rebuild for its own tree (init may have seen
        # frozen arrays); a state that has stepped or was loaded may not.
        self._fresh = True

    @property
    def plan(self) -> Plan:
        """The :class:`~mlx_fsdp.plan.Plan` of the last step (or of :meth:`init`).

        With one process it is a plan without buckets (the plain optimizer);
        before the first step and ``init`` it is ``None``.
        """
        if self.options.world_size == 1:
            return Plan(1, 0, ())  # no buckets: the plain optimizer
        return self._plan

    def _on_state_set(self):
        self._plan = None
        self._fresh = False

    def _step(self, gradients, parameters):
        if self.options.world_size == 1:
            return replicated_step(self.options, self.optimizer, self._state, gradients,
                                   parameters, dog=self._dog)
        new, norm, plan = sharded_step(self.options, self.optimizer, self._state, gradients,
                                       parameters, dog=self._dog, adopt=self._adopt,
                                       fused=self._fused)
        self._fresh = False
        return new, norm

    def _adopt(self, plan: Plan):
        """Keep ``plan``, or refuse it if the state was built for another one."""
        if plan is self._plan:
            return
        if self._plan is not None and plan != self._plan:
            if not self._fresh:
                raise tree_changed((self._plan.num_arrays, self._plan.num_elements),
                                   (plan.num_arrays, plan.num_elements), "",
                                   "create a new fsdp_step for the new tree.")
            # The state from init (e.g. of model.parameters(), frozen arrays
            # included) was never used; the step builds it for its own tree.
            for sub in sub_optimizers(self.optimizer):
                for key in [k for k, v in sub.state.items() if isinstance(v, dict)]:
                    del sub.state[key]
                sub.state = sub.state  # uninitialized again: apply_gradients inits it
            self._state["master"].clear()
        check_state(plan, self.optimizer, self.options.group.rank())
        self._plan = plan

    def plan_of(self, parameters) -> Plan:
        """The plan a step on gradients of ``parameters`` builds, without stepping.

        Its floating-point arrays, with gradients in ``reduce_dtype`` if set
        (``astype`` of unevaluated arrays: a dtype, no memory).

        Args:
            parameters (dict): The trainable parameters, e.g.
                ``model.trainable_parameters()``.
        """
        floating = _floating(parameters)
        dt = self.options.reduce_dtype
        grads = [(p, a.astype(dt) if dt is not None else a) for p, a in floating]
        return step_plan(grads, [a for _, a in floating], self.optimizer,
                         self.options.group.size(), self.options.communication_size,
                         self.options.placement, parameters)

    def init(self, parameters):
        """Initialize this rank's shard of the optimizer state.

        Optional, as with MLX optimizers; useful to see :attr:`state` before the
        first step. Every rank must call it. Like a plain optimizer's ``init``
        it takes any superset of what will be trained: non-floating arrays
        (quantized weights) are skipped, and if the first step's gradients
        cover fewer arrays (frozen ones), the step rebuilds the state for them.

        Args:
            parameters (dict): The parameters, e.g. ``model.trainable_parameters()``
                or ``model.parameters()``.
        """
        floating = _floating(parameters)
        self._fresh = True
        if self.options.world_size == 1:
            tree = {p: a for p, a in floating}
            steps = master.initial(list(tree), list(tree.values()), self._state["master"],
                                   self.options.master_dtype)
            self.optimizer.init(tree_unflatten(list(zip(tree, steps))))
            return
        plan = self.plan_of(parameters)
        with watch(self._dog, "init"):
            control.agree(self.options.group, "init", {"plan": int(plan.fingerprint[:7], 16)},
                          stream=self.options.communication_stream,
                          hint="Call init with the same parameters on every rank.")
        init_held(plan, self.optimizer, [a for _, a in floating], self.options.group.rank(),
                  self._state["master"], self.options.master_dtype)
        self._plan = None
        self._adopt(plan)


def _floating(parameters) -> list:
    """``(path, array)`` of the floating-point arrays of a tree (the trainable kinds)."""
    flat, params = match(parameters, parameters)
    return [(p, a) for (p, _), a in zip(flat, params) if mx.issubdtype(a.dtype, mx.floating)]


def fsdp_step(
    optimizer,
    *,
    group: Optional[mx.distributed.Group] = None,
    dp_group: Optional[mx.distributed.Group] = None,
    communication_size: Optional[int] = None,
    max_norm: Optional[float] = None,
    communication_stream: Optional[mx.Stream] = None,
    master_dtype: Optional[mx.Dtype] = None,
    reduce_dtype: Optional[mx.Dtype] = None,
    grad_accumulation_steps: int = 1,
    accumulation: str = "local",
    placement=None,
    timeout: Optional[float] = None,
) -> ShardedOptimizer:
    """Wrap an optimizer so that its state and its work are sharded over ranks.

    The result is used like the optimizer itself, and gives the same training
    result as data parallelism with the plain optimizer on averaged gradients:

    .. code-block:: python

        opt = mlx_fsdp.fsdp_step(optim.AdamW(learning_rate=3e-4), max_norm=1.0)
        loss, grads = nn.value_and_grad(model, loss_fn)(model, x, y)
        opt.update(model, grads)
        mx.eval(model.parameters(), opt.state)

    ``update`` only builds the step's graph (check, reduce-scatter, clip,
    update this rank's shards, all-gather); the caller's ``mx.eval`` runs it,
    together with the forward and backward pass. Each phase, the buckets'
    layout and the memory: docs/step.md.

    On a model whose modules are wrapped with :func:`mlx_fsdp.fully_shard`
    (parameters sharded too), the gradients of those modules arrive reduced
    and shaped like the shards; the step updates them in place, with no
    reduce-scatter or all-gather of its own, and every option below works.

    Element-wise optimizers update flat shards; shape-aware ones (Muon,
    Adafactor, unknown classes) whole arrays on owner ranks. Both are exact;
    which optimizer gets which: docs/optimizers.md. On a GPU the update is
    compiled (:mod:`mlx_fsdp.fused`), as in ``ddp_step`` there: MLX's
    compiled kernels round otherwise than its eager ones, so both steps
    compile alike; ``MLX_FSDP_FUSED_UPDATE=0`` keeps them eager.

    Args:
        optimizer (mlx.optimizers.Optimizer): Any MLX optimizer, or a
            ``MultiOptimizer`` (its filters see full paths and full arrays).
        group (mlx.core.distributed.Group, optional): The shard group. ``None``
            means the global group. Default: ``None``.
        dp_group (mlx.core.distributed.Group, optional): The replica group for
            hybrid sharding (see :func:`mlx_fsdp.hybrid_groups`); gradients are
            also summed over it. Default: ``None``.
        communication_size (int, optional): Byte budget of a bucket; ``<= 0``
            puts every array in its own bucket. Default: ``None``: 32 MiB where
            arrays live on a GPU (few collectives, each overlapping the
            backward pass), 4 MiB on the CPU (a bucket's buffers are the
            step's transient memory; see :mod:`mlx_fsdp.options`).
        max_norm (float, optional): Clip the averaged gradients to this global
            norm (> 0); the norm before clipping is then in ``opt.grad_norm``.
            Default: ``None``.
        communication_stream (mlx.core.Stream, optional): Stream for the
            collectives. Default: ``None``.
        master_dtype (Dtype, optional): Keep master copies of this dtype (e.g.
            ``mx.float32``) of this rank's shards of every parameter of
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
            this rank's 1/N of the sum (k times the communication). Inside
            ``mx.compile`` both reduce-scatter every micro-batch.
            Default: ``"local"``.
        placement (str, callable or list, optional): How arrays are placed:
            ``"flat"`` (element-wise optimizers: 1/N of every bucket per rank),
            ``"owner"`` (whole arrays on owner ranks), a callable
            ``(path, shape) -> "flat" | "owner"``, or a list with one of those
            (or ``None``) per sub-optimizer of a ``MultiOptimizer``. ``None``
            decides from the optimizer's class (see
            :func:`mlx_fsdp.register_placement`). Default: ``None``.
        timeout (float, optional): Seconds a rank may wait for its peers in
            a collective before a watchdog prints where it waits and ends the
            process (exit code 124), so that the launcher stops a job whose
            peer died, stopped or skipped a call (see :mod:`mlx_fsdp.watchdog`).
            ``0`` turns the watchdog off. Default: ``None``: the environment
            variable ``MLX_FSDP_TIMEOUT`` (same meaning) if set, else 600.

    Returns:
        ShardedOptimizer: The wrapper.
    """
    return ShardedOptimizer(optimizer, make_options(
        optimizer, sharded=True, group=group, dp_group=dp_group,
        communication_size=communication_size, max_norm=max_norm,
        communication_stream=communication_stream, master_dtype=master_dtype,
        reduce_dtype=reduce_dtype, grad_accumulation_steps=grad_accumulation_steps,
        accumulation=accumulation, placement=placement, timeout=timeout))
