"""Ranks whose trees differ must get a clear error, not a hang or garbage.

Usage: mismatch.py KIND   (KIND: extra_array | shape)
"""

import sys

from common import make_model, report  # noqa: F401  (sets sys.path)

import mlx.core as mx
import mlx.optimizers as optim

import mlx_fsdp

group = mx.distributed.init()
kind = sys.argv[1]
params = {"w": mx.ones((7, 15)), "b": mx.ones((15,))}
if group.rank() == 1:
    if kind == "extra_array":
        params["c"] = mx.ones((3,))
    else:
        params["w"] = mx.ones((7, 16))
grads = {k: mx.ones_like(v) for k, v in params.items()}
opt = mlx_fsdp.fsdp_step(optim.SGD(learning_rate=0.1))
try:
    mx.eval(opt.apply_gradients(grads, params))
    print(f"rank {group.rank()}: NO ERROR\n", end="", flush=True)
except ValueError as e:
    print(f"rank {group.rank()}: {type(e).__name__}: {e}\n", end="", flush=True)
