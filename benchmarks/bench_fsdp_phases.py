"""``fsdp_step`` taken apart: where the planner's margin on the sharded step comes from.

``bench_plan_memory.py --modes fsdp`` holds the planner's peak against a
whole step's. This measures, on the same points and fixed gradients, the
highest ``mx.get_peak_memory()`` per rank over ``--repeat`` steps after the
first of:

* **update**: the step up to this rank's updated shards (the reduce-scatter,
  clipping and the optimizer), evaluated before the first all-gather is
  queued;
* **gather**: the rest of that same step (the all-gathers into new
  parameters), measured from there;
* **step**: the whole step in one evaluation, as training runs it.

Next to them, the planner's peak and the parts of its fullest phase. On the
CPU the planner counts the update's temporaries beside the gathering
phase's buffers where a bucket is an owner's, and otherwise the update as a
phase of its own (``mlx_fsdp.plan_memory.phases.fsdp_fullest``), so
``step - gather`` is about what the step really held of them beside the
gathers (taken apart, the gather phase can hold more than the whole step
did, and the difference fall below zero). The split
evaluates inside ``fsdp_step`` by wrapping ``mlx_fsdp.bucketed.gather_bucket``:
a measuring device, nothing the library does. So is ``--chain-updates``:
each optimizer's ``apply_single`` waits (``mx.depends``) for the array
before's new value, so that ``mx.eval`` runs a rank's updates one at a time
(see ``bench_eval_order.py``).

    python benchmarks/ring_local.py -n 2 -- python benchmarks/bench_fsdp_phases.py --hidden 256
    python benchmarks/ring_local.py -n 2 -- python benchmarks/bench_fsdp_phases.py --chain-updates
    mpirun --allow-run-as-root --oversubscribe -n 4 python benchmarks/bench_fsdp_phases.py --hidden 256
"""

import gc
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import mlx.core as mx  # noqa: E402

import bench_plan_memory as bpm  # noqa: E402
from mlx_fsdp import bucketed, collectives  # noqa: E402
from mlx_fsdp.plan_memory import estimate, optimizers, shapes  # noqa: E402
from mlx_fsdp.plan_memory.buffers import default_device  # noqa: E402

MiB = 1024**2
_gather_bucket = bucketed.gather_bucket


def _split_step(opt, model, grads) -> tuple:
    """One step's peaks: up to the updated shards, then the gathers after them."""
    peaks = []

    def gather_bucket(bucket, mine, *args, **kwargs):
        if not peaks:  # before the first bucket's gather: every shard is updated
            mx.eval(list(mine.values()))
            peaks.append(mx.get_peak_memory())
            mx.reset_peak_memory()
        return _gather_bucket(bucket, mine, *args, **kwargs)

    bucketed.gather_bucket = gather_bucket
    try:
        opt.update(model, grads)
        mx.eval(model.parameters(), opt.state)
    finally:
        bucketed.gather_bucket = _gather_bucket
    return peaks[0], mx.get_peak_memory()


def chain_updates(optimizer):
    """``optimizer``, its updates each after the one before (a measuring device)."""
    for part in getattr(optimizer, "optimizers", [optimizer]):
        apply, single, last = part.apply_gradients, part.apply_single, []

        def apply_gradients(gradients, parameters, apply=apply, last=last):
            last.clear()
            return apply(gradients, parameters)

        def apply_single(gradient, parameter, state, single=single, last=last):
            if last:
                gradient = mx.depends(gradient, last[0])
            last[:] = [single(gradient, parameter, state)]
            return last[0]

        part.apply_gradients, part.apply_single = apply_gradients, apply_single
    return optimizer


def measure(model_name: str, optimizer: str, args, group) -> dict:
    """One point: the phases' and the whole step's peaks per rank, and the planner's count."""
    gc.collect()
    mx.clear_cache()
    model = bpm.build(model_name, args)
    plain = shapes.from_tree(model, model_name)
    grads = bpm.gradients(model, model_name, group.rank(), args)
    made = optimizers.make(optimizer)
    opt = bpm.wrapper(chain_updates(made) if args.chain_updates else made, "fsdp", args, group)
    worst = [0, 0, 0]
    for call in range(1 + args.repeat):
        for split in (True, False):
            gc.collect()
            mx.clear_cache()
            mx.reset_peak_memory()
            if split:
                measured = _split_step(opt, model, grads)
            else:
                opt.update(model, grads)
                mx.eval(model.parameters(), opt.state)
                measured = (mx.get_peak_memory(),)
            if call:
                for i, m in enumerate(measured, 0 if split else 2):
                    worst[i] = max(worst[i], m)
    rows = mx.distributed.all_gather(mx.array(worst, mx.int64)[None], group=group).tolist()
    ranks = estimate(plain, optimizer, "fsdp", group.size(),
                     master_dtype="float32" if args.dtype != "float32" else None,
                     communication_size=args.communication_size, device=default_device(),
                     reduce_scatter=collectives.reduce_scatter_method(group), every_rank=True)
    fullest = max(ranks, key=lambda r: r.peak)
    return {"model": model_name, "optimizer": optimizer, "n": group.size(),
            "measured": [max(r[i] for r in rows) for i in range(3)],
            "predicted": fullest.peak, "parts": fullest.to_dict()}


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    chain = "--chain-updates" in argv
    args = bpm.parse_args([a for a in argv if a != "--chain-updates"])
    args.chain_updates = chain
    if args.compile or args.accumulation != "none" or args.modes != ["ddp", "fsdp"]:
        raise SystemExit("bench_fsdp_phases.py takes apart eager fsdp_step steps without "
                         "accumulation: drop --compile, --accumulation and --modes.")
    group = mx.distributed.init()
    if group.size() < 2:
        raise SystemExit("run on 2 or more ranks (ring_local.py -n 2, or mpirun -n 4).")
    rows = [measure(m, o, args, group) for m in args.models for o in args.optimizers]
    if group.rank() != 0:
        return
    chained = "updates chained, " if args.chain_updates else ""
    print(f"N={group.size()}, {args.dtype}, {chained}MLP {args.layers}x{args.hidden}, GPT "
          f"{args.gpt_layers}x{args.dims}; MiB, max over ranks; held of the update = step - "
          "gather; counted = the planner's temporaries beside its fullest phase")
    print("| model | optimizer | update | gather | step | held of the update | planner's peak "
          "| counted temporaries | step / peak |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        update, gather, step = (m / MiB for m in r["measured"])
        print(f"| {r['model']} | {r['optimizer']} | {update:.2f} | {gather:.2f} | {step:.2f} | "
              f"{step - gather:.2f} | {r['predicted'] / MiB:.2f} | "
              f"{r['parts']['temporaries'] / MiB:.2f} | {step * MiB / r['predicted']:.3f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
