"""Optimizer-state bytes and peak memory per rank, DDP vs FSDP, one phase each.

Usage: memory.py HIDDEN LAYERS [OPTIMIZER [BUCKET_BYTES]]

OPTIMIZER is ``adamw`` (the default) or ``adafactor`` (every matrix whole on
an owner rank); BUCKET_BYTES is the wrappers' ``communication_size``
(default: theirs). ``*_kept``: what the model and optimizer hold after the
steps beyond their arrays' bytes.
"""

import gc
import sys

from common import report

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
from mlx.utils import tree_flatten

import mlx_fsdp


def state_bytes(state):
    # Arrays with a dimension: the per-element state (not step / learning_rate).
    return sum(v.nbytes for _, v in tree_flatten(state) if v.ndim)


OPTIMIZERS = {"adamw": lambda: optim.AdamW(learning_rate=1e-3),
              "adafactor": lambda: optim.Adafactor(learning_rate=1e-3)}


def phase(make_opt, hidden, layers, group, name):
    gc.collect()
    before = mx.get_active_memory()
    mx.random.seed(0)
    model = nn.Sequential(*[nn.Linear(hidden, hidden) for _ in range(layers)])
    mx.eval(model.parameters())
    opt = make_opt(OPTIMIZERS[name]())
    vg = nn.value_and_grad(model, lambda m, x: (m(x) ** 2).mean())
    x = mx.random.normal((8, hidden), key=mx.random.key(group.rank()))
    for step in range(3):
        if step == 1:  # after the first step built the state and the plan
            gc.collect()
            mx.clear_cache()
            mx.reset_peak_memory()
        loss, g = vg(model, x)
        opt.update(model, g)
        mx.eval(model.parameters(), opt.state)
        del g
    peak = mx.get_peak_memory()
    del loss
    gc.collect()
    mx.clear_cache()
    arrays = sum(v.nbytes for tree in (model.parameters(), opt.state)
                 for _, v in tree_flatten(tree))
    result = state_bytes(opt.state), peak, mx.get_active_memory() - before - arrays
    del model, opt, vg, x
    gc.collect()
    mx.clear_cache()
    # What outlives the model and the optimizer (nothing should).
    return (*result, mx.get_active_memory() - before)


group = mx.distributed.init()
hidden, layers = int(sys.argv[1]), int(sys.argv[2])
name = sys.argv[3] if len(sys.argv) > 3 else "adamw"
size = {"communication_size": int(sys.argv[4])} if len(sys.argv) > 4 else {}
ddp_state, ddp_peak, ddp_kept, ddp_left = phase(
    lambda o: mlx_fsdp.ddp_step(o, max_norm=1.0, **size), hidden, layers, group, name)
fsdp_state, fsdp_peak, fsdp_kept, fsdp_left = phase(
    lambda o: mlx_fsdp.fsdp_step(o, max_norm=1.0, **size), hidden, layers, group, name)
report(group, n=group.size(), device="gpu" if mx.default_device() == mx.gpu else "cpu",
       ddp_state=ddp_state, fsdp_state=fsdp_state,
       ddp_peak=ddp_peak, fsdp_peak=fsdp_peak, ddp_kept=ddp_kept, fsdp_kept=fsdp_kept,
       ddp_left=ddp_left, fsdp_left=fsdp_left)
