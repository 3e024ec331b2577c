"""Bandwidth of the collectives a training step uses, by message size.

For each message size ``S`` (bytes of float32 data), on the current backend:

* ``all_sum``: ``mx.distributed.all_sum`` of an ``S``-byte array (DDP's all-reduce);
* ``reduce_scatter``: ``mlx_fsdp.collectives.reduce_scatter`` of an ``(N, S/N)``
  array, with the method FSDP uses on this group (``native`` ``sum_scatter``
  on NCCL/JACCL; on ring/MPI ``exchange`` at two ranks, an all-gather of the
  row the peer keeps, and ``all_sum`` then keep one row at more; ``--method``
  forces one);
* ``all_gather``: ``mlx_fsdp.collectives.all_gather`` of an ``S/N``-byte shard
  into ``S`` bytes.

Each timing is one evaluated collective (``mx.eval``) after ``--warmup``
untimed ones; the three ops take turns within each of ``--iters`` rounds, the
median is taken per rank and the maximum over ranks is reported. Every rank runs the same sizes and counts
(a collective needs all ranks), so the loop is fixed, not adaptive.

Bandwidths follow the usual convention: ``algbw = S / time``, and ``busbw``
scales it by what each rank must move: ``2 (N-1)/N`` for all-reduce and
``(N-1)/N`` for reduce-scatter and all-gather. With the ``all_sum`` method
(ring and MPI beyond two ranks) the reduce-scatter is an all-reduce, so its
bus bandwidth reads low by 2x.

    mlx.launch -n 2 --backend ring -- python benchmarks/bench_collectives.py
    MLX_MPI_LIBNAME=libmpi.so.40 mpirun --allow-run-as-root --oversubscribe \\
        -x MLX_MPI_LIBNAME -n 4 python benchmarks/bench_collectives.py --json coll.json

(the ``mpirun`` line as root on Debian: see docs/launching.md.)
Rank 0 shows its progress (sizes done, sizes per second) on stderr.
"""

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import mlx.core as mx  # noqa: E402

from mlx_fsdp import collectives  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import Progress, publish  # noqa: E402

KIB, MIB = 1024, 1024**2
OPS = ("all_sum", "reduce_scatter", "all_gather")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--min-size", type=int, default=32 * KIB, help="smallest message in bytes (default 32 KiB)")
    p.add_argument("--max-size", type=int, default=32 * MIB, help="largest message in bytes (default 32 MiB)")
    p.add_argument("--factor", type=int, default=4, help="size step (default 4)")
    p.add_argument("--iters", type=int, default=10, help="timed runs per size and op (default 10)")
    p.add_argument("--warmup", type=int, default=1, help="untimed runs per size (default 1)")
    p.add_argument("--method", choices=("auto", *collectives.METHODS), default="auto",
                   help="reduce-scatter method (default: what FSDP picks for this group)")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    p.add_argument("--markdown", metavar="PATH", help="also write the table as markdown")
    args = p.parse_args(argv)
    if args.min_size < 4 or args.max_size < args.min_size or args.factor < 2 or args.iters < 1:
        p.error("need 4 <= --min-size <= --max-size, --factor >= 2 and --iters >= 1")
    return args


def sizes(args, n: int):
    """Message sizes in bytes, each a multiple of ``4 * n`` so every shard is whole."""
    out, s = [], args.min_size
    while s <= args.max_size:
        out.append(max(4 * n, s // (4 * n) * 4 * n))
        s *= args.factor
    return out


def op_fn(op: str, size: int, group, method: str):
    """A function building the lazy collective for ``size`` bytes, and its input."""
    n, elems = group.size(), size // 4
    if op == "all_sum":
        x = mx.ones((elems,), mx.float32)
        return lambda: mx.distributed.all_sum(x, group=group), x
    if op == "reduce_scatter":
        x = mx.ones((n, elems // n), mx.float32)
        return lambda: collectives.reduce_scatter(x, group, method=method), x
    x = mx.ones((elems // n,), mx.float32)
    return lambda: collectives.all_gather(x, group), x


def time_ops(fns: dict, iters: int, warmup: int) -> dict:
    """Median seconds of one evaluated collective, per op.

    The ops take turns (in a rotating order) within every iteration, so that
    a neighbour's load or a slow phase of the machine hits them all alike.
    """
    names = list(fns)
    for _ in range(warmup):
        for name in names:
            mx.eval(fns[name]())
    times = {name: [] for name in names}
    for i in range(iters):
        for name in names[i % len(names):] + names[:i % len(names)]:
            tic = time.perf_counter()
            mx.eval(fns[name]())
            times[name].append(time.perf_counter() - tic)
    return {name: statistics.median(t) for name, t in times.items()}


def bus_factor(op: str, n: int) -> float:
    return 2 * (n - 1) / n if op == "all_sum" else (n - 1) / n


def _size(b: int) -> str:
    return f"{b / MIB:g} MiB" if b >= MIB else f"{b / KIB:g} KiB"


def main(argv=None):
    args = parse_args(argv)
    group = mx.distributed.init()
    rank, n = group.rank(), group.size()
    if n == 1:
        print("one process: nothing to communicate; launch with mlx.launch or mpirun", file=sys.stderr)
        return
    method = collectives.reduce_scatter_method(group, None if args.method == "auto" else args.method)
    rows = []
    todo = sizes(args, n)
    progress = Progress(f"collectives, {_size(todo[0])} to {_size(todo[-1])}", len(todo),
                        enabled=rank == 0, unit="sizes")
    for size in todo:
        fns = {}
        for op in OPS:
            fns[op], x = op_fn(op, size, group, method)
            mx.eval(x)
        seconds = time_ops(fns, args.iters, args.warmup)
        worst = mx.distributed.all_gather(
            mx.array([seconds[op] for op in OPS], mx.float32), group=group
        ).reshape(n, -1).max(axis=0).tolist()
        for op, t in zip(OPS, worst):
            algbw = size / t / 1e9
            rows.append({"op": op, "bytes": size, "ms": t * 1e3, "algbw_GBps": algbw,
                         "busbw_GBps": algbw * bus_factor(op, n)})
        progress.advance()
    if rank != 0:
        return
    header = (f"world size {n}; mlx {mx.__version__}; reduce-scatter method: {method}; "
              f"median of {args.iters} runs after {args.warmup} warm-up, max over ranks; GB = 1e9 bytes")
    lines = ["| size | op | ms | algbw GB/s | busbw GB/s |", "|---:|---|---:|---:|---:|"]
    for r in rows:
        op = f"reduce_scatter ({method})" if r["op"] == "reduce_scatter" else r["op"]
        lines.append(f"| {_size(r['bytes'])} | {op} | {r['ms']:.2f} | {r['algbw_GBps']:.3f} | "
                     f"{r['busbw_GBps']:.3f} |")
    publish(header, "\n".join(lines), args.markdown, args.json,
            {"world_size": n, "mlx_version": mx.__version__, "reduce_scatter_method": method,
             "config": vars(args), "results": rows})


if __name__ == "__main__":
    main()
