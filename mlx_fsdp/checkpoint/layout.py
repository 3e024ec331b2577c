"""Optimizer state <-> checkpoint arrays: cut on save, rebuilt and re-cut on load.

On disk the state of every parameter is described by a plan (see
:mod:`mlx_fsdp.plan`) over ``num_shards`` shards. A sharded optimizer saves
its own plan (``num_shards`` = its world size, one file per shard). A plain
layout (an unwrapped optimizer, ``ddp_step``, or any wrapper on one process)
is saved as a plan over one shard, whose pieces are the whole flattened
entries. Either way, loading rebuilds each entry whole and then cuts it for
the plan of the optimizer it goes into.
"""

from typing import Dict, List, Optional, Tuple

import mlx.core as mx
import mlx.optimizers as optim

from .. import _trees
from ..fsdp import ShardedOptimizer
from ..plan import Plan, Slot
from ..sharded import plan_for, sub_optimizers
from ..step import local_piece
from ..wrapper import DistributedOptimizer
from .manifest import CheckpointError, master_key, scalar_key, shard_file, state_key


def split_optimizer(opt) -> Tuple[optim.Optimizer, Optional[DistributedOptimizer]]:
    """``(the MLX optimizer, the mlx_fsdp wrapper around it or None)``."""
    if isinstance(opt, DistributedOptimizer):
        return opt.optimizer, opt
    if isinstance(opt, optim.Optimizer):
        return opt, None
    raise ValueError(
        f"opt={opt!r} is neither an mlx_fsdp wrapper (fsdp_step, ddp_step) nor an "
        "mlx.optimizers.Optimizer; pass the optimizer that trains the model."
    )


def is_sharded(wrapper: Optional[DistributedOptimizer]) -> bool:
    """Whether the wrapper keeps per-rank pieces (otherwise the state is plain MLX)."""
    if not isinstance(wrapper, ShardedOptimizer):
        return False
    dp = wrapper.dp_group.size() if wrapper.dp_group is not None else 1
    return wrapper.group.size() * dp > 1


def one_shard_plan(model, optimizer, communication_size: int = 0) -> Plan:
    """The plan of a plain (unsharded) state: every parameter on one shard."""
    trainable = model.trainable_parameters()
    flat, flat_params = _trees.match(trainable, trainable)
    return plan_for(flat, flat_params, optimizer, 1, communication_size)


def owner(slot) -> Optional[int]:
    # Owner placement (whole arrays on one rank) adds Slot.owner; older plans lack it.
    return getattr(slot, "owner", None)


def lookup(tree, path: str) -> Optional[dict]:
    """The sub-tree of a plain MLX state at a parameter path, or ``None``."""
    for part in path.split("."):
        if isinstance(tree, (list, tuple)):
            i = int(part)
            tree = tree[i] if i < len(tree) else None
        elif isinstance(tree, dict):
            tree = tree.get(part)
        else:
            return None
        if tree is None:
            return None
    return tree if isinstance(tree, dict) else None


def _stored(slot: Slot, array: mx.array, sharded: bool) -> mx.array:
    # A plain state is one shard: its parameter-shaped entries are stored as
    # that shard's flat piece, so every checkpoint rebuilds the same way.
    if not sharded and owner(slot) is None and tuple(array.shape) == tuple(slot.shape):
        return array.reshape(-1)
    return array


def arrays_to_save(plan: Plan, optimizer, wrapper, sharded: bool) -> Dict[str, mx.array]:
    """This rank's optimizer arrays, keyed as in :mod:`.manifest`."""
    subs = sub_optimizers(optimizer)
    out = {}
    for k, sub in enumerate(subs):
        for name, value in sub.state.items():
            if isinstance(value, mx.array):
                out[scalar_key(k, name)] = value
    master = wrapper.state.get("master") if wrapper is not None else None
    for bucket in plan.buckets:
        sub = subs[bucket.optimizer]
        for slot in bucket.slots:
            if sharded:
                entries = sub.state.get("shards", {}).get(slot.path)
            else:
                entries = lookup(sub.state, slot.path)
            for name, value in (entries or {}).items():
                out[state_key(bucket.optimizer, slot.path, name)] = _stored(slot, value, sharded)
            if master is not None and slot.path in master:
                out[master_key(slot.path)] = _stored(slot, master[slot.path], sharded)
    return out


