"""``save_checkpoint``: every rank writes what it holds; the whole appears at once.

What it holds is its shard of the optimizer state and, of a fully sharded
model (:func:`mlx_fsdp.fully_shard`), its shard of the parameters; rank 0
also writes the parameters that every rank holds whole (:mod:`.weights`).

It starts with one cross-rank agreement (:func:`.internals.agree`): every rank
must call it at the same point, with the same path, and a rank that calls it
alone, or with another path, gets an error instead of a hang. The ranks then
write into a temporary directory and report their status to each other after
each stage (:mod:`.atomic`); rank 0 adds the manifest and swaps the directory
in only once every rank has succeeded.
"""

import json
import os
import time
from typing import Optional

import mlx.core as mx
from mlx.utils import tree_flatten

from ..fully_sharded.full import plain_paths
from ..options import group_or_global
from ..placement import sub_optimizers
from ..plan import dtype_name
from . import atomic
from .internals import agree, io_allowance, save_layout, watched
from .layout import arrays_to_save, describe_state, is_sharded, plain_plan, split_optimizer
from .manifest import (
    FORMAT,
    FORMAT_VERSION,
    LAYOUT_NOTE,
    MANIFEST,
    MODEL_FILE,
    VERSION_WITHOUT_MODEL_SHARDS,
    class_names,
    describe_optimizer,
    model_shard_file,
    read_header,
    sha256_file,
    shard_file,
    write_json,
)
from .schema import WEIGHTS
from .weights import describe_parameters, fully_sharded_problem, weights_to_save


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


def _step(optimizer) -> int:
    return int(sub_optimizers(optimizer)[0].state["step"].item())


def _save_problem(model, wrapper, metadata, weights, target: str) -> str:
    """Why this save cannot be done ("" if it can); every rank compares it before any raises."""
    problem = fully_sharded_problem(model, wrapper.group.size() if is_sharded(wrapper) else None)
    if problem:
        return problem
    if weights not in WEIGHTS:
        return (f"weights={weights!r} must be 'all' (every parameter of the model) or "
                "'trainable' (only model.trainable_parameters(), e.g. LoRA adapters over a "
                "frozen base model).")
    micro = getattr(wrapper, "micro_step", 0)
    if micro:
        return (f"save_checkpoint was called after {micro} of {wrapper.grad_accumulation_steps} "
                "micro-batches (opt.micro_step != 0): the gradients accumulated since the last "
                "optimizer step are not part of a checkpoint and would be lost. Save right "
                "after the optimizer step, when opt.micro_step == 0.")
    try:
        json.dumps(metadata, allow_nan=False)
    except (TypeError, ValueError) as e:
        return (f"metadata cannot be stored as JSON ({e}); pass a dict of strings, numbers, "
                "lists and dicts.")
    try:
        atomic.check_target(target)
    except ValueError as e:
        return str(e)
    return ""


def _stored(model, plan, weights: str) -> dict:
    params = tree_flatten(model.parameters())
    if weights == "all":
        return dict(params)
    # The trained parameters too, should some no longer be trainable: their
    # optimizer state is saved, so their weights must be.
    keep = {k for k, _ in tree_flatten(model.trainable_parameters())}
    keep |= {s.path for b in plan.buckets for s in b.slots}
    return {k: v for k, v in params if k in keep}


def _manifest(model, optimizer, wrapper, plan, sharded, world, tmp, files, metadata,
              stored, shards) -> dict:
    from .. import __version__

    headers = [read_header(os.path.join(tmp, shard_file(r, plan.world_size)))
               for r in range(plan.world_size)]
    names = plain_paths(model)
    states, master = describe_state(plan, optimizer, headers, sharded, names)
    params = describe_parameters(model)
    model_info = {
        "file": MODEL_FILE,
        "weights": "all" if len(stored) == len(params) else "trainable",
        "parameters": params,
    }
    if model_info["weights"] == "trainable":
        model_info["stored"] = [names[p] for p in stored]
    if shards:
        model_info["shards"] = shards
    return {
        "format": FORMAT,
        "format_version": FORMAT_VERSION if shards else VERSION_WITHOUT_MODEL_SHARDS,
        "mlx_fsdp_version": __version__,
        "mlx_version": mx.__version__,
        "created_unix": int(time.time()),
        "world_size": world.size(),
        "step": _step(optimizer),
        "layout": {"kind": "sharded" if sharded else "plain", "num_shards": plan.world_size,
                   "how_to_read": LAYOUT_NOTE},
        "wrapper": _wrapper_info(wrapper),
        "optimizer": describe_optimizer(optimizer),
        "optimizers": states,
        "master": master,
        "plan": plain_plan(plan, names),
        "model": model_info,
        "files": files,
        "user": metadata,
    }


