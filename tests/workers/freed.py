"""What handing the model its new parameters frees on each rank, against the plan.

Usage: freed.py HIDDEN LAYERS BUCKET_BYTES

``fsdp_step`` with Adafactor on an MLP of ``LAYERS`` ``HIDDEN`` x ``HIDDEN``
layers: every matrix whole on an owner rank. Reported per rank, at the third
step: the bytes ``opt.update`` freed before anything was evaluated (the old
arrays no one reads any more), and what the planner counts as freed by the
first gather (:mod:`mlx_fsdp.plan_memory.freed`).
"""

import gc
import sys

from common import report

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
from mlx.utils import tree_flatten

import mlx_fsdp
from mlx_fsdp.plan_memory import optimizers
from mlx_fsdp.plan_memory.freed import freed_before
from mlx_fsdp.plan_memory.sharding import _fsdp_state

group = mx.distributed.init()
hidden, layers, size = (int(a) for a in sys.argv[1:4])
mx.random.seed(0)
model = nn.Sequential(*[nn.Linear(hidden, hidden) for _ in range(layers)])
mx.eval(model.parameters())
opt = mlx_fsdp.fsdp_step(optim.Adafactor(learning_rate=1e-3), communication_size=size)
vg = nn.value_and_grad(model, lambda m, x: (m(x) ** 2).mean())
x = mx.random.normal((8, hidden), key=mx.random.key(group.rank()))
for step in range(3):
    loss, g = vg(model, x)
    mx.eval(loss, g)
    gc.collect()
    before = mx.get_active_memory()
    opt.update(model, g)
    gc.collect()
    freed = before - mx.get_active_memory()
    mx.eval(model.parameters(), opt.state)

flat = tree_flatten(model.trainable_parameters())
state = _fsdp_state(optimizers.make("adafactor"), flat, group.size(), group.rank(), size)
planned = freed_before(state["buckets"], "exchange" if group.size() == 2 else "all_sum")[0]
both = mx.distributed.all_gather(mx.array([[freed, planned.parameters]]), group=group)
report(group, freed=both[:, 0].tolist(), planned=both[:, 1].tolist())
