"""The first half of a load: check everything and build every new array, changing nothing.

:func:`stage` reads and checks a checkpoint against the model and the
optimizer it goes into and returns the new weights, optimizer states and
master weights, evaluated, so that the only thing left to do after the ranks
agree is to assign them (which cannot fail half-way).
"""

from dataclasses import dataclass
from typing import Dict, List, Optional

import mlx.core as mx
from mlx.utils import tree_flatten, tree_unflatten

from ..fully_sharded.full import plain_paths
from ..placement import assign_optimizers
from ..plan import Plan, Slot
from .layout import shard_state
from .manifest import CheckpointError, class_names, describe_optimizer
from .reader import read_checkpoint
from .contents import stored_weights
from .weights import describe_parameters, fully_sharded_problem, held_weights


@dataclass
class Staged:
    """Everything a load assigns, built and evaluated.

    Attributes:
        manifest (dict): The checked manifest.
        weights (list): ``(path, array)`` of the model parameters to replace.
        all_weights (bool): Whether ``weights`` holds every parameter.
        states (list[dict]): The new state of each (sub-)optimizer.
        master (dict, optional): The wrapper's new master weights, or
            ``None`` if it keeps none.
        ignored_master (bool): The checkpoint has masters that ``opt`` does
            not keep.
    """

    manifest: dict
    weights: List[tuple]
    all_weights: bool
    states: List[dict]
    master: Optional[Dict[str, mx.array]]
    ignored_master: bool


def describe_target(plan: Optional[Plan]) -> str:
    """How the loaded state will be laid out; every rank must agree on it."""
    if plan is None:
        return "plain (whole state on every rank)"
    return (f"{plan.world_size} shards, {len(plan.buckets)} buckets (communication_size="
            f"{plan.communication_size}), plan {plan.fingerprint[:10]}")


def _differences(saved: dict, current: dict, limit: int = 5) -> list:
    out = []
    only_saved = [k for k in saved if k not in current]
    only_here = [k for k in current if k not in saved]
    differ = [
        f"{k}: {tuple(saved[k]['shape'])} {saved[k]['dtype']} saved, "
        f"{tuple(current[k]['shape'])} {current[k]['dtype']} here"
        for k in saved
        if k in current and (list(saved[k]["shape"]), saved[k]["dtype"])
        != (list(current[k]["shape"]), current[k]["dtype"])
    ]
    for label, items in (("only in the checkpoint", only_saved), ("only in this model", only_here),
                         ("shape or dtype differ", differ)):
        if items:
            more = f" and {len(items) - limit} more" if len(items) > limit else ""
            out.append(f"{label}: {', '.join(items[:limit])}{more}")
    return out


def _check_model(path: str, manifest: dict, model):
    problems = _differences(manifest["model"]["parameters"], describe_parameters(model))
    if problems:
        raise CheckpointError(
            f"The checkpoint {path} was saved from a different model ("
            + "; ".join(problems)
            + "). Build the same model (same layers, shapes and dtypes) before loading."
        )


def _trained(model, optimizer, plan: Optional[Plan]) -> List[tuple]:
    """``(plain path, sub-optimizer)`` of every array that ``optimizer`` trains."""
    if plan is not None:  # the sharded step's own assignment (it sees whole shapes)
        names = plain_paths(model)
        return [(names[s.path], b.optimizer) for b in plan.buckets for s in b.slots]
    trainable = tree_flatten(model.trainable_parameters())
    return [(p, o) for (p, _), o in zip(trainable, assign_optimizers(trainable, optimizer))]


def _check_optimizer(path: str, manifest: dict, optimizer, model, plan: Optional[Plan]):
    saved, here = class_names(manifest["optimizer"]), class_names(describe_optimizer(optimizer))
    if saved != here:
        raise CheckpointError(
            f"The checkpoint {path} holds the state of {' / '.join(saved)}, but the "
            f"optimizer given is {' / '.join(here)}; their states do not convert. Create "
            f"the same optimizer class as when saving (the hyper-parameters may differ)."
        )
    trained = _trained(model, optimizer, plan)
    for k, desc in enumerate(manifest["optimizers"]):
        have = {p for p, o in trained if o == k}
        want = set(desc["parameters"])
        if have != want:
            raise CheckpointError(
                f"The checkpoint {path} has optimizer state (sub-optimizer {k}) for "
                f"other parameters than this model trains: only in the checkpoint "
                f"{sorted(want - have)[:5]}, only here {sorted(have - want)[:5]}. Freeze "
                "the same parameters (and use the same MultiOptimizer filters) as when saving."
            )


