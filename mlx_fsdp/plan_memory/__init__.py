"""Will it fit? Per-rank memory of ``ddp_step``, ``fsdp_step`` and ``fully_shard``, before launching.

``python -m mlx_fsdp.plan_memory`` prints, for a model given by its
safetensors, its mlx-lm directory or a Llama-style shape description, the
bytes each rank holds (parameters, gradients, optimizer state, masters,
communication buffers, and under fully sharded training the gathered
parameters) for DDP, FSDP and fully sharded training at several world
sizes, and which configurations fit a memory budget; with ``--fit``, the
largest model of a width that fits. See :mod:`mlx_fsdp.plan_memory.estimate`
and :mod:`mlx_fsdp.plan_memory.fully` for what is counted.

From Python::

    from mlx_fsdp.plan_memory import estimate, shapes
    model = shapes.llama(**shapes.PRESETS["7B"])
    ranks = estimate(model, "adamw", "fsdp", 8, master_dtype="float32")
    print(max(r.peak for r in ranks))
    ranks = estimate(model, "adamw", "fully_shard", 8, reshard_after_forward=True)

Of a model of your own, from the module itself (``shapes.from_tree(model)``),
not its parameter tree: then the planner knows which matrices are ``Linear``
weights, whose gradients MLX returns transposed, and counts only the
copies packing really makes of them (a tree: every matrix's).

With a batch, the activations as that mode's pass holds them (resharded
blocks recompute theirs; on a GPU, collectives the CPU runs cut the pass)::

    from mlx_fsdp.plan_memory.activations import activation_bytes, llama_shape, pass_of
    how = pass_of("fully_shard", reshard_after_forward=True, device="gpu", backend="jaccl",
                  world_size=8)
    acts = activation_bytes(llama_shape(model), 1, 2048, 2, device="gpu", **how)
    ranks = estimate(model, "adamw", "fully_shard", 8, reshard_after_forward=True,
                     device="gpu", activations=acts)
"""

from . import optimizers, shapes
from .estimate import ACCUMULATION, MODES, RankMemory
from .estimate import estimate_ranks as estimate


__all__ = ["estimate", "optimizers", "shapes", "RankMemory", "MODES", "ACCUMULATION"]
