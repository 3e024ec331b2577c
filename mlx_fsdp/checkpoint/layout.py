"""Optimizer state <-> checkpoint arrays: stored as held, rebuilt whole, cut again.

A sharded optimizer saves what each rank holds (see :mod:`mlx_fsdp.plan`):
its shard of every entry of each flat bucket, and the whole state of each
array it owns. A plain state (an unwrapped optimizer, ``ddp_step``, or any
wrapper on one process) is saved whole, as one shard. Loading rebuilds the
state of every parameter whole from the manifest's description, whatever
layout wrote it, and then cuts it for the optimizer it goes into: the same
bucket layout at another world size or budget, or the plain layout.

Arrays are named by plain paths (``names``: ``{path in the model: plain
path}``, see :mod:`.weights`), and a held axis-0 slice is stored flattened: a
row block of a C-ordered array is a run of its elements, so the holders'
pieces, concatenated in rank order, are the array (an entry of kind
``"pieces"``).
"""

import math
from typing import Callable, Dict, List, Optional, Tuple

import mlx.core as mx
import mlx.optimizers as optim

from .. import layout as _layout
from .._trees import match
from ..fsdp import ShardedOptimizer
from ..placement import plan_for, sub_optimizers
from ..plan import Bucket, Plan, Slot, dtype_name
from ..wrapper import DistributedOptimizer
from .manifest import (CheckpointError, master_key, model_shard_file, scalar_key, shard_file,
                       state_key)


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
    """Whether the wrapper keeps per-rank shards (otherwise the state is plain MLX)."""
    return isinstance(wrapper, ShardedOptimizer) and wrapper.options.world_size > 1


def one_shard_plan(model, optimizer, communication_size: int = 0) -> Plan:
    """The plan of a plain (unsharded) state: every parameter on one shard."""
    flat, params = match(model.trainable_parameters(), model.trainable_parameters())
    return plan_for(flat, params, optimizer, 1, communication_size)


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


def stored_piece(bucket: Bucket, held: mx.array) -> mx.array:
    """What a rank holds, as stored: a whole owned array, else 1-D (a row block flattened)."""
    return held if bucket.owned else held.reshape(-1)


def arrays_to_save(plan: Plan, optimizer, wrapper, sharded: bool,
                   names: Dict[str, str]) -> Dict[str, mx.array]:
    """This rank's optimizer arrays, keyed as in :mod:`.manifest` (by plain path)."""
    subs = sub_optimizers(optimizer)
    masters = wrapper.state["master"] if wrapper is not None else {}
    out = {}
    for k, sub in enumerate(subs):
        out.update((scalar_key(k, n), v) for n, v in sub.state.items() if isinstance(v, mx.array))
    for b in plan.buckets:
        for s in b.slots:
            path = names.get(s.path, s.path)

            def piece(a):  # a plain state is whole, shaped like the parameter
                return stored_piece(b, a) if sharded else a

            entries = sub_state(subs[b.optimizer], s.path, sharded)
            out.update((state_key(b.optimizer, path, n), piece(v))
                       for n, v in (entries or {}).items())
            if s.path in masters:
                out[master_key(path)] = piece(masters[s.path])
    return out


def sub_state(sub, path: str, sharded: bool) -> Optional[dict]:
    """The state of one parameter: by path under ``fsdp_step``, nested in a plain state."""
    return sub.state.get(path) if sharded else lookup(sub.state, path)


def holders(world_size: int, b: Bucket, s: Slot) -> List[int]:
    """The ranks that hold any of the array of slot ``s``."""
    return [r for r in range(world_size) if _layout.held_range(b, s, r) is not None]


def entry(s: Slot, ranks: Optional[List[int]], dtype: str, shape) -> dict:
    """The manifest's description of a stored array: the ``ranks`` holders' pieces, or
    (``ranks=None``) whole with its own ``shape`` in the owner's file (file 0 unsharded)."""
    if ranks is None:
        return {"kind": "whole", "dtype": dtype, "shape": list(shape), "source": s.owner or 0}
    return {"kind": "pieces", "dtype": dtype, "shape": list(s.shape), "ranks": ranks,
            "order": s.order}


def plain_plan(plan: Plan, names: Dict[str, str]) -> dict:
    """``plan.to_dict()`` with the slots' plain paths."""
    out = plan.to_dict()
    for b in out["buckets"]:
        for s in b["slots"]:
            s["path"] = names.get(s["path"], s["path"])
    return out


