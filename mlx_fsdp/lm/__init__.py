"""Fine-tuning with mlx-lm on a sharded optimizer (needs the ``lm`` extra).

- :func:`train`: ``mlx_lm.tuner.trainer.train`` with :func:`~mlx_fsdp.fsdp_step`,
  sharded checkpoints and resume at any number of ranks;
- :func:`sharded_training`: a context manager that hands mlx-lm's own
  ``train`` a sharded optimizer and turns its redundant all-reduce off;
- ``python -m mlx_fsdp.lora``: ``mlx_lm.lora`` on top of :func:`train`.

mlx-lm is imported when these are called, not when this package is imported.
"""

from .hooks import trainer_all_reduce_removed
from .sharding import save_adapters
from .train import sharded_training, train

__all__ = ["train", "sharded_training", "trainer_all_reduce_removed", "save_adapters"]
