"""Owner placement inside mx.compile equals the eager step (Muon/AdamW, clipping)."""

from functools import partial

from common import max_diff, report
from owners import OPTIMIZERS, loss_fn, make_model

import mlx.core as mx
import mlx.nn as nn

import mlx_fsdp

group = mx.distributed.init()
rank = group.rank()
eager_model, comp_model = make_model(), make_model()
eager = mlx_fsdp.fsdp_step(OPTIMIZERS["muon_adamw"](), max_norm=0.5, communication_size=300)
comp = mlx_fsdp.fsdp_step(OPTIMIZERS["muon_adamw"](), max_norm=0.5, communication_size=300)
state = [comp_model.state, comp.state]


@partial(mx.compile, inputs=state, outputs=state)
def train_step(step):
    loss, g = nn.value_and_grad(comp_model, loss_fn)(comp_model, step, rank)
    comp.update(comp_model, g)
    return loss


worst = 0.0
for step in range(3):
    _, g = nn.value_and_grad(eager_model, loss_fn)(eager_model, step, rank)
    eager.update(eager_model, g)
    loss = train_step(step)
    mx.eval(loss, state, eager_model.parameters(), eager.state)
    worst = max(worst, max_diff(comp_model.parameters(), eager_model.parameters()))
report(group, n=group.size(), max_diff=worst, owner_buckets=sum(b.owned for b in comp.plan.buckets))
