"""The sharded step, top to bottom, as the data flows.

plan -> check -> reduce-scatter each bucket -> accumulate and average -> clip
-> update this rank's shards -> all-gather each bucket. The layout of a
bucket (one flat vector, rank ``r`` holding ``[r * cols, (r + 1) * cols)``)
is in :mod:`mlx_fsdp.plan`; packing and cutting it in :mod:`mlx_fsdp.layout`;
a bucket's collectives in :mod:`mlx_fsdp.bucketed`. The parameters of a fully
sharded module (:func:`mlx_fsdp.fully_shard`) arrive as what this rank holds,
their gradients already reduce-scattered in the backward pass: their
buckets skip both collectives (:mod:`mlx_fsdp.fully_sharded.model`).

The step only builds a graph. It returns as soon as the graph is built, and
the caller's ``mx.eval`` runs it, as with ``mlx.nn.average_gradients``, so
MLX schedules the whole training step (forward, backward, the collectives
and the update) as one graph: the reduce-scatter of the last layers'
bucket can start while the backward pass is still computing the first
layers' gradients, and buffers are freed as soon as their last user has run.
The only host synchronization is the small cross-rank check before the first
collective (:mod:`mlx_fsdp.consistency`).
"""

import mlx.core as mx

from . import accumulate, bucketed, clip, collectives, consistency, layout, pace
from ._trees import like, match
from .fully_sharded.model import step_plan
from .placement import sub_optimizers
from .plain import apply_optimizer
from .order import CollectiveOrder, end_trace
from .plan import Plan


