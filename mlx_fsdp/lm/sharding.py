"""Parameter sharding of an mlx-lm model for training, and the whole model back after it.

mlx-lm's models list their transformer blocks as ``model.layers`` (wherever
the architecture keeps them: ``model.model.layers`` for Llama and Qwen3).
:func:`shard_model` wraps each block with :func:`mlx_fsdp.fully_shard`, then
the whole model (the embeddings, the final norm, the head), so that a block's
parameters are whole only while it runs. :func:`unshard_model` gathers the
trained parameters back into the model as mlx-lm built it, on every rank, so
that mlx-lm's own save, evaluation and generation take it unchanged. Without
it, :func:`save_adapters` and :func:`save_whole_weights` write the whole
trained weights from the shards, gathered one wrapped module at a time, so
that no rank ever holds the whole model.
"""

import json
import os
import shutil
from contextlib import nullcontext
from typing import Iterator, Optional

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from ..checkpoint.streamed import streamed_safetensors
from ..fully_sharded import (FullyShardedModule, full_parameters, fully_shard,
                             gathered_by_module, plain_paths)
from ..fully_sharded.model import sharded_modules


def check_options(fsdp: bool, fully_shard: bool, reshard_after_forward: bool):
    """Refuse what cannot train a fully sharded model.

    Raises:
        ValueError: For ``fully_shard`` without ``fsdp`` (``ddp_step`` would
            average gradients that arrive averaged and sharded), or
            ``reshard_after_forward`` without ``fully_shard``.
    """
    if fully_shard and not fsdp:
        raise ValueError(
            "fully_shard=True (--fully-shard) with fsdp=False (--no-fsdp): ddp_step cannot "
            "step a fully sharded model, whose gradients arrive averaged and cut into the "
            "ranks' shards. Drop --no-fsdp (fsdp_step updates the shards), or --fully-shard.")
    if reshard_after_forward and not fully_shard:
        raise ValueError(
            "reshard_after_forward=True (--reshard-after-forward) needs fully_shard=True "
            "(--fully-shard): only fully sharded blocks gather parameters to free. Add "
            "--fully-shard, or use --grad-checkpoint to recompute the blocks.")


def _blocks(model: nn.Module) -> list:
    blocks = getattr(model, "layers", None)
    if not isinstance(blocks, (list, tuple)) or not blocks:
        raise ValueError(
            f"{type(model).__name__} has no list of transformer blocks as `model.layers` (found "
            f"{type(blocks).__name__}), which fully sharding wraps one by one. Shard it "
            "yourself with mlx_fsdp.fully_shard and pass the wrapped model, fully_shard=False.")
    return list(blocks)


def _replace(model: nn.Module, path: str, value):
    """Put ``value`` at the module path ``path`` (``"model.layers.0"``) of ``model``."""
    *parents, last = path.split(".")
    node = model
    for key in parents:
        node = node[int(key)] if isinstance(node, list) else node[key]
    node[int(last) if isinstance(node, list) else last] = value


def shard_model(model: nn.Module, *, reshard_after_forward: bool = False,
                communication_size: Optional[int] = None) -> nn.Module:
    """Wrap each block of ``model.layers``, then ``model``, with :func:`mlx_fsdp.fully_shard`.

    The blocks are replaced inside ``model`` itself, where they are in its
    tree; ``model``'s own parameters become this rank's shards too. Train
    the returned wrapper, then call :func:`unshard_model`. With one process
    this returns ``model`` unchanged.

    Args:
        model (mlx.nn.Module): An mlx-lm model, frozen and unfrozen for training.
        reshard_after_forward (bool): Free each block's gathered parameters
            after its forward pass and recompute the block in the backward
            pass. Default: ``False``.
        communication_size (int, optional): Bucket bytes of the gathers.
            Default: ``None`` (``fully_shard``'s).

    Returns:
        mlx.nn.Module: The model to train.

    Raises:
        ValueError: If ``model`` has no ``layers`` list.
    """
    names = {id(m): name for name, m in model.named_modules()}
    for block in _blocks(model):
        _replace(model, names[id(block)], fully_shard(
            block, reshard_after_forward=reshard_after_forward,
            communication_size=communication_size))
    return fully_shard(model, communication_size=communication_size)


