"""Benchmark one training step of ``mlx_fsdp.ddp_step`` against ``mlx_fsdp.fsdp_step``.

It sweeps model widths (``--hidden``), bucket sizes (``--communication-size``)
and parameter dtypes (``--dtype``); ``--sweep quick`` (the default) and
``--sweep full`` name preset lists, and each flag overrides its list. Rank 0
prints one markdown row per point; ``--markdown PATH`` and ``--json PATH``
also write them to files.

Both modes train their own copy of the same MLP (same seed, hence the same
initial weights on every rank and in both modes) with AdamW on the same
per-rank random batch (each rank has different data; cross-entropy loss).
Each point of the sweep measures, per rank:

* **Step time**: ``nn.value_and_grad`` + ``opt.update`` + ``mx.eval`` of the
  loss, the parameters and the optimizer state, timed with
  ``time.perf_counter``. The median is over ``--steps`` timed steps that follow
  ``--warmup`` untimed ones. Both models live in one timing phase and take
  turns in blocks of ``--block`` steps, in ABBA order (D F F D D F ...), so that
  machine noise, thermal drift and a neighbour's load hit both modes alike;
  the first step of each block is not timed. Steps are not interleaved one by
  one: each mode's step then runs right after the other mode's, on memory
  the other just freed, and that slowed DDP more than FSDP. Measured on the
  2-core development machine (ring N=2, 4.2M MLP, 60 steps), per-step
  alternation read FSDP/DDP as 0.900 and 0.920, while each mode alone in a
  process of its own took DDP 262-265 ms and FSDP 258-272 ms per step.
* **Peak memory**: ``mx.get_peak_memory()`` is process-wide, so it is measured
  in two separate isolation phases, one per mode, *before* the timing phase.
  Each phase starts from a clean process state (``gc.collect()``,
  ``mx.clear_cache()``, ``mx.reset_peak_memory()``), builds that mode's model
  and optimizer, runs ``max(warmup, 1) + 2`` steps (the AdamW state exists
  from step 1, so the peak is reached by step 2), records the peak and then
  drops the model, optimizer and gradients. Only the shared input batch
  (identical in both phases) is alive besides the measured mode, so the
  difference between the two peaks is due to the mode alone. The peak counts
  everything MLX allocates: parameters, gradients, optimizer state,
  activations, communication buffers and temporaries.
* **Optimizer-state bytes**: the sum of ``nbytes`` of all arrays in
  ``opt.state`` with at least one dimension (``mlx.utils.tree_flatten``).
  Scalars (``step``, ``learning_rate``, ``grad_norm``) are skipped: they are a
  few bytes and the same in both modes. The ideal FSDP/DDP ratio is ``1/N``;
  FSDP pads every array to a multiple of ``N`` so it can be a little above.

Numbers are gathered from all ranks; the table reports the maximum over ranks
(the slowest / fullest rank bounds the step). Only rank 0 prints. The header
line names the reduce-scatter method FSDP uses on this backend (ring and MPI
have no ``sum_scatter``, so it is an ``all_sum`` followed by a slice there).

After the timing phase the largest parameter difference between the two
models goes to the JSON (``max_param_diff``) as a sanity check: both took the same steps on the same
data. Without clipping (``--max-norm 0``) it is exactly 0. With clipping the
float32 global norm is summed in a different order (full arrays vs. shards
then ``all_sum``), so the clip scales differ in the last digits; AdamW turns
such tiny differences into differences of up to a few ``lr`` for elements
whose gradient is near zero, so values of order ``lr * steps`` are expected.

Run it from the repository root, no installation needed::

    python benchmarks/bench_step.py --steps 3 --warmup 1          # one process
    mlx.launch -n 2 --backend ring -- python benchmarks/bench_step.py
    mlx.launch -n 2 --backend ring -- python benchmarks/bench_step.py --sweep full \\
        --markdown step.md --json step.json
    mpirun -np 4 python benchmarks/bench_step.py
"""

import argparse
import gc
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import mlx.core as mx  # noqa: E402
import mlx.nn as nn  # noqa: E402
import mlx.optimizers as optim  # noqa: E402
from mlx.utils import tree_flatten  # noqa: E402

import mlx_fsdp  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))
from lm import parse_size  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import MLP, publish  # noqa: E402

MB = 1024**2
MODES = ("ddp", "fsdp")


