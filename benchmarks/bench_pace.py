"""What pacing MLX's evaluation on the CPU (``mlx_fsdp/pace.py``) costs and saves.

One process per rank builds the modes of ``bench_step.py`` on its MLP and
runs their steps with ``mlx_fsdp.pace.QUEUE_DEPTH`` at 0 (no pacing) and at
its default, taking turns in ABBA blocks of ``--block`` steps, so that a
neighbour's load hits both alike. The value is read when a step's graph is
built, so the two settings share the model, the optimizer and the data.
Rank 0 prints, per mode, the median step time with pacing over without, and
the peak memory of each setting's steps (``mx.get_peak_memory``, reset
before each block; max over ranks).

    python benchmarks/ring_local.py -n 2 -- python benchmarks/bench_pace.py
"""

import argparse
import os
import statistics
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "examples"), os.path.join(ROOT, "benchmarks")]

import mlx.core as mx  # noqa: E402

import bench_step  # noqa: E402
from mlx_fsdp import pace  # noqa: E402

MODES = {"fsdp": "fsdp", "root": "fully_shard", "blocks": "fully_shard_blocks",
         "reshard": "fully_shard_reshard"}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--modes", nargs="+", choices=tuple(MODES), default=list(MODES),
                   help="fsdp (the sharded step), root, blocks, reshard (fully_shard as "
                        "bench_step.py's --wrap); default: all")
    p.add_argument("--hidden", type=int, default=2048, help="MLP width (default 2048)")
    p.add_argument("--layers", type=int, default=4, help="MLP layers (default 4)")
    p.add_argument("--batch", type=int, default=8, help="rows per rank (default 8)")
    p.add_argument("--blocks", type=int, default=8, help="ABBA blocks per mode (default 8)")
    p.add_argument("--block", type=int, default=3, help="steps per block (default 3)")
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    group = mx.distributed.init()
    cfg = bench_step.configs(bench_step.parse_args([
        "--hidden", str(args.hidden), "--layers", str(args.layers), "--batch", str(args.batch),
        "--dtype", "float32", "--communication-size", "default"]))[0]
    x, y = bench_step.make_batch(cfg, group.rank())
    depth = pace.QUEUE_DEPTH
    if group.rank() == 0:
        print(f"N={group.size()}; MLP {args.layers}x{args.hidden}, batch {args.batch} per rank; "
              f"QUEUE_DEPTH {depth} against 0; {args.blocks} blocks of {args.block} steps")
    for name in args.modes:
        bench_step.clean_slate()
        _, _, step_fn = bench_step.build(MODES[name], cfg)
        times, peaks = {0: [], depth: []}, {0: 0, depth: 0}
        for i in range(args.blocks):
            for setting in ((0, depth) if i % 2 == 0 else (depth, 0)):
                pace.QUEUE_DEPTH = setting
                step_fn(x, y)  # the first step of a block builds on the other setting's state
                mx.reset_peak_memory()
                for _ in range(args.block):
                    times[setting].append(bench_step.timed(step_fn, x, y)[0])
                peaks[setting] = max(peaks[setting], mx.get_peak_memory())
        pace.QUEUE_DEPTH = depth
        most = mx.distributed.all_max(mx.array([peaks[0], peaks[depth]]), group=group).tolist() \
            if group.size() > 1 else [peaks[0], peaks[depth]]
        if group.rank() == 0:
            off, on = statistics.median(times[0]), statistics.median(times[depth])
            print(f"{name:8s} step ms {off:8.1f} -> {on:8.1f} ({on / off:.3f}x)   "
                  f"peak MiB {most[0] / 2**20:7.1f} -> {most[1] / 2**20:7.1f}")


if __name__ == "__main__":
    main()
