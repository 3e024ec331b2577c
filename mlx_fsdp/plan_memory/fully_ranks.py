"""The ranks of fully sharded training: ``fully_shard`` and ``fsdp_step``.

What each counts is in :mod:`mlx_fsdp.plan_memory.estimate` and
:mod:`mlx_fsdp.plan_memory.fully`; how the pass's parts meet in
:mod:`mlx_fsdp.plan_memory.backward`, how the phases meet in
:mod:`mlx_fsdp.plan_memory.phases`.
"""

from dataclasses import replace
from typing import Optional, Sequence

import mlx.core as mx

from .. import pace
from ..fused import use_fused_updates
from . import fully, optimizers
from .backward import (pass_spare, pass_walk, reduced_after_blocks, update_during_backward,
                       wrapped_pass)
from .buffers import resolve_reduce_scatter
from .clipping import clip_bytes
from .parts import RankMemory, tree_bytes
from .phases import phases_apart
from .transient import (CHAINS, PLAIN, PLAIN_MASTER, PLAIN_UPCAST, allocated, overlap,
                        plain_window, update_costs)
from .updates import Update
from .wrappers import ddp_memory


def fully_memory(name: str, floating, trainable: Sequence[str], param_bytes: int,
                 world_size: int, communication_size: int, master_dtype: Optional[mx.Dtype],
                 accumulation: str, reduce_scatter: Optional[str], wrap: str,
                 reshard_after_forward: bool, every_rank: bool = False, device: str = "cpu",
                 activations: int = 0, compiled: bool = False, phases: bool = False,
                 budget: Optional[int] = None, keeps_old_parameters: bool = False,
                 clipped: bool = False) -> list:
    """Every rank of fully sharded training (see :mod:`mlx_fsdp.plan_memory.fully`).

    ``floating``: ``(path, array)`` of every floating array, frozen ones
    (a quantized layer's scales) included, which ``fully_shard`` shards too.
    ``compiled``, ``phases``, ``budget``, ``keeps_old_parameters``: see
    :func:`~mlx_fsdp.plan_memory.estimate.estimate_ranks`; ``clipped``: its ``max_norm`` is set.
    """
    if world_size == 1:  # fully_shard returns the module itself: the plain optimizer
        trained = set(trainable)
        flat = [(p, a) for p, a in floating if p in trained]
        one = ddp_memory(name, flat, param_bytes, 1, communication_size, master_dtype,
                         accumulation, device, clipped)
        kept = tree_bytes(dict(flat)) if keeps_old_parameters else 0
        return [replace(one, new_parameters=one.new_parameters + kept, activations=activations)]
    make_optimizer = lambda: optimizers.make(name)  # noqa: E731
    whole = param_bytes - tree_bytes(dict(floating))  # integer (quantized) weights stay whole
    method = resolve_reduce_scatter(reduce_scatter, world_size)
    units = fully.cut(floating, trainable, make_optimizer(), world_size, communication_size,
                      wrap, reshard_after_forward, method, device)
    # Rank 0 holds the most rows of every array: only owners make another rank fuller.
    owned = any(b.owned for _, plan, _ in units.plans for b in plan.buckets)
    apart = phases_apart(device, compiled)
    # Compiled whole, the update waits for the pass too (mlx_fsdp.pace
    # paces inside mx.compile), but the pass holds what an unpaced one
    # does: each phase alone, the pass counted as unpaced. Under the
    # all-sum the pass held more than that (COMPILED_UNITS): there each
    # phase alone with that much more, of buckets that are not an owner's.
    alone = apart or (compiled and phases_apart(device) and method == "exchange")
    hedged = compiled and phases_apart(device) and not alone
    out = []
    for rank in range(world_size) if owned or every_rank else [0]:
        if budget is not None and out and not phases and out[-1].peak > budget:
            break
        held = fully.rank_bytes(units, make_optimizer(), rank, master_dtype)
        grads = held["gradients"]
        common = dict(parameters=whole + held["parameters"], gradients=grads,
                      accumulation=0 if accumulation == "none" else grads,
                      optimizer=tree_bytes(held["optimizer"]), masters=tree_bytes(held["master"]))
        fused = use_fused_updates(device)
        costed = list(update_costs(name, held["pieces"], master_dtype, fused or compiled).values())
        counted = overlap(name, costed, fused, device, traced=compiled)
        total = counted.side + counted.ahead
        # Compiled whole and counted apart, the eager count's further arrays
        # come on top of the compiled update's (without them Adafactor on the
        # MLP 8 x 1024 at ring N=2 peaked 6% above the plan, 2026-11-29),
        # never capped below it.
        def update_temps(traced: bool) -> int:
            temps = unpaced_update(name, costed, total, device, fused or traced)
            temps = max(temps, total) if compiled else temps
            if not clipped:
                return temps
            return clip_bytes([a for _, a in held["pieces"]], costed, device).with_update(temps)
        temps = update_temps(compiled and not alone)
        spare = pass_spare(units, activations) if apart else (0, 0)
        walked, gathered = pass_walk(units, grads, rank) if apart else (grads, units.gathered)
        if apart:  # a gather's vector and a reduce-scatter's buffers: never at once
            gathered -= min(units.extra, units.communication)
        backward = dict(common, gradients=walked, communication=units.communication,
                        new_parameters=0, gathered=gathered + spare[0],
                        full_gradients=units.full_gradients + spare[1])
        # The gradients arrive averaged: the step divides them, into copies,
        # only by the micro-batches (mlx_fsdp.step). Kept, the rank's old
        # trainable pieces (as many bytes as its gradients).
        update = dict(common, communication=0 if accumulation == "none" else grads,
                      new_parameters=held["largest"] + (grads if keeps_old_parameters else 0))
        if phases or alone:  # each alone: the pass's activations, the update's temporaries
            wrapped = wrapped_pass(activations, wrap, reshard_after_forward)
            pair = (reduced_after_blocks(backward, wrapped, units) if apart
                    else RankMemory(**backward, activations=activations),
                    RankMemory(**update, temporaries=temps))
            out.append(pair if phases else max(pair, key=lambda r: r.peak))
            continue
        if hedged:
            more = dict(backward,
                        communication=units.communication
                        + int(COMPILED_UNITS * units.queued))
            out.append(max(RankMemory(**more, activations=activations),
                           RankMemory(**update, temporaries=update_temps(False)),
                           key=lambda r: r.peak))
            continue
        backward.update(update_during_backward(device, held, grads, units, rank))
        if pace.unpaced_cpu(device) and not compiled:  # more units in flight
            extra_units = UNPACED_UNITS - 1
            backward.update(communication=UNPACED_UNITS * units.communication,
                            full_gradients=backward["full_gradients"]
                            + extra_units * units.full_gradients)
        both = max(RankMemory(**backward, temporaries=temps, activations=activations),
                   RankMemory(**update, temporaries=temps, activations=activations),
                   key=lambda r: r.peak)  # a tie: the backward pass
        out.append(both)
    return out


