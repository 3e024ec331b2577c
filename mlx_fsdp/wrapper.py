"""The part every distributed optimizer wrapper shares.

A wrapper behaves like an ``mlx.optimizers.Optimizer``: ``update``,
``apply_gradients``, ``init``, ``state``, ``learning_rate`` and ``step``. Its
``state`` is one persistent dict, updated in place, so that the usual
``state = [model.state, opt.state]`` works with ``mx.compile``.
"""

from typing import Optional, Union

import mlx.core as mx
import mlx.optimizers as optim

from mlx.utils import tree_flatten, tree_map

from . import _trees, clip, master

#: Ways to accumulate gradients over micro-batches.
ACCUMULATION = ("local", "sharded")


_global = []


def _check_eager(gradients):
    # The micro-batch count is Python state: a compiled update would replay the
    # traced branch forever (never step, or step every call) without a word.
    leaves = [g for _, g in tree_flatten(gradients)]
    try:
        mx.eval(leaves[:1])
    except ValueError as e:
        if "transformations" not in str(e):
            raise
        raise ValueError(
            "grad_accumulation_steps > 1 cannot run inside mx.compile: which "
            "micro-batch steps is decided in Python. Compile the gradient "
            "computation and call opt.update outside of it."
        ) from None


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

    Subclasses implement :meth:`_step` and :meth:`init`.

    Args:
        optimizer (mlx.optimizers.Optimizer): The optimizer to wrap.
        group (mlx.core.distributed.Group, optional): The data-parallel group;
            ``None`` means the global group. Default: ``None``.
        max_norm (float, optional): Clip gradients to this global norm.
            Default: ``None``.
        communication_size (int): Byte budget of a communication bucket.
            Default: ``32 * 1024**2``.
        communication_stream (mlx.core.Stream, optional): Stream for the
            collectives. Default: ``None``.
        master_dtype (Dtype, optional): Step parameters of other dtypes
            through master copies of this dtype. Default: ``None``.
        reduce_dtype (Dtype, optional): Cast gradients to this dtype before
            they are communicated. Default: ``None`` (their own dtype).
        grad_accumulation_steps (int): Micro-batches per optimizer step.
            Default: ``1``.
        accumulation (str): ``"local"`` or ``"sharded"``. Default: ``"local"``.
    """

    #: The accumulation modes a subclass supports.
    accumulation_modes = ("local",)

    def __init__(
        self,
        optimizer,
        group=None,
        max_norm: Optional[float] = None,
        *,
        communication_size: int = 32 * 1024**2,
        communication_stream: Optional[mx.Stream] = None,
        master_dtype: Optional[mx.Dtype] = None,
        reduce_dtype: Optional[mx.Dtype] = None,
        grad_accumulation_steps: int = 1,
        accumulation: str = "local",
    ):
        if not isinstance(optimizer, optim.Optimizer):
            raise ValueError(
                f"optimizer={optimizer!r} is not an mlx.optimizers.Optimizer; wrap "
                "an optimizer instance, e.g. optim.AdamW(learning_rate=3e-4)."
            )
        clip.check_max_norm(max_norm)
        if not isinstance(communication_size, int) or isinstance(communication_size, bool):
            raise ValueError(
                f"communication_size={communication_size!r} must be an int number "
                "of bytes (<= 0 puts every array in its own bucket)."
            )
        master.check_dtype("master_dtype", master_dtype)
        master.check_dtype("reduce_dtype", reduce_dtype)
        k = grad_accumulation_steps
        if not isinstance(k, int) or isinstance(k, bool) or k < 1:
            raise ValueError(
                f"grad_accumulation_steps={k!r} must be an int >= 1 (1 steps on "
                "every call of update)."
            )
        if accumulation not in self.accumulation_modes:
            raise ValueError(
                f"accumulation={accumulation!r} is not supported here; use one of "
                f"{', '.join(map(repr, self.accumulation_modes))}."
            )
        self.optimizer = optimizer
        self.group = group_or_global(group)
        self.max_norm = max_norm
        self.communication_size = communication_size
        self.communication_stream = communication_stream
        self.master_dtype = master_dtype
        self.reduce_dtype = reduce_dtype
        self.grad_accumulation_steps = k
        self.accumulation = accumulation
        self._micro = 0
        self._state = {"optimizer": optimizer.state}

    def update(self, model, gradients):
        """Apply ``gradients`` to ``model`` and update it in place.

        With ``grad_accumulation_steps=k``, call it after every micro-batch:
        the model changes on every k-th call only.

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
        if self.reduce_dtype is not None:
            gradients = tree_map(lambda g: g.astype(self.reduce_dtype), gradients)
        k = self.grad_accumulation_steps
        if k == 1:
            return self._step(gradients, parameters)
        _check_eager(gradients)
        self._micro += 1
        finish = self._micro == k
        if finish:
            self._micro = 0
        carry = self._state.setdefault("accumulated", {})
        if self.accumulation == "sharded":
            return self._step(gradients, parameters, carry=carry, finish=finish, divide=k)
        summed = _trees.accumulate(carry, tree_flatten(gradients), keep=not finish)
        if not finish:
            return _trees.like(gradients, _trees.match(gradients, parameters)[1])
        return self._step(_trees.like(gradients, [g / k for g in summed]), parameters)

    def _step(self, gradients, parameters, **accumulate):
        raise NotImplementedError

    def _masters(self) -> Optional[dict]:
        if self.master_dtype is None:
            return None
        return self._state.setdefault("master", {})

    def _initial_masters(self, paths, params):
        return master.initial(paths, params, self._masters(), self.master_dtype)

    @property
    def micro_step(self) -> int:
        """Micro-batches accumulated since the last optimizer step."""
        return self._micro

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
