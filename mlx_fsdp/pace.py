"""Hold MLX's evaluation back until its worker has caught up, on the CPU.

MLX evaluates a graph on the calling thread: it walks the graph and queues
each operation for the stream's worker, allocating the operation's output as
it queues it, and waits for the worker only once a few operations are queued
(or at the memory limit). On the CPU the outputs of the next operations
therefore exist before the buffers they follow are freed. In a fully
sharded backward pass the next block's full weight gradient (and, with
``reshard_after_forward``, its gathered parameters) was allocated while the
previous block's still waited for their reduce-scatter; and the update's
new state was allocated while the last reduce-scatter still held its
buffers. PyTorch FSDP1's ``limit_all_gathers`` solved the same problem for
its CPU thread.

:func:`paced` puts a chain of tiny operations (one element each) after a
point of the graph; whatever depends on the chain is queued only after it,
and by then the worker has run everything up to that point and freed what
it consumed. It is used where a fully sharded module's gather waits for the
module's inputs, where its reduce-scatter's first bucket waits for its
gradients and each later bucket for the one before, and where the layers
before it wait for its reduce-scatter
(:mod:`mlx_fsdp.fully_sharded.gather`), and where the step's
reduce-scatters wait each for the one before, its update for its gradients
and each flat bucket's all-gather for its update (:mod:`mlx_fsdp.step`):
with SGD on ``bench_plan_memory.py``'s MLP 4 x 512 at ring N=2 the step's
peak fell from 24.1 to 18.5 MiB once the gathers waited (2026-11-27), and
``bench_pace.py --modes fsdp`` (MLP 4 x 2048, AdamW) read 320.3 MiB paced,
unpaced alike, before and 296.3 since; with 2 MiB buckets (a layer each)
it fell from 18.04 to 14.03 MiB once the reduce-scatters waited, and
``bench_pace.py --modes fsdp`` read 312.3 MiB unpaced and 288.3 paced, at
0.989x the unpaced step's time (2026-11-28).

Measured on the MLP of ``bench_step.py`` (4 layers of 2048 x 2048, AdamW,
batch 8, ring N=2, mlx 0.32.4, 2026-11-26): the fully sharded step's peak,
per block, fell from 264.7 to 224.2 MiB, and with ``reshard_after_forward``
from 248.6 to 224.2 MiB (0.467x DDP's). In the backward pass, chains of 4, 8
and 12 operations helped in part and 16 to 250 all gave the same peak:
``QUEUE_DEPTH`` is twice the shortest that did.

Only the CPU: a GPU backend counts what it has queued in command buffers of
many operations each, where the chain would cost kernel launches for
nothing. Inside ``mx.compile`` (mlx-lm's trainer compiles its step) the
chain is of 1 x 1 products, which, unlike additions, are not fused into one
kernel. Measured there (ring N=2, a compiled fully sharded step, 2026-11-26):
the MLP 4 x 512 with SGD, per block with ``reshard_after_forward``, peaked
at 12.60 MiB against 20.12 unpaced; in bfloat16 with AdamW, 14.05 against
20.10.
"""

from typing import List, Sequence

import mlx.core as mx

from .layout import empty_of

#: Tiny operations in a chain; ``0`` turns pacing off.
QUEUE_DEPTH = 32


def paced_on(device: str) -> bool:
    """Whether evaluation is paced on ``device`` (``"cpu"`` or ``"gpu"``): on
    the CPU, with ``QUEUE_DEPTH`` above 0. The memory planner's one test of it."""
    return device == "cpu" and QUEUE_DEPTH > 0


def unpaced_cpu(device: str) -> bool:
    """Whether ``device`` is the CPU with its pacing turned off (``QUEUE_DEPTH`` 0)."""
    return device == "cpu" and not paced_on(device)


def pacing() -> bool:
    """Whether evaluation is paced here: :func:`paced_on` the default device."""
    return paced_on("cpu" if mx.default_device() == mx.cpu else "gpu")


def paced(arrays: Sequence[mx.array], traced: bool = False) -> List[mx.array]:
    """What to ``mx.depends`` on to follow ``arrays``, paced on the CPU.

    Args:
        arrays (list[array]): What the caller's later operations must follow.
        traced (bool): Whether this runs inside ``mx.compile``. Default: ``False``.

    Returns:
        list[array]: On the CPU, one empty array that depends on ``arrays``
        through ``QUEUE_DEPTH`` operations; elsewhere (a GPU, or
        ``QUEUE_DEPTH`` 0), ``arrays`` themselves.
    """
    if not pacing():
        return list(arrays)
    empty = mx.concatenate([empty_of(a).astype(mx.float32) for a in arrays])
    tick = mx.depends(mx.zeros((1, 1), mx.float32), [empty])
    one = mx.ones((1, 1), mx.float32) if traced else 1
    for _ in range(QUEUE_DEPTH):
        # One queued operation on one element; inside mx.compile a product,
        # which is not fused with the next as an addition would be.
        tick = tick @ one if traced else tick + one
    return [tick[:0]]


def after_queue(arrays: Sequence[mx.array], traced: bool = False) -> List[mx.array]:
    """``arrays``, to be used only once everything they depend on has run (see :func:`paced`).

    Unchanged where there is no pacing (off the CPU, or ``QUEUE_DEPTH`` 0).
    """
    if not arrays or not pacing():
        return list(arrays)
    token = paced(arrays, traced)
    return [mx.depends(a, token) for a in arrays]
