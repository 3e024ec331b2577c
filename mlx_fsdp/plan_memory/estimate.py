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
  alive next to it, compiled or not as ``fsdp_step`` runs it there, and a
  GPU's matmul workspaces (:mod:`mlx_fsdp.plan_memory.transient`);
* **activations**: one batch's pass, given (:mod:`mlx_fsdp.plan_memory.activations`).

The **peak** is their sum, an upper bound of one step (``benchmarks/bench_plan_memory.py``).
"""

import math
from dataclasses import replace
from typing import List, Optional, Sequence, Tuple

import mlx.core as mx

from ..fused import use_fused_updates
from . import fully, optimizers
from .phases import pass_spare, phases_apart, update_during_backward, with_pass
from .transient import temporaries
from .buffers import default_communication_size, default_device, resolve_reduce_scatter
from .parts import RankMemory, tree_bytes
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


def fully_memory(name: str, floating, trainable: Sequence[str], param_bytes: int,
                 world_size: int, communication_size: int, master_dtype: Optional[mx.Dtype],
                 accumulation: str, reduce_scatter: Optional[str], wrap: str,
                 reshard_after_forward: bool, every_rank: bool = False, device: str = "cpu",
                 activations: int = 0, compiled: bool = False, phases: bool = False,
                 budget: Optional[int] = None, keeps_old_parameters: bool = False) -> list:
    """Every rank of fully sharded training (see :mod:`mlx_fsdp.plan_memory.fully`).

    ``floating``: ``(path, array)`` of every floating array, frozen ones
    (a quantized layer's scales) included, which ``fully_shard`` shards too.
    ``compiled``, ``phases``, ``budget``, ``keeps_old_parameters``: see
    :func:`estimate_ranks`.
    """
    if world_size == 1:  # fully_shard returns the module itself: the plain optimizer
        trained = set(trainable)
        flat = [(p, a) for p, a in floating if p in trained]
        one = ddp_memory(name, flat, param_bytes, 1, communication_size, master_dtype,
                         accumulation, device)
        kept = tree_bytes(dict(flat)) if keeps_old_parameters else 0
        return [replace(one, new_parameters=one.new_parameters + kept, activations=activations)]
    make_optimizer = lambda: optimizers.make(name)  # noqa: E731
    whole = param_bytes - tree_bytes(dict(floating))  # integer (quantized) weights stay whole
    units = fully.cut(floating, trainable, make_optimizer(), world_size, communication_size,
                      wrap, reshard_after_forward,
                      resolve_reduce_scatter(reduce_scatter, world_size), device)
    # Rank 0 holds the most rows of every array: only owners make another rank fuller.
    owned = any(b.owned for _, plan, _ in units.plans for b in plan.buckets)
    out = []
    for rank in range(world_size) if owned or every_rank else [0]:
        if budget is not None and out and not phases and out[-1].peak > budget:
            break
        held = fully.rank_bytes(units, make_optimizer(), rank, master_dtype)
        grads = held["gradients"]
        common = dict(parameters=whole + held["parameters"], gradients=grads,
                      accumulation=0 if accumulation == "none" else grads,
                      optimizer=tree_bytes(held["optimizer"]), masters=tree_bytes(held["master"]))
        temps = temporaries(name, held["pieces"], master_dtype, use_fused_updates(device),
                            device, traced=compiled)
        apart = phases_apart(device, compiled)
        spare = pass_spare(units, activations) if apart else (0, 0)
        backward = dict(common, communication=units.communication, new_parameters=0,
                        gathered=units.gathered + spare[0],
                        full_gradients=units.full_gradients + spare[1])
        # Kept, the rank's old trainable pieces (as many bytes as its gradients).
        update = dict(common, communication=grads,
                      new_parameters=held["largest"] + (grads if keeps_old_parameters else 0))
        if phases or apart:  # each alone: the pass's activations, the update's temporaries
            pair = (RankMemory(**backward, activations=activations),
                    RankMemory(**update, temporaries=temps))
            out.append(pair if phases else max(pair, key=lambda r: r.peak))
            continue
        backward.update(update_during_backward(device, held, grads, units, rank))
        out.append(max(RankMemory(**backward, temporaries=temps, activations=activations),
                       RankMemory(**update, temporaries=temps, activations=activations),
                       key=lambda r: r.peak))  # a tie: the backward pass
    return out


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
            or ``"sharded"`` (FSDP; DDP accumulates locally). Default: ``"none"``.
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
    if phases and (mode != "fully_shard" or world_size == 1):
        raise ValueError(f"phases=True needs mode='fully_shard' at world_size > 1, not "
                         f"mode={mode!r} at world_size={world_size}: only there are the "
                         "two phases counted apart; drop phases or plan fully_shard.")
    return _ranks(model, optimizer, mode, world_size, dtype, master_dtype, communication_size,
                  accumulation, device, reduce_scatter, wrap, reshard_after_forward, every_rank,
                  activations, compiled, phases, budget, keeps_old_parameters)


def _ranks(model, optimizer, mode, world_size, dtype, master_dtype, communication_size,
           accumulation, device, reduce_scatter, wrap, reshard_after_forward, every_rank,
           activations, compiled, phases=False, budget=None, keeps_old_parameters=False):
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
                                communication_size, master, local, device)]
        else:
            ranks = fsdp_memory(optimizer, flat, param_bytes, world_size, communication_size,
                                master, accumulation, reduce_scatter, device, compiled,
                                {a.path: a.transposed for a in model.arrays}, budget)
        return [with_pass(replace(r, new_parameters=r.new_parameters + kept), activations, mode,
                          device, world_size) for r in ranks]
    trained = dict(flat)
    floating = [(a.path, trained[a.path] if a.path in trained else
                 mx.zeros(a.shape, getattr(mx, a.dtype)))
                for a in model.arrays if a.path in trained or _floating(a.dtype)]
    return fully_memory(optimizer, floating, list(trained), param_bytes, world_size,
                        communication_size, master, accumulation, reduce_scatter, wrap,
                        reshard_after_forward, every_rank, device, activations, compiled,
                        phases, budget, keeps_old_parameters)
