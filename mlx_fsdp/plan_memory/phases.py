"""How the phases of a step meet, by device: what one counts of the other.

A fully sharded step has two phases (:mod:`mlx_fsdp.plan_memory.fully`):
the forward and backward pass, with the gathers, the full gradients and the
activations, and the update, with the optimizer's temporaries. An
``fsdp_step`` has two too (:mod:`mlx_fsdp.plan_memory.buffers`): the
reduce-scatters, then the update and the all-gathers. Whether they overlap
depends on who paces evaluation: on the CPU the update waits for what comes
before it (:mod:`mlx_fsdp.pace`), on a GPU nothing holds it back.
"""

from dataclasses import replace
from typing import Optional, Sequence, Tuple

from .. import pace
from .parts import RankMemory
from .buffers import DdpBuffers, fullest_gather
from .clipping import Clip
from .freed import Freed
from .sharding import BucketBytes
from .transient import IN_FLIGHT_OPS, Temporaries


def phases_apart(device: str, compiled: bool = False) -> bool:
    """Whether the update's temporaries and the pass's activations are never alive together.

    On the CPU the step's update waits for the whole backward pass
    (:func:`mlx_fsdp.pace.after_queue`), so each phase is counted alone: the
    pass with the activations (and
    :func:`~mlx_fsdp.plan_memory.backward.pass_spare`), the update with the
    temporaries. On a GPU, unpaced, both phases count both, and so does
    ``compiled``, a step compiled whole counted as unpaced: ``fsdp_step``'s
    plan keeps that count where it is less than the paced count with what
    compiling was measured to add (:func:`compiled_paced`); a fully sharded
    one apart (under the all-sum with what compiling added, where that is
    less: :func:`mlx_fsdp.plan_memory.fully_ranks.fully_memory`).
    """
    return pace.paced_on(device) and not compiled


#: Buckets whose reduce-scatter buffers can be alive at once on an unpaced
#: CPU (``pace.QUEUE_DEPTH`` 0): the main thread allocates each operation's
#: output as it queues it, up to
#: :data:`~mlx_fsdp.plan_memory.transient.IN_FLIGHT_OPS` ahead of the worker,
#: and a bucket's reduce-scatter is at least two of them (the packing and
#: the collective). Measured unpaced (2026-11-28): at ring N=2 in 2 MiB
#: buckets the MLP 4 x 512 held all four buckets' vectors. Paced, as by
#: default, each bucket's reduce-scatter waits for the one before
#: (:mod:`mlx_fsdp.step`), and one bucket's buffers are counted: that MLP
#: then held one (14.03 MiB, 18.04 before; tests/test_multirank.py).
UNPACED_REDUCES_AHEAD = IN_FLIGHT_OPS // 2

#: What the count of an ``fsdp_step``'s buffers leaves out, in bytes: its
#: small arrays (the tokens that chain its collectives, 1-D arrays' pieces).
#: MPI N=4's Llama 8 x 128 with Adafactor peaked 4,964 bytes above the rest
#: of the count, packing's copies counted (2026-11-28).
SMALL_ARRAYS = 64 * 1024


def reduces_ahead(device: str, compiled: bool = False) -> int:
    """Buckets whose reduce-scatter buffers are counted at once: one where each
    waits for the one before (the CPU, paced) and on a GPU (not measured);
    :data:`UNPACED_REDUCES_AHEAD` on an unpaced CPU, and for a step compiled
    whole, counted as unpaced (:func:`phases_apart`; at MPI N=3 with 1 MiB
    buckets the MLP 4 x 512's compiled step with SGD peaked at 16.04 MiB
    against 16.09 counted with one bucket, 2026-11-28)."""
    return UNPACED_REDUCES_AHEAD if device == "cpu" and not phases_apart(device, compiled) else 1


#: A step compiled whole on a paced CPU holds, beyond the paced count, this
#: many of its largest bucket's vectors and, under the all-sum, times its
#: reduced pieces' bytes, by reduce-scatter (measured, not derived; perhaps
#: its fused kernels let MLX queue further ahead). Fitted (mlx 0.32.4) as the
#: least that keeps each recorded compiled ``fsdp_step`` point 2% below the
#: plan, or as close as it already was: on 108 points (2026-11-29), 2 vectors
#: and 2 pieces; on 387 (2026-12-01; ring N=2, MPI N=3 to 8; the MLP, the GPT
#: and mlx-lm's Llama; six optimizers), these, bound by Adafactor on the MLP
#: 4 x 512 at ring N=2 and Lion on the MLP 4 x 256 at MPI N=4 (both 1.021x):
#: 173 of them above 1.3x, 211 before (docs/memory-planner-history.md).
COMPILED_VECTORS = {"exchange": 1.75, "all_sum": 1, "native": 1}
COMPILED_PIECES = {"exchange": 0, "all_sum": 2.5, "native": 2.5}


