"""Mixed precision: optimizer steps on master copies in a wider dtype.

A model trained in bfloat16 loses small updates when they are added to
bfloat16 weights. With ``master_dtype=mx.float32`` the optimizer instead
updates a float32 copy of every lower-precision parameter (its "master") and
the model receives the master rounded to the parameter's dtype.

Both wrappers use the functions here on ``{path: array}`` dicts: ``ddp_step``
on whole parameters, so every rank holds every master; ``fsdp_step`` on this
rank's pieces, so it holds 1/N of them. The masters live in the wrapper's
``state["master"][path]`` in the same layout as the optimizer state of that
parameter.
"""

from typing import Dict, Optional, Sequence

import mlx.core as mx


def has_master(param_dtype: mx.Dtype, master_dtype: Optional[mx.Dtype]) -> bool:
    """Whether a parameter of ``param_dtype`` is stepped through a master copy."""
    return master_dtype is not None and param_dtype != master_dtype


def lift(paths: Sequence[str], params: Sequence[mx.array], grads: Sequence[mx.array],
         masters: Dict[str, mx.array], master_dtype: Optional[mx.Dtype]):
    """What the optimizer steps: masters for low-precision parameters.

    A parameter without a master yet (first step, or a checkpoint without
    masters) gets one from its current value.

    Args:
        paths (list[str]): The parameters' paths.
        params (list[array]): The parameters (or this rank's pieces of them).
        grads (list[array]): The matching gradients.
        masters (dict): ``{path: master}`` kept by the wrapper.
        master_dtype (Dtype, optional): The masters' dtype; ``None`` turns
            master copies off.

    Returns:
        tuple: The parameters and gradients to give the optimizer.
    """
    up = [has_master(p.dtype, master_dtype) for p in params]
    steps = [masters.get(k, p.astype(master_dtype)) if u else p for k, p, u in zip(paths, params, up)]
    return steps, [g.astype(master_dtype) if u else g for g, u in zip(grads, up)]


def lower(paths: Sequence[str], new: Sequence[mx.array], param_dtypes: Sequence[mx.Dtype],
          masters: Dict[str, mx.array], master_dtype: Optional[mx.Dtype]):
    """Store the updated masters and return the parameters in their own dtypes.

    Args:
        paths (list[str]): The parameters' paths.
        new (list[array]): The optimizer's output for each parameter.
        param_dtypes (list[Dtype]): Each parameter's own dtype.
        masters (dict): ``{path: master}``, updated in place.
        master_dtype (Dtype, optional): As for :func:`lift`.

    Returns:
        list[array]: The new parameters (or pieces), each in its own dtype.
    """
    down = [has_master(dtype, master_dtype) for dtype in param_dtypes]
    masters.update((k, v) for k, v, d in zip(paths, new, down) if d)
    return [v.astype(dtype) if d else v for v, dtype, d in zip(new, param_dtypes, down)]


def initial(
    paths: Sequence[str],
    params: Sequence[mx.array],
    masters: Optional[Dict[str, mx.array]],
    master_dtype: Optional[mx.Dtype],
):
    """Create (and store) the masters of ``params``; what the optimizer is
    initialized with, so that its state takes the masters' dtype.

    Returns:
        list[array]: ``params`` with low-precision entries replaced by masters.
    """
    steps, _ = lift(paths, params, params, masters or {}, master_dtype)
    for path, p, s in zip(paths, params, steps):
        if has_master(p.dtype, master_dtype):
            masters[path] = s
    return steps
