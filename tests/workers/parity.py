"""FSDP vs DDP vs plain MLX on averaged gradients, step after step.

Usage: parity.py STEPS CONFIG [CONFIG ...], each CONFIG ``optimizer:max_norm:comm:bf16``
(``max_norm`` < 0 disables clipping; ``bf16`` is 0 or 1). Prints one RESULT line
per config on rank 0.
"""

import sys

from common import (OPTIMIZERS, averaged_grads, batch, loss_fn, make_model, max_diff,
                    reference_clip, reference_update, report)

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

import mlx_fsdp
from mlx_fsdp import fused

# Counts the steps' compiled updates: ddp_step must compile wherever
# fsdp_step does, or the two round apart on a GPU.
_CALLS = [0]
_apply = fused.FusedUpdates.apply


def _counted(self, *args):
    _CALLS[0] += 1
    return _apply(self, *args)


fused.FusedUpdates.apply = _counted


def run(group, name, max_norm, comm, bf16, steps):
    n, rank = group.size(), group.rank()
    fsdp_model, ddp_model, ref_model = (make_model(bf16=bf16) for _ in range(3))
    fsdp = mlx_fsdp.fsdp_step(OPTIMIZERS[name](), max_norm=max_norm, communication_size=comm)
    ddp = mlx_fsdp.ddp_step(OPTIMIZERS[name](), max_norm=max_norm, communication_size=comm)
    ref = OPTIMIZERS[name]()
    ref_update = reference_update(ref, n)

    worst = dict(fsdp_ref_f32=0.0, fsdp_ddp_f32=0.0, fsdp_ref_bf16=0.0,
                 fsdp_ddp_bf16=0.0, norm_ref=0.0, norm_ddp=0.0)
    clipped, compiled = 0, {"fsdp": 0, "ddp": 0}
    for step in range(steps):
        x, y = batch(step, rank)
        _, g = nn.value_and_grad(fsdp_model, loss_fn)(fsdp_model, x, y)
        before = _CALLS[0]
        fsdp.update(fsdp_model, g)
        compiled["fsdp"] += _CALLS[0] - before
        # Each step is evaluated on its own, as in training: a graph that also
        # holds the other models' collectives could hide a misordered step.
        mx.eval(fsdp_model.parameters(), fsdp.state)
        _, g = nn.value_and_grad(ddp_model, loss_fn)(ddp_model, x, y)
        before = _CALLS[0]
        ddp.update(ddp_model, g)
        compiled["ddp"] += _CALLS[0] - before
        mx.eval(ddp_model.parameters(), ddp.state)
        g = averaged_grads(ref_model, step, n)
        if max_norm is not None:
            g, ref_norm = reference_clip(g, max_norm)
        ref_update(ref_model, g)
        mx.eval(ref_model.parameters(), ref.state)
        p, d, r = fsdp_model.parameters(), ddp_model.parameters(), ref_model.parameters()
        for key, other in (("ref", r), ("ddp", d)):
            worst[f"fsdp_{key}_f32"] = max(worst[f"fsdp_{key}_f32"], max_diff(p, other, mx.float32))
            worst[f"fsdp_{key}_bf16"] = max(worst[f"fsdp_{key}_bf16"], max_diff(p, other, mx.bfloat16))
        if max_norm is not None:
            norm = fsdp.grad_norm.item()
            worst["norm_ref"] = max(worst["norm_ref"], abs(norm - ref_norm.item()))
            worst["norm_ddp"] = max(worst["norm_ddp"], abs(norm - ddp.grad_norm.item()))
            clipped += int(norm > max_norm)
    dtypes = sorted({str(v.dtype).rsplit(".", 1)[-1] for _, v in tree_flatten(fsdp_model.parameters())})
    state_dtypes = {k: str(v.dtype).rsplit(".", 1)[-1] for k, v in tree_flatten(fsdp_model.parameters())}
    report(group, config=f"{name}:{max_norm}:{comm}:{int(bf16)}", n=n, steps=steps, dtypes=dtypes,
           method=mlx_fsdp.reduce_scatter_method(group) if n > 1 else None,
           clipped=clipped, compiled_updates=compiled, buckets=len(fsdp.plan.buckets) if fsdp.plan else 0,
           param_dtypes=state_dtypes, **worst)


def main():
    group = mx.distributed.init()
    steps = int(sys.argv[1])
    for cfg in sys.argv[2:]:
        name, max_norm, comm, bf16 = cfg.split(":")
        max_norm = None if float(max_norm) < 0 else float(max_norm)
        run(group, name, max_norm, int(comm), bool(int(bf16)), steps)


if __name__ == "__main__":
    main()