def loss_fn(model, x, y):
    """Mean cross-entropy of the model's logits (computed in float32)."""
    return nn.losses.cross_entropy(model(x).astype(mx.float32), y, reduction="mean")


#: The sweeps ``--sweep`` names: model widths, bucket sizes and dtypes.
SWEEPS = {
    "quick": {"hidden": [512], "communication_size": [1 * MB, 32 * MB],
              "dtype": ["float32", "bfloat16"]},
    "full": {"hidden": [512, 1024, 2048], "communication_size": [1 * MB, 16 * MB, 32 * MB],
             "dtype": ["float32", "bfloat16"]},
}


def parse_args(argv=None):
    """Parse the command line.

    Args:
        argv (list, optional): Arguments; ``None`` means ``sys.argv[1:]``.

    Returns:
        argparse.Namespace: The options; ``hidden``, ``communication_size``
        and ``dtype`` are lists (the sweep).
    """
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sweep", choices=sorted(SWEEPS), default="quick",
                   help="preset lists of widths, bucket sizes and dtypes (default quick: "
                   "width 512; 1 and 32 MiB; float32 and bfloat16)")
    p.add_argument("--hidden", type=int, nargs="+", help="MLP widths (overrides --sweep)")
    p.add_argument("--layers", type=int, default=4, help="Linear layers (default 4)")
    p.add_argument("--batch", type=int, default=32, help="per-rank batch (default 32)")
    p.add_argument("--steps", type=int, default=6, help="timed steps per mode (default 6)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per mode (default 2)")
    p.add_argument("--block", type=int, default=5,
                   help="timed steps per mode before the other mode takes its turn (default 5)")
    p.add_argument(
        "--communication-size",
        type=parse_size,
        nargs="+",
        help="bucket sizes for both modes, e.g. 256KiB 16MiB 32MiB (overrides --sweep)",
    )
    p.add_argument("--dtype", choices=("float32", "bfloat16"), nargs="+",
                   help="parameter dtypes (overrides --sweep)")
    p.add_argument(
        "--max-norm", type=float, default=1.0, help="gradient clipping norm; <= 0 disables"
    )
    p.add_argument("--lr", type=float, default=1e-4, help="AdamW learning rate")
    p.add_argument("--seed", type=int, default=0, help="model seed (same on all ranks)")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    p.add_argument("--markdown", metavar="PATH", help="also write the table as markdown")
    args = p.parse_args(argv)
    for key, values in SWEEPS[args.sweep].items():
        if getattr(args, key) is None:
            setattr(args, key, values)
    if (min(args.hidden) < 1 or args.layers < 1 or args.batch < 1 or args.steps < 1
            or args.block < 1 or args.warmup < 0):
        p.error("--hidden, --layers, --batch, --steps, --block must be >= 1 and --warmup >= 0")
    return args


def configs(args):
    """One namespace per point of the sweep, with scalar ``hidden``, ``communication_size``, ``dtype``."""
    out = []
    for hidden in args.hidden:
        for dtype in args.dtype:
            for size in args.communication_size:
                cfg = argparse.Namespace(**vars(args))
                cfg.hidden, cfg.dtype, cfg.communication_size = hidden, dtype, size
                out.append(cfg)
    return out


def make_batch(args, rank: int):
    """A random batch that differs per rank and is reproducible.

    Args:
        args (argparse.Namespace): The options.
        rank (int): This process's rank.

    Returns:
        tuple: ``(x, y)``: inputs of shape ``(batch, hidden)`` in ``--dtype`` and
        integer class targets of shape ``(batch,)``.
    """
    kx, ky = mx.random.split(mx.random.key(10_000 + rank))
    x = mx.random.normal((args.batch, args.hidden), key=kx).astype(getattr(mx, args.dtype))
    y = mx.random.randint(0, args.hidden, (args.batch,), key=ky)
    mx.eval(x, y)
    return x, y


def build(mode: str, args):
    """Create a fresh model (from ``--seed``) and its distributed optimizer.

    Args:
        mode (str): ``"ddp"`` or ``"fsdp"``.
        args (argparse.Namespace): The options.

    Returns:
        tuple: ``(model, opt, step_fn)`` where ``step_fn(x, y)`` runs one full,
        evaluated training step.
    """
    mx.random.seed(args.seed)
    model = MLP(args.hidden, args.layers)
    model.set_dtype(getattr(mx, args.dtype))
    mx.eval(model.parameters())
    wrap = mlx_fsdp.ddp_step if mode == "ddp" else mlx_fsdp.fsdp_step
    opt = wrap(
        optim.AdamW(learning_rate=args.lr),
        max_norm=args.max_norm if args.max_norm > 0 else None,
        communication_size=args.communication_size,
    )
    loss_and_grad = nn.value_and_grad(model, loss_fn)

    def step_fn(x, y):
        loss, grads = loss_and_grad(model, x, y)
        opt.update(model, grads)
        mx.eval(loss, model.parameters(), opt.state)
        return loss

    return model, opt, step_fn


