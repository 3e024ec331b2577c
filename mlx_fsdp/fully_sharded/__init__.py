"""Parameter sharding (ZeRO-3): ``fully_shard`` and the optimizer step on its shards.

:func:`fully_shard` wraps a module so that each rank keeps only its part of
the module's parameters (:mod:`.wrap`, :mod:`.module`); the module gathers
them for its call and reduce-scatters their gradients in the backward pass
(:mod:`.gather`, :mod:`.remat`). :func:`mlx_fsdp.fsdp_step` then updates the
shards where they are, with no collective of its own besides the gradient
norm (:mod:`.model` plans it). :func:`full_parameters` gathers the whole
model under the paths it has without ``fully_shard``, and
:func:`gathered_by_module` one module at a time (:mod:`.full`).
"""

from .full import full_parameters, gathered_by_module, plain_paths
from .module import FullyShardedModule
from .wrap import fully_shard

__all__ = ["FullyShardedModule", "fully_shard", "full_parameters", "gathered_by_module",
           "plain_paths"]
