"""The two-rank ``exchange`` reduce-scatter equals the ``all_sum`` one, bit for bit.

Three levels: the collective on a flat vector, one bucket of the step
(a padded array, a square one and a scalar, in fp32 and bf16), and whole
clipped AdamW steps of the odd model with the method forced through the
environment variable the step reads.
"""

import os

from common import OPTIMIZERS, batch, loss_fn, make_model, report

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

import mlx_fsdp
from mlx_fsdp import collectives, layout
from mlx_fsdp.plan import build_plan

group = mx.distributed.init()
n, rank = group.size(), group.rank()
auto = collectives.reduce_scatter_method(group)


def same(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and mx.array_equal(a, b).item()


# 1. The collective, on different data on each rank.
x = mx.random.normal((n * 1001,), key=mx.random.key(7 + rank)) * 3
rows_equal = all(
    same(collectives.reduce_scatter(x.astype(dt), group, method="exchange"),
         collectives.reduce_scatter(x.astype(dt), group, method="all_sum"))
    for dt in (mx.float32, mx.bfloat16)
)

# 2. One bucket: sizes 35 (padded at N=2), 1024 and 1 (a scalar).
shapes = [(7, 5), (32, 32), ()]
pieces_equal = True
for dt in ("float32", "bfloat16"):
    grads = [mx.random.normal(s, key=mx.random.key(100 * rank + i)).astype(getattr(mx, dt))
             for i, s in enumerate(shapes)]
    plan = build_plan(tuple((f"a{i}", s, dt, dt, 0, "flat") for i, s in enumerate(shapes)), n, 1 << 20)
    (bucket,) = plan.buckets
    vector = layout.pack(bucket, grads, n)
    got = {method: collectives.reduce_scatter(vector, group, method=method)
           for method in ("exchange", "all_sum")}
    mx.eval(got)
    pieces_equal &= same(got["exchange"], got["all_sum"])

# 3. Whole steps: the method forced each way, same data, same model.
finals = {}
for method in ("exchange", "all_sum"):
    os.environ[collectives.ENV_VAR] = method
    model = make_model()
    opt = mlx_fsdp.fsdp_step(OPTIMIZERS["adamw"](), max_norm=0.5, communication_size=300)
    for s in range(3):
        _, grads = nn.value_and_grad(model, loss_fn)(model, *batch(s, rank))
        opt.update(model, grads)
        mx.eval(model.parameters(), opt.state)
    finals[method] = dict(tree_flatten(model.parameters()))
del os.environ[collectives.ENV_VAR]
steps_equal = all(same(finals["exchange"][k], finals["all_sum"][k]) for k in finals["all_sum"])
report(group, n=n, auto=auto, rows_equal=rows_equal, pieces_equal=pieces_equal,
       steps_equal=steps_equal, arrays=len(finals["all_sum"]))
