"""Train one small model with DDP and with FSDP, side by side, and compare.

The data is text every machine with Python has: the source of Python's standard
library, read as bytes. The model is a small MLP that predicts the next byte
from the previous ``--context`` bytes. Both runs start from the same weights
and see the same global batches; each rank takes its own slice of every batch.

Run it on 2 local ranks (ring), on more with MPI, or as a single process:

    mlx.launch -n 2 --backend ring -- python examples/quickstart.py
    mpirun -n 4 python examples/quickstart.py
    python examples/quickstart.py

Rank 0 prints both losses at every step, their largest difference, and the
optimizer-state bytes each rank holds under DDP and under FSDP.
"""

import argparse
import os
import sys
import sysconfig
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten

import mlx_fsdp


def stdlib_bytes(limit: int) -> np.ndarray:
    """Up to ``limit`` bytes of Python's standard library source, in a fixed order."""
    root = sysconfig.get_paths()["stdlib"]
    chunks, total = [], 0
    for name in sorted(os.listdir(root)):
        if name.endswith(".py"):
            with open(os.path.join(root, name), "rb") as f:
                data = f.read()
            chunks.append(np.frombuffer(data, dtype=np.uint8))
            total += len(data)
            if total >= limit:
                break
    return np.concatenate(chunks)[:limit]


class NextByte(nn.Module):
    def __init__(self, context: int, dims: int, hidden: int):
        super().__init__()
        self.embed = nn.Embedding(256, dims)
        self.hidden = nn.Linear(context * dims, hidden)
        self.out = nn.Linear(hidden, 256)

    def __call__(self, x):
        h = self.embed(x).reshape(x.shape[0], -1)
        return self.out(nn.gelu(self.hidden(h)))


def loss_fn(model, x, y):
    return nn.losses.cross_entropy(model(x), y, reduction="mean")


def global_batch(data: np.ndarray, step: int, batch: int, context: int):
    """The same global batch on every rank, whatever the world size."""
    rng = np.random.default_rng(step)
    starts = rng.integers(0, len(data) - context - 1, size=batch)
    idx = starts[:, None] + np.arange(context + 1)[None]
    window = data[idx]
    return window[:, :-1].astype(np.int32), window[:, -1].astype(np.int32)


def state_bytes(opt) -> int:
    return sum(v.nbytes for _, v in tree_flatten(opt.state) if v.ndim)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--batch-size", type=int, default=64, help="global batch")
    p.add_argument("--context", type=int, default=16)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--learning-rate", type=float, default=3e-3)
    p.add_argument("--max-norm", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()

    group = mx.distributed.init()
    n, rank = group.size(), group.rank()
    if args.batch_size % n:
        raise ValueError(
            f"--batch-size={args.batch_size} must divide by the number of ranks {n}."
        )
    data = stdlib_bytes(2_000_000)
    local = args.batch_size // n

    runs = {}
    for mode, wrap in (("ddp", mlx_fsdp.ddp_step), ("fsdp", mlx_fsdp.fsdp_step)):
        mx.random.seed(args.seed)
        model = NextByte(args.context, 32, args.hidden)
        mx.eval(model.parameters())
        opt = wrap(optim.AdamW(learning_rate=args.learning_rate), max_norm=args.max_norm)
        runs[mode] = (model, opt, nn.value_and_grad(model, loss_fn), [], [])

    if rank == 0:
        params = sum(v.size for _, v in tree_flatten(runs["ddp"][0].parameters()))
        print(f"{n} rank(s), {params} parameters, global batch {args.batch_size}, "
              f"{len(data)} bytes of stdlib text")
        print(f"{'step':>5} {'ddp loss':>10} {'fsdp loss':>10} {'|diff|':>9} {'ddp ms':>8} {'fsdp ms':>8}")
    worst = 0.0
    for step in range(args.steps):
        x, y = global_batch(data, step, args.batch_size, args.context)
        x, y = mx.array(x[rank * local:(rank + 1) * local]), mx.array(y[rank * local:(rank + 1) * local])
        row = []
        for mode in ("ddp", "fsdp"):
            model, opt, vg, losses, times = runs[mode]
            tic = time.perf_counter()
            loss, grads = vg(model, x, y)
            opt.update(model, grads)
            loss = mx.distributed.all_sum(loss, group=group) / n
            mx.eval(loss, model.parameters(), opt.state)
            times.append(1e3 * (time.perf_counter() - tic))
            losses.append(loss.item())
            row.append(losses[-1])
        worst = max(worst, abs(row[0] - row[1]))
        if rank == 0 and (step % 5 == 0 or step == args.steps - 1):
            print(f"{step:5d} {row[0]:10.4f} {row[1]:10.4f} {abs(row[0] - row[1]):9.2e} "
                  f"{runs['ddp'][4][-1]:8.1f} {runs['fsdp'][4][-1]:8.1f}")

    if rank == 0:
        ddp_state, fsdp_state = state_bytes(runs["ddp"][1]), state_bytes(runs["fsdp"][1])
        first, last = runs["fsdp"][3][0], runs["fsdp"][3][-1]
        print()
        print(f"loss {first:.4f} -> {last:.4f} (FSDP); largest |DDP - FSDP| loss difference: {worst:.2e}")
        print(f"optimizer state per rank: DDP {ddp_state / 1e6:.2f} MB, FSDP "
              f"{fsdp_state / 1e6:.2f} MB ({fsdp_state / ddp_state:.3f}x, ideal 1/{n})")
        print(f"median step: DDP {np.median(runs['ddp'][4]):.1f} ms, FSDP {np.median(runs['fsdp'][4]):.1f} ms")


if __name__ == "__main__":
    main()
