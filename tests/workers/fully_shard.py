"""Fully sharded training (fully_shard + fsdp_step) against ddp_step, config by config.

Usage: fully_shard.py STEPS CONFIG...

CONFIG is ``optimizer:wrap:reshard:max_norm:k:accumulation:master:bf16[:compiled[:stale]]``:
``wrap`` is ``blocks`` (every layer, then the root), ``root`` (the whole
model once) or ``part`` (two layers only: the rest takes the sharded step's
own buckets); ``bf16`` gives the model a bfloat16 layer; ``compiled`` (``1``)
runs the fully sharded step inside ``mx.compile``, its model and optimizer
state as inputs and outputs, as mlx-lm's trainer does; ``stale`` (``1``)
first wraps another model the same way and drops it on every rank but rank
0, where it stays alive. With accumulation, a
bfloat16 gradient is summed in another order than DDP's (each micro-batch
reduced first), so those configurations run in float32. Both runs see the same local batches; ``ddp_step`` is
``mlx.nn.average_gradients`` plus the plain optimizer.
"""

import gc
import sys
from functools import partial

from common import OPTIMIZERS, batch, loss_fn, make_model, max_diff, report

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
from mlx.utils import tree_flatten

import mlx_fsdp

MAKERS = dict(OPTIMIZERS, muon=lambda: optim.MultiOptimizer(
    [optim.Muon(learning_rate=2e-2), optim.AdamW(learning_rate=1e-2)],
    [lambda path, g: g.ndim == 2]), adafactor=lambda: optim.Adafactor(learning_rate=1e-2))
LAYERS = ("inp", "wide", "table", "out")


def wrap(model, how: str, reshard: bool, placement):
    layers = LAYERS if how == "blocks" else ("inp", "table") if how == "part" else ()
    for name in layers:
        setattr(model, name, mlx_fsdp.fully_shard(getattr(model, name), placement=placement,
                                                  reshard_after_forward=reshard,
                                                  communication_size=256))
    if how in ("blocks", "root"):
        model = mlx_fsdp.fully_shard(model, placement=placement, reshard_after_forward=reshard)
    return model


def run(config: str, steps: int, group):
    name, how, reshard, max_norm, k, accumulation, master, bf16, *rest = config.split(":")
    compiled, stale = rest[:1] == ["1"], rest[1:2] == ["1"]
    max_norm = None if float(max_norm) < 0 else float(max_norm)
    k, master = int(k), mx.float32 if master == "1" else None
    ref = make_model(bf16=bf16 == "1")
    inner = MAKERS[name]()
    placement = inner if name in ("muon", "adafactor") else None
    if stale:  # as if its last reference lived on there a while longer
        earlier = wrap(make_model(bf16=bf16 == "1"), how, reshard == "1", placement)
        kept = earlier if group.rank() == 0 else None  # noqa: F841 (alive until the end)
        del earlier
        gc.collect()
    model = wrap(make_model(bf16=bf16 == "1"), how, reshard == "1", placement)
    opt = mlx_fsdp.fsdp_step(inner, max_norm=max_norm, grad_accumulation_steps=k,
                             accumulation=accumulation, master_dtype=master)
    ddp = mlx_fsdp.ddp_step(MAKERS[name](), max_norm=max_norm, grad_accumulation_steps=k,
                            master_dtype=master)
    vg, ref_vg = nn.value_and_grad(model, loss_fn), nn.value_and_grad(ref, loss_fn)

    def train(x, y):
        loss, grads = vg(model, x, y)
        opt.update(model, grads)
        return loss

    def ddp_train(x, y):
        loss, grads = ref_vg(ref, x, y)
        ddp.update(ref, grads)
        return loss

    if compiled:
        state = [model.state, opt.state]
        train = partial(mx.compile, inputs=state, outputs=state)(train)
        if mx.default_device() == mx.gpu:
            # MLX's compiled GPU kernels fuse multiply-adds that eager ones
            # round twice (mlx_fsdp.fused): the reference is compiled there too.
            state = [ref.state, ddp.state]
            ddp_train = partial(mx.compile, inputs=state, outputs=state)(ddp_train)
    loss_diff = 0.0
    for step in range(steps * k):
        x, y = batch(step, group.rank())
        loss = train(x, y)
        mx.eval(loss, model.parameters(), opt.state)
        ref_loss = ddp_train(x, y)
        mx.eval(ref_loss, ref.parameters(), ddp.state)
        loss_diff = max(loss_diff, abs(loss.item() - ref_loss.item()))
    full = mlx_fsdp.full_parameters(model)
    held = sum(a.nbytes for _, a in tree_flatten(model.parameters()))
    whole = sum(a.nbytes for _, a in tree_flatten(ref.parameters()))
    state = sum(a.nbytes for _, a in tree_flatten(opt.state) if a.ndim)
    ddp_state = sum(a.nbytes for _, a in tree_flatten(ddp.state) if a.ndim)
    return dict(config=config, steps=int(opt.step.item()), loss_diff=loss_diff,
                f32=max_diff(full, ref.parameters(), mx.float32),
                bf16=max_diff(full, ref.parameters(), mx.bfloat16),
                params_ratio=held / whole, state_ratio=state / ddp_state,
                sharded_buckets=sum(b.sharded_params for b in opt.plan.buckets),
                other_buckets=sum(not b.sharded_params for b in opt.plan.buckets))


def main():
    group = mx.distributed.init()
    steps = int(sys.argv[1])
    for config in sys.argv[2:]:
        result = run(config, steps, group)
        # Every rank's share of the parameters: the largest decides the memory.
        ratios = mx.distributed.all_gather(mx.array([result["params_ratio"]]), group=group)
        report(group, **result, max_params_ratio=max(ratios.tolist()))


main()
