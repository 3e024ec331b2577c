"""The optimizer's update on what a rank holds, compiled with ``mx.compile``.

Called eagerly, an MLX optimizer runs each of its element-wise operations as
a kernel of its own, with a temporary array for each: AdamW on a piece of a
parameter is about fifteen passes over it. Compiled, the chain becomes one
fused kernel per array, which writes only the new parameter and state:
AdamW on 6.45M float32 elements took 20-27 ms compiled against 100-110 ms
eagerly on the development CPU, with bit-identical results there (MLX's
compiled CPU kernels compute the same operations in the same order), and on
a GPU it turns hundreds of small kernel launches into a few.

The compiled function takes the optimizer's state as its ``inputs`` and
``outputs``, as MLX's own compiled training steps do, and is rebuilt when the
state dict is replaced (a load) or a hyper-parameter changes (they are
constants of the trace). ``mlx.core.disable_compile()`` or
``MLX_DISABLE_COMPILE=1`` turn it into the eager call.

``fsdp_step`` and ``ddp_step`` use it, both alike, where arrays live on a
GPU and there is more than one process. On the CPU the update is a small
part of a step (measured: no difference in a 4.2M MLP's step at N=2), while
MLX builds each fused CPU kernel with the system's C++ compiler, which takes
seconds on the first step and may be missing: the CPU stays eager.
``MLX_FSDP_FUSED_UPDATE=1`` (or ``0``) chooses either way on any device.

Rounding: MLX's CUDA kernels, compiled, contract a multiply and an add into
one fused multiply-add and keep a fused chain's bfloat16 intermediates
unrounded, so a compiled update is not bit for bit an eager one there
(``benchmarks/fused_rounding.py`` on an H100, three steps: float32 within
1.2e-7, bfloat16 one ulp apart on up to 27% of the elements). Both steps
compile alike, so ``fsdp_step`` still rounds as ``ddp_step`` does (the
parity tests pass on an H100); to round as an eager plain loop,
``MLX_FSDP_FUSED_UPDATE=0``.
"""

import os
import warnings
from typing import Any, Callable, Dict, Optional

import mlx.core as mx

from . import accumulate, consistency

#: Environment variable: ``1`` compiles the update on any device, ``0`` on none.
ENV_VAR = "MLX_FSDP_FUSED_UPDATE"


def use_fused_updates(device: Optional[str] = None, world_size: int = 2) -> bool:
    """Whether the wrappers compile their update: ``MLX_FSDP_FUSED_UPDATE``, else on a GPU.

    Never on one process, where both wrappers are exactly plain MLX.

    Args:
        device (str, optional): ``"cpu"`` or ``"gpu"``, where the step runs
            (the memory planner plans for another machine). Default:
            ``None``, MLX's default device.
        world_size (int): Processes in the wrapper's group. Default: ``2``.
    """
    if world_size == 1:
        return False
    choice = os.environ.get(ENV_VAR)
    if choice not in (None, "", "0", "1"):
        raise ValueError(f"{ENV_VAR}={choice!r} must be 1 (compile the update) or 0 (eager).")
    if choice:
        return choice == "1"
    return device == "gpu" if device is not None else mx.default_device() == mx.gpu


class FusedUpdates:
    """Compiled ``apply_gradients`` for each (sub-)optimizer of one wrapper."""

    def __init__(self):
        self._cache: Dict[int, tuple] = {}

    def _compiled(self, optimizer) -> Callable:
        key = (id(optimizer.state), consistency.describe(optimizer))
        hit = self._cache.get(id(optimizer))
        if hit is None or hit[0] != key:
            state = [optimizer.state]
            fn = mx.compile(lambda g, p: optimizer.apply_gradients(g, p),
                            inputs=state, outputs=state)
            hit = self._cache[id(optimizer)] = (key, fn)
        return hit[1]

    def apply(self, optimizer, gradients: Any, parameters: Any) -> Any:
        """``optimizer.apply_gradients(gradients, parameters)``, compiled where possible.

        The state is initialized eagerly first, so that the compiled
        function's inputs have the same structure on every call. If tracing
        fails (an optimizer whose update reads values on the host), the
        state is restored and this optimizer is updated eagerly from then on.
        """
        if self._cache.get(id(optimizer), (None,))[0] == "eager":
            return optimizer.apply_gradients(gradients, parameters)
        optimizer.init(gradients)
        before = accumulate.snapshot(optimizer.state)
        try:
            return self._compiled(optimizer)(gradients, parameters)
        except Exception as e:  # noqa: BLE001 (a trace that fails leaves tracers behind)
            accumulate.restore(optimizer.state, before)
            self._cache[id(optimizer)] = ("eager", None)
            warnings.warn(
                f"mlx_fsdp: {type(optimizer).__name__}'s update could not be compiled "
                f"({type(e).__name__}: {e}); it runs eagerly.", stacklevel=4)
            return optimizer.apply_gradients(gradients, parameters)
