"""Which reduce-scatters each bucket's update waits for, read from the graph.

Unpaced, as a GPU runs (``mlx_fsdp.pace.QUEUE_DEPTH = 0``): MLX then
evaluates the step's graph in the order its dependencies allow, so an
update that depends on a later bucket's collective cannot run before it,
and holds its own bucket's buffers until then. One layer per bucket,
AdamW without clipping (the global norm needs every bucket); the graph of
each layer's first moment is written with ``mx.export_to_dot`` and its
collectives counted. The last layer's bucket is reduced first.
"""

import os
import re
import tempfile

from common import report

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
from mlx.utils import tree_flatten

import mlx_fsdp
from mlx_fsdp import collectives, pace

pace.QUEUE_DEPTH = 0
group = mx.distributed.init()
LAYERS, WIDTH = 3, 16
model = nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)])
mx.eval(model.parameters())
opt = mlx_fsdp.fsdp_step(optim.AdamW(1e-2), communication_size=4 * (WIDTH * WIDTH + WIDTH))


def grads(power):
    g = nn.value_and_grad(model, lambda m, x: (m(x) ** power).sum())(model, mx.ones((4, WIDTH)))[1]
    mx.eval(g)
    return g


opt.update(model, grads(1))  # the first step builds the state
mx.eval(model.parameters(), opt.state)
opt.update(model, grads(2))
moments = dict(tree_flatten(opt.state["optimizer"]))
# MLX labels them "AllGather", "Sum AllReduce" and so on (and Send, Recv).
collective = re.compile(r'label ="[^"]*(All[A-Z]|Send|Recv|Scatter)')
waits = []
with tempfile.TemporaryDirectory() as tmp:
    path = os.path.join(tmp, "graph.dot")
    for i in range(LAYERS):
        mx.export_to_dot(path, moments[f"layers.{i}.weight.m"])
        with open(path) as f:
            waits.append(len(collective.findall(f.read())))
mx.eval(model.parameters(), opt.state)
report(group, waits=waits, buckets=len(opt.plan.buckets),
       method=collectives.reduce_scatter_method(group))