def sharded_step(opts, optimizer, state, gradients, parameters, *, dog=None, adopt=None,
                 fused=None):
    """One sharded optimizer step on trees.

    Args:
        opts (Options): The wrapper's options (group, budget, clipping...).
        optimizer (mlx.optimizers.Optimizer): The wrapped optimizer; it holds
            this rank's state (see :mod:`mlx_fsdp.state`).
        state (WrapperState): The wrapper's state, updated in place.
        gradients (dict): This rank's local gradients.
        parameters (dict): The parameters, a superset of the gradients' paths,
            or the model.
        dog (Watchdog, optional): Watches the cross-rank check. Default: ``None``.
        adopt (callable, optional): Called with the plan before anything uses
            the optimizer state (the wrapper checks that the state fits it).
            Default: ``None``.
        fused (FusedUpdates, optional): Runs the optimizer compiled (see
            :mod:`mlx_fsdp.fused`). Default: ``None`` (eagerly).

    Returns:
        tuple: The updated parameters shaped like ``gradients`` (``None`` on a
        micro-batch that does not finish the step), the gradient norm before
        clipping (``None`` without ``max_norm``), and the plan.
    """
    flat_grads, params = match(gradients, parameters)
    grads = [g for _, g in flat_grads]
    group, stream, k = opts.group, opts.communication_stream, opts.grad_accumulation_steps
    n, rank = group.size(), group.rank()
    traced = accumulate.is_traced(state["micro_step"])

    # -- plan: buckets and shards, cached per tree structure, N and budget
    plan = step_plan(flat_grads, params, optimizer, n, opts.communication_size, opts.placement,
                     parameters)
    # -- check: every rank takes this step, with the same plan and settings
    summary = consistency.describe_tree(plan.num_arrays, plan.num_elements, plan.fingerprint,
                                        f", {len(plan.buckets)} buckets")
    consistency.check_step(opts, optimizer, summary, state, tracing=traced, dog=dog)
    if adopt is not None:
        adopt(plan)
    finish = True
    if k > 1 and opts.accumulation == "local" and not traced:
        grads, finish = accumulate.add(state, [(p, g) for (p, _), g in zip(flat_grads, grads)],
                                       k, traced)
        if not finish:
            return None, None, plan

    # -- reduce-scatter each bucket, the last one first: in the backward pass
    #    the last layers' gradients are ready first
    method = collectives.reduce_scatter_method(group)
    # Inside mx.compile, after the fully sharded modules' collectives of the
    # same trace (a chain that starts at one of these parameters).
    order = CollectiveOrder(group, traced, params)
    if opts.communication_stream is None and mx.default_device() == mx.cpu and len(plan.buckets) > 1:
        # One CPU stream runs compute and collectives in turn, so there a
        # collective inside the backward pass overlaps nothing and makes the
        # ranks wait for each other mid-pass: the first one waits for every
        # gradient (3.3M GPT, ring N=2, 4 MiB buckets: 0.98-1.01x DDP's step
        # instead of 1.09-1.16x).
        order.ran(mx.concatenate([layout.empty_of(g) for g in reversed(grads)]))
    # Inside mx.compile only what the outputs depend on runs: a gradient this
    # rank holds none of (an array an owner elsewhere keeps whole) would drop,
    # on this rank alone, the collectives that made it (see the end).
    every = [layout.empty_of(g) for g in grads] if traced else []
    held = {}  # path -> summed gradient of what this rank holds of it
    averaged = set()  # paths whose gradient the model averaged over the group
    mine = []
    for i, bucket in enumerate(reversed(plan.buckets)):
        if i and pace.pacing():
            # On the CPU, this bucket's buffers only once the last one's are
            # freed: run ahead, MLX packed and reduced up to every bucket at
            # once (the MLP 4 x 512 with SGD in 2 MiB buckets, ring N=2:
            # 18.04 MiB, 14.03 paced; see mlx_fsdp.pace).
            order.follow(pace.paced(order.last(), traced)[0])
            # Its packing's copies too (a transposed weight gradient flattened,
            # an owner's rows): read from the gradients alone, they were
            # queued beside the bucket before (mlx-lm's Llama 12 x 128 with
            # Adafactor at MPI N=5, four owner buckets: 34.42 MiB, 30.05 so).
            at = [slot.index for slot in bucket.slots]
            for i, g in zip(at, order.after([grads[i] for i in at], eager=True)):
                grads[i] = g
        if bucket.sharded_params:
            mine = bucketed.sum_over_replicas(bucket, layout.held_of(bucket, grads, rank), rank,
                                              opts.dp_group, order=order, stream=stream)
            averaged.update(slot.path for slot, _ in mine)
        else:
            mine = bucketed.reduce_bucket(bucket, grads, group, method=method, order=order,
                                          stream=stream, dp_group=opts.dp_group)
        held.update((slot.path, g) for slot, g in mine)
    last = [slot.path for slot, _ in mine]  # the pieces of the bucket reduced last
    del grads

    # -- accumulate micro-batches (sharded, or any inside mx.compile) and average
    if k > 1 and (opts.accumulation == "sharded" or traced):
        sums, finish = accumulate.add(state, list(held.items()), k, traced)
        held = dict(zip(held, sums))
        if finish is False:
            # The sums need only the collectives of what this rank holds, and
            # a bucket kept whole by another rank leaves none here: the counter
            # carries the chain's end, so that every rank runs every collective
            # now (owner placement, ring N=2: the ranks fell out of step).
            state["micro_step"], = order.after([state["micro_step"]], eager=True)
            return None, None, plan
    # The last bucket's token is a lazy slice of the buffers it followed (the
    # exchange's whole received vector, an all-sum's total); evaluated only
    # by the first gather, it kept them through the update (MLP 4 x 256, SGD,
    # ring N=2: 1.0 MiB). So the update evaluates it: on the CPU all of the
    # update waits for it (owner buckets' updates otherwise met the last
    # reduce-scatters: Adafactor, MLP 2 x 1024, ring N=2, 56 -> 72 MiB);
    # unpaced, only that bucket's update, or the others ran after every
    # collective and held more (MLP 4 x 2048, 32 MiB buckets, H100: 8 MiB).
    waiting = list(held) if pace.pacing() else last
    held.update(zip(waiting, order.after([held[p] for p in waiting], eager=True)))
    # On the CPU the update's new state would otherwise be allocated while
    # the last reduce-scatter still holds its buffers (see mlx_fsdp.pace).
    held = dict(zip(held, pace.after_queue(list(held.values()), traced)))
    replicas = opts.world_size // n
    # (A gradient the model averaged is not divided by 1: that would copy it.)
    held = {p: g if p in averaged and replicas * k == 1 else
            g / ((replicas if p in averaged else opts.world_size) * k) for p, g in held.items()}

    # -- clip by the global norm: every element is held by exactly one rank
    norm = None
    if opts.max_norm is not None:
        norm = clip.global_norm(list(held.values()), group, order=order, stream=stream)
        held = dict(zip(held, clip.clip_by_norm(list(held.values()), norm, opts.max_norm)))
        state["grad_norm"] = accumulate.select(finish, norm, state["grad_norm"])

    # -- update: each sub-optimizer on what this rank holds of its arrays
    new = _update(plan, held, params, optimizer, state, opts.master_dtype, rank, finish, fused)
    del held

    # -- all-gather each bucket, the first one first (the next forward pass
    #    needs it first); the new parameters are views of the gathered vectors
    out = list(params)
    for bucket in plan.buckets:
        mine = {s.index: new[s.path] for s in bucket.held(rank)}
        if bucket.sharded_params:  # the model keeps what this rank holds
            for index, a in mine.items():
                out[index] = accumulate.select(finish, a, params[index])
            continue
        if not bucket.owned:
            # On the CPU the gather's shard and vector would otherwise be
            # allocated while the update's temporaries are alive (see
            # mlx_fsdp.pace). Pacing an owner bucket too raised the GPT's
            # peak with Muon (docs/memory-planner-history.md).
            mine = dict(zip(mine, pace.after_queue(list(mine.values()), traced)))
        whole = bucketed.gather_bucket(bucket, mine, group, order=order, stream=stream)
        for slot, a in zip(bucket.slots, whole):
            out[slot.index] = accumulate.select(finish, a, params[slot.index])
    if plan.buckets:
        last = plan.buckets[-1].slots[-1].index
        out[last] = order.settle(out[last])
    if traced:
        out = mx.depends(out, every)
        end_trace(group)
    return like(gradients, out), norm, plan


def _update(plan: Plan, held: dict, params, optimizer, state, master_dtype, rank: int,
            finish, fused) -> dict:
    """Run each sub-optimizer on what this rank holds; return it, updated, by path.

    A sub-optimizer sees ``{path: array}`` with what this rank holds of each
    of its arrays (see :mod:`mlx_fsdp.layout`): a 1-D piece, which an
    element-wise optimizer updates exactly, or a whole array it owns, which
    it updates exactly as plain MLX would. Array by array, as plain MLX
    does, so that its temporaries are as small as an array. It is called
    even when it holds nothing here, so its step count stays equal on every rank.
    """
    subs = sub_optimizers(optimizer)
    grads, values = [{} for _ in subs], [{} for _ in subs]
    for b in plan.buckets:
        for slot, p in layout.held_of(b, params, rank):
            grads[b.optimizer][slot.path] = held[slot.path]
            values[b.optimizer][slot.path] = p
    new = {}
    for sub, g, v in zip(subs, grads, values):
        new.update(apply_optimizer(sub, g, v, state["master"], master_dtype, finish, fused))
    return new