def timed(step_fn, x, y) -> float:
    """Run one step and return its wall time in milliseconds."""
    t0 = time.perf_counter()
    step_fn(x, y)
    return (time.perf_counter() - t0) * 1e3


def state_bytes(opt) -> int:
    """Bytes of the non-scalar arrays in ``opt.state`` (scalars are skipped)."""
    return sum(
        v.nbytes for _, v in tree_flatten(opt.state) if isinstance(v, mx.array) and v.ndim > 0
    )


def clean_slate():
    """Free everything unreferenced and reset the peak-memory counter."""
    gc.collect()
    mx.clear_cache()
    mx.reset_peak_memory()


def memory_phase(mode: str, args, x, y) -> dict:
    """Measure one mode's peak memory with no other model alive.

    Args:
        mode (str): ``"ddp"`` or ``"fsdp"``.
        args (argparse.Namespace): The options.
        x (mlx.core.array): This rank's inputs.
        y (mlx.core.array): This rank's targets.

    Returns:
        dict: ``peak_bytes``, ``state_bytes`` and the (non-interleaved) step
        times in ms of this phase as ``isolated_step_ms``.
    """
    clean_slate()
    model, opt, step_fn = build(mode, args)
    times = [timed(step_fn, x, y) for _ in range(max(args.warmup, 1) + 2)]
    out = {
        "peak_bytes": mx.get_peak_memory(),
        "state_bytes": state_bytes(opt),
        "isolated_step_ms": times,
    }
    del model, opt, step_fn
    clean_slate()
    return out


def timing_phase(args, x, y):
    """Time DDP and FSDP steps in alternating blocks (ABBA order).

    Args:
        args (argparse.Namespace): The options.
        x (mlx.core.array): This rank's inputs.
        y (mlx.core.array): This rank's targets.

    Returns:
        tuple: ``(times, max_param_diff)`` with ``times[mode]`` the list of
        timed step durations in ms, and the largest absolute difference between
        the two models' parameters at the end.
    """
    built = {m: build(m, args) for m in MODES}
    for m in MODES:
        for _ in range(args.warmup):
            built[m][2](x, y)
    times = {m: [] for m in MODES}
    i = 0
    while any(len(t) < args.steps for t in times.values()):
        for m in (MODES if i % 2 == 0 else MODES[::-1]):
            built[m][2](x, y)  # the block's first step runs after the other mode: untimed
            for _ in range(min(args.block, args.steps - len(times[m]))):
                times[m].append(timed(built[m][2], x, y))
        i += 1
    diff = max(
        mx.max(mx.abs(a.astype(mx.float32) - b.astype(mx.float32))).item()
        for (_, a), (_, b) in zip(
            tree_flatten(built["ddp"][0].parameters()), tree_flatten(built["fsdp"][0].parameters())
        )
    )
    return times, diff


def gather(group, values):
    """All-gather a list of floats (as float32) and return one row per rank."""
    if group.size() == 1:
        return [list(values)]
    rows = mx.distributed.all_gather(mx.array([values], dtype=mx.float32), group=group)
    return rows.tolist()


