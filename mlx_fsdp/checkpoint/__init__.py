"""Sharded checkpoints that load at any world size, and their consolidation.

See :func:`save_checkpoint`, :func:`load_checkpoint` and
:func:`consolidate_checkpoint`; the on-disk format is described in
:mod:`mlx_fsdp.checkpoint.manifest`.
"""

from .consolidate import consolidate_checkpoint
from .load import load_checkpoint
from .manifest import CheckpointError
from .save import save_checkpoint

__all__ = ["save_checkpoint", "load_checkpoint", "consolidate_checkpoint", "CheckpointError"]
