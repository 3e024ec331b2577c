"""Time ``save_checkpoint`` and ``load_checkpoint`` for a model of a few million parameters.

An MLP of ``--layers`` x ``--hidden`` (default 4 x 1024: 4.2M float32
parameters) is trained one step with ``fsdp_step(AdamW)`` so that the sharded
state exists (2 x 4.2M elements over N ranks), then saved ``--repeats`` times
into the same directory (each save replaces the previous one, as in a training
run) and loaded ``--repeats`` times into a fresh model and wrapper. Each
repeat starts with a barrier; the time is the slowest rank's. Save time
includes writing every shard, the model, the checksums, the manifest and the
atomic swap; load time includes verifying every checksum, rebuilding each
parameter's state and cutting this rank's pieces. The page cache is warm (the
files were just written), so this measures the package's own work and memory
bandwidth more than the disk.

Rank 0 shows its progress (checkpoints done, checkpoints per second) on stderr.
Run it from the repository root::

    mlx.launch -n 2 --backend ring -- python benchmarks/bench_checkpoint.py
    python benchmarks/bench_checkpoint.py            # one process: plain layout
"""

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
from mlx.utils import tree_flatten

import mlx_fsdp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import MLP, Progress  # noqa: E402


def build(hidden, layers):
    mx.random.seed(0)
    model = MLP(hidden, layers)
    opt = mlx_fsdp.fsdp_step(optim.AdamW(learning_rate=1e-3))
    mx.eval(model.parameters())
    return model, opt


def slowest(group, seconds):
    return mx.distributed.all_gather(mx.array([seconds]), group=group).max().item()


def timed(group, fn):
    mx.eval(mx.distributed.all_sum(mx.array(1.0), group=group))  # barrier
    start = time.perf_counter()
    fn()
    return slowest(group, time.perf_counter() - start)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dir", default=None, help="parent directory (default: a new temp dir)")
    args = p.parse_args()

    group = mx.distributed.init()
    rank, n = group.rank(), group.size()
    parent = args.dir or (tempfile.mkdtemp(prefix="bench_ckpt_") if rank == 0 else None)
    # Every rank needs the same path: rank 0 picks it, a tiny gather shares it.
    if args.dir is None:
        code = mx.array(list(parent.encode()) if rank == 0 else [0] * 64, dtype=mx.int32)
        code = mx.concatenate([code, mx.zeros((64 - code.size,), mx.int32)])[:64]
        parent = bytes(v for v in mx.distributed.all_sum(code, group=group).tolist() if v).decode()
    path = os.path.join(parent, "ckpt")

    model, opt = build(args.hidden, args.layers)
    x = mx.random.normal((8, args.hidden), key=mx.random.key(rank))
    _, g = nn.value_and_grad(model, lambda m: (m(x) ** 2).mean())(model)
    opt.update(model, g)
    mx.eval(model.parameters(), opt.state)
    params = sum(v.size for _, v in tree_flatten(model.parameters()))

    progress = Progress("saves then loads", 2 * args.repeats, enabled=rank == 0, unit="checkpoints")
    saves = []
    for _ in range(args.repeats):
        saves.append(timed(group, lambda: mlx_fsdp.save_checkpoint(path, model, opt)))
        progress.advance()
    loads = []
    for _ in range(args.repeats):
        fresh, fresh_opt = build(args.hidden, args.layers)
        loads.append(timed(group, lambda: mlx_fsdp.load_checkpoint(path, fresh, fresh_opt)))
        progress.advance()
    if rank == 0:
        size = sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path))
        print(f"{params / 1e6:.1f}M parameters, AdamW, N={n}, checkpoint {size / 2**20:.1f} MiB "
              f"in {len(os.listdir(path))} files")
        print("| operation | median s | min s | max s |")
        print("|-----------|---------:|------:|------:|")
        for name, t in (("save", saves), ("load", loads)):
            print(f"| {name:9s} | {statistics.median(t):8.3f} | {min(t):5.3f} | {max(t):5.3f} |")
        if args.dir is None:
            shutil.rmtree(parent)


if __name__ == "__main__":
    main()
