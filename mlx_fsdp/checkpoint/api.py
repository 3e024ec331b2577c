"""``save_checkpoint`` and ``load_checkpoint``."""

import dataclasses
import os
import time
import warnings
from typing import Optional

import mlx.core as mx
from mlx.utils import tree_flatten, tree_unflatten

from ..plan import dtype_name
from ..options import group_or_global
from ..placement import assign_optimizers, sub_optimizers
from . import atomic
from .layout import (
    arrays_to_save,
    describe_state,
    is_sharded,
    one_shard_plan,
    rebuild,
    shard_state,
    split_optimizer,
)
from .manifest import (
    FORMAT,
    FORMAT_VERSION,
    LAYOUT_NOTE,
    MANIFEST,
    MODEL_FILE,
    CheckpointError,
    class_names,
    describe_optimizer,
    read_header,
    read_manifest,
    sha256_file,
    shard_file,
    verify_files,
    write_json,
)


def _write(file: str, arrays: dict):
    mx.save_safetensors(file, arrays)
    with open(file, "rb+") as f:
        os.fsync(f.fileno())


def _check_status(status, error, target: str, what: str):
    failed = [r for r, (ok, _, _) in enumerate(status) if not ok]
    if failed:
        raise RuntimeError(
            f"Saving the checkpoint {target} failed while {what} on rank(s) {failed}"
            + (f" (here: {type(error).__name__}: {error})" if error is not None else "")
            + "; the previous checkpoint there, if any, is untouched."
        ) from error


def _wrapper_info(wrapper) -> Optional[dict]:
    if wrapper is None:
        return None
    info = {"class": type(wrapper).__name__}
    for name in ("communication_size", "max_norm", "master_dtype"):
        value = getattr(wrapper, name, None)
        info[name] = dtype_name(value) if isinstance(value, mx.Dtype) else value
    return info


def _manifest(model, optimizer, wrapper, plan, sharded, world, tmp, files, metadata) -> dict:
    from .. import __version__

    headers = [read_header(os.path.join(tmp, shard_file(r, plan.world_size)))
               for r in range(plan.world_size)]
    states, master = describe_state(plan, optimizer, headers, sharded)
    return {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "mlx_fsdp_version": __version__,
        "mlx_version": mx.__version__,
        "created_unix": int(time.time()),
        "world_size": world.size(),
        "step": int(sub_optimizers(optimizer)[0].state["step"].item()),
        "layout": {"kind": "sharded" if sharded else "plain", "num_shards": plan.world_size,
                   "how_to_read": LAYOUT_NOTE},
        "wrapper": _wrapper_info(wrapper),
        "optimizer": describe_optimizer(optimizer),
        "optimizers": states,
        "master": master,
        "plan": dataclasses.asdict(plan),
        "model": {
            "file": MODEL_FILE,
            "parameters": {
                k: {"shape": list(v.shape), "dtype": dtype_name(v.dtype)}
                for k, v in tree_flatten(model.parameters())
            },
        },
        "files": files,
        "user": metadata,
    }


