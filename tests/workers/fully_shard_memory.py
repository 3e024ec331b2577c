"""How long a block's gathered parameters live: peak memory of one forward and backward pass.

Usage: fully_shard_memory.py LAYERS WIDTH [ahead|once|compiled]

LAYERS Linear blocks, each wrapped with reshard_after_forward, then the
root. MLX's CPU evaluation allocates ahead of the thread that computes, so
the run sets a small memory limit (evaluation then waits until memory is
free), and the peak is what the graph itself keeps alive. A block's gathered
parameters that outlived its backward pass (or were gathered for every block
at once) would add a block's size per block to it. With ``ahead`` there is
no limit: the peak then also holds what MLX allocated ahead, which
mlx_fsdp.pace bounds. With ``once`` the model is wrapped once, one block per
bucket, with no limit: every block's full gradient arrives at the one VJP,
and what MLX allocates ahead is each bucket's reduce-scatter buffers.
``compiled`` is ``ahead`` under ``mx.compile``, as mlx-lm's trainer runs it.
"""

import sys
from functools import partial

from common import report

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

import mlx_fsdp

layers, width = int(sys.argv[1]), int(sys.argv[2])
group = mx.distributed.init()
mx.random.seed(0)
model = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])
once = sys.argv[3:] == ["once"]
block = width * (width + 1) * 4
for i in range(0 if once else layers):
    model.layers[i] = mlx_fsdp.fully_shard(model.layers[i], reshard_after_forward=True)
model = mlx_fsdp.fully_shard(model, communication_size=block if once else None)
mx.eval(model.parameters())
x = mx.random.normal((4, width), key=mx.random.key(group.rank()))
vg = nn.value_and_grad(model, lambda m, x: (m(x) ** 2).mean())
if sys.argv[3:] == ["compiled"]:
    eager = vg
    compiled = partial(mx.compile, inputs=model.state, outputs=model.state)(
        lambda x: eager(model, x))
    vg = lambda model, x: compiled(x)  # noqa: E731
if not sys.argv[3:]:
    mx.set_memory_limit(1 << 20)
peaks = []
for _ in range(3):
    base = mx.get_active_memory()
    mx.reset_peak_memory()
    loss, grads = vg(model, x)
    mx.eval(loss, grads)
    peaks.append(mx.get_peak_memory() - base)
    grad_bytes = sum(g.nbytes for _, g in tree_flatten(grads))
    del grads, loss
report(group, peak_above_params=min(peaks), grads=grad_bytes, block=block,
       activations=4 * width * 4 * layers, held=sum(a.nbytes for _, a in tree_flatten(model.parameters())))
