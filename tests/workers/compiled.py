"""fsdp_step inside mx.compile (state = [model.state, opt.state]) equals eager.

Usage: compiled.py CONFIG [CONFIG ...], each ``optimizer:communication_size``.
"""

import sys
from functools import partial

from common import OPTIMIZERS, batch, loss_fn, make_model, max_diff, report

import mlx.core as mx
import mlx.nn as nn

import mlx_fsdp


def run(group, name, comm):
    rank = group.rank()
    eager_model, comp_model = make_model(), make_model()
    eager = mlx_fsdp.fsdp_step(OPTIMIZERS[name](), max_norm=0.5, communication_size=comm)
    comp = mlx_fsdp.fsdp_step(OPTIMIZERS[name](), max_norm=0.5, communication_size=comm)
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
        loss = train_step(x, y)
        mx.eval(loss, state, eager_model.parameters(), eager.state)
        worst = max(worst, max_diff(comp_model.parameters(), eager_model.parameters()))
        norm_err = max(norm_err, abs(comp.grad_norm.item() / eager.grad_norm.item() - 1))
    report(group, config=f"{name}:{comm}", n=group.size(), max_diff=worst,
           norm_err=norm_err, steps=comp.step.item())


group = mx.distributed.init()
for cfg in sys.argv[1:]:
    name, comm = cfg.split(":")
    run(group, name, int(comm))
