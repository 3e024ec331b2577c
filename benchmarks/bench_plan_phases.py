"""The memory planner per phase of a fully sharded step: where its margin comes from.

``bench_plan_memory.py --modes fully_shard`` holds the planner's peak
against a whole step's. This takes the step apart on the same points
(``fully_shard`` per block and at the root, or ``--wrap model``, then
``fsdp_step``) and measures, per rank, the highest ``mx.get_peak_memory()``
over ``--repeat`` steps after the first of:

* **backward**: ``nn.value_and_grad`` alone, evaluated (the forward and
  backward pass, with the gathers and reduce-scatters);
* **update**: ``opt.update`` on those gradients alone, evaluated;
* **step**: both in one evaluation, as training runs them.

Next to them, the planner's count of each phase alone
(``estimate_ranks(..., phases=True)``: the pass with the activations, the
update with the optimizer's temporaries) and its peak, which is what
``bench_plan_memory.py`` checks. On the CPU the step's update waits for its
backward pass (``mlx_fsdp/pace.py``), so the step's peak is about the
fuller phase's, and the planner's peak is the fuller phase's count: each
phase's count must be above its measurement (the pass counts one block
more than it keeps where its activations are small,
``mlx_fsdp.plan_memory.backward.pass_spare``). Accumulation, masters other
than the bfloat16 points' float32 ones and ``--compile`` are not taken
apart here.

    python benchmarks/ring_local.py -n 2 -- python benchmarks/bench_plan_phases.py
    mpirun --allow-run-as-root --oversubscribe -n 3 python benchmarks/bench_plan_phases.py \\
        --hidden 256 --dtype bfloat16 --optimizers adamw adafactor
"""

import gc
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import mlx.core as mx  # noqa: E402
import mlx.nn as nn  # noqa: E402

import bench_plan_memory as bpm  # noqa: E402
from mlx_fsdp import collectives  # noqa: E402
from mlx_fsdp.plan_memory import estimate, optimizers, shapes  # noqa: E402
from mlx_fsdp.plan_memory.buffers import default_device  # noqa: E402

MiB = 1024**2


def _peak(run) -> int:
    """``mx.get_peak_memory()`` of ``run()``'s evaluation, from a clean cache."""
    gc.collect()
    mx.clear_cache()
    mx.reset_peak_memory()
    run()
    return mx.get_peak_memory()


def measure(model_name: str, optimizer: str, reshard: bool, args, group) -> dict:
    """One point: each phase's measured peak per rank, and the planner's counts."""
    gc.collect()
    mx.clear_cache()
    model = bpm.build(model_name, args)
    plain = shapes.from_tree(model, model_name)
    inner = optimizers.make(optimizer)
    loss = bpm.loss_of(model, model_name, group.rank(), args, own_dtype=True)
    activations = bpm.pass_activations(model, model_name, loss,
                                       reshard and args.wrap == "blocks" and group.size() > 1)
    model = bpm.fully_shard(model, model_name, inner, reshard, args, group)
    value_and_grad = nn.value_and_grad(model, loss)
    opt = bpm.wrapper(inner, "fully_shard", args, group)
    options = dict(master_dtype="float32" if args.dtype != "float32" else None,
                   communication_size=args.communication_size, device=default_device(),
                   reduce_scatter=collectives.reduce_scatter_method(group), wrap=args.wrap,
                   reshard_after_forward=reshard, every_rank=True, activations=activations)
    phases = estimate(plain, optimizer, "fully_shard", group.size(), phases=True, **options)
    peak = max(r.peak for r in estimate(plain, optimizer, "fully_shard", group.size(), **options))
    grads = []

    def backward():
        grads[:] = [value_and_grad(model)]
        mx.eval(grads)

    def update():
        opt.update(model, grads.pop()[1])
        mx.eval(model.parameters(), opt.state)

    def step():
        opt.update(model, value_and_grad(model)[1])
        mx.eval(model.parameters(), opt.state)

    worst = [0, 0, 0]
    for call in range(1 + args.repeat):
        measured = [_peak(backward), _peak(update), _peak(step)]
        if call:
            worst = [max(w, m) for w, m in zip(worst, measured)]
    rows = mx.distributed.all_gather(mx.array(worst, mx.int64)[None], group=group).tolist()
    return {"model": model_name, "optimizer": optimizer, "reshard": reshard,
            "activations": activations, "measured": [max(r[i] for r in rows) for i in range(3)],
            "predicted": [max(p[0].peak for p in phases), max(p[1].peak for p in phases), peak]}


def main(argv=None):
    args = bpm.parse_args(argv)
    if args.compile or args.accumulation != "none":
        raise SystemExit("bench_plan_phases.py takes apart eager steps without accumulation: "
                         "drop --compile and --accumulation.")
    group = mx.distributed.init()
    if group.size() < 2:
        raise SystemExit("run on 2 or more ranks (ring_local.py -n 2, or mpirun -n 3).")
    rows = [measure(m, o, r == "on", args, group) for m in args.models
            for o in args.optimizers for r in args.reshard_after_forward]
    if group.rank() != 0:
        return
    print(f"N={group.size()}, {args.dtype}, MLP {args.layers}x{args.hidden}, GPT "
          f"{args.gpt_layers}x{args.dims}, fully_shard wraps {args.wrap}; MiB, max over ranks; "
          "ratios predicted / measured")
    print("| model | optimizer | reshard | backward pred | backward meas | ratio | update pred "
          "| update meas | ratio | step: planner's peak | step meas | ratio |")
    print("|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    ratios = []
    for r in rows:
        cells = []
        for pred, meas in zip(r["predicted"], r["measured"]):
            cells += [f"{pred / MiB:.2f}", f"{meas / MiB:.2f}", f"{pred / meas:.3f}"]
        ratios.append([p / m for p, m in zip(r["predicted"], r["measured"])])
        print(f"| {r['model']} | {r['optimizer']} | {'on' if r['reshard'] else 'off'} | "
              + " | ".join(cells) + " |")
    for i, name in enumerate(("backward, counted alone", "update, counted alone",
                              "step, the planner's peak")):
        column = [r[i] for r in ratios]
        print(f"{name}: predicted / measured {min(column):.3f} to {max(column):.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"config": vars(args), "n": group.size(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
