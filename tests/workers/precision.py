"""bfloat16 model with float32 masters: fsdp_step vs ddp_step vs plain MLX.

Usage: precision.py STEPS. Rank 0 prints one RESULT line per reduce dtype.
The plain reference (no mlx_fsdp) keeps a float32 copy of the model, averages
the bfloat16 gradients of all ranks in this process and runs AdamW on the
copy; it sums in rank order, as the all-reduce of two ranks does, so it is
compared at N=2 only.
"""

import sys

from common import OPTIMIZERS, batch, loss_fn, make_model, report

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
from mlx.utils import tree_flatten, tree_map

import mlx_fsdp
from mlx_fsdp.sharded_state import held_shapes

STEPS = int(sys.argv[1])
group = mx.distributed.init()
n, rank = group.size(), group.rank()


def bf16_model():
    model = make_model(bf16=False)
    model.set_dtype(mx.bfloat16)
    mx.eval(model.parameters())
    return model


def ulps(a, b):
    """Largest |a - b| over the leaves, in units of one bfloat16 ulp of b."""
    worst = 0.0
    for (k, x), (_, y) in zip(tree_flatten(a), tree_flatten(b)):
        assert x.dtype == y.dtype == mx.bfloat16, (k, x.dtype, y.dtype)
        x, y = x.astype(mx.float32), y.astype(mx.float32)
        ulp = mx.power(2.0, mx.floor(mx.log2(mx.maximum(mx.abs(y), 2.0**-126))) - 7)
        worst = max(worst, (mx.abs(x - y) / ulp).max().item())
    return worst


def state_bytes(tree):
    return sum(v.nbytes for _, v in tree_flatten(tree))


def run(reduce_dtype):
    fsdp_model, ddp_model, ref_model = bf16_model(), bf16_model(), bf16_model()
    kw = dict(max_norm=1.0, master_dtype=mx.float32, reduce_dtype=reduce_dtype)
    fsdp = mlx_fsdp.fsdp_step(OPTIMIZERS["adamw"](), communication_size=300, **kw)
    ddp = mlx_fsdp.ddp_step(OPTIMIZERS["adamw"](), **kw)
    ref, ref_master = OPTIMIZERS["adamw"](), tree_map(lambda p: p.astype(mx.float32),
                                                       ref_model.trainable_parameters())
    worst_ddp = worst_ref = 0.0
    for step in range(STEPS):
        for model, opt in ((fsdp_model, fsdp), (ddp_model, ddp)):
            _, g = nn.value_and_grad(model, loss_fn)(model, *batch(step, rank))
            opt.update(model, g)
            mx.eval(model.parameters(), opt.state)
        worst_ddp = max(worst_ddp, ulps(fsdp_model.parameters(), ddp_model.parameters()))
        if reduce_dtype is None and n == 2:
            vg = nn.value_and_grad(ref_model, loss_fn)
            grads = [vg(ref_model, *batch(step, r))[1] for r in range(n)]
            g = tree_map(lambda a, b: ((a + b) / 2).astype(mx.float32), *grads)
            g, _ = optim.clip_grad_norm(g, 1.0)
            ref_master = ref.apply_gradients(g, ref_master)
            ref_model.update(tree_map(lambda p: p.astype(mx.bfloat16), ref_master))
            mx.eval(ref_model.parameters(), ref_master, ref.state)
            worst_ref = max(worst_ref, ulps(fsdp_model.parameters(), ref_model.parameters()))
    masters = fsdp.state["master"]
    held = held_shapes(fsdp.plan, group.rank(), 0)
    # Over all ranks, exactly the masters DDP keeps: no padding is stored.
    total = mx.distributed.all_sum(mx.array(state_bytes(masters)), group=group).item()
    report(group, reduce_dtype=str(reduce_dtype), n=n, ulps_vs_ddp=worst_ddp, ulps_vs_ref=worst_ref,
           param_dtypes=sorted({str(v.dtype) for _, v in tree_flatten(fsdp_model.parameters())}),
           master_dtypes=sorted({str(v.dtype) for v in masters.values()}),
           state_dtypes=sorted({str(v.dtype) for _, v in tree_flatten(fsdp.state["optimizer"]) if v.ndim}),
           master_fraction=state_bytes(masters) / max(1, state_bytes(ddp.state["master"])),
           masters_total_over_ddp=total / state_bytes(ddp.state["master"]),
           masters_are_what_this_rank_holds=set(masters) == set(held))


run(None)
run(mx.float32)
