"""Gradient accumulation equals one step on the concatenated batch.

Usage: accumulate.py K STEPS. Each optimizer step takes K micro-batches per
rank; the reference is plain MLX in this process on the concatenation of all
ranks' micro-batches of that step.
"""

import sys

from common import OPTIMIZERS, batch, loss_fn, make_model, max_diff, reference_clip, report

import mlx.core as mx
import mlx.nn as nn

import mlx_fsdp

K, STEPS = int(sys.argv[1]), int(sys.argv[2])
group = mx.distributed.init()
n, rank = group.size(), group.rank()


def micro(step, m, r):
    return batch(1000 * step + m, r, size=4)


ref_model, ref = make_model(bf16=False), OPTIMIZERS["adamw"]()
runs = {
    "fsdp_local": mlx_fsdp.fsdp_step(OPTIMIZERS["adamw"](), max_norm=0.5, grad_accumulation_steps=K),
    "fsdp_sharded": mlx_fsdp.fsdp_step(OPTIMIZERS["adamw"](), max_norm=0.5, grad_accumulation_steps=K,
                                       accumulation="sharded", communication_size=300),
    # Whole arrays on owner ranks, one per bucket: each rank holds nothing of
    # the other ranks' buckets, whose collectives it must run all the same.
    "fsdp_sharded_owner": mlx_fsdp.fsdp_step(OPTIMIZERS["adamw"](), max_norm=0.5,
                                             grad_accumulation_steps=K, accumulation="sharded",
                                             placement="owner", communication_size=300),
    "ddp_local": mlx_fsdp.ddp_step(OPTIMIZERS["adamw"](), max_norm=0.5, grad_accumulation_steps=K),
}
models = {name: make_model(bf16=False) for name in runs}
worst = {name: 0.0 for name in runs}
moved_early = {name: 0 for name in runs}
for step in range(STEPS):
    for name, opt in runs.items():
        model = models[name]
        for m in range(K):
            before = model.parameters()
            _, g = nn.value_and_grad(model, loss_fn)(model, *micro(step, m, rank))
            opt.update(model, g)
            mx.eval(model.parameters(), opt.state)
            if m < K - 1:
                moved_early[name] += int(max_diff(before, model.parameters()) > 0)
    parts = [micro(step, m, r) for r in range(n) for m in range(K)]
    x = mx.concatenate([p[0] for p in parts])
    y = mx.concatenate([p[1] for p in parts])
    _, g = nn.value_and_grad(ref_model, loss_fn)(ref_model, x, y)
    g, _ = reference_clip(g, 0.5)
    ref.update(ref_model, g)
    mx.eval(ref_model.parameters(), ref.state)
    for name, model in models.items():
        worst[name] = max(worst[name], max_diff(model.parameters(), ref_model.parameters()))

report(group, n=n, k=K, steps=STEPS, max_diff=worst, moved_early=moved_early,
       opt_steps={name: opt.step.item() for name, opt in runs.items()},
       ref_steps=ref.step.item())
