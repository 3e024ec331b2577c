"""The replicated step, and the optimizer call both steps share.

``ddp_step`` averages the gradients over the ranks (``mlx.nn.average_gradients``)
and runs the plain optimizer on whole arrays; ``fsdp_step`` runs the same step
on one process, where sharding has nothing to split, so that it is exactly
plain MLX there.
"""

from typing import Any, Optional, Tuple

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from . import accumulate, clip, consistency, master
from ._trees import like, match
from .fully_sharded.model import sharded_modules
from .placement import signature_of, sub_optimizers
from .state import tree_changed


def apply_optimizer(optimizer, gradients: Any, parameters: Any, masters: dict,
                    master_dtype: Optional[mx.Dtype], finish=True, fused=None) -> Any:
    """``optimizer.apply_gradients``, through master copies, kept only if ``finish``.

    Args:
        optimizer (mlx.optimizers.Optimizer): The (sub-)optimizer.
        gradients: A tree of gradients.
        parameters: A tree with a parameter for every gradient path.
        masters (dict): ``{path: master}`` by the gradients' ``tree_flatten``
            paths, updated in place (see :mod:`mlx_fsdp.master`).
        master_dtype (Dtype, optional): Step parameters of other dtypes
            through masters of this dtype.
        finish (bool or array): ``True`` to step; a traced boolean (see
            :mod:`mlx_fsdp.accumulate`) keeps the old optimizer state and
            masters where it is false. Default: ``True``.
        fused (FusedUpdates, optional): Run the update compiled (see
            :mod:`mlx_fsdp.fused`). Default: ``None`` (eagerly, as plain MLX).

    Returns:
        The new parameters, shaped like ``gradients``, in their own dtypes.
    """
    flat_grads, flat_params = match(gradients, parameters)
    keys = [k for k, _ in flat_grads]
    steps, grads = master.lift(keys, flat_params, [g for _, g in flat_grads], masters, master_dtype)
    if finish is not True:
        optimizer.init(like(gradients, grads))
        old_state, old_masters = accumulate.snapshot(optimizer.state), dict(zip(keys, steps))
    apply = optimizer.apply_gradients if fused is None else (
        lambda g, p: fused.apply(optimizer, g, p))
    new = apply(like(gradients, grads), like(gradients, steps))
    # By path: a MultiOptimizer returns its parts' results merged in its own order.
    by_path = dict(tree_flatten(new))
    new = master.lower(keys, [by_path[k] for k in keys], [p.dtype for p in flat_params],
                       masters, master_dtype)
    if finish is not True:
        accumulate.restore(optimizer.state, accumulate.select(finish, optimizer.state, old_state))
        for key in keys:
            if key in masters:
                masters[key] = mx.where(finish, masters[key], old_masters[key])
    return like(gradients, new)


def replicated_step(opts, optimizer, state, gradients, parameters, *,
                    dog=None, fused=None) -> Tuple[Optional[Any], Optional[mx.array]]:
    """One step with the whole optimizer state on every rank.

    Gradients are accumulated (``grad_accumulation_steps``), averaged over
    ``opts.group`` with ``mlx.nn.average_gradients`` (nothing to do on one
    process), clipped by their global norm (accumulated in float32, as in
    the sharded step) and given to the plain optimizer.

    Returns:
        tuple: The new parameters shaped like ``gradients`` (``None`` on a
        micro-batch that does not finish the step) and the norm before
        clipping (``None`` without ``max_norm``).
    """
    flat_grads, flat_params = match(gradients, parameters)
    if sharded_modules(parameters):
        raise ValueError(
            "This model is fully sharded (mlx_fsdp.fully_shard): its gradients arrive "
            "reduce-scattered and averaged over the ranks, shaped like the shards each rank "
            "holds, and averaging them again would be wrong. Use mlx_fsdp.fsdp_step, or a "
            "plain element-wise mlx.optimizers optimizer, on a fully sharded model.")
    traced = accumulate.is_traced(state["micro_step"])
    tree = None
    if opts.world_size > 1:
        tree = consistency.describe_tree(
            len(flat_grads), sum(g.size for _, g in flat_grads),
            consistency.tree_fingerprint(signature_of(flat_grads, flat_params)))
    consistency.check_step(opts, optimizer, tree, state, tracing=traced, dog=dog)
    _check_covered(optimizer, flat_grads, parameters)
    k, finish = opts.grad_accumulation_steps, True
    if k > 1:
        sums, finish = accumulate.add(state, flat_grads, k, traced)
        if finish is False:
            return None, None
        gradients = like(gradients, [s / k for s in sums])
    if opts.group.size() > 1:
        gradients = nn.average_gradients(gradients, opts.group, opts.communication_size,
                                         opts.communication_stream)
    norm = None
    if opts.max_norm is not None:
        gradients, norm = clip.clip_tree(gradients, opts.max_norm)
        state["grad_norm"] = accumulate.select(finish, norm, state["grad_norm"])
    new = apply_optimizer(optimizer, gradients, parameters, state["master"], opts.master_dtype,
                          finish, fused)
    return accumulate.select(finish, new, like(gradients, flat_params)), norm


def _has_state(state, path: str) -> bool:
    node = state
    for key in path.split("."):
        if isinstance(node, dict) and key in node:
            node = node[key]
        elif isinstance(node, (list, tuple)) and key.isdigit() and int(key) < len(node):
            node = node[int(key)]
        else:
            return False
    return True


def _check_covered(optimizer, flat_grads, parameters):
    """Refuse gradients that an initialized (sub-)optimizer has no state for.

    Plain MLX takes any subtree of what its state was built for (frozen
    layers, a part of the model), and fails with a ``KeyError`` deep in
    ``tree_map`` on anything else, after counting the step. This names the
    array first, with the error ``fsdp_step`` gives for a changed plan.
    """
    subs = [s for s in sub_optimizers(optimizer) if getattr(s, "_initialized", False)]
    for path, _ in flat_grads if subs else ():
        if any(_has_state(s.state, path) for s in subs):
            continue
        with_state = [(p, a) for p, a in tree_flatten(parameters)
                      if isinstance(a, mx.array) and any(_has_state(s.state, p) for s in subs)]
        raise tree_changed(
            (len(with_state), sum(a.size for _, a in with_state)),
            (len(flat_grads), sum(x.size for _, x in flat_grads)),
            f": '{path}' has no optimizer state (a parameter the first steps did not train)",
            "create a new optimizer for the new tree, or initialize it with every parameter "
            "that training will use: opt.init(model.trainable_parameters()).")
