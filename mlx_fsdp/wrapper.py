"""The part every distributed optimizer wrapper shares.

A wrapper behaves like an ``mlx.optimizers.Optimizer``: ``update``,
``apply_gradients``, ``init``, ``state``, ``learning_rate`` and ``step``. Its
``state`` is one persistent dict, updated in place, so that the usual
``state = [model.state, opt.state]`` works with ``mx.compile``.
"""

from typing import Optional, Union

import mlx.core as mx
import mlx.optimizers as optim

from . import clip


_global = []


def group_or_global(group):
    """``group`` itself, or the global group for ``None`` (MLX's convention).

    The global group is fetched once so that it is one Python object, and what
    is learned about it (its plan check, its collectives) is learned once.
    """
    if group is not None:
        return group
    if not _global:
        _global.append(mx.distributed.init())
    return _global[0]


class DistributedOptimizer:
    """Base class of :func:`mlx_fsdp.fsdp_step` and :func:`mlx_fsdp.ddp_step`.

    Subclasses implement :meth:`apply_gradients` and :meth:`init`.

    Args:
        optimizer (mlx.optimizers.Optimizer): The optimizer to wrap.
        group (mlx.core.distributed.Group, optional): The data-parallel group;
            ``None`` means the global group. Default: ``None``.
        max_norm (float, optional): Clip gradients to this global norm.
            Default: ``None``.
    """

    def __init__(self, optimizer, group=None, max_norm: Optional[float] = None):
        if not isinstance(optimizer, optim.Optimizer):
            raise ValueError(
                f"optimizer={optimizer!r} is not an mlx.optimizers.Optimizer; wrap "
                "an optimizer instance, e.g. optim.AdamW(learning_rate=3e-4)."
            )
        clip.check_max_norm(max_norm)
        self.optimizer = optimizer
        self.group = group_or_global(group)
        self.max_norm = max_norm
        self._state = {"optimizer": optimizer.state}

    def update(self, model, gradients):
        """Apply ``gradients`` to ``model`` and update it in place.

        Args:
            model (mlx.nn.Module): The model; every rank holds all of it.
            gradients (dict): This rank's local gradients, e.g. from
                :func:`mlx.nn.value_and_grad`.
        """
        model.update(self.apply_gradients(gradients, model))

    def apply_gradients(self, gradients, parameters):
        raise NotImplementedError

    def init(self, parameters):
        raise NotImplementedError

    def _set_grad_norm(self, norm):
        if norm is not None:
            self._state["grad_norm"] = norm

    @property
    def grad_norm(self) -> Optional[mx.array]:
        """The global gradient norm before clipping, from the last step.

        ``None`` without ``max_norm`` or before the first step. A NaN or
        infinite value means the step saw non-finite gradients.
        """
        return self._state.get("grad_norm")

    @property
    def state(self) -> dict:
        """``{"optimizer": <the wrapped optimizer's state>, "grad_norm": ...}``.

        The same dict object for the wrapper's lifetime, so it can be passed to
        ``mx.compile`` as ``inputs``/``outputs``.
        """
        return self._state

    @state.setter
    def state(self, state: dict):
        if not isinstance(state, dict) or "optimizer" not in state:
            raise ValueError(
                "The state must be a dict with an 'optimizer' entry, as this "
                "wrapper's .state returns it."
            )
        self.optimizer.state = state["optimizer"]
        self._state.clear()
        self._state.update(state)
        self._state["optimizer"] = self.optimizer.state
        self._on_state_set()

    def _on_state_set(self):
        pass

    @property
    def step(self) -> mx.array:
        """The number of steps taken, as the wrapped optimizer counts them."""
        opt = self.optimizer
        if isinstance(opt, optim.MultiOptimizer):
            opt = opt.optimizers[0]
        return opt.step

    @property
    def learning_rate(self) -> mx.array:
        """The wrapped optimizer's learning rate (settable)."""
        return self.optimizer.learning_rate

    @learning_rate.setter
    def learning_rate(self, learning_rate: Union[float, mx.array]):
        self.optimizer.learning_rate = learning_rate
