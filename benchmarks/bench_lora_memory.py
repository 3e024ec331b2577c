"""LoRA's whole-step peak against the planner's (``--fine-tune-type lora``), one process.

An mlx-lm Llama (``--layers`` blocks of ``--dims``), frozen and given
adapters by mlx-lm itself (``linear_to_lora_layers``, rank ``--rank`` in the
last ``--num-layers`` blocks), trained with AdamW as ``mlx_lm.lora``'s
trainer steps it: ``nn.value_and_grad``, ``optimizer.update``, one
``mx.eval``. The peak (``mx.get_peak_memory``, the highest of ``--repeat``
steps after the first) against
``plan_memory.estimate(with_lora(...), "adamw", "ddp", 1)`` with the
activations of the batch; at one process every mode is this step.

    python benchmarks/bench_lora_memory.py
"""

import argparse
import gc
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "benchmarks")]

import mlx.core as mx  # noqa: E402
import mlx.nn as nn  # noqa: E402
import mlx.optimizers as optim  # noqa: E402

from bench_activations import add_shape_args, build, shape_of  # noqa: E402
from mlx_fsdp.plan_memory import estimate, shapes  # noqa: E402
from mlx_fsdp.plan_memory.activations import Shape, activation_bytes  # noqa: E402
from mlx_fsdp.plan_memory.buffers import default_device  # noqa: E402
from mlx_fsdp.plan_memory.lora import adapter_activations, with_lora  # noqa: E402

MiB = 1024**2


def measure(shape: Shape, batch: int, seq: int, rank: int, num_layers: int, checkpoint: bool,
            repeat: int = 2) -> int:
    """The highest whole-step peak of ``repeat`` LoRA steps after the first (bytes)."""
    from mlx_lm.tuner.utils import linear_to_lora_layers
    gc.collect()
    mx.clear_cache()
    model = build(shape, "float32", checkpoint)
    model.freeze()
    linear_to_lora_layers(model, num_layers, {"rank": rank, "scale": 20.0, "dropout": 0.0})
    mx.eval(model.parameters())
    opt = optim.AdamW(learning_rate=1e-4)
    tokens = mx.random.randint(0, shape.vocab, (batch, seq + 1), key=mx.random.key(0))
    mx.eval(tokens)

    def loss(m):
        return nn.losses.cross_entropy(m(tokens[:, :-1]), tokens[:, 1:]).mean()

    step = nn.value_and_grad(model, loss)
    peak = 0
    for i in range(1 + repeat):
        gc.collect()
        mx.clear_cache()
        mx.reset_peak_memory()
        value, grads = step(model)
        opt.update(model, grads)
        mx.eval(value, model.parameters(), opt.state)
        del value, grads
        if i:
            peak = max(peak, mx.get_peak_memory())
    if checkpoint:  # grad_checkpoint patched the class: undo it for the next model
        from mlx_lm.models import llama
        llama.TransformerBlock.__call__ = llama.TransformerBlock.__call__.__closure__[0].cell_contents
    return peak


def predict(shape: Shape, batch: int, seq: int, rank: int, num_layers: int,
            checkpoint: bool) -> int:
    """The planner's peak of the same step (bytes)."""
    model = with_lora(shapes.llama(shape.layers, shape.dims, shape.ffn, shape.vocab, shape.heads,
                                   shape.kv_heads, dtype="float32"), rank, num_layers)
    acts = activation_bytes(shape, batch, seq, 4, checkpoint, default_device()) + \
        adapter_activations(model, batch, seq, 4)
    return estimate(model, "adamw", "ddp", 1, activations=acts)[0].peak


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_shape_args(p, layers=4)
    p.add_argument("--rank", type=int, default=8, help="adapter rank (default 8)")
    p.add_argument("--num-layers", type=int, nargs="+", default=[2, -1],
                   help="blocks with adapters, -1 all (default 2 -1)")
    p.add_argument("--checkpoint", nargs="+", default=["off", "on"], choices=("off", "on"))
    args = p.parse_args(argv)
    shape = shape_of(args)
    print(f"mlx-lm llama {shape}, float32, LoRA rank {args.rank}, AdamW, {default_device()}")
    print("| adapted blocks | batch x seq | checkpoint | predicted MiB | measured MiB | "
          "predicted / measured |")
    print("|---|---|---|---:|---:|---:|")
    ratios = []
    for num_layers in args.num_layers:
        for size in args.sizes:
            batch, seq = map(int, size.split("x"))
            for ck in args.checkpoint:
                got = measure(shape, batch, seq, args.rank, num_layers, ck == "on")
                want = predict(shape, batch, seq, args.rank, num_layers, ck == "on")
                ratios.append(want / got)
                print(f"| {num_layers} | {size} | {ck} | {want / MiB:.2f} | {got / MiB:.2f} | "
                      f"{want / got:.3f} |", flush=True)
    print(f"predicted / measured: lowest {min(ratios):.3f} (below 1: measured above the bound), "
          f"highest {max(ratios):.3f}")


if __name__ == "__main__":
    main()