def run_config(cfg, group, x, y) -> dict:
    """Measure one point of the sweep on every rank; rank 0 gets the full record.

    Returns:
        dict: Per mode ``step_ms_median``, ``peak_mb``, ``state_mb`` (max over
        ranks) and per-rank rows, plus ``ratios`` and ``max_param_diff``.
    """
    mem = {m: memory_phase(m, cfg, x, y) for m in MODES}
    times, diff = timing_phase(cfg, x, y)
    local = []
    for m in MODES:
        local += [statistics.median(times[m]), mem[m]["peak_bytes"] / MB, mem[m]["state_bytes"] / MB]
    rows = gather(group, local)
    worst = [max(r[i] for r in rows) for i in range(len(local))]  # max over ranks, per column
    res = {"hidden": cfg.hidden, "layers": cfg.layers, "dtype": cfg.dtype,
           "communication_size": cfg.communication_size,
           "num_params": cfg.layers * (cfg.hidden * cfg.hidden + cfg.hidden),
           "max_param_diff": diff}
    for j, m in enumerate(MODES):
        ms, peak, st = worst[3 * j : 3 * j + 3]
        res[m] = {
            "step_ms_median": ms,
            "peak_mb": peak,
            "state_mb": st,
            "state_bytes_per_rank": mem[m]["state_bytes"],
            "per_rank": [
                {"step_ms_median": r[3 * j], "peak_mb": r[3 * j + 1], "state_mb": r[3 * j + 2]}
                for r in rows
            ],
            "rank0_step_ms": times[m],
        }
    d, f = res["ddp"], res["fsdp"]
    res["ratios"] = {
        "time": f["step_ms_median"] / d["step_ms_median"],
        "peak_memory": f["peak_mb"] / d["peak_mb"],
        "state_bytes": f["state_bytes_per_rank"] / d["state_bytes_per_rank"],
    }
    return res


def _count(n: int) -> str:
    return f"{n / 1e6:.1f}M" if n >= 1e5 else f"{n / 1e3:.1f}k"


def _bucket(size: int) -> str:
    return f"{size / MB:g} MiB" if size >= MB else f"{size / 1024:g} KiB"


def markdown(results) -> str:
    """The sweep as one markdown table: a row per (model, dtype, bucket)."""
    lines = [
        "| params | dtype | bucket | DDP ms | FSDP ms | time FSDP/DDP | DDP peak MiB | "
        "FSDP peak MiB | peak FSDP/DDP | DDP state MiB/rank | FSDP state MiB/rank | state FSDP/DDP |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        d, f, q = r["ddp"], r["fsdp"], r["ratios"]
        lines.append(
            f"| {_count(r['num_params'])} | {r['dtype']} | {_bucket(r['communication_size'])} | "
            f"{d['step_ms_median']:.1f} | {f['step_ms_median']:.1f} | {q['time']:.3f} | "
            f"{d['peak_mb']:.1f} | {f['peak_mb']:.1f} | {q['peak_memory']:.3f} | "
            f"{d['state_mb']:.2f} | {f['state_mb']:.2f} | {q['state_bytes']:.3f} |"
        )
    return "\n".join(lines)


def main(argv=None):
    """Run the sweep and print (rank 0) one table row per configuration."""
    args = parse_args(argv)
    group = mx.distributed.init()
    rank, n = group.rank(), group.size()
    launched = int(os.environ.get("OMPI_COMM_WORLD_SIZE") or os.environ.get("PMI_SIZE") or 1)
    if n == 1 and launched > 1:
        print(
            f"warning: launched as {launched} MPI processes but MLX formed a group of 1 "
            "(is MLX's MPI backend available? mx.distributed.is_available('mpi')); "
            "every process runs alone.",
            file=sys.stderr,
        )
    # A collective probe on the first call: every rank must make it.
    method = mlx_fsdp.reduce_scatter_method(group) if n > 1 else "none (one process)"
    results = []
    for cfg in configs(args):
        x, y = make_batch(cfg, rank)
        results.append(run_config(cfg, group, x, y))
        if rank == 0:
            r = results[-1]
            print(f"  {_count(r['num_params'])} {cfg.dtype} bucket {_bucket(cfg.communication_size)}: "
                  f"time {r['ratios']['time']:.3f}x, peak {r['ratios']['peak_memory']:.3f}x, "
                  f"state {r['ratios']['state_bytes']:.3f}x (FSDP/DDP)", file=sys.stderr, flush=True)
    if rank != 0:
        return
    header = (
        f"world size {n}; MLP {args.layers} x width, batch {args.batch}/rank, AdamW lr {args.lr}, "
        f"max_norm {args.max_norm if args.max_norm > 0 else None}; FSDP reduce-scatter: {method}; "
        f"{args.steps} timed + {args.warmup} warm-up steps per mode (in blocks of {args.block}); "
        f"ms and MiB are the max over ranks; ideal state ratio 1/N = {1 / n:.3f}"
    )
    publish(header, markdown(results), args.markdown, args.json,
            {"world_size": n, "config": vars(args), "reduce_scatter_method": method,
             "mlx_version": mx.__version__, "results": results})


if __name__ == "__main__":
    main()
