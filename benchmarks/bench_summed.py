"""Owner buckets all-summed without their padding (``mlx_fsdp/summed.py``) against the padded collectives.

Muon and Adafactor keep each matrix whole on an owner rank; a matrix larger
than the bucket budget over N has an owner bucket of its own, N - 1 of whose
N shards are padding. One process per rank builds an MLP of ``--layers``
square ``Linear`` layers of ``--hidden`` and trains it with ``fsdp_step``
(``fsdp``) or fully sharded per layer with the optimizer's placement
(``fully``), with ``Bucket.summed`` as it is and forced off (the padded
reduce-scatter and all-gather), taking turns in ABBA blocks of ``--block``
steps. The rule is read when a step's graph is built, so both settings share
the model, the optimizer and the data. Rank 0 prints, per mode and
optimizer, the median step time and the peak memory of each setting
(``mx.get_peak_memory``, reset before each block; max over ranks). At N=2
no bucket is all-summed (a lone matrix's bucket is exactly half padding);
``--at-half`` all-sums those too, to see what the rule gives up there.

    mpirun -n 3 python benchmarks/bench_summed.py
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

import mlx_fsdp  # noqa: E402
from mlx_fsdp.plan import Bucket  # noqa: E402

OPTIMIZERS = {"adafactor": lambda: optim.Adafactor(learning_rate=1e-3),
              "muon": lambda: optim.Muon(learning_rate=1e-3)}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--modes", nargs="+", choices=("fsdp", "fully"), default=["fsdp", "fully"])
    p.add_argument("--optimizers", nargs="+", choices=tuple(OPTIMIZERS), default=["adafactor"],
                   help="default adafactor (Muon's Newton-Schulz on 1024 x 1024 took 30 s a "
                   "step at MPI N=3 on 2 cores)")
    p.add_argument("--hidden", type=int, default=1024, help="layer width (default 1024)")
    p.add_argument("--layers", type=int, default=4, help="layers (default 4)")
    p.add_argument("--batch", type=int, default=8, help="rows per rank (default 8)")
    p.add_argument("--at-half", action="store_true",
                   help="all-sum buckets exactly half padding too (a lone matrix's at N=2), "
                   "which the rule leaves padded")
    p.add_argument("--blocks", type=int, default=6, help="ABBA blocks per setting (default 6)")
    p.add_argument("--block", type=int, default=3, help="steps per block (default 3)")
    return p.parse_args(argv)


def build(mode: str, name: str, args):
    mx.random.seed(0)
    model = nn.Sequential(*[nn.Linear(args.hidden, args.hidden) for _ in range(args.layers)])
    mx.eval(model.parameters())
    inner = OPTIMIZERS[name]()
    if mode == "fully":
        for i, layer in enumerate(model.layers):
            model.layers[i] = mlx_fsdp.fully_shard(layer, placement=inner)
        model = mlx_fsdp.fully_shard(model, placement=inner)
    opt = mlx_fsdp.fsdp_step(inner)
    value_and_grad = nn.value_and_grad(model, lambda m, x: (m(x) ** 2).mean())

    def step(x):
        mx.synchronize()
        start = time.perf_counter()
        loss, grads = value_and_grad(model, x)
        opt.update(model, grads)
        mx.eval(loss, model.parameters(), opt.state)
        mx.synchronize()
        return (time.perf_counter() - start) * 1e3

    return step


def main(argv=None):
    args = parse_args(argv)
    group = mx.distributed.init()
    x = mx.random.normal((args.batch, args.hidden), key=mx.random.key(group.rank()))
    rule = Bucket.summed
    half = lambda self, n: self.owned and self.cols > 0 and \
        2 * self.padding(n) >= n * self.cols  # noqa: E731
    settings = {"padded": lambda self, n: False, "summed": half if args.at_half else rule}
    if group.rank() == 0:
        print(f"N={group.size()}; MLP {args.layers}x{args.hidden}, batch {args.batch} per rank; "
              f"{args.blocks} blocks of {args.block} steps per setting")
    for mode in args.modes:
        for name in args.optimizers:
            step = build(mode, name, args)
            times, peaks = {s: [] for s in settings}, {s: 0 for s in settings}
            for i in range(args.blocks):
                for s in (("padded", "summed") if i % 2 == 0 else ("summed", "padded")):
                    Bucket.summed = settings[s]
                    step(x)  # the first step of a block follows the other setting's
                    mx.reset_peak_memory()
                    times[s] += [step(x) for _ in range(args.block)]
                    peaks[s] = max(peaks[s], mx.get_peak_memory())
            Bucket.summed = rule
            most = mx.distributed.all_max(mx.array([peaks["padded"], peaks["summed"]]),
                                          group=group).tolist()
            if group.rank() == 0:
                before, after = (statistics.median(times[s]) for s in ("padded", "summed"))
                print(f"{mode:5s} {name:9s} step ms {before:7.1f} -> {after:7.1f} "
                      f"({after / before:.3f}x)   peak MiB {most[0] / 2**20:7.1f} -> "
                      f"{most[1] / 2**20:7.1f}")


if __name__ == "__main__":
    main()