def _entry(slot: Slot, info: dict, source: int) -> dict:
    flat = owner(slot) is None and info["shape"] == [slot.cols]
    entry = {
        "kind": "flat" if flat else "whole",
        "dtype": info["dtype"],
        "shape": list(slot.shape) if flat else info["shape"],
        "source": source,
    }
    if flat:
        entry["order"] = getattr(slot, "order", "C")
    return entry


def describe_state(plan: Plan, optimizer, headers: List[dict]) -> Tuple[list, dict]:
    """The manifest's per-sub-optimizer state description and its master section.

    Args:
        plan (Plan): The saved plan.
        optimizer: The MLX optimizer (for the top-level values, shown in JSON).
        headers (list[dict]): :func:`.manifest.read_header` of every shard file.
    """
    subs = sub_optimizers(optimizer)
    states = [{"scalars": {}, "parameters": {}} for _ in subs]
    master = {}
    for k, sub in enumerate(subs):
        for name, value in sub.state.items():
            if isinstance(value, mx.array):
                info = {"dtype": str(value.dtype).rsplit(".", 1)[-1]}
                if value.size == 1:
                    info["value"] = value.item()
                states[k]["scalars"][name] = info
    for bucket in plan.buckets:
        k = bucket.optimizer
        for slot in bucket.slots:
            source = owner(slot) if owner(slot) is not None else 0
            header = headers[source]
            prefix = state_key(k, slot.path, "")
            entries = {
                key[len(prefix):]: _entry(slot, info, source)
                for key, info in header.items()
                if key.startswith(prefix)
            }
            states[k]["parameters"][slot.path] = {
                "shape": list(slot.shape),
                "dtype": bucket.param_dtype,
                "size": slot.size,
                "cols": slot.cols,
                "owner": owner(slot),
                "entries": entries,
            }
            if master_key(slot.path) in header:
                master[slot.path] = _entry(slot, header[master_key(slot.path)], source)
    return states, master


def _rebuild(key: str, entry: dict, size: int, files: Dict[str, dict], num_shards: int):
    def get(rank):
        name = shard_file(rank, num_shards)
        if key not in files[name]:
            raise CheckpointError(f"{name} lacks '{key}', which the manifest lists; "
                                  "the checkpoint is inconsistent.")
        return files[name][key]

    if entry["kind"] == "whole":
        return get(entry["source"])
    pieces = [get(r) for r in range(num_shards)]
    flat = pieces[0] if num_shards == 1 else mx.concatenate(pieces)[:size]
    # Checkpoints written before the column order existed have no "order":
    # their pieces are row by row.
    if entry.get("order", "C") == "F":
        return mx.contiguous(flat.reshape(entry["shape"][::-1]).T)
    return flat.reshape(entry["shape"])


def rebuild(manifest: dict, files: Dict[str, dict]):
    """Whole arrays from the shard files.

    Returns:
        tuple: ``states`` (per sub-optimizer ``{path: {name: array}}``),
        ``scalars`` (per sub-optimizer ``{name: array}``) and ``master``
        (``{path: array}``).
    """
    num_shards = manifest["plan"]["world_size"]
    first = files[shard_file(0, num_shards)]
    # Tree order (as a plain optimizer orders its state), not bucket order.
    index = {s["path"]: s["index"] for b in manifest["plan"]["buckets"] for s in b["slots"]}
    states, scalars = [], []
    for k, desc in enumerate(manifest["optimizers"]):
        scalars.append({name: first[scalar_key(k, name)] for name in desc["scalars"]})
        states.append({
            path: {
                name: _rebuild(state_key(k, path, name), entry, p["size"], files, num_shards)
                for name, entry in p["entries"].items()
            }
            for path, p in sorted(desc["parameters"].items(), key=lambda i: index[i[0]])
        })
    sizes = {path: p["size"] for d in manifest["optimizers"] for path, p in d["parameters"].items()}
    master = {
        path: _rebuild(master_key(path), entry, sizes[path], files, num_shards)
        for path, entry in manifest.get("master", {}).items()
    }
    return states, scalars, master


def cut(slot: Slot, array: mx.array, rank: int, what: str) -> mx.array:
    """``rank``'s piece of a whole entry for a flat (non-owner) slot."""
    if tuple(array.shape) == tuple(slot.shape):
        return local_piece(slot, array, rank)
    if array.ndim == 0:
        return array
    raise CheckpointError(
        f"{what} of '{slot.path}' has shape {tuple(array.shape)}, not the parameter's "
        f"{tuple(slot.shape)}, so it cannot be split into flat shards; load it into an "
        "optimizer that keeps this parameter whole (owner placement, ddp_step or a "
        "plain optimizer)."
    )
