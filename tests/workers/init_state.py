"""init() before the first step builds this rank's shard state, and the step uses it."""

from common import OPTIMIZERS, batch, loss_fn, make_model, max_diff, report

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

import mlx_fsdp
from mlx_fsdp.sharded_state import held_shapes

group = mx.distributed.init()
model, lazy_model = make_model(), make_model()
opt = mlx_fsdp.fsdp_step(OPTIMIZERS["adam"](), communication_size=300)
lazy = mlx_fsdp.fsdp_step(OPTIMIZERS["adam"](), communication_size=300)
opt.init(model.trainable_parameters())
state = opt.state["optimizer"]
lengths = {k: v["m"].shape[0] for k, v in state.items() if isinstance(v, dict)}
held = {p: s[0] for p, s in held_shapes(opt.plan, group.rank(), 0).items()}
fits_plan = lengths == held
for step in range(2):
    for m, o in ((model, opt), (lazy_model, lazy)):
        _, g = nn.value_and_grad(m, loss_fn)(m, *batch(step, group.rank()))
        o.update(m, g)
    mx.eval(model.parameters(), lazy_model.parameters(), opt.state, lazy.state)
report(group, lengths=lengths, fits_plan=fits_plan, max_diff=max_diff(model.parameters(), lazy_model.parameters()),
       same_state=sorted(k for k, _ in tree_flatten(opt.state)) == sorted(k for k, _ in tree_flatten(lazy.state)))