def compiled_paced(paced: RankMemory, buckets: Sequence[BucketBytes], pieces: int,
                   method: str) -> RankMemory:
    """A step compiled whole on a paced CPU: ``paced``, :func:`fsdp_fullest`'s
    count of the same step run eagerly, with what compiling was measured to
    add (:data:`COMPILED_VECTORS`); ``pieces``: the reduced pieces' bytes,
    ``method``: the reduce-scatter's. The caller keeps the unpaced count
    where that is less, and alone where a bucket is all-summed."""
    extra = int(COMPILED_VECTORS[method] * max((b.vector for b in buckets), default=0)
                + COMPILED_PIECES[method] * pieces)
    return replace(paced, communication=paced.communication + extra)


def fsdp_fullest(common: RankMemory, buffers, temporaries: Temporaries, pieces: int,
                 buckets: Sequence[BucketBytes], device: str,
                 gathers_wait: bool = False, compiled: bool = False,
                 split: Optional[Tuple[Temporaries, Temporaries]] = None,
                 clip: Clip = Clip(), freed: Freed = Freed(), carried: int = 0) -> RankMemory:
    """One ``fsdp_step`` rank at its fullest phase.

    ``buffers``: :func:`~mlx_fsdp.plan_memory.buffers.fsdp_buffer_phases`'
    ``(reducing, gathering)``, each ``(communication, new parameters)``;
    ``temporaries``: the update's
    (:class:`~mlx_fsdp.plan_memory.transient.Temporaries`: under way, queued
    ahead, and at most, all updates' allocations); ``pieces``: the reduced
    pieces with their division's copies, which the update holds;
    ``buckets``: the rank's bytes of every bucket. ``gathers_wait``: no
    bucket is an owner's, so every all-gather waits for its bucket's update
    on the CPU (:mod:`mlx_fsdp.step`). Default: ``False``.
    ``compiled``: the step is compiled whole, counted as unpaced. Default: ``False``.
    ``split``: the temporaries of the gathered bucket's own updates and of every
    other bucket's, whose ``kept`` meets every gather. Default: ``None`` (all).
    ``clip``: what clipping holds (:mod:`~mlx_fsdp.plan_memory.clipping`):
    its copies in every phase of the update, and a phase of its own before
    it, the norm's, with the reduced pieces and the updates queued ahead.
    Default: ``Clip()`` (no clipping). ``freed``: what the gathered bucket
    meets no more (:mod:`~mlx_fsdp.plan_memory.freed`). Default: ``Freed()``.
    ``carried``: what ``common.freed`` takes off that the reducing phase
    still holds (local accumulation's sums, which its reduce-scatters
    consume). Default: ``0``.

    On the CPU the update waits for the last reduce-scatter
    (:func:`mlx_fsdp.pace.after_queue`), so its temporaries meet the
    gathering phase alone, and the reducing phase counts no temporaries:
    ``buffers`` holds the buckets reduced at once (:func:`reduces_ahead`).
    A bucket's gather follows its own updates, not the other buckets': it
    meets what is left of its own (an owner bucket's gather, unpaced, their
    tail; a flat bucket's, which waits, what was under way, but alone in
    its bucket none of SGD's or Lion's: ``Temporaries.tail``) and the other
    buckets' updates (``split``): under way beside an owner bucket's
    gather, queued ahead too beside a flat bucket's.
    Where the gathers wait, the update is a phase of its own. With one
    bucket nothing of the gather exists during the update; past one, a
    gather waits for its own bucket's update but the next update not for
    it, so one bucket's gather (its packed shard and vector) and another
    bucket's gathered vector meet it (MPI N=3, 64 KiB buckets: the MLP with
    SGD measured 4.6% above the count without that vector). The pacing
    chains' one-element arrays and :data:`SMALL_ARRAYS` are counted in
    every phase. Elsewhere (a GPU, unpaced) the temporaries meet the fuller buffers, with the
    largest bucket's vector packed ahead and, on an unpaced CPU, the next largest (session 49).
    Measured: docs/memory-planner-history.md, "The update waits for the last bucket's token",
    "A gather meets the other buckets' updates" and "The first unpaced points".
    """
    (red, red_new), (gat, gat_new) = buffers
    if not phases_apart(device, compiled):
        ahead = sorted(b.vector for b in buckets)[-(2 if device == "cpu" and not compiled else 1):]
        whole = temporaries.together + pieces + sum(ahead) + SMALL_ARRAYS + clip.copies + clip.norm
        return max((replace(common, communication=gat, new_parameters=gat_new, temporaries=whole),
                    replace(common, communication=red, new_parameters=red_new, temporaries=whole)),
                   key=lambda r: r.peak)
    chains = pace.QUEUE_DEPTH * 4 * (1 + (len(buckets) if gathers_wait else 0)) + SMALL_ARRAYS
    late = clip.copies  # in every phase of the update
    meets = temporaries.together  # without a split, every update beside the gather
    # What the other buckets' updates keep to the step's end meets every
    # gather (transient.KEPT_TO_THE_END).
    late += split[1].kept if split else 0
    if split:
        # An owner bucket's gather follows its own updates' last operations:
        # it meets their tail and what is under way of the other buckets'
        # updates (with what those queued ahead too, the GPT 2 x 128 with
        # Muon at MPI N=4 in 64 KiB buckets read 1.60x; no point needed it).
        # The tail: the larger of the last update under way and what is
        # queued ahead, and the second update under way (``side`` less
        # ``last``). With the larger alone, Muon's three matrices a rank
        # peaked above the plan (the MLP 9 x 256 in bfloat16 at MPI N=3:
        # 11.52 MiB, 10.30 counted); a bias beside a matrix adds its own
        # bytes, not the matrix's update again (Adafactor on the MLP 4 x 512
        # at ring N=2 read 1.45x counted twice, 1.29x). docs/memory-planner-history.md.
        own, others = split
        tail = max(own.last, own.ahead) + own.side - own.last
        meets = min(tail + others.side, meets)
    # A tie goes to the gathering phase, the one with the new parameters.
    phases = [replace(common, freed=common.freed - freed.parameters,
                      communication=gat - freed.reduced, new_parameters=gat_new,
                      temporaries=chains + late + meets + pieces - freed.divided)]
    if gathers_wait:
        # The update has consumed the gathered bucket's reduced pieces, and
        # its updated pieces (counted in ``gat``) stand in their place.
        fullest, many = fullest_gather(buckets), sum(1 for b in buckets if b.held) > 1
        # A flat bucket's gather waits for its own updates; what still meets
        # it of them, with one bucket, was measured as much as the updates
        # under way with Adam and AdamW, nothing with SGD and Lion (``tail``):
        # the MLP 4 x 512 with AdamW in bfloat16 at ring N=2 peaked at 19.04
        # MiB, 14.09 counted without them and 19.09 with them (20.09 with the
        # reduced pieces too, which the update has consumed); with SGD at
        # 12.03, 12.09 counted without them.
        # And what they keep to the step's end (Lion's, KEPT_TO_THE_END): alone
        # in its step, the MLP 9 x 256 at ring N=2 peaked at 11.29 MiB, 10.23
        # counted without it, 11.36 with it (7 and 8 layers too; 2026-11-29).
        meets = temporaries.tail + temporaries.kept
        if many:
            # Past one, what its own updates keep to the step's end too
            # (Lion's: without it the MLP 48 x 128 in 128 KiB buckets at MPI
            # N=3 peaked above the plan, 9.60 MiB against 9.598; counted with
            # all its updates under way instead, the MLP 4 x 1024 read 1.47x,
            # 1.40x so), and the other buckets' updates, under way and queued
            # ahead. Counted with as many under way as MLX's graph width
            # allows (seven, session 29), no point measured since needed
            # them: the MLP 16 x 256 with Lion in 256 KiB buckets at ring N=2,
            # for which they were counted, peaked at 15.69 MiB, 17.04 counted
            # without them; the GPT 2 x 512 with AdamW read 1.31x with them,
            # 1.21x without (2026-11-29).
            meets = temporaries.together if not split else \
                min(own.tail + own.kept + others.together, temporaries.most)
        phases[0] = replace(phases[0], communication=gat - fullest.held,
                            temporaries=chains + late + meets)
        gather = fullest.packed + fullest.new_parameters if many else 0
        # The main thread runs ahead of the worker while the worker waits in
        # a collective, so what it queues ahead meets the gathers (above),
        # beside the updates under way: MLX's graph order interleaves
        # independent updates of several buckets (mlx-lm's Llama 4 x 256
        # with Lion and 1 MiB buckets at ring N=2: 48.23 MiB, 44.22 with
        # MLX_BFS_MAX_WIDTH=1). Counted with the queued ones alone, ring
        # N=2 with 1 and 2 MiB buckets measured up to 8% above the plan (the
        # MLP 4 x 512 with AdamW: 21.54 MiB against 19.93; 2026-11-28).
        # Between the gathers the update holds what is under way.
        # The second vector is another bucket's: counting the fullest twice,
        # SGD on mlx-lm's Llama 6 x 192 in bfloat16 at MPI N=3 (two buckets
        # of 3.86 and 1.08 MiB) read 1.34x, and 1.26x so (2026-11-27).
        rest = list(buckets)
        rest.remove(fullest)
        second = max((b.new_parameters for b in rest), default=0)
        phases.append(replace(common, communication=pieces + gather,
                              new_parameters=second if many else 0,
                              temporaries=chains + late + temporaries.side))
    phases.append(replace(common, communication=red, new_parameters=red_new, temporaries=chains,
                          freed=common.freed + carried))
    if clip.copies:  # the norm's squares, after the last reduce-scatter, before any update
        phases.append(replace(common, communication=pieces, new_parameters=0,
                              temporaries=chains + clip.copies + clip.norm))
    return max(phases, key=lambda r: r.peak)


