"""Does a plain training loop hold its old parameters through the sharded step?

``opt.update(model, grads)`` puts the step's lazy new parameters in the
model; an old parameter nothing else references is freed once the
operations that read it have run. With bfloat16 parameters and float32
masters the update reads the masters, so the old parameters are gone before
the new ones are gathered. This runs the loop users write:
``nn.value_and_grad``, ``opt.update``, one ``mx.eval`` of the loss,
parameters and state, on mlx-lm's Llama under ``fsdp_step``, with and
without a reference to the old parameters kept across each step, and prints
each peak (max over ranks and steps after the first) beside the planner's
(``keeps_old_parameters`` as the loop), its activations for the batch
included.

    python benchmarks/ring_local.py -n 2 -- python benchmarks/bench_old_parameters.py
"""

import argparse
import gc
import os
import sys
import types

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import mlx.core as mx  # noqa: E402
import mlx.nn as nn  # noqa: E402

import bench_plan_memory as bpm  # noqa: E402
from mlx_fsdp import collectives  # noqa: E402
from mlx_fsdp.plan_memory import estimate, optimizers, shapes  # noqa: E402
from mlx_fsdp.plan_memory.activations import activation_bytes  # noqa: E402
from mlx_fsdp.plan_memory.buffers import default_device  # noqa: E402


def peak(args, name: str, group, hold: bool) -> int:
    """The loop's peak bytes over ``args.steps`` steps after the first, max over ranks."""
    model = bpm.build("llama", args)
    opt = bpm.wrapper(optimizers.make(name), "fsdp", args, group)
    step = nn.value_and_grad(model, bpm.loss_of(model, "llama", group.rank(), args))
    worst, held = 0, []
    for i in range(1 + args.steps):
        gc.collect()
        mx.clear_cache()
        mx.reset_peak_memory()
        loss, grads = step(model)
        if hold:
            held = [model.parameters()]
        opt.update(model, grads)
        del grads
        mx.eval(loss, model.parameters(), opt.state)
        held.clear()
        if i:
            worst = max(worst, mx.get_peak_memory())
    return int(mx.distributed.all_gather(mx.array([worst])[None], group=group).max().item())


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dims", type=int, default=192)
    p.add_argument("--gpt-layers", type=int, default=6)
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--seq-len", type=int, default=8)
    p.add_argument("--optimizers", nargs="+", default=["sgd", "muon"],
                   choices=list(optimizers.OPTIMIZERS))
    p.add_argument("--steps", type=int, default=5)
    a = p.parse_args(argv)
    args = types.SimpleNamespace(dtype="bfloat16", communication_size=None, accumulation="none",
                                 hidden=512, layers=4, **vars(a))
    group = mx.distributed.init()
    plain = shapes.from_tree(bpm.build("llama", args), "llama")
    mib = lambda n: f"{n / 1024**2:.2f}"  # noqa: E731
    if group.rank() == 0:
        print(f"N={group.size()}, mlx-lm llama {a.gpt_layers} x {a.dims}, bfloat16 with float32 "
              f"masters, batch {a.batch_size} x {a.seq_len}; MiB")
        print("| optimizer | old parameters freed | planned | held | planned, kept |")
        print("|---|---:|---:|---:|---:|")
    for name in a.optimizers:
        freed, held = peak(args, name, group, False), peak(args, name, group, True)
        planned = [max(r.peak for r in estimate(
            plain, name, "fsdp", group.size(), master_dtype="float32", device=default_device(),
            reduce_scatter=collectives.reduce_scatter_method(group) if group.size() > 1 else None,
            activations=activation_bytes(bpm.llama_shape(args), a.batch_size, a.seq_len, 2,
                                         device=default_device()), keeps_old_parameters=kept))
            for kept in (False, True)]
        if group.rank() == 0:
            print(f"| {name} | {mib(freed)} | {mib(planned[0])} | {mib(held)} | "
                  f"{mib(planned[1])} |", flush=True)


if __name__ == "__main__":
    main()
