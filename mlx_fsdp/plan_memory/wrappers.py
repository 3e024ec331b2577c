"""The ranks of the two optimizer wrappers: ``ddp_step`` and ``fsdp_step``.

What each counts is in :mod:`mlx_fsdp.plan_memory.estimate`; the buffers in
:mod:`mlx_fsdp.plan_memory.buffers`, how the step's phases meet in
:mod:`mlx_fsdp.plan_memory.phases`.
"""

from dataclasses import replace
from typing import List, Optional

import mlx.core as mx

from ..fused import use_fused_updates
from . import optimizers
from .clipping import Clip, clip_bytes
from .freed import Freed, freed_before, with_room
from .buffers import (ddp_buffers, fsdp_buffer_phases, fullest_index,
                      resolve_reduce_scatter, view_slack)
from .parts import RankMemory, tree_bytes
from .phases import (compiled_paced, ddp_fullest, fsdp_fullest, phases_apart,
                     reduces_ahead)
from .sharding import _fsdp_state, plain_state
from .transient import IN_FLIGHT_OPS, overlap, update_costs


def ddp_memory(name: str, flat, param_bytes: int, world_size: int, communication_size: int,
               master_dtype: Optional[mx.Dtype], accumulation: str,
               device: str = "cpu", clipped: bool = False) -> RankMemory:
    """Every rank of ``ddp_step``: the plain optimizer ``name`` on whole arrays
    (``clipped``: by their global norm, :mod:`~mlx_fsdp.plan_memory.clipping`)."""
    state = plain_state(optimizers.make(name), flat, master_dtype)
    grads = tree_bytes(dict(flat))
    common = RankMemory(
        parameters=param_bytes, gradients=grads,
        accumulation=0 if accumulation == "none" else grads,
        optimizer=tree_bytes(state["optimizer"]), masters=tree_bytes(state["master"]),
        communication=0, new_parameters=0)
    fused = use_fused_updates(device, world_size)
    costed = list(update_costs(name, flat, master_dtype, fused).values())
    temps = overlap(name, costed, fused, device, whole_arrays=True)
    clip = clip_bytes([a for _, a in flat], costed, device) if clipped else Clip()
    window = IN_FLIGHT_OPS if device == "cpu" else 0  # a GPU's: not measured
    return ddp_fullest(common, ddp_buffers([a for _, a in flat], world_size, communication_size,
                                           window), temps, device, clip)


