"""Where a training step's time goes: the forward and backward pass, then the update.

``bench_step.py`` times whole steps, one lazy graph each. This script
evaluates the gradients first and then times the rest (``opt.update`` and
its evaluation: the collectives, clipping and the optimizer) on its own, for
``ddp_step`` and ``fsdp_step`` side by side in one run. The update phase is
all FSDP can change, so ``(forward+backward + FSDP update) / (forward+backward
+ DDP update)`` bounds how far below DDP a whole step can go on a machine
where nothing overlaps.

    python benchmarks/ring_local.py -n 2 -- python benchmarks/bench_phases.py --model gpt
    python benchmarks/ring_local.py -n 2 -- python benchmarks/bench_phases.py --model mlp --hidden 1024

Rank 0 prints one row per mode: median milliseconds (max over ranks) of each phase.
"""

import argparse
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import mlx.core as mx  # noqa: E402
import mlx.nn as nn  # noqa: E402
import mlx.optimizers as optim  # noqa: E402

import bench_step  # noqa: E402  (its models and batches, and the package path)
import mlx_fsdp  # noqa: E402
from _common import Progress  # noqa: E402

lm = bench_step.lm


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", choices=("mlp", "gpt"), default="gpt")
    p.add_argument("--hidden", type=int, default=1024, help="MLP width (default 1024)")
    p.add_argument("--dims", type=int, default=256, help="GPT width (default 256)")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--batch", type=int, default=None, help="rows per rank (default: bench_step's)")
    p.add_argument("--communication-size", type=lm.parse_size, default=None,
                   help="bucket size for both modes (default: each wrapper's own)")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--cpu", action="store_true", help="run on the CPU even where a GPU is the default")
    args = p.parse_args(argv)
    if args.cpu:
        mx.set_default_device(mx.cpu)
    cfg = argparse.Namespace(**vars(args), width=args.hidden if args.model == "mlp" else args.dims,
                             dtype="float32", seed=0)
    cfg.batch = args.batch or bench_step.DEFAULT_BATCH[args.model]
    group = lm.init_distributed()
    rank, n = group.rank(), group.size()
    x, y = bench_step.make_batch(cfg, rank)
    rows = {}
    progress = Progress("phases", 2 * (args.steps + 2), enabled=rank == 0)
    for mode, wrap in (("ddp", mlx_fsdp.ddp_step), ("fsdp", mlx_fsdp.fsdp_step)):
        model = bench_step.make_model(cfg)
        kwargs = {} if args.communication_size is None else {"communication_size": args.communication_size}
        opt = wrap(optim.AdamW(learning_rate=1e-4), max_norm=1.0, **kwargs)
        loss_and_grad = nn.value_and_grad(model, lm.loss_fn)
        backward, update = [], []
        for i in range(args.steps + 2):
            mx.synchronize()
            t0 = time.perf_counter()
            loss, grads = loss_and_grad(model, x, y)
            mx.eval(loss, grads)
            t1 = time.perf_counter()
            opt.update(model, grads)
            mx.eval(model.parameters(), opt.state)
            mx.synchronize()
            t2 = time.perf_counter()
            if i >= 2:
                backward.append(t1 - t0)
                update.append(t2 - t1)
            progress.advance()
        v = mx.distributed.all_gather(
            mx.array([statistics.median(backward), statistics.median(update)]), group=group)
        rows[mode] = [1e3 * t for t in v.reshape(n, 2).max(axis=0).tolist()]
        del model, opt, grads
    if rank == 0:
        bwd = min(rows["ddp"][0], rows["fsdp"][0])
        print(f"N={n}, {mx.default_device()}, {bench_step.describe(cfg)}, AdamW, max_norm 1, "
              f"buckets {args.communication_size or 'default'}")
        print("| mode | forward+backward ms | update ms (collectives, clip, optimizer) |")
        print("|---|---:|---:|")
        for mode, (b, u) in rows.items():
            print(f"| {mode} | {b:.1f} | {u:.1f} |")
        print(f"update FSDP/DDP {rows['fsdp'][1] / rows['ddp'][1]:.3f}x; a whole step can go at "
              f"best to (fwd+bwd + FSDP update) / (fwd+bwd + DDP update) = "
              f"{(bwd + rows['fsdp'][1]) / (bwd + rows['ddp'][1]):.3f}x of DDP's")


if __name__ == "__main__":
    main()
