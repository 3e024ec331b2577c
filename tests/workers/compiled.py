"""fsdp_step inside mx.compile (state = [model.state, opt.state]) equals eager.

Usage: compiled.py CONFIG [CONFIG ...], each ``optimizer:communication_size[:k:mode]``
(``k`` micro-batches per step, accumulated ``mode`` = local | sharded).
"""

import sys
from functools import partial

from common import OPTIMIZERS, batch, loss_fn, make_model, max_diff, report

import mlx.core as mx
import mlx.nn as nn

import mlx_fsdp


def run(group, name, comm, k=1, mode="local"):
    rank = group.rank()
    eager_model, comp_model = make_model(), make_model()
    kw = dict(max_norm=0.5, communication_size=comm, grad_accumulation_steps=k)
    # Inside mx.compile every micro-batch is reduce-scattered whatever the mode
    # (the graph cannot skip collectives), so the eager reference sums the
    # same way: sharded (local sums bfloat16 gradients in another order).
    eager = mlx_fsdp.fsdp_step(OPTIMIZERS[name](), accumulation="sharded" if k > 1 else mode, **kw)
    comp = mlx_fsdp.fsdp_step(OPTIMIZERS[name](), accumulation=mode, **kw)
    state = [comp_model.state, comp.state]

    @partial(mx.compile, inputs=state, outputs=state)
    def train_step(x, y):
        loss, g = nn.value_and_grad(comp_model, loss_fn)(comp_model, x, y)
        comp.update(comp_model, g)
        return loss

    worst, norm_err = 0.0, 0.0
    for step in range(5):
        x, y = batch(step, rank)
        _, g = nn.value_and_grad(eager_model, loss_fn)(eager_model, x, y)
        eager.update(eager_model, g)
        mx.eval(eager_model.parameters(), eager.state)
        # Evaluated apart: a compiled graph cannot be chained after another
        # step's collectives, so two steps in one evaluation could interleave
        # their collectives differently on different ranks.
        loss = train_step(x, y)
        mx.eval(loss, state)
        worst = max(worst, max_diff(comp_model.parameters(), eager_model.parameters()))
        if eager.grad_norm is not None:  # a step has run (not only micro-batches)
            norm_err = max(norm_err, abs(comp.grad_norm.item() / eager.grad_norm.item() - 1))
    report(group, config=":".join(map(str, (name, comm) if k == 1 else (name, comm, k, mode))),
           n=group.size(), max_diff=worst, norm_err=norm_err, steps=comp.step.item(),
           micro=comp.micro_step, eager_steps=eager.step.item())


group = mx.distributed.init()
for cfg in sys.argv[1:]:
    name, comm, *acc = cfg.split(":")
    run(group, name, int(comm), *([int(acc[0]), acc[1]] if acc else []))
