"""Owner buckets all-summed without their padding: the same arrays as the padded collectives.

A lone large array in an owner bucket (and two small ones sharing another)
at a bucket budget that leaves the large one alone. Each rank holds what it
owns; the gather must return every array bit for bit (``-0.0`` and
``+0.0`` elements included), as the padded all-gather does, and the reduce
must leave each owner the sum of every rank's gradient (integer-valued, so
that any order of summation is exact).
"""

from common import report

import mlx.core as mx

from mlx_fsdp import bucketed, layout
from mlx_fsdp.collectives import all_gather, reduce_scatter_method
from mlx_fsdp.order import CollectiveOrder
from mlx_fsdp.plan import build_plan

group = mx.distributed.init()
n, rank = group.size(), group.rank()
shapes = [(64, 48), (3, 5), (7,)]


def bits(a):
    return a.view(mx.uint32 if a.dtype == mx.float32 else mx.uint16)


def arrays(seed, dt):
    out = []
    for i, s in enumerate(shapes):
        a = mx.round(mx.random.normal(s, key=mx.random.key(seed + i)) * 4)
        a = mx.where(a == 0, -0.0, a)  # signed zeros: -0.0 where rounding gave 0, +0.0 below
        out.append(mx.concatenate([a.reshape(-1)[:-1], mx.zeros((1,))]).reshape(s).astype(dt))
    return out


def evaluated(out):
    # With the group's last collective: a rank that keeps nothing of a
    # bucket's reduction must still run it (the step chains it to the next).
    mx.eval(out, CollectiveOrder(group).settle(mx.zeros(())))
    return out


exact = gathered_like_padded = reduced = True
applies = []
for dt in ("float32", "bfloat16"):
    dtype = getattr(mx, dt)
    # 64 * 48 elements alone exceed the budget over N; the two small ones share a bucket.
    budget = 64 * 48 * dtype.size * n // 2
    plan = build_plan(tuple((f"a{i}", s, dt, dt, 0, "owner") for i, s in enumerate(shapes)),
                      n, budget)
    params = arrays(0, dtype)
    for b in plan.buckets:
        applies.append(b.summed(n))
        mine = {s.index: a for s, a in layout.held_of(b, params, rank)}
        whole = evaluated(bucketed.gather_bucket(b, mine, group, order=CollectiveOrder(group)))
        padded = layout.unpack(b, all_gather(layout.join(layout.held_parts(b, mine, rank), dtype),
                                             group))
        for s, a, p in zip(b.slots, whole, padded):
            exact &= mx.array_equal(bits(a), bits(params[s.index])).item()
            gathered_like_padded &= mx.array_equal(bits(a), bits(p)).item()
        grads = arrays(100 * (rank + 1), dtype)
        total = [sum(arrays(100 * (r + 1), dtype)[i] for r in range(n)) for i in range(len(shapes))]
        held = bucketed.reduce_bucket(b, grads, group, method=reduce_scatter_method(group),
                                      order=CollectiveOrder(group))
        evaluated([a for _, a in held])
        reduced &= [s.index for s, _ in held] == [s.index for s in b.held(rank)]
        for s, a in held:
            reduced &= mx.array_equal(a, total[s.index]).item()

report(group, n=n, applies=applies, exact=exact, gathered_like_padded=gathered_like_padded,
       reduced=reduced)
