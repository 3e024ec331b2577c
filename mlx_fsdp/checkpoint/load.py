"""``load_checkpoint``: all or nothing, on every rank.

It starts with one cross-rank agreement (:func:`.internals.agree`): every rank
must call it at the same point, with the same path. Then every rank checks the
checkpoint and builds the new weights and optimizer state without touching
its model or optimizer (:mod:`.staging`), the ranks agree that all of them
succeeded, and only then does any rank assign.
"""

import os
import warnings
from typing import Optional

from .. import control
from ..options import group_or_global
from ..placement import sub_optimizers
from . import staging
from .internals import agree, load_target, read_allowance, reset_wrapper
from .layout import split_optimizer
from .manifest import class_names, describe_optimizer


def _status(error: Optional[BaseException]) -> str:
    return "ok" if error is None else f"{type(error).__name__}: {error}"


def load_checkpoint(path: str, model, opt) -> dict:
    """Load a checkpoint saved by :func:`~mlx_fsdp.save_checkpoint`, at any world size.

    All or nothing. Every rank checks the manifest against its schema, every
    file's place, size and sha256 and its arrays' shapes, the model (paths,
    shapes, dtypes), the optimizer class, the trained parameters and whether
    the state can be cut for ``opt``, and builds the new weights and state;
    then the ranks agree that every one of them can load, and only then is
    anything replaced. On any failure on any rank, nothing changes on any
    rank: the rank that failed raises its error, the others a
    :class:`~mlx_fsdp.control.RankMismatch` that names it.

    The optimizer state of every parameter is rebuilt whole from the shards
    and cut again for ``opt``: an :func:`~mlx_fsdp.fsdp_step` wrapper at any
    world size and any ``communication_size``, a :func:`~mlx_fsdp.ddp_step`
    wrapper, or a plain MLX optimizer (its usual state layout). So are the
    weights of a fully sharded model (:func:`~mlx_fsdp.fully_shard`): each
    rank keeps what its modules hold. Parameters are matched by their plain
    paths (without the ``"module"`` keys of ``fully_shard``), so a checkpoint
    of a fully sharded model loads into the model without ``fully_shard`` (one
    process, ``ddp_step``) and the other way round. The step count
    and the learning rate are part of the state and carry over, so a schedule
    continues where it was; the other hyper-parameters are those of ``opt``.
    Every rank must call it, at the same point and with the same ``path``. A
    checkpoint saved with ``weights="trainable"`` replaces only those
    parameters; the model's others must exist with the saved shapes and dtypes
    and keep their values.

    Args:
        path (str): The checkpoint directory (it may be a symbolic link to one).
        model (mlx.nn.Module): A model with the same parameter paths, shapes
            and dtypes (wrapped by ``fully_shard`` or not); its weights are
            replaced.
        opt: The optimizer, of the same class as the saved one; its state is
            replaced. For a fully sharded model, its ``fsdp_step`` wrapper.

    Returns:
        dict: The manifest (``manifest["user"]`` holds ``metadata`` given to
        :func:`~mlx_fsdp.save_checkpoint`).

    Raises:
        CheckpointError: naming what is wrong: a malformed manifest field, a
            missing, truncated or altered file, a different model, a
            different optimizer class, state that cannot be cut for ``opt``.
        ValueError: Between micro-batches of gradient accumulation, or for a
            fully sharded model without its ``fsdp_step`` wrapper.
        mlx_fsdp.control.RankMismatch: On the ranks that could load, when
            another could not, or when the ranks differ in the path or in the
            layout ``opt`` needs (e.g. ``communication_size``).
    """
    optimizer, wrapper = split_optimizer(opt)
    world = group_or_global(None)
    path = os.path.abspath(path)
    agree(wrapper, world, "load_checkpoint", path, {
        "path": path,
        "optimizer": " / ".join(class_names(describe_optimizer(optimizer))),
    })

    staged, error, layout, plan = None, None, "-", None
    try:
        plan, shard = load_target(wrapper, model)
        layout = staging.describe_target(plan)
        staged = staging.stage(path, model, optimizer, wrapper, plan, shard)
    except Exception as e:  # every rank learns of it below, and nothing changes
        error = e
    mismatch = None
    try:
        agree(wrapper, world, "load_checkpoint", path, {"status": _status(error), "layout": layout},
              hint="The rank(s) that failed raised the full error.",
              allowance=read_allowance(path, world.size()))
    except control.RankMismatch as e:
        mismatch = e
    if error is not None:
        raise error
    if mismatch is not None:
        raise control.RankMismatch(f"Nothing was loaded from {path} on any rank. {mismatch}") \
            from mismatch

    model.load_weights(staged.weights, strict=staged.all_weights)
    for sub, state in zip(sub_optimizers(optimizer), staged.states):
        staging.replace_state(sub, state)
    if wrapper is not None:
        reset_wrapper(wrapper, staged.master, plan)
    if staged.ignored_master:
        warnings.warn(
            f"The checkpoint {path} holds fp32 master weights, but this optimizer keeps "
            "none; they are ignored and training continues from the model weights "
            "(the masters rounded to the parameters' dtype).",
            stacklevel=2,
        )
    return staged.manifest
