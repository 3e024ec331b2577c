"""The part every distributed optimizer wrapper shares.

A wrapper behaves like an ``mlx.optimizers.Optimizer``: ``update``,
``apply_gradients``, ``init``, ``state``, ``learning_rate`` and ``step``. Its
``state`` is one persistent dict (see :mod:`mlx_fsdp.state`), updated in
place, so that the usual ``state = [model.state, opt.state]`` works with
``mx.compile``.
"""

from typing import Optional, Union

import mlx.core as mx
from mlx.utils import tree_map

from . import state as _state
from . import ending, watchdog
from .fused import FusedUpdates, use_fused_updates
from ._trees import like, match
from .options import Options, check_new_learning_rate
from .placement import sub_optimizers


class DistributedOptimizer:
    """Base class of the wrappers :func:`mlx_fsdp.fsdp_step` and :func:`mlx_fsdp.ddp_step` return.

    Subclasses implement :meth:`_step` and :meth:`init`.

    Args:
        optimizer (mlx.optimizers.Optimizer): The optimizer to wrap.
        options (Options): Validated settings, from :func:`mlx_fsdp.options.make_options`.
    """

    def __init__(self, optimizer, options: Options):
        self.optimizer = optimizer
        self.options = options
        self._state = _state.new_state(optimizer.state)
        # One process has nothing to wait for: no watchdog, exactly plain MLX.
        distributed = options.world_size > 1
        self._dog = watchdog.get(options.timeout, options.group.rank()) if distributed else None
        # Both steps compile their update alike (on a GPU, see mlx_fsdp.fused),
        # so that they round alike: MLX's compiled GPU kernels fuse multiply-adds.
        self._fused = FusedUpdates() if use_fused_updates(world_size=options.world_size) else None
        ending.register(options.group, options.dp_group)
        self._clipped = False

    # The options, under the names the wrappers' arguments have.
    group = property(lambda self: self.options.group)
    dp_group = property(lambda self: self.options.dp_group)
    max_norm = property(lambda self: self.options.max_norm)
    communication_size = property(lambda self: self.options.communication_size)
    communication_stream = property(lambda self: self.options.communication_stream)
    master_dtype = property(lambda self: self.options.master_dtype)
    reduce_dtype = property(lambda self: self.options.reduce_dtype)
    grad_accumulation_steps = property(lambda self: self.options.grad_accumulation_steps)
    accumulation = property(lambda self: self.options.accumulation)

    def update(self, model, gradients):
        """Apply ``gradients`` to ``model`` and update it in place.

        With ``grad_accumulation_steps=k``, call it after every micro-batch:
        the model changes on every k-th call only. The step's collectives run
        when the caller evaluates the result (``mx.eval(model.parameters(),
        opt.state)``): ``update`` only builds the graph.

        Args:
            model (mlx.nn.Module): The model; every rank holds all of it.
            gradients (dict): This rank's local gradients, e.g. from
                :func:`mlx.nn.value_and_grad`.
        """
        model.update(self.apply_gradients(gradients, model))

    def apply_gradients(self, gradients, parameters):
        """Apply gradients and return the updated parameters.

        Args:
            gradients (dict): This rank's local gradients.
            parameters (dict): The parameters, or the model itself. It can be a
                superset of the gradients; the result has the gradients' structure.

        Returns:
            dict: The updated full parameters, the same on every rank (the
            parameters unchanged on a micro-batch that does not step).
        """
        if self._dog is not None:
            self._dog.done()  # back in the library: the last step's collectives finished
            step = self.optimizer_step_count()
        if self.options.reduce_dtype is not None:
            gradients = tree_map(lambda g: g.astype(self.options.reduce_dtype), gradients)
        new, norm = self._step(gradients, parameters)
        if norm is not None:
            self._clipped = True
        if self._dog is not None:
            self._dog.waiting(
                f"a collective evaluated after update of step {step} returned (the step's own "
                "collectives run in the caller's evaluation)", lazy=True)
        if new is None:  # a micro-batch that does not finish the step
            return like(gradients, match(gradients, parameters)[1])
        return new

    def _step(self, gradients, parameters):
        raise NotImplementedError

    def init(self, parameters):
        raise NotImplementedError

    def optimizer_step_count(self) -> str:
        """The step count as text, for messages (without forcing a traced value)."""
        try:
            return str(int(self.step.item()))
        except ValueError:
            return "(traced)"

    @property
    def micro_step(self) -> int:
        """Micro-batches accumulated since the last optimizer step."""
        return int(self._state["micro_step"].item())

    @property
    def grad_norm(self) -> Optional[mx.array]:
        """The global gradient norm before clipping, from the last step.

        ``None`` without ``max_norm`` or before the first step. A NaN or
        infinite value means the step saw non-finite gradients.
        """
        return self._state["grad_norm"] if self._clipped else None

    @property
    def state(self) -> dict:
        """The wrapper's state (see :mod:`mlx_fsdp.state`).

        The same dict object for the wrapper's lifetime, so it can be passed to
        ``mx.compile`` as ``inputs``/``outputs``.
        """
        return self._state

    @state.setter
    def state(self, state: dict):
        _state.replace(self._state, state)
        self.optimizer.state = self._state["optimizer"]
        self._state["optimizer"] = self.optimizer.state
        self._on_state_set()

    def _on_state_set(self):
        pass

    @property
    def step(self) -> mx.array:
        """The number of steps taken, as the wrapped optimizer counts them."""
        return sub_optimizers(self.optimizer)[0].step

    @property
    def learning_rate(self) -> mx.array:
        """The wrapped optimizer's learning rate (settable)."""
        return self.optimizer.learning_rate

    @learning_rate.setter
    def learning_rate(self, learning_rate: Union[float, mx.array]):
        check_new_learning_rate(learning_rate)
        self.optimizer.learning_rate = learning_rate