#: A fully sharded step compiled whole on a paced CPU under the all-sum
#: holds, beyond its pass counted alone, up to this many more units'
#: reduce-scatter buffers (``fully.Units.communication``): measured, not
#: derived (perhaps MLX queues the next units' collectives further ahead
#: inside a compiled graph). The GPT 2 x 128 with Lion at MPI N=4 peaked at
#: 9.63 MiB in two launches and 10.39 in a third, its pass counted alone
#: 8.84 and a unit's buffers 0.94 (2026-11-29). Its step is counted so. It
#: was counted so only where that is less than both phases at once (one
#: unit's buffers beside the update's temporaries), until the first compiled
#: points at MPI N=8 (2026-11-30, session 48): there the GPT 2 x 128 with
#: SGD peaked at 9.17 MiB, 8.71 counted at once, 9.83 so (Adam and AdamW
#: 0.8% and 0.1% above; at N=6 and 7, measured after, SGD 3.5% and 2.2%).
#: The 148 points recorded before read 1.035-2.197x so (2.102x before).
#: The buffers are of buckets that are not an owner's (``Units.queued``): the
#: 50 such recorded points with Muon and Adafactor each peaked 0.48 of a
#: unit's buffers or more below the pass counted alone without them; counted with
#: two units of their owner buckets, padded or all-summed, the MLP 4 x 512
#: with Adafactor at MPI N=8 read 2.698x (7.13 MiB measured, 19.24 planned;
#: 11.24 so), and, measured after (session 49), the GPT 3 x 192 with
#: Adafactor at MPI N=6, resharded, 2.508x (1.494x so). Two until 2026-12-01:
#: refitted on the 248 compiled points recorded under the all-sum as the least
#: that keeps each 2% below (bound by the GPT 2 x 128 with Adam at MPI N=8,
#: 1.019x): 90 of them above 1.3x, 123 with two.
COMPILED_UNITS = 1.5