def save_checkpoint(path: str, model, opt, *, metadata: Optional[dict] = None):
    """Save the model and the (sharded) optimizer state into the directory ``path``.

    Every rank must call it (it synchronizes the ranks three times with tiny
    all-gathers). Each shard of the optimizer state is written by its own
    rank, the model by rank 0, and the directory appears at ``path`` only when
    complete: ranks write into ``.NAME.partial`` next to it, and rank 0 swaps
    it in once every rank has succeeded. An existing checkpoint at ``path``
    is kept until then. With several hosts, ``path`` must be on a filesystem
    that every rank sees.

    Args:
        path (str): The checkpoint directory.
        model (mlx.nn.Module): The model (the same on every rank).
        opt: The optimizer: an :func:`~mlx_fsdp.fsdp_step` or
            :func:`~mlx_fsdp.ddp_step` wrapper, or a plain MLX optimizer.
        metadata (dict, optional): JSON-able data stored in the manifest under
            ``"user"`` (e.g. the data loader's position). Default: ``None``.

    Raises:
        ValueError: If ``path`` exists and is not a checkpoint.
        RuntimeError: On every rank, if writing failed on any rank.
    """
    optimizer, wrapper = split_optimizer(opt)
    world = group_or_global(None)
    rank = world.rank()
    sharded = is_sharded(wrapper)
    if sharded:
        if wrapper.plan is None:
            wrapper.init(model.trainable_parameters())
        plan, shard = wrapper.plan, wrapper.group.rank()
        writer = wrapper.dp_group is None or wrapper.dp_group.rank() == 0
    else:
        plan = one_shard_plan(model, optimizer)
        shard, writer = 0, rank == 0
    arrays = arrays_to_save(plan, optimizer, wrapper, sharded) if writer else {}
    target, tmp, _ = atomic.side_paths(path)
    atomic.check_target(target)

    error = None
    try:
        if rank == 0:
            atomic.prepare(target)
    except Exception as e:  # reported on every rank below
        error = e
    _check_status(atomic.gather_status(world, error is None), error, target, "preparing")

    digest = ""
    try:
        if writer:
            file = os.path.join(tmp, shard_file(shard, plan.world_size))
            _write(file, arrays)
            digest = sha256_file(file)
        if rank == 0:
            _write(os.path.join(tmp, MODEL_FILE), dict(tree_flatten(model.parameters())))
    except Exception as e:
        error = e
    status = atomic.gather_status(world, error is None, shard if writer else -1, digest)
    if rank == 0 and not all(ok for ok, _, _ in status):
        atomic.abandon(target)
    _check_status(status, error, target, "writing")

    try:
        if rank == 0:
            digests = {}
            for ok, s, d in status:
                if s >= 0:
                    digests[shard_file(s, plan.world_size)] = d
            digests[MODEL_FILE] = sha256_file(os.path.join(tmp, MODEL_FILE))
            digests = {
                name: {"sha256": d, "bytes": os.path.getsize(os.path.join(tmp, name))}
                for name, d in sorted(digests.items())
            }
            manifest = _manifest(model, optimizer, wrapper, plan, sharded, world, tmp,
                                 digests, metadata)
            write_json(os.path.join(tmp, MANIFEST), manifest)
            atomic.commit(target)
    except Exception as e:
        error = e
        if rank == 0:
            atomic.abandon(target)
    _check_status(atomic.gather_status(world, error is None), error, target, "committing")


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
    current = {k: {"shape": list(v.shape), "dtype": dtype_name(v.dtype)}
               for k, v in tree_flatten(model.parameters())}
    problems = _differences(manifest["model"]["parameters"], current)
    if problems:
        raise CheckpointError(
            f"The checkpoint {path} was saved from a different model ("
            + "; ".join(problems)
            + "). Build the same model (same layers, shapes and dtypes) before loading."
        )


def _check_optimizer(path: str, manifest: dict, optimizer, model):
    saved, here = class_names(manifest["optimizer"]), class_names(describe_optimizer(optimizer))
    if saved != here:
        raise CheckpointError(
            f"The checkpoint {path} holds the state of {' / '.join(saved)}, but the "
            f"optimizer given is {' / '.join(here)}; their states do not convert. Create "
            f"the same optimizer class as when saving (the hyper-parameters may differ)."
        )
    trainable = tree_flatten(model.trainable_parameters())
    assigned = assign_optimizers(trainable, optimizer)
    for k, desc in enumerate(manifest["optimizers"]):
        have = {p for (p, _), o in zip(trainable, assigned) if o == k}
        want = set(desc["parameters"])
        if have != want:
            raise CheckpointError(
                f"The checkpoint {path} has optimizer state (sub-optimizer {k}) for "
                f"other parameters than this model trains: only in the checkpoint "
                f"{sorted(want - have)[:5]}, only here {sorted(have - want)[:5]}. Freeze "
                "the same parameters (and use the same MultiOptimizer filters) as when saving."
            )


