"""A model's weights in a checkpoint: plain paths, whole shapes and each rank's shards.

A checkpoint names every parameter by its plain path, the one it has in the
model without :func:`mlx_fsdp.fully_shard` (see
:mod:`mlx_fsdp.fully_sharded.full`), and describes it by its whole shape, so
that it loads into the same model wrapped in any way, at any world size, or
not wrapped at all (one process). Of each of its floating-point parameters a
fully sharded module holds an axis-0 slice, or the whole array on its owner
rank: saving writes exactly that, each rank into its own model shard file,
described as the optimizer entries are (:func:`.layout.entry`), and loading
cuts the whole arrays again for the modules of the model it loads into
(:func:`.layout.cut`). The other parameters are whole on every rank and go
into rank 0's model file.
"""

from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import mlx.core as mx
from mlx.utils import tree_flatten

from .. import layout as _layout
from ..fully_sharded.full import plain_paths
from ..fully_sharded.model import sharded_modules
from ..plan import Bucket, Slot, dtype_name
from .layout import cut, entry, holders, stored_piece


@dataclass(frozen=True)
class Held:
    """A parameter that a fully sharded module holds in part.

    Attributes:
        bucket (Bucket): Its bucket in the module's plan.
        slot (Slot): Its slot there (with the whole shape).
        rank (int): This rank in the module's group.
        world_size (int): The size of the module's group.
    """

    bucket: Bucket
    slot: Slot
    rank: int
    world_size: int


def held_parameters(model) -> Dict[str, Held]:
    """``{path in model: Held}`` of the parameters that fully sharded modules hold in part."""
    out = {}
    for prefix, m in sharded_modules(model):
        for b in m.plan.buckets:
            for s in b.slots:
                out[f"{prefix}module.{s.path}"] = Held(b, s, m.group.rank(), m.group.size())
    return out


def describe_parameters(model) -> Dict[str, dict]:
    """``{plain path: {"shape": whole shape, "dtype": name}}`` of every parameter of ``model``."""
    names, held = plain_paths(model), held_parameters(model)
    return {names[p]: {"shape": list(held[p].slot.shape if p in held else a.shape),
                       "dtype": dtype_name(a.dtype)}
            for p, a in tree_flatten(model.parameters())}


def weights_to_save(model, stored: Dict[str, mx.array]) -> Tuple[dict, dict, dict]:
    """The weights to store, split into rank 0's model file and this rank's model shard.

    Args:
        model (mlx.nn.Module): The model.
        stored (dict): ``{path in model: array}`` of the parameters to store.

    Returns:
        tuple: ``{plain path: array}`` of the parameters every rank holds
        whole (rank 0's model file); ``{plain path: array}`` of what this
        rank holds of the others (its model shard file); and the manifest's
        ``model.shards``, ``{plain path: entry}`` (empty if the model is not
        fully sharded).
    """
    names, held = plain_paths(model), held_parameters(model)
    whole, pieces, shards = {}, {}, {}
    for p, a in stored.items():
        h = held.get(p)
        if h is None:
            whole[names[p]] = a
            continue
        ranks = None if h.bucket.owned else holders(h.world_size, h.bucket, h.slot)
        shards[names[p]] = entry(h.slot, ranks, dtype_name(a.dtype), h.slot.shape)
        if _layout.held_range(h.bucket, h.slot, h.rank) is not None:
            pieces[names[p]] = stored_piece(h.bucket, a)
    return whole, pieces, shards


def held_weights(model, weights: Dict[str, mx.array], paths: List[str]) -> List[tuple]:
    """``(path in model, array)`` for the plain ``paths``: what this rank's ``model``
    holds of each, cut from the whole ``weights``."""
    own = {q: p for p, q in plain_paths(model).items()}
    held = held_parameters(model)
    out = []
    for q in paths:
        p, a = own[q], weights[q]
        h = held.get(p)
        if h is not None:
            part = cut(h.bucket, h.slot, a, h.rank)
            a = part if part is not None else mx.zeros(
                _layout.held_shape(h.bucket, h.slot, h.rank), a.dtype)
        out.append((p, a))
    return out


def fully_sharded_problem(model, group_size: Optional[int]) -> str:
    """Why a checkpoint of ``model`` cannot be saved or loaded ("" if it can).

    Args:
        model (mlx.nn.Module): The model.
        group_size (int, optional): The shard group of the ``fsdp_step``
            wrapper, ``None`` for any other optimizer.
    """
    modules = sharded_modules(model)
    if modules and group_size is None:
        return ("The model is fully sharded (mlx_fsdp.fully_shard): each rank holds part of "
                "its parameters and of their optimizer state, which only fsdp_step keeps. "
                "Pass the mlx_fsdp.fsdp_step wrapper that trains the model as opt.")
    for prefix, m in modules:
        if m.group.size() != group_size:
            return (f"The fully sharded module at '{prefix or '(root)'}' is sharded over "
                    f"{m.group.size()} ranks, but the optimizer's group has {group_size}; a "
                    "checkpoint keeps one shard per rank of that group. Pass the same group "
                    "to fully_shard and fsdp_step.")
    return ""