def save_checkpoint(path: str, model, opt, *, metadata: Optional[dict] = None,
                    weights: str = "all"):
    """Save the model and the (sharded) optimizer state into the directory ``path``.

    Every rank must call it, at the same point and with the same ``path``: it
    starts by checking that across ranks, so a call on some ranks only (``if
    rank == 0: save_checkpoint(...)``) or with different paths raises an
    error instead of hanging. Each shard of the optimizer state is written by
    its own rank and the model by rank 0; of a fully sharded model
    (:func:`~mlx_fsdp.fully_shard`) each rank writes the part of the
    parameters it holds, and no rank gathers them. Parameters are stored under
    their plain paths (without the ``"module"`` keys of ``fully_shard``). The
    directory appears at ``path`` only when complete: ranks write into ``.NAME.partial`` next to it, and
    rank 0 swaps it in once every rank has succeeded. An existing checkpoint
    at ``path`` is kept until then. If ``path`` is a symbolic link, the
    checkpoint replaces the directory it points to and the link stays. With
    several hosts, ``path`` must be on a filesystem that every rank sees.

    Args:
        path (str): The checkpoint directory.
        model (mlx.nn.Module): The model (the same on every rank, or the
            same fully sharded model).
        opt: The optimizer: an :func:`~mlx_fsdp.fsdp_step` or
            :func:`~mlx_fsdp.ddp_step` wrapper, or a plain MLX optimizer; for a
            fully sharded model, the ``fsdp_step`` wrapper that trains it.
        metadata (dict, optional): JSON-able data stored in the manifest under
            ``"user"`` (e.g. the data loader's position). Default: ``None``.
        weights (str): ``"all"`` stores every parameter of the model;
            ``"trainable"`` only ``model.trainable_parameters()`` (and the
            optimizer state), e.g. LoRA adapters without the frozen base
            model, which must then be in the model before loading.
            Default: ``"all"``.

    Raises:
        mlx_fsdp.control.RankMismatch: On every rank, if the ranks are not all
            in ``save_checkpoint`` or differ in the path, the step count, the
            optimizer or the arguments.
        ValueError: On every rank, if ``path`` exists and is not a
            checkpoint, for a bad ``weights`` or ``metadata``, between
            micro-batches of gradient accumulation (``opt.micro_step != 0``),
            or for a fully sharded model without its ``fsdp_step`` wrapper.
        RuntimeError: On every rank, if writing failed on any rank.
    """
    optimizer, wrapper = split_optimizer(opt)
    world = group_or_global(None)
    rank = world.rank()
    target = atomic.resolve(path)
    problem = _save_problem(model, wrapper, metadata, weights, target)
    agree(wrapper, world, "save_checkpoint", target, {
        "path": target,
        "step": _step(optimizer),
        "optimizer": " / ".join(class_names(describe_optimizer(optimizer))),
        "arguments": problem or "ok",
    })
    if problem:
        raise ValueError(problem)

    sharded = is_sharded(wrapper)
    plan, shard, writer = save_layout(wrapper, model, optimizer, rank)
    names = plain_paths(model)
    arrays = arrays_to_save(plan, optimizer, wrapper, sharded, names) if writer else {}
    stored = _stored(model, plan, weights)
    whole, pieces, shards = weights_to_save(model, stored)
    # Rank 0 writes the model file and hashes it twice while the others wait.
    allowance = io_allowance(sum(a.nbytes for d in (whole, whole, whole, arrays, pieces)
                                 for a in d.values()))

    def status(ok, shard=-1, digests=("",)):
        with watched(wrapper, f"save_checkpoint({target})", allowance):
            return atomic.gather_status(world, ok, shard, digests)

    _, tmp, _ = atomic.side_paths(target)

    error = None
    try:
        if rank == 0:
            atomic.prepare(target)
    except Exception as e:  # reported on every rank below
        error = e
    _check_status(status(error is None), error, target, "preparing")

    # This rank's files: its optimizer shard, and its model shard if the model has any.
    names_of = [shard_file] + ([model_shard_file] if shards else [])
    digests = [""] * len(names_of)
    try:
        if writer:
            for i, (name, contents) in enumerate(zip(names_of, (arrays, pieces))):
                file = os.path.join(tmp, name(shard, plan.world_size))
                _write(file, contents)
                digests[i] = sha256_file(file)
        if rank == 0:
            _write(os.path.join(tmp, MODEL_FILE), whole)
    except Exception as e:
        error = e
    written = status(error is None, shard if writer else -1, digests)
    if rank == 0 and not all(ok for ok, _, _ in written):
        atomic.abandon(target)
    _check_status(written, error, target, "writing")

    try:
        if rank == 0:
            digests = {}
            for ok, s, ds in written:
                if s >= 0:
                    digests.update((name(s, plan.world_size), d) for name, d in zip(names_of, ds))
            digests[MODEL_FILE] = sha256_file(os.path.join(tmp, MODEL_FILE))
            digests = {
                name: {"sha256": d, "bytes": os.path.getsize(os.path.join(tmp, name))}
                for name, d in sorted(digests.items())
            }
            manifest = _manifest(model, optimizer, wrapper, plan, sharded, world, tmp,
                                 digests, metadata, stored, shards)
            write_json(os.path.join(tmp, MANIFEST), manifest)
            atomic.commit(target)
    except Exception as e:
        error = e
        if rank == 0:
            atomic.abandon(target)
    _check_status(status(error is None), error, target, "committing")