def _check_whole(slot: Slot, name: str, array: mx.array):
    # An owner keeps the plain optimizer's state of the whole array: shaped
    # like it, or like it with dimensions dropped (Adafactor's row and column
    # statistics), as the step requires.
    dims = iter(slot.shape)
    if array.ndim and not all(any(d == e for e in dims) for d in array.shape):
        raise CheckpointError(
            f"{name} of '{slot.path}' has shape {tuple(array.shape)}, which does not fit the "
            f"parameter's {tuple(slot.shape)}; the optimizer that saved it keeps another "
            "state than this one."
        )


def _sharded_states(plan: Plan, rank: int, states, scalars, master, names):
    """What this rank holds under ``plan``: new sub-optimizer states and masters."""
    trees, pieces = shard_state(plan, rank, states, master, names)
    for b in plan.buckets:
        if b.owned:
            for s in b.held(rank):
                for n, a in trees[b.optimizer].get(s.path, {}).items():
                    _check_whole(s, f"The entry '{n}'", a)
                if s.path in pieces:
                    _check_whole(s, "The master copy", pieces[s.path])
    return [{**scalars[k], **tree} for k, tree in enumerate(trees)], pieces


def _plain_states(states, scalars):
    new = []
    for k in range(len(scalars)):
        items = [(f"{p}.{n}", a) for p, entries in states[k].items() for n, a in entries.items()]
        state = dict(scalars[k])  # first, where MLX keeps them
        state.update(tree_unflatten(items) if items else {})
        new.append(state)
    return new


def stage(path: str, model, optimizer, wrapper, plan: Optional[Plan], rank: int) -> Staged:
    """Check the checkpoint at ``path`` against ``model`` and ``optimizer``; build what loads.

    Changes nothing: neither the model, nor the optimizer, nor the wrapper.

    Args:
        path (str): The checkpoint directory.
        model (mlx.nn.Module): The model the weights go into.
        optimizer (mlx.optimizers.Optimizer): The MLX optimizer the state goes into.
        wrapper: The mlx_fsdp wrapper around it, or ``None``.
        plan (Plan, optional): The sharded layout of the state ``wrapper``
            keeps, or ``None`` for the plain layout.
        rank (int): This rank's shard in ``plan``.

    Raises:
        CheckpointError: Naming what does not fit.
        ValueError: Between micro-batches of gradient accumulation, or for a
            fully sharded model without its ``fsdp_step`` wrapper.
    """
    micro = getattr(wrapper, "micro_step", 0)
    if micro:
        raise ValueError(
            f"load_checkpoint was called after {micro} of {wrapper.grad_accumulation_steps} "
            "micro-batches (opt.micro_step != 0); their accumulated gradients would be added "
            "to the loaded state. Load before training, or right after an optimizer step."
        )
    problem = fully_sharded_problem(model, None if plan is None else plan.world_size)
    if problem:
        raise ValueError(problem)
    manifest, weights, states, scalars, master = read_checkpoint(path)
    _check_model(path, manifest, model)
    _check_optimizer(path, manifest, optimizer, model, plan)
    if plan is None:
        new = _plain_states(states, scalars)
    else:
        new, master = _sharded_states(plan, rank, states, scalars, master, plain_paths(model))
    master_dtype = getattr(wrapper, "master_dtype", None)
    kept = None
    if master_dtype is not None:
        kept = {p: a.astype(master_dtype) for p, a in master.items()}
    stored = stored_weights(manifest)
    out = Staged(
        manifest=manifest,
        weights=held_weights(model, weights, stored),
        all_weights=len(stored) == len(manifest["model"]["parameters"]),
        states=new,
        master=kept,
        ignored_master=bool(master) and kept is None,
    )
    # Evaluated one at a time, with no reference left to the whole arrays, each
    # whole array is freed once what this rank holds of it is cut out: a load
    # needs little memory beyond the new state (a fully sharded model is never
    # whole on a rank).
    del weights, states, master
    for _, a in tree_flatten((out.weights, out.states, out.master)):
        if isinstance(a, mx.array):
            mx.eval(a)
    return out


def replace_state(optimizer, new: dict):
    """Give ``optimizer`` the state ``new``, in place.

    In place, so that ``mx.compile`` captures of the state dict stay valid;
    the setter marks the optimizer uninitialized, so entries not in the
    checkpoint (a never-updated parameter) are created on the next step.
    """
    state = optimizer.state
    state.clear()
    state.update(new)
    optimizer.state = state
