"""One file in plain MLX layout from a sharded checkpoint (like DeepSpeed's zero_to_fp32).

Keys of the consolidated safetensors file:

* ``model.{path}``: the model parameters, whole, under their plain paths
  (those of the model without ``fully_shard``), e.g. ``model.layers.0.weight``;
* ``optimizer.{key}``: the optimizer state exactly as ``tree_flatten`` names a
  plain MLX optimizer's state, e.g. ``optimizer.step``,
  ``optimizer.learning_rate``, ``optimizer.layers.0.weight.m``; for a
  ``MultiOptimizer``, ``optimizer.states.{k}.{...}``;
* ``master.{path}``: fp32 master weights, if the checkpoint has them.

A checkpoint saved with ``weights="trainable"`` has ``model.*`` keys for the
trainable parameters only (the file's metadata says ``weights: trainable``).

So a plain MLX run continues with::

    arrays = mx.load(OUT)
    model.load_weights([(k[6:], v) for k, v in arrays.items() if k.startswith("model.")])
    opt.state = tree_unflatten([(k[10:], v) for k, v in arrays.items()
                                if k.startswith("optimizer.")])
"""

import json
import os

import mlx.core as mx

from .reader import read_checkpoint


def consolidate_checkpoint(path: str, out: str):
    """Write the checkpoint at ``path`` as one safetensors file ``out``.

    The checksums are verified first. Runs in one process, without the model
    or the optimizer: everything comes from the checkpoint. The file appears
    at ``out`` only when complete.

    Args:
        path (str): A checkpoint directory written by :func:`save_checkpoint`.
        out (str): The output file (``.safetensors`` is appended if missing).
    """
    path = os.path.abspath(path)
    manifest, weights, states, scalars, master = read_checkpoint(path)

    arrays = {f"model.{k}": v for k, v in weights.items()}
    multi = "sub_optimizers" in manifest["optimizer"]
    for k in range(len(states)):
        prefix = f"optimizer.states.{k}." if multi else "optimizer."
        arrays.update({prefix + name: v for name, v in scalars[k].items()})
        arrays.update({f"{prefix}{p}.{name}": v
                       for p, entries in states[k].items() for name, v in entries.items()})
    arrays.update({f"master.{p}": v for p, v in master.items()})

    if not out.endswith(".safetensors"):
        out += ".safetensors"
    out = os.path.abspath(out)
    tmp = os.path.join(os.path.dirname(out), f".{os.path.basename(out)}.partial.safetensors")
    metadata = {
        "format": "mlx_fsdp-consolidated",
        "source": path,
        "step": str(manifest["step"]),
        "weights": manifest["model"].get("weights", "all"),
        "optimizer": json.dumps(manifest["optimizer"]),
    }
    mx.save_safetensors(tmp, arrays, metadata)
    os.replace(tmp, out)
    return out
