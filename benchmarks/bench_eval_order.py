"""How far apart independent updates end decides how many run at once, on the CPU.

``mx.eval`` lays its graph out breadth-first from the outputs (at most
``MLX_BFS_MAX_WIDTH`` arrays wide, 20 by default) and runs that tape from
its far end: an operation runs as late as its consumers allow. Updates whose
results are equally far from the outputs therefore run side by side, one
operation of each in turn, and all their temporaries are alive together;
updates whose results go on through chains of different lengths (a bucket's
all-gather following another's) run staggered, and hold less.

This updates ``--matrices`` square matrices with one ``mlx.optimizers``
optimizer in one ``mx.eval``, as a rank updates the arrays it holds. The
update of matrix ``i`` is followed by ``i * offset`` additions of zero
before it is an output; in the last row none is, but each matrix's update
waits for the one before (``mx.depends``), as a step could chain them. For
each offset and each tape width it prints the
peak above the parameters, gradients and state, in MiB, and its ratio to one
matrix's update alone: from 1 (one at a time) to ``--matrices`` (side by side).
Each width runs in a process of its own, since MLX reads the variable once.

    python benchmarks/bench_eval_order.py
    python benchmarks/bench_eval_order.py --optimizer adamw --widths 20 1
"""

import argparse
import json
import os
import subprocess
import sys

import mlx.core as mx
import mlx.optimizers as optim

MiB = 1024**2
OPTIMIZERS = {"muon": lambda: optim.Muon(learning_rate=0.01),
              "adamw": lambda: optim.AdamW(learning_rate=0.01),
              "adafactor": lambda: optim.Adafactor(learning_rate=0.01)}


def peak(optimizer: str, matrices: int, size: int, offset: int, repeat: int,
         chained: bool = False) -> int:
    """The highest peak above the inputs over ``repeat`` updates after the first, in bytes.

    ``chained``: each matrix's update waits (``mx.depends``) for the one
    before's new value, so that the tape cannot run them side by side.

    The updates' evaluation races MLX's worker thread, so one update's peak
    varies by a few arrays from call to call; the highest is what a plan must
    hold.
    """
    opt = OPTIMIZERS[optimizer]()
    params = {f"w{i}": mx.random.normal((size, size)) for i in range(matrices)}
    grads = {f"w{i}": mx.random.normal((size, size)) for i in range(matrices)}
    opt.init(params)
    mx.eval(params, grads, opt.state)
    worst = 0
    for call in range(1 + repeat):
        mx.clear_cache()
        mx.reset_peak_memory()
        base = mx.get_active_memory()
        if chained:
            new, last = {}, None
            for key in grads:
                g = grads[key] if last is None else mx.depends(grads[key], last)
                new.update(opt.apply_gradients({key: g}, params))
                last = new[key]
        else:
            new = opt.apply_gradients(grads, params)
        outs = []
        for i in range(matrices):
            y = new[f"w{i}"]
            for _ in range(i * offset):
                y = y + 0.0
            outs.append(y)
        mx.eval(outs, opt.state)
        del new, outs
        if call:  # the first update also builds what later ones reuse
            worst = max(worst, mx.get_peak_memory() - base)
    return worst


def child(args) -> None:
    alone = peak(args.optimizer, 1, args.size, 0, args.repeat)
    rows = {off: peak(args.optimizer, args.matrices, args.size, off, args.repeat)
            for off in args.offsets}
    rows["chained"] = peak(args.optimizer, args.matrices, args.size, 0, args.repeat, chained=True)
    print(json.dumps({"alone": alone, "rows": rows}))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--optimizer", choices=sorted(OPTIMIZERS), default="muon",
                   help="The mlx.optimizers optimizer. Default: muon.")
    p.add_argument("--matrices", type=int, default=4, help="Matrices updated. Default: 4.")
    p.add_argument("--size", type=int, default=256, help="Their side. Default: 256.")
    p.add_argument("--repeat", type=int, default=3,
                   help="Updates measured after the first, the highest kept. Default: 3.")
    p.add_argument("--offsets", type=int, nargs="+", default=[0, 5, 10, 20, 40, 80],
                   help="Operations between one matrix's end and the next's. "
                   "Default: 0 5 10 20 40 80.")
    p.add_argument("--widths", type=int, nargs="+", default=[20, 1],
                   help="MLX_BFS_MAX_WIDTH values, each in its own process. Default: 20 1.")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    mx.set_default_device(mx.cpu)  # the tape order measured is the CPU's
    if args.child:
        return child(args)
    runs = {}
    for width in args.widths:
        env = dict(os.environ, MLX_BFS_MAX_WIDTH=str(width))
        out = subprocess.run([sys.executable, os.path.abspath(__file__), "--child",
                              *(argv if argv is not None else sys.argv[1:])],
                             env=env, check=True, capture_output=True, text=True).stdout
        runs[width] = json.loads(out.splitlines()[-1])
    print(f"{args.optimizer}, {args.matrices} matrices of {args.size} x {args.size} float32, "
          f"mlx {mx.__version__}; peak above the inputs, MiB (x: over one matrix's update "
          "alone)")
    print("| offset (operations) | " + " | ".join(f"width {w}" for w in args.widths) + " |")
    print("|---:|" + "---:|" * len(args.widths))
    for off in [*args.offsets, "chained"]:
        cells = []
        for w in args.widths:
            got, alone = runs[w]["rows"][str(off)], runs[w]["alone"]
            cells.append(f"{got / MiB:.2f} ({got / alone:.2f}x)")
        print(f"| {off} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