def ddp_fullest(common: RankMemory, buffers: DdpBuffers, temporaries: Temporaries,
                device: str, clip: Clip = Clip()) -> RankMemory:
    """One ``ddp_step`` rank at its fullest phase: packing its gradients, or updating.

    With one group (``average_gradients``' default 32 MiB holds the model) on
    the CPU, every update follows the all-sum, which follows the packing:
    the packing's copies are freed before any update runs, and meet only
    the updates the main thread has queued ahead (``temporaries.ahead``,
    over :data:`~mlx_fsdp.plan_memory.transient.ELEMENTWISE_IN_FLIGHT_OPS`).
    Counted beside the updates under way too, the MLP 4 x 256 with Lion at
    ring N=2 read 1.34x (10.10 MiB planned, 7.53 measured; 2026-11-28).
    So in several groups (``buffers.packing``: the groups packed at once),
    though a group's updates can run while the next is packed: counted at
    once, 108 measured points read up to 1.89x (docs/memory-planner-history.md). On
    a GPU the copies' buffers live until their command buffer finishes:
    both are counted at once. ``clip``: what clipping holds
    (:mod:`~mlx_fsdp.plan_memory.clipping`), after the averaging.
    Default: ``Clip()`` (no clipping). In every phase the caller's gradients
    keep their buffers, which can be larger than they are
    (:data:`~mlx_fsdp.plan_memory.buffers.VIEW_SLACK`).
    """
    both = replace(common, communication=buffers.averaged + buffers.packing + buffers.views,
                   new_parameters=buffers.new_parameters,
                   temporaries=clip.with_update(temporaries.side + temporaries.ahead))
    if device != "cpu":
        return both
    # Clipped, no update starts before the last group is averaged: the
    # global norm reads every gradient. A group's packing can meet the
    # norm's squares of the groups before it, queued ahead (Clip.norm).
    # Counted at once, groups of 256 KiB at MPI N=3 read up to 1.91x.
    ahead = max(temporaries.ahead, clip.norm) if buffers.groups != 1 else temporaries.ahead
    # The step's small arrays (:data:`SMALL_ARRAYS`) in both: with SGD, whose
    # updates all fit in what is queued ahead, the MLP 4 x 256 at ring N=2
    # peaked 3,134 bytes below the packing phase's count without them.
    updating = replace(both, communication=buffers.averaged + buffers.views + SMALL_ARRAYS)
    packing = replace(both, communication=both.communication + SMALL_ARRAYS, new_parameters=0,
                      temporaries=ahead)  # the clipping comes after it
    return max(updating, packing, key=lambda r: r.peak)


