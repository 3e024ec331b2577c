"""Peak memory of a backward pass that recomputes each block: mx.checkpoint vs mlx_fsdp's remat.

A chain of ``--blocks`` blocks, each three ``tanh(h @ W)`` on a
``--rows x --width`` activation, one process. Each mode runs in a fresh
process (peaks do not mix):

* ``none``: plain backward pass, every block's activations kept;
* ``mx.checkpoint``: MLX's rematerialization;
* ``mx.checkpoint, ordered``: the same, with each block's input gradient made
  to wait for its weight gradient (as a fully sharded block's reduce-scatter
  makes it wait, see ``mlx_fsdp/fully_sharded/gather.py``);
* ``remat, ordered``: ``mlx_fsdp.fully_sharded.remat.remat`` (recomputation
  waits for the cotangents), ordered the same way.

With ``--memory-limit`` MLX's evaluation waits for memory instead of
allocating ahead of the CPU thread that computes, which shows what the graph
itself keeps alive.

    python benchmarks/bench_remat.py
    python benchmarks/bench_remat.py --memory-limit 1MiB
"""

import argparse
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

MODES = ("none", "mx.checkpoint", "mx.checkpoint, ordered", "remat, ordered")


def _ordered(fn):
    """``fn(w, x)`` whose input gradient waits for its weight gradient."""
    import mlx.core as mx

    @mx.custom_function
    def g(w, x):
        return fn(w, x)

    @g.vjp
    def g_vjp(primals, cotangents, _):
        cotangents = list(cotangents) if isinstance(cotangents, (list, tuple)) else [cotangents]
        gw, gx = mx.vjp(fn, list(primals), cotangents)[1]
        return gw, mx.depends(gx, gw)

    return g


def measure(mode: str, blocks: int, rows: int, width: int, limit: int) -> float:
    import mlx.core as mx

    from mlx_fsdp.fully_sharded.remat import remat

    def block(w, x):
        for _ in range(3):
            x = mx.tanh(x @ w)
        return x

    fn = {"none": block, "mx.checkpoint": mx.checkpoint(block),
          "mx.checkpoint, ordered": _ordered(mx.checkpoint(block)),
          "remat, ordered": _ordered(lambda w, x: remat(block, w, x))}[mode]

    def net(ws, x):
        for w in ws:
            x = fn(w, x)
        return x.sum()

    mx.random.seed(0)
    ws = [mx.random.normal((width, width)) * 0.05 for _ in range(blocks)]
    x = mx.random.normal((rows, width))
    mx.eval(ws, x)
    if limit:
        mx.set_memory_limit(limit)
    base = mx.get_active_memory()
    mx.reset_peak_memory()
    mx.eval(mx.value_and_grad(net)(ws, x))
    return (mx.get_peak_memory() - base) / 1024**2


def main():
    from mlx_fsdp.lora import parse_size

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--blocks", type=int, default=8)
    p.add_argument("--rows", type=int, default=1024)
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--memory-limit", type=parse_size, default=0,
                   help="mx.set_memory_limit for the backward pass, e.g. 1MiB. Default: none.")
    p.add_argument("--mode", choices=MODES, help=argparse.SUPPRESS)  # one measurement, in a child
    args = p.parse_args()
    if args.mode:
        print(measure(args.mode, args.blocks, args.rows, args.width, args.memory_limit))
        return
    act = args.rows * args.width * 4 / 1024**2
    print(f"{args.blocks} blocks of three {args.rows} x {args.width} float32 activations "
          f"({act:.0f} MiB each); memory limit: {args.memory_limit or 'none'}")
    print()
    print("| mode | backward peak above inputs, MiB |")
    print("|---|---:|")
    for mode in MODES:
        out = subprocess.run([sys.executable, __file__, "--mode", mode, "--blocks",
                              str(args.blocks), "--rows", str(args.rows), "--width",
                              str(args.width), "--memory-limit", str(args.memory_limit)],
                             capture_output=True, text=True, check=True).stdout
        print(f"| {mode} | {float(out.split()[-1]):.1f} |")


if __name__ == "__main__":
    main()
