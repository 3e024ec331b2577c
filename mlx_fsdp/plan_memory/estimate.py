"""Per-rank bytes of one training configuration, computed from shape-only arrays.

Every array here is built with ``mx.zeros(shape, dtype)`` and never
evaluated (MLX allocates nothing until evaluation), so a 70B model costs no
memory to plan. The optimizer state is what the real ``mlx.optimizers``
optimizer builds on those arrays (for FSDP, on this rank's pieces; see
:mod:`mlx_fsdp.plan_memory.sharding`).

What is counted, per rank (all ranks hold the whole model under ``ddp``
and ``fsdp``; under ``fully_shard`` see :mod:`mlx_fsdp.plan_memory.fully`):

* **parameters** (``fsdp``: with their gathered vectors' padding) and
  **gradients** (the tree the caller holds, in the parameters' dtype; none
  for a quantized layer, frozen whole as MLX freezes it, nor a frozen
  array, a LoRA base: :mod:`mlx_fsdp.plan_memory.lora`);
* **accumulation**: with gradient accumulation, the running sum: the whole
  gradient (``"local"``) or this rank's reduced pieces (``"sharded"``,
  FSDP only);
* **optimizer state** and **masters** (``master_dtype`` copies of
  parameters of another dtype);
* **communication** and **new parameters**: what the step keeps alive at
  its fullest phase besides the above (:mod:`mlx_fsdp.plan_memory.buffers`):
  FSDP, the output of every bucket's reduce-scatter and one bucket's
  reduced, updated, packed and gathered pieces (the gathered vector is the
  new parameters), or in the update's own phase the reduced pieces; DDP,
  the averaged gradients, one group's flattening copies, one array's new copy;
* **gathered** and **full gradients** (``fully_shard`` only): the full
  parameters of the wrapped modules alive at once in the forward and
  backward pass, and the full gradients of one of them before its
  reduce-scatter;
* **temporaries**: the optimizer's arithmetic, what MLX's run-ahead keeps
  alive next to it, compiled or not as ``fsdp_step`` runs it there, a
  GPU's matmul workspaces (:mod:`mlx_fsdp.plan_memory.transient`), and
  with ``max_norm`` the clipping's copies and squares
  (:mod:`mlx_fsdp.plan_memory.clipping`);
* **activations**: one batch's pass, given (:mod:`mlx_fsdp.plan_memory.activations`);
* **freed** (negative; ``fsdp``, eager on the CPU): the old parameters of
  arrays another rank updates whole, gone by the fullest gather
  (:mod:`mlx_fsdp.plan_memory.freed`), and local accumulation's sums, gone
  once the reduce-scatters have read them.

The **peak** is their sum, an upper bound of one step (``benchmarks/bench_plan_memory.py``).
"""

import math
from dataclasses import replace
from typing import List, Optional, Tuple

import mlx.core as mx

from . import optimizers
from .buffers import default_communication_size, default_device, view_slack
from .fully_ranks import fully_memory
from .parts import RankMemory, tree_bytes  # noqa: F401 (RankMemory: re-exported)
from .phases import with_pass
from .shapes import Model
from .wrappers import ddp_memory, fsdp_memory

MODES = ("ddp", "fsdp", "fully_shard")
ACCUMULATION = ("none", "local", "sharded")


def _floating(dtype: str) -> bool:
    return mx.issubdtype(getattr(mx, dtype), mx.floating)


def shape_only(model: Model, dtype: Optional[str] = None) -> Tuple[List[tuple], int]:
    """Unevaluated zeros for the trainable arrays, and the bytes of all arrays.

    Args:
        model (Model): The model.
        dtype (str, optional): Cast every floating array to this dtype.
            Default: ``None`` (as stored).

    Returns:
        tuple: ``(path, array)`` of every floating (trainable) array, and the
        bytes of the parameters, frozen ones included.
    """
    # A quantized layer (nn.QuantizedLinear) keeps integer weights with
    # floating scales, biases and bias next to them, and freezes them all.
    quantized = {a.path.rpartition(".")[0] for a in model.arrays
                 if a.path.endswith(".weight") and not _floating(a.dtype)}
    trainable, total = [], 0
    for a in model.arrays:
        floating = _floating(a.dtype) and a.path.rpartition(".")[0] not in quantized \
            and not a.frozen
        dt = getattr(mx, dtype if (dtype and floating) else a.dtype)
        total += math.prod(a.shape) * dt.size
        if floating:
            trainable.append((a.path, mx.zeros(a.shape, dt)))
    if not trainable:
        raise ValueError(
            f"{model.name} has no floating-point arrays, so nothing is trained; "
            "pass a model with float32, bfloat16 or float16 weights."
        )
    return trainable, total


