"""``fully_shard``: the entry point of parameter sharding, and its argument checks.

A drop-in for ``mlx.nn.fully_shard`` (same call, same ``"module"`` key in
the parameter tree, same gradients where MLX's runs) that also runs on ring
and MPI, takes any shape (padded as the sharded step pads), keeps the
matrices of shape-aware optimizers whole on owner ranks, groups its
collectives into buckets, and can free a block's gathered parameters
between its forward and backward pass (``reshard_after_forward``).
"""

from typing import Optional

import mlx.core as mx
import mlx.nn as nn

from ..options import DEFAULT_SIZE_CPU, DEFAULT_SIZE_GPU, check_dtype, check_group, group_or_global
from .module import FullyShardedModule


def fully_shard(module: nn.Module, *, group: Optional[mx.distributed.Group] = None,
                compute_dtype: Optional[mx.Dtype] = None,
                reduce_dtype: Optional[mx.Dtype] = None,
                communication_size: Optional[int] = None,
                reshard_after_forward: bool = False,
                placement=None,
                communication_stream: Optional[mx.Stream] = None) -> nn.Module:
    """Split the parameters of ``module`` over the ranks of ``group`` (ZeRO-3).

    A drop-in for ``mlx.nn.fully_shard``: the same call, the wrapped module
    under ``"module"`` in the parameter tree, and after ``nn.value_and_grad``
    each parameter's gradient is this rank's axis-0 slice of the gradient
    averaged over the ranks, as data parallelism averages it. Unlike MLX's,
    it runs on every backend and takes any shape (the last ranks hold fewer
    rows, possibly none); docs/fully-shard.md compares the two.

    .. code-block:: python

        for i, block in enumerate(model.layers):
            model.layers[i] = mlx_fsdp.fully_shard(block, reshard_after_forward=True)
        model = mlx_fsdp.fully_shard(model)       # the rest: embeddings, head
        opt = mlx_fsdp.fsdp_step(optim.AdamW(learning_rate=3e-4), max_norm=1.0)
        loss, grads = nn.value_and_grad(model, loss_fn)(model, x, y)
        opt.update(model, grads)                  # updates the shards where they are

    Calling the wrapper all-gathers the module's parameters, calls the module
    and puts the shards back; the backward pass reduce-scatters the full
    gradients. Wrap each transformer block, then the whole model. When the
    parameters exist whole, and what is sharded (floating-point parameters;
    quantized ones stay whole): docs/fully-shard.md.

    Args:
        module (mlx.nn.Module): The module to shard. Every rank must pass the
            same module (same paths, shapes and dtypes) with the same values.
        group (mlx.core.distributed.Group, optional): The ranks to shard over.
            ``None`` means the global group. Default: ``None``.
        compute_dtype (Dtype, optional): Gather the parameters in this dtype
            (e.g. ``mx.bfloat16``): the forward and backward pass run in it,
            the all-gather and reduce-scatter move it, and each rank keeps its
            shards and their gradients in the parameters' own dtype.
            Default: ``None`` (the parameters' dtype).
        reduce_dtype (Dtype, optional): Reduce-scatter the gradients in this
            dtype, e.g. ``mx.float32`` under a bfloat16 ``compute_dtype``.
            Default: ``None`` (``compute_dtype``, else the parameters' dtype).
        communication_size (int, optional): Byte budget of a bucket (one
            all-gather in the forward pass, one reduce-scatter in the
            backward pass); ``<= 0`` gives every parameter its own.
            Default: ``None``: 32 MiB on a GPU, 4 MiB on the CPU, as
            :func:`mlx_fsdp.fsdp_step`.
        reshard_after_forward (bool): Free the gathered parameters after the
            forward pass and gather them again for the backward pass. In MLX
            that recomputes the module's forward pass in the backward pass,
            as ``mx.checkpoint`` does (the module's activations are freed as
            well), so it costs a second all-gather and a second forward pass
            of the module. Default: ``False``.
        placement (optional): ``None`` or ``"flat"``: every rank holds its
            axis-0 slice of every parameter; ``"owner"``: whole parameters on
            owner ranks; a callable ``(path, shape) -> "flat" | "owner"``; or
            the optimizer that will train the module, whose needs decide
            (Muon keeps its matrices whole, Adafactor all its arrays; a
            ``MultiOptimizer``'s filters see paths relative to ``module``
            here, and in :func:`mlx_fsdp.fsdp_step` the paths the model has
            without ``fully_shard``). An optimizer that is not element-wise
            needs whole arrays: :func:`mlx_fsdp.fsdp_step` refuses to update
            axis-0 slices with it. Default: ``None``.
        communication_stream (mlx.core.Stream, optional): Stream of the
            collectives. Default: ``None``.

    Returns:
        mlx.nn.Module: The :class:`FullyShardedModule`, or ``module`` itself
        with one process, for a module already wrapped, or one without
        floating-point parameters of its own.
    """
    _check_arguments(module, group, compute_dtype, reduce_dtype, communication_size,
                     reshard_after_forward, communication_stream)
    group = group_or_global(group)
    if group.size() == 1 or isinstance(module, FullyShardedModule):
        return module
    if communication_size is None:
        communication_size = DEFAULT_SIZE_GPU if mx.default_device() == mx.gpu else DEFAULT_SIZE_CPU
    wrapped = FullyShardedModule(
        module, group=group, compute_dtype=compute_dtype, reduce_dtype=reduce_dtype,
        communication_size=communication_size, reshard_after_forward=reshard_after_forward,
        placement=placement, communication_stream=communication_stream)
    return wrapped if wrapped._paths else module


def _check_arguments(module, group, compute_dtype, reduce_dtype, communication_size,
                     reshard_after_forward, communication_stream):
    if not isinstance(module, nn.Module):
        raise ValueError(f"module={module!r} is not an mlx.nn.Module; pass the layer or model "
                         "whose parameters to shard.")
    check_group("group", group)
    check_dtype("compute_dtype", compute_dtype)
    check_dtype("reduce_dtype", reduce_dtype)
    if communication_size is not None and (not isinstance(communication_size, int)
                                           or isinstance(communication_size, bool)):
        raise ValueError(f"communication_size={communication_size!r} must be an int number of "
                         "bytes (<= 0 gives every parameter its own bucket), or None.")
    if not isinstance(reshard_after_forward, bool):
        raise ValueError(f"reshard_after_forward={reshard_after_forward!r} must be True or False.")
    if communication_stream is not None and not isinstance(communication_stream, mx.Stream):
        raise ValueError(f"communication_stream={communication_stream!r} must be an mx.Stream, "
                         "e.g. mx.new_stream(mx.default_device()), or None.")
