"""How ``fully_shard`` keeps each parameter: axis-0 slices, or whole on an owner rank.

Element-wise optimizers update any slice of an array exactly, so by default
every rank holds its axis-0 slice of every parameter, as ``mlx.nn.fully_shard``
does. Muon orthogonalizes whole matrices and Adafactor factors them: on a
slice of rows they would silently be other optimizers. ``placement=`` keeps
such arrays whole, each on one owner rank, so that ``fsdp_step`` updates them
exactly; it takes the optimizer itself, or the rules of ``fsdp_step``'s
``placement``.
"""

from typing import Dict, List, Tuple

import mlx.core as mx
import mlx.optimizers as optim

from .. import placement as _placement
from ..plan import OWNER, ROWS


def placement_of(placement, flat: List[Tuple[str, mx.array]]) -> Dict[str, str]:
    """``{path: "rows" | "owner"}`` for the trainable arrays of a module.

    Args:
        placement: ``None`` or ``"flat"`` (axis-0 slices), ``"owner"`` (whole
            arrays on owner ranks), a callable ``(path, shape) -> "flat" |
            "owner"``, or the ``mlx.optimizers.Optimizer`` that will train
            the module (its arrays are placed as :func:`mlx_fsdp.fsdp_step`
            places them; a ``MultiOptimizer``'s filters see paths relative
            to the wrapped module).
        flat (list): ``(path, array)`` of the trainable floating-point arrays.

    Returns:
        dict: The placement of each array.
    """
    if placement is None:
        return {p: ROWS for p, _ in flat}
    if isinstance(placement, optim.Optimizer):
        rules = _placement.resolve(placement)
        chosen = _placement.placements(rules, flat, _placement.assign_optimizers(flat, placement))
    else:
        _placement.check_rule(placement, "placement")
        chosen = _placement.placements([placement], flat, [0] * len(flat))
    return {p: OWNER if c == OWNER else ROWS for (p, _), c in zip(flat, chosen)}