def estimate_ranks(
    model: Model,
    optimizer: str,
    mode: str,
    world_size: int,
    *,
    dtype: Optional[str] = None,
    master_dtype: Optional[str] = None,
    communication_size: Optional[int] = None,
    accumulation: str = "none",
    device: Optional[str] = None,
    reduce_scatter: Optional[str] = None,
    wrap: str = "blocks",
    reshard_after_forward: bool = False,
    every_rank: bool = False,
    activations: int = 0,
    compiled: bool = False,
    phases: bool = False,
    budget: Optional[int] = None,
    keeps_old_parameters: bool = False,
    max_norm: Optional[float] = None,
) -> list:
    """The bytes every rank holds in one configuration.

    Args:
        model (shapes.Model): The model (see :mod:`mlx_fsdp.plan_memory.shapes`).
        optimizer (str): A key of :data:`optimizers.OPTIMIZERS`.
        mode (str): ``"ddp"``, ``"fsdp"`` or ``"fully_shard"`` (``fully_shard``
            and ``fsdp_step``).
        world_size (int): Number of ranks.
        dtype (str, optional): Train the floating arrays in this dtype.
            Default: ``None`` (as stored).
        master_dtype (str, optional): As the wrappers' ``master_dtype``.
            Default: ``None``.
        communication_size (int, optional): The bucket byte budget. Default:
            ``None``, the wrapper's default on ``device`` (see
            :func:`~mlx_fsdp.plan_memory.buffers.default_communication_size`).
        accumulation (str): ``"none"`` (no gradient accumulation), ``"local"``
            or ``"sharded"`` (FSDP; DDP accumulates locally; ``fsdp_step``
            compiled whole shards either, as it runs them). Default: ``"none"``.
        device (str, optional): ``"cpu"`` or ``"gpu"``, where the ranks
            train. Default: ``None``, the device MLX defaults to here.
        reduce_scatter (str, optional): FSDP's reduce-scatter: ``"native"``
            (NCCL, JACCL), ``"exchange"`` (2 ranks) or ``"all_sum"``.
            Default: ``None``, what ring and MPI get.
        wrap (str): ``fully_shard``: ``"blocks"`` (each block, then the
            root) or ``"model"`` (the whole model once). Default: ``"blocks"``.
        reshard_after_forward (bool): ``fully_shard``: the blocks' argument.
            Default: ``False``.
        every_rank (bool): ``fully_shard``: every rank's, also where rank 0
            is the fullest. Default: ``False``.
        activations (int): Bytes of one rank's forward and backward pass
            (:func:`mlx_fsdp.plan_memory.activations.activation_bytes`, as
            :func:`~mlx_fsdp.plan_memory.activations.pass_of` says this mode
            holds them). Default: ``0``.
        compiled (bool): The step is compiled whole with ``mx.compile``
            (mlx-lm's trainer). Measured so on the CPU, ``fully_shard``'s
            update (compiled with it) meets the activations, and the gathers
            of ``fsdp_step`` meet its update. Default: ``False``.
        phases (bool): ``fully_shard`` (at N > 1): per rank, its forward and
            backward pass and its update each counted alone, the one with
            the activations, the other with the temporaries
            (``benchmarks/bench_plan_phases.py`` measures them so), instead
            of the peak (on the CPU, the fuller of the two). Default: ``False``.
        budget (int, optional): Bytes; stop at the first rank whose peak
            exceeds them (``fsdp_step`` and ``fully_shard``): a search for
            what fits needs no more. Default: ``None`` (every rank).
        keeps_old_parameters (bool): The training loop keeps a reference to
            the parameters across ``opt.update`` (``params =
            model.parameters()`` alive through the step's ``mx.eval``), so
            none is freed as its update reads it, or, with masters, at
            once: the step is counted with the rank's trainable parameters
            once more, as new parameters. Default: ``False`` (a loop of
            ``value_and_grad``, ``opt.update`` and ``mx.eval``, as mlx-lm's
            trainer).
        max_norm (float, optional): As the wrappers' ``max_norm``: the
            gradients are clipped by their global norm, and the clipped
            copies and the norm's squares are counted in the update
            (:mod:`mlx_fsdp.plan_memory.clipping`); only whether it is set
            matters. Default: ``None`` (no clipping).

    Returns:
        list[RankMemory]: One per rank (DDP: one, all ranks are alike;
        ``fully_shard`` without owner-placed arrays: rank 0's, the fullest);
        with ``phases``, a ``(backward, update)`` pair per rank; with
        ``budget``, up to the first rank above it.
    """
    if mode not in MODES:
        raise ValueError(f"mode={mode!r} must be one of {', '.join(MODES)}.")
    if accumulation not in ACCUMULATION:
        raise ValueError(f"accumulation={accumulation!r} must be one of "
                         f"{', '.join(ACCUMULATION)}.")
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size={world_size!r} must be an integer >= 1.")
    if not isinstance(activations, int) or activations < 0:
        raise ValueError(f"activations={activations!r} must be a byte count >= 0.")
    if budget is not None and (not isinstance(budget, int) or budget < 0):
        raise ValueError(f"budget={budget!r} must be a byte count >= 0, or None for every rank.")
    if max_norm is not None and not (isinstance(max_norm, (int, float)) and max_norm > 0):
        raise ValueError(f"max_norm={max_norm!r} must be a number > 0, as the wrappers take "
                         "it, or None when the gradients are not clipped.")
    if phases and (mode != "fully_shard" or world_size == 1):
        raise ValueError(f"phases=True needs mode='fully_shard' at world_size > 1, not "
                         f"mode={mode!r} at world_size={world_size}: only there are the "
                         "two phases counted apart; drop phases or plan fully_shard.")
    return _ranks(model, optimizer, mode, world_size, dtype, master_dtype, communication_size,
                  accumulation, device, reduce_scatter, wrap, reshard_after_forward, every_rank,
                  activations, compiled, phases, budget, keeps_old_parameters,
                  max_norm is not None)


