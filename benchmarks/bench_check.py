"""What the per-step cross-rank check costs, next to the step it guards.

Every ``update`` of ``fsdp_step`` and ``ddp_step`` first exchanges one small
control message (:mod:`mlx_fsdp.consistency`) and reads it on the host. This
script times that check alone (the same call the step makes, repeated) and a
whole training step of the 4.2M-parameter MLP of ``bench_step.py`` (forward,
backward, ``update``, ``mx.eval``), in one run, and prints the ratio.

    python benchmarks/ring_local.py -n 2 -- python benchmarks/bench_check.py
    MLX_MPI_LIBNAME=libmpi.so.40 mpirun --allow-run-as-root --oversubscribe \\
        -x MLX_MPI_LIBNAME -n 4 python benchmarks/bench_check.py
"""

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import mlx.core as mx  # noqa: E402
import mlx.nn as nn  # noqa: E402
import mlx.optimizers as optim  # noqa: E402

import mlx_fsdp  # noqa: E402
from _common import MLP  # noqa: E402
from mlx_fsdp import consistency  # noqa: E402


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--batch", type=int, default=32, help="rows per rank (default 32)")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--checks", type=int, default=200)
    args = p.parse_args()
    group = mx.distributed.init()
    rank, n = group.rank(), group.size()

    mx.random.seed(0)
    model = MLP(args.hidden, args.layers)
    opt = mlx_fsdp.fsdp_step(optim.AdamW(learning_rate=1e-3), max_norm=1.0)
    vg = nn.value_and_grad(model, lambda m, x: (m(x) ** 2).mean())
    x = mx.random.normal((args.batch, args.hidden), key=mx.random.key(rank))
    steps = []
    for i in range(args.steps + 3):
        mx.synchronize()
        t0 = time.perf_counter()
        _, g = vg(model, x)
        opt.update(model, g)
        mx.eval(model.parameters(), opt.state)
        if i >= 3:
            steps.append(time.perf_counter() - t0)
    # The same call the step makes, with the same plan and settings.
    summary = consistency.describe_tree(opt.plan.num_arrays, opt.plan.num_elements,
                                        opt.plan.fingerprint, f", {len(opt.plan.buckets)} buckets")
    checks = []
    for _ in range(args.checks):
        t0 = time.perf_counter()
        consistency.check_step(opt.options, opt.optimizer, summary, opt.state, tracing=False)
        checks.append(time.perf_counter() - t0)
    v = mx.distributed.all_gather(
        mx.array([statistics.median(steps), statistics.median(checks)]), group=group)
    step_s, check_s = v.reshape(n, 2).max(axis=0).tolist()
    if rank == 0:
        print(f"N={n}, {mx.default_device()}, MLP {args.layers} x {args.hidden}, AdamW, max_norm 1: "
              f"step {step_s * 1e3:.1f} ms, check {check_s * 1e3:.3f} ms "
              f"({100 * check_s / step_s:.2f} % of the step; medians, max over ranks)")


if __name__ == "__main__":
    main()
