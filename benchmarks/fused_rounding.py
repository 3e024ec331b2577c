"""Does the compiled (fused) optimizer update round like the eager one here?

``fsdp_step`` compiles the optimizer's update on a GPU (``mlx_fsdp.fused``),
while ``ddp_step`` and a plain training loop run it eagerly. Where MLX's
fused kernels compute each operation in its own dtype, in the same order, the
two agree bit for bit (they do on the CPU). This script says, on MLX's
default device, for each optimizer and dtype, how far a few compiled updates
land from the eager ones, and which elementary pattern moves a rounding:

    python benchmarks/fused_rounding.py [--steps 5]

One process; no ranks. ``MLX_ENABLE_TF32=0`` does not matter (no matmul
except Muon's).
"""

import argparse
import json

import mlx.core as mx
import mlx.optimizers as optim
from mlx.utils import tree_flatten

from mlx_fsdp.fused import FusedUpdates

MAKERS = {
    "sgd": lambda: optim.SGD(learning_rate=0.1),
    "sgd_momentum": lambda: optim.SGD(learning_rate=0.1, momentum=0.9),
    "adam": lambda: optim.Adam(learning_rate=0.01),
    "adamw": lambda: optim.AdamW(learning_rate=0.01),
    "lion": lambda: optim.Lion(learning_rate=0.01),
    "adafactor": lambda: optim.Adafactor(learning_rate=0.01),
    "muon": lambda: optim.Muon(learning_rate=0.01),
}


def _tree(dtype, seed):
    mx.random.seed(seed)
    return {"w": (mx.random.normal((37, 23)) * 0.5).astype(dtype),
            "b": (mx.random.normal((23,)) * 0.5).astype(dtype)}


def _diff(a, b):
    """Largest absolute difference and how many elements differ at all."""
    worst, moved, total = 0.0, 0, 0
    for (_, x), (_, y) in zip(tree_flatten(a), tree_flatten(b)):
        d = mx.abs(x.astype(mx.float32) - y.astype(mx.float32))
        worst = max(worst, d.max().item())
        moved += int((d > 0).sum().item())
        total += x.size
    return worst, moved, total


def optimizers(steps):
    rows = []
    for name, make in MAKERS.items():
        for dtype in (mx.float32, mx.bfloat16):
            eager, fused = make(), make()
            runner = FusedUpdates()
            p_e = p_f = _tree(dtype, 0)
            for s in range(steps):
                g = _tree(dtype, 100 + s)
                p_e = eager.apply_gradients(g, p_e)
                p_f = runner.apply(fused, g, p_f)
                mx.eval(p_e, p_f, eager.state, fused.state)
            worst, moved, total = _diff(p_e, p_f)
            rows.append({"optimizer": name, "dtype": str(dtype).split(".")[-1],
                         "max_abs": worst, "moved": f"{moved}/{total}"})
    return rows


def patterns():
    """Elementary patterns: which one rounds differently once fused?"""
    mx.random.seed(7)
    a, b, c = (mx.random.normal((4096,)) for _ in range(3))
    cases = {
        "f32 a*b+c": (lambda a, b, c: a * b + c, mx.float32),
        "f32 a-0.1*b": (lambda a, b, c: a - 0.1 * b, mx.float32),
        "bf16 a*b+c": (lambda a, b, c: a * b + c, mx.bfloat16),
        "bf16 a-0.1*b": (lambda a, b, c: a - 0.1 * b, mx.bfloat16),
        "bf16 0.9*a+0.1*b": (lambda a, b, c: 0.9 * a + 0.1 * b, mx.bfloat16),
        "bf16 a/(sqrt(b*b)+1e-8)": (lambda a, b, c: a / (mx.sqrt(b * b) + 1e-8), mx.bfloat16),
        "bf16 (a*0.5).astype(f32)": (lambda a, b, c: (a * 0.5).astype(mx.float32) * c, mx.bfloat16),
    }
    rows = []
    for name, (fn, dtype) in cases.items():
        x, y, z = (v.astype(dtype) for v in (a, b, c))
        e, f = fn(x, y, z), mx.compile(fn)(x, y, z)
        d = mx.abs(e.astype(mx.float32) - f.astype(mx.float32))
        rows.append({"pattern": name, "max_abs": d.max().item(),
                     "moved": f"{int((d > 0).sum().item())}/{x.size}"})
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=5)
    args = ap.parse_args()
    print(f"device {mx.default_device()}, mlx {mx.__version__}")
    print("compiled vs eager update, after", args.steps, "steps:")
    for r in optimizers(args.steps):
        print(" ", json.dumps(r))
    print("elementary patterns, compiled vs eager:")
    for r in patterns():
        print(" ", json.dumps(r))


if __name__ == "__main__":
    main()