def with_pass(step: RankMemory, activations: int, mode: str, device: str,
              world_size: int, views: int = 0) -> RankMemory:
    """One ``ddp_step`` or ``fsdp_step`` rank's ``step`` with one batch's pass.

    On the CPU ``fsdp_step``'s update waits for its last reduce-scatter and
    each reduce-scatter for the one before it (:mod:`mlx_fsdp.pace`), also
    inside ``mx.compile``: the whole backward pass has run, and its
    activations are gone, before the update's temporaries and new
    parameters come; and its first reduce-scatter waits for every gradient
    (:mod:`mlx_fsdp.step`), so no communication buffer meets the pass. So
    the fuller of the two counts: the step, or the pass with its
    activations beside the parameters, gradients, state and masters, and
    ``views``: what the gradients' buffers hold beyond their bytes
    (:func:`~mlx_fsdp.plan_memory.buffers.view_slack`). Default: ``0``.
    The pass frees nothing (it holds every parameter and any accumulation's
    sums). ``ddp_step`` (not paced), one process and a GPU count both at once.
    """
    counted = replace(step, activations=activations)
    if mode != "fsdp" or world_size == 1 or not pace.paced_on(device):
        return counted
    return max(step, replace(counted, temporaries=0, new_parameters=0, communication=views,
                             freed=0), key=lambda r: r.peak)
