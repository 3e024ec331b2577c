"""Training checkpoints of an mlx-lm run: ``DIR/step-0000100``, one per save.

Each is an :func:`mlx_fsdp.save_checkpoint` directory (loads at any world
size) with the trainable parameters only, whose manifest also holds, under
``"user"``, the iteration, mlx-lm's data position (see
:mod:`mlx_fsdp.lm.position`), MLX's random key and the settings that fix the
batch order. Of a model trained with :func:`mlx_fsdp.fully_shard` each rank
writes only the parameter shards it holds; the checkpoint names them by the
paths of the model without ``fully_shard``, so a run resumes from it with or
without ``fully_shard``, and the other way round.
"""

import os
import re
from typing import Optional

import mlx.core as mx

from ..checkpoint import load_checkpoint, save_checkpoint
from .hooks import mlx_lm_version

_STEP = re.compile(r"^step-(\d+)$")

#: Settings that must match for a resumed run to see the same batches.
ORDER_SETTINGS = ("batch_size", "grad_accumulation_steps")


def step_path(directory: str, iteration: int) -> str:
    """The checkpoint directory of ``iteration`` under ``directory``."""
    return os.path.join(directory, f"step-{iteration:07d}")


def latest(directory: str) -> Optional[str]:
    """The complete checkpoint with the highest iteration under ``directory``, or ``None``."""
    if not os.path.isdir(directory):
        return None
    found = [(int(m.group(1)), name) for name in os.listdir(directory)
             if (m := _STEP.match(name))
             and os.path.isfile(os.path.join(directory, name, "manifest.json"))]
    return os.path.join(directory, max(found)[1]) if found else None


def save(directory: str, model, optimizer, position: dict, settings: dict) -> str:
    """Save a checkpoint of ``model`` and ``optimizer`` at ``position["iteration"]``.

    Every rank must call it.

    Args:
        directory (str): The run's checkpoint directory.
        model (mlx.nn.Module): The model.
        optimizer: The optimizer (a wrapper or a plain one).
        position (dict): :meth:`ResumableBatches.position`.
        settings (dict): The values of :data:`ORDER_SETTINGS`.

    Returns:
        str: The checkpoint's path.
    """
    path = step_path(directory, position["iteration"])
    key = mx.random.state[0].tolist()
    metadata = {"iteration": position["iteration"], "data": position, "random_key": key,
                "mlx_lm": mlx_lm_version(), **{k: settings[k] for k in ORDER_SETTINGS}}
    # Only what trains (LoRA: the adapters): the rest is the base model, which
    # a resumed run loads from --model before the checkpoint.
    save_checkpoint(path, model, optimizer, metadata=metadata, weights="trainable")
    return path


def load(path: str, model, optimizer, settings: dict) -> dict:
    """Load the checkpoint at ``path``; return its metadata (see :func:`save`).

    Also restores MLX's global random key (dropout continues as it would
    have). Every rank must call it.

    Raises:
        ValueError: If a setting that fixes the batch order differs.
    """
    meta = load_checkpoint(path, model, optimizer)["user"]
    differ = [f"{k}={settings[k]!r} (saved with {meta[k]!r})"
              for k in ORDER_SETTINGS if meta.get(k) != settings[k]]
    if differ:
        raise ValueError(
            f"Cannot resume from {path}: {', '.join(differ)}. The batches of the run "
            "depend on these; resume with the saved values."
        )
    hi, lo = meta["random_key"]
    mx.random.seed((hi << 32) | lo)  # seed(k) sets the key to (k >> 32, k & 0xffffffff)
    return meta
