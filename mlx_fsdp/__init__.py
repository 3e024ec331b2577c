"""Fully sharded data parallel optimizer steps for MLX.

Wrap any ``mlx.optimizers`` optimizer with :func:`fsdp_step` and each rank
keeps and updates 1/N of the optimizer state, with the same result as plain
data parallelism (:func:`ddp_step`). Element-wise optimizers run on flat
shards; shape-aware ones (Muon, Adafactor) on whole arrays, each on one
owner rank.
"""

from .checkpoint import (
    CheckpointError,
    consolidate_checkpoint,
    load_checkpoint,
    save_checkpoint,
)
from .collectives import reduce_scatter_method, supports_sum_scatter
from .control import PeerLost, RankMismatch
from .compat import fsdp_apply_gradients
from .ddp import ReplicatedOptimizer, ddp_step
from .fsdp import ShardedOptimizer, fsdp_step
from .fully_sharded import FullyShardedModule, full_parameters, fully_shard, gathered_by_module
from .hybrid import hybrid_groups
from .placement import register_placement
from .plan import Plan, build_plan

__version__ = "0.1.0"

__all__ = [
    "fsdp_step",
    "fully_shard",
    "FullyShardedModule",
    "full_parameters",
    "gathered_by_module",
    "ddp_step",
    "fsdp_apply_gradients",
    "hybrid_groups",
    "save_checkpoint",
    "load_checkpoint",
    "consolidate_checkpoint",
    "CheckpointError",
    "RankMismatch",
    "PeerLost",
    "register_placement",
    "ShardedOptimizer",
    "ReplicatedOptimizer",
    "Plan",
    "build_plan",
    "reduce_scatter_method",
    "supports_sum_scatter",
    "__version__",
]
