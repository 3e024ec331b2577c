"""Wrapping a lazily built model with ``fully_shard``: no rank holds it whole.

MLX creates parameters unevaluated, and ``fully_shard`` evaluates only this
rank's rows of the module it wraps. This builds ``--layers`` ``nn.Linear``
of ``--hidden`` and wraps each, then the model, either as built (lazy) or
after ``mx.eval(model.parameters())`` (eager), and prints each rank's peak
beside the whole model's bytes (docs/fully-shard.md).

    python benchmarks/ring_local.py -n 2 -- python benchmarks/bench_lazy_shard.py
"""

import argparse
import gc
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import mlx.core as mx  # noqa: E402
import mlx.nn as nn  # noqa: E402

import mlx_fsdp  # noqa: E402

MiB = 1024**2


def peak(layers: int, hidden: int, eager: bool, group) -> int:
    """The highest peak over the ranks of building and wrapping the model (bytes)."""
    gc.collect()
    mx.clear_cache()
    mx.reset_peak_memory()
    model = nn.Sequential(*[nn.Linear(hidden, hidden) for _ in range(layers)])
    if eager:
        mx.eval(model.parameters())
    for i in range(layers):
        model.layers[i] = mlx_fsdp.fully_shard(model.layers[i], group=group)
    model = mlx_fsdp.fully_shard(model, group=group)
    got = mx.distributed.all_gather(mx.array([mx.get_peak_memory()])[None], group=group)
    return int(got.max().item())


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=1024)
    args = p.parse_args(argv)
    group = mx.distributed.init()
    whole = args.layers * (args.hidden + 1) * args.hidden * 4
    rows = [(how, peak(args.layers, args.hidden, how == "eager", group))
            for how in ("lazy", "eager")]
    if group.rank() == 0:
        print(f"N={group.size()}, {args.layers} x nn.Linear({args.hidden}, {args.hidden}), "
              f"float32: the whole model {whole / MiB:.2f} MiB")
        for how, got in rows:
            print(f"{how}: peak {got / MiB:.2f} MiB per rank (max over ranks), "
                  f"{got / whole:.3f}x the whole model")


if __name__ == "__main__":
    main()
