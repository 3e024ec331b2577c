"""The unsharded step: clip, then the plain optimizer (through masters if asked).

``ddp_step`` runs it after averaging the gradients, and ``fsdp_step`` runs it
when there is a single process, where sharding has nothing to split.
"""

from typing import Any, Optional, Tuple

import mlx.core as mx
from mlx.utils import tree_flatten

from . import _trees, clip, master


def plain_step(
    gradients: Any,
    parameters: Any,
    optimizer,
    *,
    max_norm: Optional[float] = None,
    masters: Optional[dict] = None,
    master_dtype: Optional[mx.Dtype] = None,
) -> Tuple[Any, Optional[mx.array]]:
    """Clip ``gradients`` by their global norm and apply them with ``optimizer``.

    Args:
        gradients: The (already averaged) gradients.
        parameters: The parameters, a superset of the gradients' paths.
        optimizer (mlx.optimizers.Optimizer): The plain optimizer.
        max_norm (float, optional): Clip to this norm. Default: ``None``.
        masters (dict, optional): ``{path: master}``, updated in place.
            Default: ``None``.
        master_dtype (Dtype, optional): Step low-precision parameters through
            masters of this dtype. Default: ``None``.

    Returns:
        tuple: The updated parameters (shaped like ``gradients``) and the
        norm before clipping (``None`` without ``max_norm``).
    """
    norm = None
    if max_norm is not None:
        gradients, norm = clip.clip_tree(gradients, max_norm)
    if master_dtype is None:
        return optimizer.apply_gradients(gradients, parameters), norm
    flat_grads, flat_params = _trees.match(gradients, parameters)
    paths = [k for k, _ in flat_grads]
    steps, grads = master.lift(
        paths, flat_params, [g for _, g in flat_grads], masters, master_dtype
    )
    new = optimizer.apply_gradients(_trees.like(gradients, grads), _trees.like(gradients, steps))
    new = master.lower(
        paths, [v for _, v in tree_flatten(new)], [p.dtype for p in flat_params],
        masters, master_dtype,
    )
    return _trees.like(gradients, new), norm