#: Units whose full gradients and reduce-scatter buffers an unpaced CPU's pass
#: (``pace.QUEUE_DEPTH`` 0) holds at once, both phases counted at once: the
#: main thread queues the next unit's backward pass and reduce-scatter while
#: one unit's are alive. With one, the MLP 4 x 256 with SGD at MPI N=4 peaked
#: at 3.02 MiB against 2.69 planned, and the MLP 4 x 512 at ring N=2 at 15.67
#: against 15.26 (session 49, the first unpaced points measured).
UNPACED_UNITS = 2

#: Updates under way in ``fully_shard``'s update on the CPU beyond the
#: :data:`~mlx_fsdp.plan_memory.transient.CHAINS` largest that
#: :func:`~mlx_fsdp.plan_memory.transient.overlap` counts (:func:`unpaced_update`):
#: the next largest, each holding its ``live`` bytes. Adafactor's owner
#: updates of six matrices a rank (the MLP 12 x 384 at ring N=2, its update
#: alone) held 14.71 MiB in bfloat16, 13.43 counted without, and 14.72 in
#: float32, 13.00; of eight (16 x 256 in float32) 7.07, 6.80; of four or
#: fewer, no more than counted. With these two, 43 MLPs of 2 to 32 layers of
#: 256 and 384 at ring N=2, MPI N=3 and 4 read 1.03-1.54x; counting one more
#: update's total instead (and 1.5 of it to clear the MLP 18 x 256 at MPI
#: N=3, 0.998x with one) made the recorded GPT points looser, up to 1.87x
#: (2026-11-29, ``bench_plan_phases.py``).
UNPACED_UNDER_WAY = {"adafactor": 2}


def unpaced_update(optimizer: str, updates: Sequence[Update], counted: int,
                   device: str = "cpu", compiled: bool = False) -> int:
    """What an unpaced update of many pieces holds on the CPU.

    ``fully_shard``'s update is one graph of every piece's update with no
    collective between them, as the plain optimizer's is. ``counted`` is
    :func:`~mlx_fsdp.plan_memory.transient.overlap`'s count of ``updates``
    (:func:`~mlx_fsdp.plan_memory.transient.update_costs`'), and on top
    Adafactor's further updates under way (:data:`UNPACED_UNDER_WAY`);
    Lion and Muon keep ``PLAIN``'s arrays of each update's size however
    many there are (``PLAIN_MASTER`` through masters): without Muon's, its
    owner updates on the MLP 48 x 128 at ring N=2, resharded, peaked at
    6.48 MiB against 6.32 planned (2026-11-29). And none holds more than
    its updates allocate in all (``Temporaries.most``, with SGD's float32
    copies through masters, ``PLAIN_UPCAST``): the count's chains and
    run-ahead both hold the largest updates, which on a few pieces counts
    them twice (Lion on the MLP 4 x 512 at ring N=2: its update alone peaked
    at 11.54 MiB, 18.18 counted without this, 14.53 with it; 2026-11-29).
    On a GPU and compiled: ``counted``.
    """
    if device != "cpu" or compiled:
        return counted
    table = PLAIN_MASTER if any(u.upcast for u in updates) else PLAIN
    _, kept, run = table.get(optimizer, PLAIN[optimizer])
    kept_bytes = plain_window(updates, 0, kept) if run is None else 0
    lives = sorted((u.live for u in updates), reverse=True)
    more = sum(lives[CHAINS:CHAINS + UNPACED_UNDER_WAY.get(optimizer, 0)])
    upcasts = sum(u.upcast for u in updates) if optimizer in PLAIN_UPCAST else 0
    return min(counted + kept_bytes + more, allocated(updates, 0) + upcasts)
