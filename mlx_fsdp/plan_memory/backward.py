"""The fully sharded backward pass: what it holds beside the count of its parts.

:mod:`mlx_fsdp.plan_memory.fully` counts the parts of the pass (the
gathered parameters, a unit's full gradients, the reduce-scatter's
buffers); how they meet depends on who paces evaluation
(:mod:`mlx_fsdp.plan_memory.phases`): on the CPU the pass runs alone, a
block at a time, and its gathers and sharded gradients take turns
(:func:`pass_walk`); on a GPU the update runs beside it
(:func:`update_during_backward`). On the CPU, too, a unit's reduce-scatter
comes after its backward pass has freed its activations
(:func:`reduced_after_blocks`).
"""

from typing import Tuple

from .. import layout
from .fully import BLOCKS_ALIVE, Units
from .parts import RankMemory, tree_bytes


def update_during_backward(device: str, held: dict, gradients: int, units, rank: int) -> dict:
    """What the update adds to the backward pass's count where the two overlap.

    On a GPU nothing paces the step: a block's update is queued as soon as
    its reduce-scatter is, while the pass goes on, and MLX frees an old
    parameter or state only once the GPU has finished the command buffer
    that last read it. On one H100 (2026-11-26, ``bench_plan_phases.py``, two
    MLP layers of 512 with SGD, resharded) the whole step peaked at 15.08
    MB, the pass and the update alone at 9.81 and 5.32 MB: each phase whole,
    side by side. So on a GPU the pass is counted with the new parameters and
    state, and the gradients, of the blocks in flight
    (:data:`BLOCKS_ALIVE`, this rank's share of the largest; the root's
    update comes after the pass). An empty dict elsewhere.
    """
    if device != "gpu":
        return {}
    share = sum(held_blocks(units, rank)[:BLOCKS_ALIVE[device]]) / max(held["parameters"], 1)
    new = share * (held["parameters"] + tree_bytes(held["optimizer"]))
    return {"communication": units.communication + int(share * gradients),
            "new_parameters": int(new)}


def held_blocks(units: Units, rank: int) -> list:
    """The bytes ``rank`` holds of each block, the largest first."""
    return sorted((sum(a.nbytes for b in plan.buckets
                       for _, a in layout.held_of(b, [a for _, a in own], rank))
                   for prefix, plan, own in units.plans if prefix), reverse=True)


def pass_spare(units: Units, activations: int) -> Tuple[int, int]:
    """What the CPU's pass adds to its gathered parameters and full gradients.

    Measured alone (``bench_plan_phases.py``, ring N=2, 2026-11-27), the pass
    held up to one block's parameters and gradients more than its count
    where its activations were small (MLPs of 1 to 8 layers of 256 to 1024:
    1.08 MiB on layers of 1 MiB, resharded), and, with every block's
    parameters gathered, 1.26 MiB more beside 6.9 MiB of activations (the
    GPT 4 x 256 with Adafactor, blocks of 3 MiB). So
    :attr:`~mlx_fsdp.plan_memory.fully.Units.spare`, less what the
    ``activations`` cover: with resharding all of it, without only the
    gradients.
    """
    params, grads = units.spare
    if not units.resharded:
        return params, max(0, grads - activations)
    more = max(0, params + grads - activations)
    return min(more, params), more - min(more, params)


def pass_walk(units: Units, gradients: int, rank: int) -> Tuple[int, int]:
    """``(sharded gradients, gathered parameters)`` where the CPU's pass is fullest.

    At the backward pass's start every gather the forward pass kept is alive
    and no sharded gradient yet but the first block's, which may come before
    its gather is freed (counted as what ``rank`` holds of the largest
    block); block by block, each block's parameters go as its sharded
    gradients come, so at its end ``units.last`` and all of the rank's
    ``gradients``. Counted with both at once, the MLP 4 x 512 with SGD at
    ring N=2 read 1.29x (15.03 MiB against 11.63, 2026-11-29); without the
    first block's, the MLP 48 x 128 with AdamW, clipped, 1.005x (8.19 MiB
    against 8.15).
    """
    first = min(gradients, max(held_blocks(units, rank), default=0))
    if units.gathered + first >= units.last + gradients:
        return first, units.gathered
    return gradients, units.last


