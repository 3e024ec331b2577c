"""Where a fully sharded step's time goes: its parts, timed side by side with the plain ones.

On the MLP of ``bench_step.py`` (``--layers`` square layers of ``--hidden``,
``--batch`` rows per rank), rank 0 prints the median and the minimum over
``--iters`` rounds of each part, each part evaluated alone with
``mx.synchronize()`` on both sides. The parts take turns within every round,
so that a neighbour's load hits them alike:

* ``plain forward`` / ``fully sharded forward``: the model's forward pass,
  plain and wrapped once with ``mlx_fsdp.fully_shard``;
* ``gather``: the wrapped model's all-gathers alone (the forward pass's
  communication);
* ``plain forward+backward`` / ``fully sharded forward+backward``:
  ``nn.value_and_grad`` evaluated (the latter reduce-scatters its gradients);
* ``sharded step`` / ``fully sharded step``: the whole step with ``fsdp_step``
  (AdamW, ``max_norm`` 1) on the plain and the wrapped model;
* ``weight gradients to rows``: the copy that cuts the ``Linear`` weights'
  gradients into axis-0 rows whole, as ``fully_shard``'s reduce-scatter did
  before it read them in column order (:mod:`mlx_fsdp.columns`). MLX
  returns such a gradient as the transpose of an ``(in, out)`` buffer, so
  on the CPU this is a strided copy of every weight;
* ``weight gradients, column order``: what the column order copies instead:
  the other ranks' rows as plain runs of the buffer, and this rank's own
  ``1/N`` turned into rows (:func:`mlx_fsdp.columns.row_major`).

    python benchmarks/ring_local.py -n 2 -- python benchmarks/bench_fully_parts.py
"""

import argparse
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "examples"), os.path.join(ROOT, "benchmarks")]

import mlx.core as mx  # noqa: E402
import mlx.nn as nn  # noqa: E402
import mlx.optimizers as optim  # noqa: E402
from mlx.utils import tree_flatten  # noqa: E402

import lm  # noqa: E402
import mlx_fsdp  # noqa: E402
from mlx_fsdp import columns, rows  # noqa: E402
from _common import MLP  # noqa: E402
from mlx_fsdp.fully_sharded.gather import gather_buckets  # noqa: E402
from mlx_fsdp.order import CollectiveOrder  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--hidden", type=int, default=2048, help="layer width (default 2048)")
    p.add_argument("--layers", type=int, default=4, help="layers (default 4)")
    p.add_argument("--batch", type=int, default=8, help="rows per rank (default 8)")
    p.add_argument("--iters", type=int, default=12, help="timed rounds (default 12)")
    p.add_argument("--warmup", type=int, default=2, help="untimed rounds (default 2)")
    return p.parse_args(argv)


def parts(args, group):
    """The parts to time, by name, each a function that runs and evaluates one."""
    rank = group.rank()
    x = mx.random.normal((args.batch, args.hidden), key=mx.random.key(rank))
    y = mx.random.randint(0, args.hidden, (args.batch,), key=mx.random.key(100 + rank))
    mx.random.seed(0)
    plain = MLP(args.hidden, args.layers)
    mx.eval(plain.parameters())
    mx.random.seed(0)
    full = mlx_fsdp.fully_shard(MLP(args.hidden, args.layers))
    mx.eval(full.parameters())
    held = [a for _, a in tree_flatten(full.module.parameters())]
    grad_plain = nn.value_and_grad(plain, lm.loss_fn)
    grad_full = nn.value_and_grad(full, lm.loss_fn)
    opts = {id(m): mlx_fsdp.fsdp_step(optim.AdamW(learning_rate=1e-4), max_norm=1.0)
            for m in (plain, full)}

    def step(model, grad):
        loss, grads = grad(model, x, y)
        opts[id(model)].update(model, grads)
        mx.eval(loss, model.parameters(), opts[id(model)].state)

    _, grads = grad_plain(plain, x, y)
    weights = [g for p, g in tree_flatten(grads) if p.endswith("weight")]
    mx.eval(weights)
    return {
        "plain forward": lambda: mx.eval(plain(x)),
        "fully sharded forward": lambda: mx.eval(full(x)),
        "gather": lambda: mx.eval(gather_buckets(full.plan, held, [x], group, rank,
                                                 CollectiveOrder(group, False))),
        "plain forward+backward": lambda: mx.eval(grad_plain(plain, x, y)),
        "fully sharded forward+backward": lambda: mx.eval(grad_full(full, x, y)),
        "sharded step": lambda: step(plain, grad_plain),
        "fully sharded step": lambda: step(full, grad_full),
        "weight gradients to rows": lambda: mx.eval([g.reshape(-1) for g in weights]),
        "weight gradients, column order": lambda: mx.eval(column_order(weights, group)),
    }


def column_order(weights, group):
    """What the column order does instead, on each weight: the other ranks' rows
    as column runs (what is sent) and this rank's own rows turned back."""
    n, rank = group.size(), group.rank()
    out = []
    for g in weights:
        k = rows.chunk(g.shape, n)
        spans = [rows.held_rows(g.shape, k, r) for r in range(n)]
        out += [g[lo:hi].T.reshape(-1) for r, (lo, hi) in enumerate(spans) if r != rank and hi > lo]
        lo, hi = spans[rank]
        out.append(columns.row_major(g[lo:hi], n, g.dtype))
    return out


def main(argv=None):
    args = parse_args(argv)
    group = lm.init_distributed()
    todo = parts(args, group)
    times = {name: [] for name in todo}
    for i in range(args.warmup + args.iters):
        for name, run in todo.items():
            mx.synchronize()
            t0 = time.perf_counter()
            run()
            mx.synchronize()
            if i >= args.warmup:
                times[name].append((time.perf_counter() - t0) * 1e3)
    if group.rank() == 0:
        print(f"N={group.size()}; MLP {args.layers}x{args.hidden}, batch {args.batch} per rank; "
              f"{args.iters} rounds (ms)")
        for name, ms in times.items():
            print(f"{name:32s} median {statistics.median(ms):7.1f}  min {min(ms):7.1f}")


if __name__ == "__main__":
    main()