def _ranks(model, optimizer, mode, world_size, dtype, master_dtype, communication_size,
           accumulation, device, reduce_scatter, wrap, reshard_after_forward, every_rank,
           activations, compiled, phases=False, budget=None, keeps_old_parameters=False,
           clipped=False):
    optimizers.make(optimizer)
    device = device or default_device()
    if communication_size is None:
        communication_size = default_communication_size(mode, device)
    flat, param_bytes = shape_only(model, dtype)
    master = None if master_dtype is None else getattr(mx, master_dtype)
    # Kept, the old parameters are held beside everything the step allocates,
    # and nothing else the step holds changes: their bytes bound what keeping
    # them adds. Counted with every gathered vector instead of them, as
    # fsdp_step's phases would have it, a lone flat bucket's step peaked above
    # the plan: there the freed old parameters had made room for the updates'
    # temporaries (SGD on the MLP 4 x 512 in bfloat16 at ring N=2: 14.03 MiB
    # against 12.09, 2026-11-29).
    kept = tree_bytes(dict(flat)) if keeps_old_parameters else 0
    if mode in ("ddp", "fsdp"):  # activations on top; fully_shard weighs them itself
        if mode == "ddp":
            local = "none" if accumulation == "none" else "local"
            ranks = [ddp_memory(optimizer, flat, param_bytes, world_size,
                                communication_size, master, local, device, clipped)]
        else:
            ranks = fsdp_memory(optimizer, flat, param_bytes, world_size, communication_size,
                                master, accumulation, reduce_scatter, device, compiled,
                                {a.path: a.transposed for a in model.arrays}, budget, clipped)
        views = view_slack([a for _, a in flat])
        return [with_pass(replace(r, new_parameters=r.new_parameters + kept), activations, mode,
                          device, world_size, views) for r in ranks]
    trained = dict(flat)
    floating = [(a.path, trained[a.path] if a.path in trained else
                 mx.zeros(a.shape, getattr(mx, a.dtype)))
                for a in model.arrays if a.path in trained or _floating(a.dtype)]
    return fully_memory(optimizer, floating, list(trained), param_bytes, world_size,
                        communication_size, master, accumulation, reduce_scatter, wrap,
                        reshard_after_forward, every_rank, device, activations, compiled,
                        phases, budget, keeps_old_parameters, clipped)