def describe_state(plan: Plan, optimizer, headers: List[dict], sharded: bool,
                   names: Dict[str, str]) -> Tuple[list, dict]:
    """The manifest's per-sub-optimizer state description and its master section.

    Args:
        plan (Plan): The saved plan.
        optimizer: The MLX optimizer (for the top-level values, shown in JSON).
        headers (list[dict]): :func:`.manifest.read_header` of every shard file.
        sharded (bool): Whether the state was saved as each rank's pieces.
        names (dict): ``{path in the model: plain path}``.
    """
    subs = sub_optimizers(optimizer)
    states = [{"scalars": {}, "parameters": {}} for _ in subs]
    master = {}
    for k, sub in enumerate(subs):
        for name, value in sub.state.items():
            if isinstance(value, mx.array):
                info = {"dtype": dtype_name(value.dtype)}
                if value.size == 1:
                    info["value"] = value.item()
                states[k]["scalars"][name] = info
    for b in plan.buckets:
        k = b.optimizer
        for s in b.slots:
            path = names.get(s.path, s.path)
            ranks = holders(plan.world_size, b, s) if sharded and not b.owned else None
            source = ranks[0] if ranks else (s.owner or 0)

            def entry_of(info):
                return entry(s, ranks, info["dtype"], info["shape"])

            prefix = state_key(k, path, "")
            states[k]["parameters"][path] = {
                "shape": list(s.shape), "dtype": b.param_dtype, "size": s.size,
                "owner": s.owner,
                "entries": {key[len(prefix):]: entry_of(info)
                            for key, info in headers[source].items() if key.startswith(prefix)},
            }
            if master_key(path) in headers[source]:
                master[path] = entry_of(headers[source][master_key(path)])
    return states, master


def _rebuild(key: str, entry: dict, size: int, files: Dict[str, dict], num_shards: int,
             name: Callable[[int, int], str] = shard_file):
    def get(rank):
        file = name(rank, num_shards)
        if key not in files[file]:
            raise CheckpointError(f"{file} lacks '{key}', which the manifest lists; "
                                  "the checkpoint is inconsistent.")
        return files[file][key]

    if entry["kind"] == "whole":
        return get(entry["source"])
    if entry["kind"] == "pieces":  # format 3: each holder's piece, in rank order
        flat = mx.concatenate([get(r) for r in entry["ranks"]])
    else:  # formats 1 and 2: each array split over every rank, zero-padded
        flat = mx.concatenate([get(r) for r in range(num_shards)])[:size]
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
            path: {name: _rebuild(state_key(k, path, name), e, p["size"], files, num_shards)
                   for name, e in p["entries"].items()}
            for path, p in sorted(desc["parameters"].items(), key=lambda i: index[i[0]])
        })
    sizes = {path: p["size"] for d in manifest["optimizers"] for path, p in d["parameters"].items()}
    master = {path: _rebuild(master_key(path), e, sizes[path], files, num_shards)
              for path, e in manifest.get("master", {}).items()}
    return states, scalars, master


def rebuild_weights(manifest: dict, files: Dict[str, dict]) -> Dict[str, mx.array]:
    """Every stored model weight, whole, by plain path (the model file and the model shards)."""
    num_shards = manifest["plan"]["world_size"]
    weights = dict(files[manifest["model"]["file"]])
    for path, e in manifest["model"].get("shards", {}).items():
        weights[path] = _rebuild(path, e, math.prod(e["shape"]), files, num_shards,
                                 model_shard_file)
    return weights


def cut(b: Bucket, s: Slot, array: mx.array, rank: int) -> Optional[mx.array]:
    """What ``rank`` holds of ``array`` (whole, shaped as ``s``) under ``b``, or ``None``.

    A slice is copied out, so that the whole array is freed once cut.
    """
    r = _layout.held_range(b, s, rank)
    if r is None:
        return None
    if b.owned:
        return array
    piece = _layout.flatten(s, array)[r[0]:r[1]]
    if b.by_rows:
        piece = piece.reshape(_layout.held_shape(b, s, rank))
    return piece * 1  # a buffer of its own (exact, -0.0 included)


def shard_state(plan: Plan, rank: int, states: list, master: dict, names: Dict[str, str]):
    """What ``rank`` holds under ``plan``, cut from whole per-parameter state.

    Args:
        plan (Plan): The plan of the optimizer being loaded into.
        rank (int): This rank in its shard group.
        states (list): Per sub-optimizer ``{plain path: {name: whole array}}``.
        master (dict): ``{plain path: whole master}``.
        names (dict): ``{path in the model: plain path}``.

    Returns:
        tuple: Per sub-optimizer ``{path: {name: held array}}``, and the
        masters ``{path: held master}``, by the paths of ``plan``.

    Raises:
        CheckpointError: If an entry of an array placed flat is not shaped
            like the array (e.g. Adafactor's factored statistics), so it
            cannot be cut into pieces.
    """
    trees = [{} for _ in states]
    masters = {}
    for b in plan.buckets:
        saved = states[b.optimizer]
        for s in b.held(rank):
            path = names.get(s.path, s.path)

            def held(array, what):
                if not b.owned and tuple(array.shape) != tuple(s.shape):
                    raise CheckpointError(
                        f"{what} of '{path}' has shape {tuple(array.shape)}, not the "
                        f"parameter's {tuple(s.shape)}, so it cannot be cut into flat pieces; "
                        "load it into an optimizer that keeps this parameter whole (owner "
                        "placement, ddp_step or a plain optimizer)."
                    )
                return cut(b, s, array, rank)

            if path in saved:
                trees[b.optimizer][s.path] = {n: held(a, f"The entry '{n}'")
                                              for n, a in saved[path].items()}
            if path in master:
                masters[s.path] = held(master[path], "The master copy")
    return trees, masters