def _replace_state(optimizer, new: dict):
    # In place, so that mx.compile captures of the state dict stay valid; the
    # setter marks the optimizer uninitialized, so entries not in the checkpoint
    # (a never-updated parameter) are created on the next step.
    state = optimizer.state
    state.clear()
    state.update(new)
    optimizer.state = state


def _reset_wrapper(wrapper):
    # The setter forgets the plan, so the next step re-checks the state against it.
    wrapper.state = {k: v for k, v in wrapper.state.items() if k not in ("master", "grad_norm")}


def _load_plain(optimizer, states, scalars):
    for k, sub in enumerate(sub_optimizers(optimizer)):
        items = [(f"{p}.{n}", a) for p, entries in states[k].items() for n, a in entries.items()]
        new = dict(scalars[k])  # first, where MLX keeps them
        new.update(tree_unflatten(items) if items else {})
        _replace_state(sub, new)


def _load_sharded(wrapper, optimizer, model, states, scalars, master):
    subs = sub_optimizers(optimizer)
    for k, sub in enumerate(subs):
        _replace_state(sub, dict(scalars[k]))
    _reset_wrapper(wrapper)
    wrapper.init(model.trainable_parameters())
    trees, masters = shard_state(wrapper.plan, wrapper.group.rank(), states, master)
    for sub, tree in zip(subs, trees):
        sub.state.update(tree)
    return masters


def load_checkpoint(path: str, model, opt) -> dict:
    """Load a checkpoint saved by :func:`save_checkpoint`, at any world size.

    The manifest and the sha256 of every file are checked, and the model and
    optimizer compared with the saved ones, before anything is modified. The
    optimizer state of every parameter is rebuilt whole from the shards and
    cut again for ``opt``: an :func:`~mlx_fsdp.fsdp_step` wrapper at any world
    size and any ``communication_size``, a :func:`~mlx_fsdp.ddp_step` wrapper,
    or a plain MLX optimizer (its usual state layout). The step count and the
    learning rate are part of the state and carry over, so a schedule
    continues where it was; the other hyper-parameters are those of ``opt``.
    Every rank must call it (a sharded ``opt`` checks its plan across ranks).

    Args:
        path (str): The checkpoint directory.
        model (mlx.nn.Module): A model with the same parameter paths, shapes
            and dtypes; its weights are replaced.
        opt: The optimizer, of the same class as the saved one; its state is
            replaced.

    Returns:
        dict: The manifest (``manifest["user"]`` holds ``metadata`` given to
        :func:`save_checkpoint`).

    Raises:
        CheckpointError: naming what is wrong: a missing, truncated or altered
            file, a different model, a different optimizer class.
    """
    path = os.path.abspath(path)
    manifest = read_manifest(path)
    verify_files(path, manifest)
    optimizer, wrapper = split_optimizer(opt)
    _check_model(path, manifest, model)
    _check_optimizer(path, manifest, optimizer, model)

    files = {name: mx.load(os.path.join(path, name)) for name in manifest["files"]}
    states, scalars, master = rebuild(manifest, files)
    weights = files[MODEL_FILE]
    mx.eval(states, scalars, master, weights)

    model.load_weights(list(weights.items()), strict=True)
    keeps_master = getattr(wrapper, "master_dtype", None) is not None
    if is_sharded(wrapper):
        master = _load_sharded(wrapper, optimizer, model, states, scalars, master)
    else:
        _load_plain(optimizer, states, scalars)
        if wrapper is not None:
            _reset_wrapper(wrapper)
    if master and keeps_master:
        wrapper.state["master"] = master
    elif master:
        warnings.warn(
            f"The checkpoint {path} holds fp32 master weights, but this optimizer keeps "
            "none; they are ignored and training continues from the model weights "
            "(the masters rounded to the parameters' dtype).",
            stacklevel=2,
        )
    return manifest
