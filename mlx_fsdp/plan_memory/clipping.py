"""What clipping by the global norm (the wrappers' ``max_norm``) adds to a step.

The step clips what it updates: ``ddp_step`` and one process the averaged
gradients, ``fsdp_step`` and ``fully_shard`` this rank's reduced pieces.
:func:`mlx_fsdp.clip.global_norm` first sums every gradient's float32
squares (a half-precision gradient is cast to float32 first), then
:func:`mlx_fsdp.clip.clip_by_norm` scales each gradient into a copy, which
its update reads in place of the gradient. Evaluated alone on one process,
the clipping of the MLP 4 x 512's gradients held every square and every
copy at once (8.02 MiB beside 4.01 of gradients in float32); so, counted:

* every **copy**, in the gradients' dtype, through every phase of the
  update: MLX orders the graph breadth-first, so the copies can all be made
  before the first update reads one;
* before the update, the **norm**'s float32 squares, the float32 products
  a half-precision gradient is scaled in before its cast back, and the
  updates the main thread has queued ahead: what one window of
  :data:`~mlx_fsdp.plan_memory.transient.IN_FLIGHT_OPS` operations
  allocates, the largest first (:func:`~mlx_fsdp.plan_memory.transient.in_flight`).
  Counted as the fuller of that and the update: ``copies + max(update,
  norm)`` (:meth:`Clip.with_update`).

Measured before this count (``bench_plan_memory.py --max-norm 1.0``, 2-core
CPU, 2026-11-29), clipping added up to a whole gradient and more to the
step's peak: SGD on the MLP 4 x 512 on one process, 21.04 MiB against
17.03 planned (16.03 without clipping); in bfloat16 at ring N=2 under
``fsdp_step``, 15.53 against 12.09 (12.03 without): 3.5 times the rank's
pieces, which the squares' float32 casts explain.
"""

from typing import NamedTuple, Sequence

import mlx.core as mx

from .transient import GPU_IN_FLIGHT_OPS, IN_FLIGHT_OPS, in_flight
from .updates import Update

#: Operations per gradient: the norm's cast, square, sum and running total,
#: and the scaling's product and cast.
CLIP_OPS = 6


class Clip(NamedTuple):
    """Bytes clipping holds: the clipped ``copies``, and the ``norm``'s phase
    (its squares, the products and the updates queued ahead)."""

    copies: int = 0
    norm: int = 0

    def with_update(self, update: int) -> int:
        """The update's temporaries (``update`` bytes) with the clipping: its copies, and
        the fuller of the norm's phase and the update's."""
        return self.copies + max(update, self.norm) if self.copies else update


def clip_bytes(gradients: Sequence[mx.array], updates: Sequence[Update] = (),
               device: str = "cpu") -> Clip:
    """What clipping ``gradients`` by their global norm holds (see the module docstring).

    Args:
        gradients (list[array]): What the rank clips and updates (whole
            gradients, or its pieces of them), shape-only.
        updates (list[Update]): Their updates
            (:func:`~mlx_fsdp.plan_memory.transient.update_costs`), which the
            main thread can queue in the norm's window. Default: ``()``.
        device (str): ``"cpu"`` or ``"gpu"``: how far the main thread queues
            ahead. Default: ``"cpu"``.

    Returns:
        Clip: The copies of every gradient, and the norm's phase.
    """
    # A float32 square each, and a float32 product where the gradient is not float32.
    chains = [Update(total=g.size * 4 * (1 if g.dtype == mx.float32 else 2), live=0,
                     ops=CLIP_OPS, kernels=CLIP_OPS) for g in gradients]
    window = GPU_IN_FLIGHT_OPS if device == "gpu" else IN_FLIGHT_OPS
    return Clip(sum(g.nbytes for g in gradients),
                in_flight(chains + list(updates), window)[1])
