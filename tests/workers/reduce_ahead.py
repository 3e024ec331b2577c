"""How many buckets' reduce-scatter buffers ``fsdp_step`` holds at once on the CPU.

Usage: reduce_ahead.py HIDDEN LAYERS BUCKET_BYTES

An MLP of LAYERS square layers with SGD (no state), each layer's weight in a
bucket of its own, its gradients evaluated before the step: the step's peak
above what it starts with (``most``, the highest of three steps after the
first) is what the reduce-scatters, the update and the all-gathers hold.
Reported in bytes with one layer's weight (``layer``).
"""

import gc
import sys

from common import report

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim

import mlx_fsdp

# The pacing under test is the CPU's: on a machine with a GPU the default
# device would run ahead unpaced (8.6 layers at MPI N=3 on an H200, 2026-12-01).
mx.set_default_device(mx.cpu)
group = mx.distributed.init()
hidden, layers, size = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
mx.random.seed(0)
model = nn.Sequential(*[nn.Linear(hidden, hidden) for _ in range(layers)])
opt = mlx_fsdp.fsdp_step(optim.SGD(learning_rate=1e-2), communication_size=size)
x = mx.random.normal((8, hidden), key=mx.random.key(group.rank()))
vg = nn.value_and_grad(model, lambda m, x: (m(x) ** 2).mean())
above = []
for step in range(4):
    loss, grads = vg(model, x)
    mx.eval(loss, grads, model.parameters())
    del loss
    gc.collect()
    mx.clear_cache()
    mx.reset_peak_memory()
    start = mx.get_active_memory()
    opt.update(model, grads)
    mx.eval(model.parameters(), opt.state)
    above.append(mx.get_peak_memory() - start)
    del grads
report(group, most=max(above[1:]), layer=hidden * hidden * 4, buckets=len(opt.plan.buckets))
