"""Parameter sharding of an mlx-lm model for training, and the whole model back after it.

mlx-lm's models list their transformer blocks as ``model.layers`` (wherever
the architecture keeps them: ``model.model.layers`` for Llama and Qwen3).
:func:`shard_model` wraps each block with :func:`mlx_fsdp.fully_shard`, then
the whole model (the embeddings, the final norm, the head), so that a block's
parameters are whole only while it runs. :func:`unshard_model` gathers the
trained parameters back into the model as mlx-lm built it, on every rank, so
that mlx-lm's own save, evaluation and generation take it unchanged.
"""

from typing import Optional

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from ..fully_sharded import FullyShardedModule, full_parameters, fully_shard, plain_paths
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


def trainable_weights(model: nn.Module) -> dict:
    """``{path: array}`` of the trainable parameters, whole, under the paths mlx-lm saves.

    With a fully sharded model this is a collective (every rank must call it)
    that gathers the whole model on every rank; otherwise it communicates nothing.
    """
    weights = dict(tree_flatten(model.trainable_parameters()))
    if not sharded_modules(model):
        return weights
    plain = plain_paths(model)
    full = dict(tree_flatten(full_parameters(model)))
    weights = {plain[p]: full[plain[p]] for p in weights}
    mx.eval(weights)  # here, on every rank: the gathers are collectives
    return weights