#: What the CPU's fully sharded pass holds of its batch beyond the model's
#: own pass, as a fraction of the activations, with its blocks' activations
#: kept or, the model wrapped once and resharded, the whole pass recomputed
#: (:func:`wrapped_pass`).
WRAPPED_PASS = {"kept": 0.16, "recomputed": 0.30}


def wrapped_pass(activations: int, wrap: str, reshard_after_forward: bool) -> int:
    """The activations of the CPU's fully sharded pass: the model's own pass's and more.

    MLX runs an operation as late as its consumers allow. In the model's own
    pass a weight's gradient is an output of the evaluation; wrapped, it is
    an input of its unit's reduce-scatter, and the pass then holds more
    arrays of the batch at its fullest (mlx-lm's Llama 2 x 128 at 32 x 64
    tokens: 9 MiB more, where a layer's largest arrays are of 2 and 2.75
    MiB), which of them changing with the graph's shape, not with the
    collectives (with the all-gathers and reduce-scatters replaced by local
    copies it held as much). Measured (``bench_plan_phases.py``,
    2026-11-29, 71 points: the GPT and mlx-lm's Llama, 2 to 8 blocks of 64
    and 128, batches of 128 to 2048 tokens, ring N=2, MPI N=3 and 4,
    wrapped per block and once), the pass alone measured above the count
    of the model's own pass by up to 15.4% of its activations (the GPT 2 x
    64 at batch 32, MPI N=4), the step by up to 10.6%; the model wrapped once and
    resharded, recomputing its whole pass, by up to 26.8% and 21.8%. Blocks
    resharded are counted as ``mx.checkpoint``'s, fitted to fully sharded
    steps themselves (:data:`mlx_fsdp.plan_memory.activations.PACED`), and
    get nothing more.
    """
    if wrap == "blocks" and reshard_after_forward:
        return activations
    return activations + int(WRAPPED_PASS["recomputed" if reshard_after_forward else "kept"]
                             * activations)


def reduced_after_blocks(backward: dict, activations: int, units: Units) -> RankMemory:
    """The CPU's pass at its fullest, each unit reduced after its backward pass.

    ``backward``: the pass's parts (:class:`~mlx_fsdp.plan_memory.parts.RankMemory`
    fields): in ``communication`` the largest bucket's reduce-scatter
    buffers, in ``gathered`` the gathers less the vector those buffers
    stand in for (:attr:`~mlx_fsdp.plan_memory.fully.Units.extra`). A unit's
    gradients are reduced once its backward pass has run and freed the
    activations it kept, so no reduce-scatter meets them all. The pass is
    the fuller of two moments: every activation and no reduce-scatter (the
    gather's vector in its place), or the buffers beside the activations
    less one unit's share, an equal part of them among the blocks and the
    rest of the model. The model wrapped once is reduced after its whole
    pass: beside no activation. Counted beside them all, the GPT 2 x 128
    with Adafactor read 1.70x at MPI N=6 and, wrapped once in bfloat16 at
    ring N=2, 1.70x; 1.50x and 1.30x so. With two shares less, the GPT 2 x
    128 at MPI N=4 read 0.983x (8.83 MiB measured; 2026-11-29).
    """
    blocks = sum(1 for prefix, _, _ in units.plans if prefix)
    before = dict(backward, communication=0,
                  gathered=backward["gathered"] + min(units.extra, units.communication))
    return max(RankMemory(**before, activations=activations),
               RankMemory(**backward, activations=activations - activations // (blocks + 1)),
               key=lambda r: r.peak)
