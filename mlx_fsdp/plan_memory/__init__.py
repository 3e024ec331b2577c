"""Will it fit? Per-rank memory of ``ddp_step`` and ``fsdp_step``, before launching.

``python -m mlx_fsdp.plan_memory`` prints, for a model given by its
safetensors, its mlx-lm directory or a Llama-style shape description, the
bytes each rank holds (parameters, gradients, optimizer state, masters,
communication buffers) for DDP and FSDP at several world sizes, and which
configurations fit a memory budget. See :mod:`mlx_fsdp.plan_memory.estimate`
for what is counted.

From Python::

    from mlx_fsdp.plan_memory import estimate, shapes
    model = shapes.llama(**shapes.PRESETS["7B"])
    ranks = estimate(model, "adamw", "fsdp", 8, master_dtype="float32")
    print(max(r.peak for r in ranks))
"""

from . import optimizers, shapes
from .estimate import ACCUMULATION, MODES, RankMemory
from .estimate import estimate_ranks as estimate


__all__ = ["estimate", "optimizers", "shapes", "RankMemory", "MODES", "ACCUMULATION"]
