"""Per-rank memory of fp32 masters and optimizer state: ddp_step vs fsdp_step.

A bfloat16 MLP trained with AdamW and ``master_dtype=mx.float32``. For each
mode, in its own phase: the bytes of the masters and of the optimizer state on
this rank, and the peak memory of a step (``mx.get_peak_memory``). Rank 0
prints the maximum over ranks and the FSDP/DDP ratios.

    mlx.launch -n 2 --backend ring -- python benchmarks/bench_state.py
    MLX_MPI_LIBNAME=libmpi.so.40 mpirun --allow-run-as-root --oversubscribe \\
        -x MLX_MPI_LIBNAME -n 4 python benchmarks/bench_state.py

(the ``mpirun`` line as root on Debian: see docs/launching.md.)
Rank 0 shows its progress (steps done, steps per second) on stderr.
"""

import argparse
import gc
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import mlx.core as mx  # noqa: E402
import mlx.nn as nn  # noqa: E402
import mlx.optimizers as optim  # noqa: E402
from mlx.utils import tree_flatten  # noqa: E402

import mlx_fsdp  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import Progress  # noqa: E402

MB = 1024**2
STEPS = 3  # AdamW's state and the masters exist from step 1; the peak is reached by step 2


def nbytes(tree) -> int:
    return sum(v.nbytes for _, v in tree_flatten(tree) if isinstance(v, mx.array) and v.ndim)


def measure(mode, args, group, progress):
    gc.collect()
    mx.clear_cache()
    mx.reset_peak_memory()
    mx.random.seed(0)
    model = nn.Sequential(*[nn.Linear(args.hidden, args.hidden) for _ in range(args.layers)])
    model.set_dtype(mx.bfloat16)
    mx.eval(model.parameters())
    wrap = mlx_fsdp.fsdp_step if mode == "fsdp" else mlx_fsdp.ddp_step
    opt = wrap(optim.AdamW(learning_rate=1e-4), master_dtype=mx.float32)
    x = mx.random.normal((args.batch, args.hidden), key=mx.random.key(group.rank())).astype(mx.bfloat16)

    def loss_fn(m):
        return (m(x).astype(mx.float32) ** 2).mean()

    for _ in range(STEPS):
        _, g = nn.value_and_grad(model, loss_fn)(model)
        opt.update(model, g)
        mx.eval(model.parameters(), opt.state)
        del g
        progress.advance()
    row = mx.array([nbytes(opt.state.get("master", {})), nbytes(opt.state["optimizer"]),
                    mx.get_peak_memory()], mx.float32)
    return mx.distributed.all_gather(row[None], group=group).max(axis=0).tolist()


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--batch", type=int, default=16)
    args = p.parse_args()
    group = mx.distributed.init()
    modes = ("ddp", "fsdp")
    progress = Progress("DDP then FSDP", len(modes) * STEPS, enabled=group.rank() == 0)
    res = {mode: measure(mode, args, group, progress) for mode in modes}
    if group.rank() == 0:
        params = args.layers * (args.hidden**2 + args.hidden)
        print(f"N={group.size()}, bf16 MLP {args.layers}x{args.hidden} ({params / 1e6:.2f}M params), "
              "AdamW, master_dtype=float32; per rank, max over ranks")
        print("| mode | masters MB | optimizer state MB | masters + state MB | step peak MB |")
        print("|------|-----------:|-------------------:|-------------------:|-------------:|")
        for mode, (m, s, peak) in res.items():
            print(f"| {mode} | {m / MB:.2f} | {s / MB:.2f} | {(m + s) / MB:.2f} | {peak / MB:.1f} |")
        (dm, ds, dp), (fm, fs, fp) = res["ddp"], res["fsdp"]
        print(f"ratio fsdp/ddp: masters {fm / dm:.4f}, masters + state {(fm + fs) / (dm + ds):.4f}, "
              f"peak {fp / dp:.3f} (ideal 1/N = {1 / group.size():.4f})")


if __name__ == "__main__":
    main()
