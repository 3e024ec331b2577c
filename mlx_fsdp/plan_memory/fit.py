"""The largest model that fits: a Llama-style width, with as many layers as fit.

The width (``dims``, ``ffn``, ``vocab``, heads) stays as described; the
layer count grows. Every mode's peak grows with the layer count (each layer
adds its parameters, gradients and state, under ``fully_shard`` its shards,
and, given a batch, its activations), so the most layers that fit is found
by doubling, then bisecting.
"""

from typing import Callable, List, NamedTuple, Optional

from . import shapes
from .estimate import estimate_ranks
from .report import Row

#: The most layers tried: a model this deep at the given width fits at least.
MAX_LAYERS = 1 << 16


class Fit(NamedTuple):
    """The largest model of one configuration.

    Attributes:
        layers (int): The most layers that fit (0: not even one).
        parameters (int): That model's parameters (0 when none fits).
        row (Row): That model's answer; with ``layers == 0``, one layer's
            (which does not fit).
        at_least (bool): Whether :data:`MAX_LAYERS` fit, so more would too.
    """

    layers: int
    parameters: int
    row: Row
    at_least: bool


def largest(fields: dict, optimizer: str, mode: str, world_size: int, memory: int,
            activations: Optional[Callable[[shapes.Model, str, int], int]] = None,
            transform: Callable[[shapes.Model], shapes.Model] = lambda m: m,
            **options) -> Fit:
    """The most layers of a Llama-style model whose fullest rank fits ``memory``.

    Args:
        fields (dict): :func:`shapes.llama`'s arguments but ``layers``.
        optimizer (str): A key of :data:`optimizers.OPTIMIZERS`.
        mode (str): ``"ddp"``, ``"fsdp"`` or ``"fully_shard"``.
        world_size (int): Ranks.
        memory (int): Bytes per rank.
        activations (callable, optional): ``(model, mode, world_size) ->`` the
            model's activation bytes (they grow with its layers; fully_shard's
            resharded blocks recompute theirs). Default: ``None`` (none counted).
        transform (callable, optional): What training makes of each model
            (:func:`mlx_fsdp.plan_memory.lora.with_lora`). Default: the model itself.
        **options: The other keyword arguments of :func:`estimate_ranks`.

    Returns:
        Fit: The answer.
    """
    def attempt(layers: int):
        model = transform(shapes.llama(layers=layers, **fields))
        acts = activations(model, mode, world_size) if activations is not None else 0
        row = Row(optimizer, mode, world_size,
                  estimate_ranks(model, optimizer, mode, world_size, activations=acts, **options))
        return row, model.num_parameters

    row, count = attempt(1)
    if not row.fits(memory):
        return Fit(0, 0, row, False)
    best, lo, hi = (row, count), 1, 2
    while hi <= MAX_LAYERS:
        row, count = attempt(hi)
        if not row.fits(memory):
            break
        best, lo, hi = (row, count), hi, 2 * hi
    else:
        return Fit(lo, best[1], best[0], True)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        row, count = attempt(mid)
        if row.fits(memory):
            best, lo = (row, count), mid
        else:
            hi = mid
    return Fit(lo, best[1], best[0], False)


def search(fields: dict, optimizers: List[str], modes: List[str], ranks: List[int],
           memory: int, **options) -> dict:
    """``{optimizer: [Fit per mode and world size]}``."""
    return {name: [largest(fields, name, mode, n, memory, **options)
                   for mode in modes for n in sorted(set(ranks))] for name in optimizers}


def layer_parameters(fields: dict) -> int:
    """Parameters of one more layer at this width."""
    one, two = (shapes.llama(layers=k, **fields).num_parameters for k in (1, 2))
    return two - one


def to_dict(fit: Fit, memory: Optional[int]) -> dict:
    return dict(fit.row.to_dict(memory), layers=fit.layers, parameters=fit.parameters,
                at_least=fit.at_least)
