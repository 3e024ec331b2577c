"""Benchmark Muon's optimizer update: owner-sharded (``fsdp_step``) vs replicated (``ddp_step``).

The model is a bank of ``--square`` matrices ``(width, width)`` and
``--wide`` matrices ``(width, 4 * width)``, all updated by
``mlx.optimizers.Muon``. Each rank has its own fixed random gradients, so
only the optimizer update is timed: ``opt.update(model, grads)`` and
``mx.eval`` of the parameters and the state.

* **replicated**: ``ddp_step(Muon)`` all-reduces the gradients, then every
  rank runs Newton-Schulz on every matrix (what data parallelism does).
* **sharded**: ``fsdp_step(Muon)`` reduce-scatters so that each matrix lands
  whole on one owner rank, the owner runs Newton-Schulz on it, and the
  all-gather brings the result back. The ideal is ``1/N`` of the compute plus
  the gather.

The two modes alternate in ABBA order (R S S R R S ...) in one run, so that
machine noise hits both alike. The times are medians over ``--steps`` timed
updates after ``--warmup`` untimed ones, maximum over ranks. Both models start
equal and see the same gradients, so the largest parameter difference printed
at the end should be about float32 rounding.

Rank 0 shows its progress (updates done, updates per second) on stderr.
Run it from the repository root::

    mlx.launch -n 2 --backend ring -- python benchmarks/bench_muon.py
"""

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import mlx.core as mx  # noqa: E402
import mlx.nn as nn  # noqa: E402
import mlx.optimizers as optim  # noqa: E402
from mlx.utils import tree_flatten, tree_map  # noqa: E402

import mlx_fsdp  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import Progress  # noqa: E402


class Bank(nn.Module):
    """``square`` ``(width, width)`` and ``wide`` ``(width, 4 * width)`` matrices."""

    def __init__(self, width: int, square: int, wide: int):
        super().__init__()
        self.square = [mx.random.normal((width, width)) * width**-0.5 for _ in range(square)]
        self.wide = [mx.random.normal((width, 4 * width)) * width**-0.5 for _ in range(wide)]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--square", type=int, default=16)
    ap.add_argument("--wide", type=int, default=2)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=1)
    args = ap.parse_args()

    group = mx.distributed.init()
    n, rank = group.size(), group.rank()
    models = {}
    for mode in ("replicated", "sharded"):
        mx.random.seed(0)
        models[mode] = Bank(args.width, args.square, args.wide)
        mx.eval(models[mode].parameters())
    opts = {
        "replicated": mlx_fsdp.ddp_step(optim.Muon(learning_rate=0.02)),
        "sharded": mlx_fsdp.fsdp_step(optim.Muon(learning_rate=0.02)),
    }
    key = mx.random.key(1 + rank)
    grads = tree_map(
        lambda p: mx.random.normal(p.shape, key=key) * 1e-2, models["sharded"].trainable_parameters()
    )
    mx.eval(grads)

    times = {mode: [] for mode in opts}
    order = ["replicated", "sharded", "sharded", "replicated"]
    total = 2 * (args.warmup + args.steps)
    progress = Progress("Muon updates, both modes", total, enabled=rank == 0, unit="updates")
    for i in range(total):
        mode = order[i % 4]
        model, opt = models[mode], opts[mode]
        mx.synchronize()
        t0 = time.perf_counter()
        opt.update(model, grads)
        mx.eval(model.parameters(), opt.state)
        elapsed = time.perf_counter() - t0
        if i >= 2 * args.warmup:
            times[mode].append(elapsed)
        progress.advance()

    local = mx.array([statistics.median(times["replicated"]), statistics.median(times["sharded"])])
    worst = mx.distributed.all_gather(local[None], group=group).max(axis=0).tolist()
    diff = max(
        mx.abs(a - b).max().item()
        for (_, a), (_, b) in zip(
            tree_flatten(models["replicated"].parameters()), tree_flatten(models["sharded"].parameters())
        )
    )
    if rank == 0:
        params = sum(p.size for _, p in tree_flatten(models["sharded"].parameters()))
        plan = opts["sharded"].plan
        owned = [0] * n
        if plan is not None:
            for b in plan.buckets:
                for s in b.slots:
                    if s.owner is not None:
                        owned[s.owner] += 1
        print(
            f"Muon update, N={n}, {args.square} x ({args.width}, {args.width}) + {args.wide} x "
            f"({args.width}, {4 * args.width}) = {params / 1e6:.2f}M parameters, "
            f"{args.steps} timed steps per mode (median, max over ranks)"
        )
        print(f"  matrices owned per rank: {owned}")
        print(f"  replicated (ddp_step): {worst[0] * 1e3:8.1f} ms")
        print(f"  sharded   (fsdp_step): {worst[1] * 1e3:8.1f} ms")
        print(f"  sharded / replicated:  {worst[1] / worst[0]:.3f}x")
        print(f"  max |parameter difference| after {args.warmup + args.steps} steps each: {diff:.2e}")


if __name__ == "__main__":
    main()