def unshard_model(trained: nn.Module, model: nn.Module):
    """Put the whole parameters of ``trained`` (:func:`shard_model`'s) back into ``model``.

    A collective: every rank must call it, and every rank gets the whole
    model, unwrapped, as mlx-lm built it.
    """
    if trained is model:
        return
    full = full_parameters(trained)
    for name, m in model.named_modules():
        if isinstance(m, FullyShardedModule):
            _replace(model, name, m.module)
    model.update(full)
    mx.eval(model.parameters())  # on every rank: the gathers are collectives


def trainable_parts(model: nn.Module) -> Iterator[dict]:
    """The trainable parameters, whole, under the paths mlx-lm saves, a part at a time.

    With a fully sharded model this is a collective (every rank must run it
    to its end) that gathers one wrapped module at a time and keeps its
    trainable arrays, so no rank ever holds the whole model (for LoRA, the
    frozen base is dropped as it comes); otherwise one part, with no
    communication.
    """
    weights = dict(tree_flatten(model.trainable_parameters()))
    if not sharded_modules(model):
        yield weights
        return
    plain = plain_paths(model)
    trained = {plain[p] for p in weights}
    yield from gathered_by_module(model, keep=trained.__contains__)


def save_whole_weights(path: str, model: nn.Module):
    """Write the whole weights of a fully sharded ``model`` as ``mlx_lm.load`` reads them.

    A collective: every rank must call it. One wrapped module is gathered at
    a time (:func:`~mlx_fsdp.fully_sharded.gathered_by_module`) and rank 0
    writes it to a file of its own, ``model-0000i-of-0000K.safetensors``,
    then ``model.safetensors.index.json``, as mlx-lm's ``save_model`` names
    them; so no rank ever holds the whole model.

    Args:
        path (str): The model directory (created).
        model (mlx.nn.Module): The trained model, wrapped by :func:`shard_model`.
    """
    rank = mx.distributed.init().rank()
    written, index, total = [], {}, 0
    for part in gathered_by_module(model):
        if rank == 0 and part:
            os.makedirs(path, exist_ok=True)
            name = os.path.join(path, f".model-{len(written):05d}.tmp.safetensors")
            mx.save_safetensors(name, part, metadata={"format": "mlx"})
            written.append((name, sorted(part)))
            total += sum(a.nbytes for a in part.values())
        del part
    for i, (name, keys) in enumerate(written):
        final = f"model-{i + 1:05d}-of-{len(written):05d}.safetensors"
        os.replace(name, os.path.join(path, final))
        index.update(dict.fromkeys(keys, final))
    if rank == 0:
        with open(os.path.join(path, "model.safetensors.index.json"), "w") as fh:
            json.dump({"metadata": {"total_size": total},
                       "weight_map": dict(sorted(index.items()))}, fh, indent=4)


def save_adapters(adapter_file: str, model, iteration: Optional[int] = None):
    """Write the trainable parameters as mlx-lm does: ``adapters.safetensors``, and a numbered copy.

    Rank 0 writes. Call it on every rank, or on rank 0 alone for a model
    without :func:`mlx_fsdp.fully_shard`: a fully sharded model's parameters
    are gathered a module at a time (a collective), and written whole under
    the paths of the model without ``fully_shard``.

    Args:
        adapter_file (str): mlx-lm's ``adapter_file`` (``.../adapters.safetensors``).
        model (mlx.nn.Module): The model.
        iteration (int, optional): Also write ``{iteration:07d}_adapters.safetensors``
            next to it. Default: ``None``.
    """
    writing = mx.distributed.init().rank() == 0
    # A part at a time: a full fine-tune's trainable arrays are the whole model.
    with streamed_safetensors(str(adapter_file)) if writing else nullcontext() as out:
        for part in trainable_parts(model):
            if writing:
                out.add(part)
    if writing and iteration is not None:
        shutil.copyfile(str(adapter_file), os.path.join(
            os.path.dirname(str(adapter_file)), f"{iteration:07d}_adapters.safetensors"))