def fsdp_memory(name: str, flat, param_bytes: int, world_size: int, communication_size: int,
                master_dtype: Optional[mx.Dtype], accumulation: str, reduce_scatter=None,
                device: str = "cpu", compiled: bool = False,
                transposed: Optional[dict] = None,
                budget: Optional[int] = None, clipped: bool = False) -> List[RankMemory]:
    """Every rank of ``fsdp_step``, in rank order, each at the fullest's peak
    (owners and packing make their parts differ, the rest is counted as
    temporaries); with a ``budget`` in bytes, only up to the first rank whose
    peak exceeds it; ``clipped``: its pieces by their global norm."""
    if world_size == 1:  # the plain optimizer, as in ddp_step
        return [ddp_memory(name, flat, param_bytes, 1, communication_size,
                           master_dtype, accumulation, device, clipped)]
    if compiled and accumulation == "local":
        # Inside mx.compile the step reduce-scatters every micro-batch and
        # carries only this rank's 1/N of the sum (mlx_fsdp.step).
        accumulation = "sharded"
    method = resolve_reduce_scatter(reduce_scatter, world_size)
    grads = tree_bytes(dict(flat))
    views = view_slack([a for _, a in flat])
    out = []
    for rank in range(world_size):
        state = _fsdp_state(optimizers.make(name), flat, world_size, rank, communication_size,
                            None, master_dtype, transposed)
        pieces = tree_bytes(state["gradient"])
        buckets = state["buckets"]
        if compiled:
            # Inside mx.compile the step does not wait for a bucket's copies
            # (mlx_fsdp.bucketed), and its vectors are counted as views: the
            # MLP 4 x 512 with Adafactor in 1 MiB buckets at ring N=2 peaked
            # at 28.07 MiB with views, 29.07 with the copies (2026-11-29),
            # 27.17 counted so.
            buckets = [b._replace(copied=0) for b in buckets]
        common = RankMemory(
            parameters=param_bytes + sum(b.kept_padding for b in buckets), gradients=grads,
            accumulation={"none": 0, "local": grads, "sharded": pieces}[accumulation],
            optimizer=tree_bytes(state["optimizer"]), masters=tree_bytes(state["master"]),
            communication=0, new_parameters=0)
        fused = use_fused_updates(device)
        costed = update_costs(name, list(state["gradient"].items()), master_dtype, fused)
        temps = overlap(name, list(costed.values()), fused, device)
        clip = clip_bytes(list(state["gradient"].values()), costed.values(), device) \
            if clipped else Clip()

        def fullest_of(traced: bool) -> RankMemory:
            waits = not traced and not any(b.owned for b in buckets)  # see mlx_fsdp.step
            ahead = reduces_ahead(device, traced)
            if not (buckets and phases_apart(device, traced)):
                return fsdp_fullest(common, fsdp_buffer_phases(buckets, method, ahead), temps,
                                    pieces, buckets, device, waits, traced, None, clip)
            # Local accumulation's sums (the carried gradients and this
            # micro-batch's) are read by the reduce-scatters alone, and the
            # update waits for the last: none meets it. The MLP 4 x 512 and
            # the GPT 2 x 128 at ring N=2 in 1 MiB buckets peaked as high with
            # it as without, every optimizer (AdamW: 18.03 MiB both; 2026-11-29).
            # Compiled, every micro-batch is reduce-scattered: not counted so.
            carried = common.accumulation if accumulation == "local" and not compiled else 0
            base = replace(common, freed=-carried)
            # Where the phases are apart, a gather meets its own updates'
            # tail: at the fullest gather, or, where a rank owns whole
            # arrays, at the bucket of its largest updates, whichever is
            # fuller (the fullest is the first of equals: at MPI N=3 in 1
            # MiB buckets the MLP 4 x 512's first matrix, another rank's;
            # counted there alone, with Muon rank 1 peaked above its plan,
            # 22.02 MiB against 19.13; 2026-11-29).
            candidates = {fullest_index(buckets)}
            freed = [Freed()] * len(buckets)
            if not waits:
                owned = [sum(costed[p].total for p in paths if p in costed)
                         for paths in state["paths"]]
                candidates.add(owned.index(max(owned)))
                # What was freed before a gather can make a later one the
                # fullest: the gathers holding the most of what is left.
                if not compiled:  # compiled whole, planned as before (mlx_fsdp.plan_memory.freed)
                    freed = freed_before(buckets, method)
                left = [b.held + b.packed + b.new_parameters + o - sum(f)
                        for b, o, f in zip(buckets, owned, freed)]
                candidates.update(sorted(range(len(buckets)), key=lambda i: -left[i])[:8])

            def at(i: int) -> RankMemory:
                split = split_at(i)
                return fsdp_fullest(base, fsdp_buffer_phases(buckets, method, ahead, i), temps,
                                    pieces, buckets, device, waits, traced, split, clip,
                                    with_room(freed[i], split[1]), carried)
            return max(map(at, sorted(candidates)), key=lambda r: r.peak)

        def split_at(index: int) -> tuple:
            own = set(state["paths"][index])
            return tuple(overlap(name, [u for p, u in costed.items() if (p in own) == mine],
                                 fused, device)
                         for mine in (True, False))

        fullest = fullest_of(compiled)
        if compiled and buckets and phases_apart(device) and not any(b.summed for b in buckets):
            # Compiled whole on a paced CPU: the paced count, and what the
            # compiled step was measured to hold beyond it, where that is less.
            # Not with an all-summed owner bucket: at MPI N=7 mlx-lm's Llama 4 x
            # 192 with Adafactor (its last bucket all-summed) peaked at 34.72 MiB
            # on the rank owning most of it, 2.8% above that count and below the
            # unpaced one (40.11 planned); the 35 recorded points with one read up to
            # 2.25x so (2026-12-01, docs/memory-planner-history.md).
            fullest = min(fullest, compiled_paced(fullest_of(False), buckets, pieces, method),
                          key=lambda r: r.peak)
        if accumulation == "sharded":
            # The step's sum of the carried and this micro-batch's pieces, beside
            # both: at MPI N=3 Adafactor on the MLP 4 x 256 in bfloat16 (two
            # matrices on rank 0) peaked at 5.01 MiB, 4.89 counted without it
            # (2026-11-29). No eager float32 point needed it (the MLP 4 x 512
            # with Adafactor at ring N=2 would read 1.50x, 1.39x without).
            # Compiled whole, the carry is a new array too (mlx_fsdp.accumulate):
            # the MLP 4 x 512 with SGD at MPI N=3 peaked at 23.71 MiB, 22.81
            # counted without it (2026-11-30); and unpaced, where nothing makes
            # the sum wait for the carry's last reader: the MLP 4 x 256 with AdamW
            # on an unpaced CPU at MPI N=4 peaked at 7.03 MiB, 6.87 without it.
            more = (master_dtype is not None) + (not phases_apart(device, compiled))
            fullest = replace(fullest, temporaries=fullest.temporaries + more * pieces)
        # The caller's gradients keep their buffers through the step, as under
        # ddp_step (the closest deep Llama, 48 x 96 with SGD in 256 KiB buckets
        # at ring N=2, read 1.002x without them, 2026-11-29).
        out.append(replace(fullest, communication=fullest.communication + views))
        if budget is not None and out[-1].peak > budget:
            break
    # A rank can peak above its own count while the fullest's holds it: over
    # the exchange rank 0, at ring N=2, with Lion on mlx-lm's Llama 1 x 256
    # in bfloat16 (12.06 MiB against 11.74; rank 1's count 12.41) and SGD on
    # the MLP 4 x 512 in bfloat16 in 1 MiB buckets (12.02 against 11.87);
    # under the all-sum, at MPI N=7, the ranks whose shard of the MLP 4 x 384
    # is one piece of one array, with Lion (8.06 against 7.83; the others'
    # count 8.16) and SGD (7.73 against 7.51). Which rank runs ahead is not
    # counted: every rank is planned at the fullest's peak, the difference
    # as temporaries.
    fullest = max(r.peak for r in out)
    return [replace(r, temporaries=r.temporaries + fullest - r.peak) for r in out]
