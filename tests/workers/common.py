"""Shared by the multi-rank worker scripts: a small model with awkward shapes."""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
from mlx.utils import tree_flatten, tree_map

from mlx_fsdp.fused import use_fused_updates

IN = 15

if os.environ.get("MLX_FSDP_TEST_EMULATE_SUM_SCATTER"):
    # The packed path of NCCL and JACCL on any backend: sum_scatter as
    # all_sum, keeping this rank's contiguous part (what the native op returns).
    def _sum_scatter(x, group=None, stream=None):
        group = group or mx.distributed.init()
        part = x.shape[0] // group.size()
        summed = mx.distributed.all_sum(x, group=group, stream=stream)
        return summed[group.rank() * part:(group.rank() + 1) * part]

    mx.distributed.sum_scatter = _sum_scatter


class OddModel(nn.Module):
    """Odd shapes ((7, 15), (15, 3), (16, 17)...), a scalar and a bfloat16 layer."""

    def __init__(self, bf16: bool = True):
        super().__init__()
        self.inp = nn.Linear(IN, 7)
        self.mix = mx.random.normal((7, 15)) * 0.2
        self.proj = mx.random.normal((15, 3)) * 0.2
        self.scale = mx.array(0.75)
        self.wide = nn.Linear(3, 16)
        self.table = nn.Linear(16, 17)
        if bf16:
            self.table.set_dtype(mx.bfloat16)
        self.out = nn.Linear(17, 5)

    def __call__(self, x):
        h = nn.relu(self.inp(x))
        h = nn.tanh(h @ self.mix) @ self.proj * self.scale
        h = nn.relu(self.wide(h))
        h = self.table(h.astype(self.table.weight.dtype)).astype(mx.float32)
        return self.out(h)


def loss_fn(model, x, y):
    return nn.losses.cross_entropy(model(x), y, reduction="mean")


def batch(step: int, rank: int, size: int = 6):
    """The local batch of ``rank`` at ``step``: the same on any process."""
    key = mx.random.key(1000 * step + rank)
    kx, ky = mx.random.split(key)
    x = mx.random.normal((size, IN), key=kx)
    y = mx.random.randint(0, 5, (size,), key=ky)
    return x, y


def make_model(seed: int = 0, bf16: bool = True):
    mx.random.seed(seed)
    model = OddModel(bf16)
    mx.eval(model.parameters())
    return model


OPTIMIZERS = {
    "sgd": lambda: optim.SGD(learning_rate=0.05, momentum=0.9, weight_decay=1e-3),
    "adam": lambda: optim.Adam(learning_rate=1e-2),
    "adamw": lambda: optim.AdamW(learning_rate=1e-2, weight_decay=0.05),
    "lion": lambda: optim.Lion(learning_rate=1e-3, weight_decay=0.01),
    # Two sub-optimizers with schedules: matrices and the rest take different
    # buckets, and the learning rate changes every step.
    "multi": lambda: optim.MultiOptimizer(
        [optim.AdamW(learning_rate=optim.cosine_decay(2e-2, 20), weight_decay=0.05),
         optim.SGD(learning_rate=optim.cosine_decay(2e-2, 20), momentum=0.9)],
        [lambda path, g: g.ndim == 2],
    ),
}


def averaged_grads(model, step, world):
    """Plain-MLX reference: the mean of every rank's local gradients."""
    vg = nn.value_and_grad(model, loss_fn)
    total = None
    for r in range(world):
        _, g = vg(model, *batch(step, r))
        total = g if total is None else tree_map(lambda a, b: a + b, total, g)
    return tree_map(lambda a: a / world, total)


def reference_clip(grads, max_norm):
    """mlx.optimizers.clip_grad_norm, with bfloat16 leaves summed in float32."""
    up = tree_map(lambda g: g.astype(mx.float32), grads)
    _, norm = optim.clip_grad_norm(up, max_norm)
    scale = mx.minimum(max_norm / (norm + 1e-6), 1.0)
    return tree_map(lambda g: (g * scale).astype(g.dtype), grads), norm


def reference_update(optimizer, world):
    """``optimizer.update``, compiled on a GPU where the steps at ``world`` ranks compile theirs.

    Both steps compile their update on a GPU (``mlx_fsdp.fused``), where
    MLX's compiled kernels round otherwise than eager ones; the reference
    compiles it there too, with plain ``mx.compile``. On the CPU, where they
    round alike, it stays eager: the steps' compiled updates are held to it.
    """
    if not use_fused_updates(world_size=world) or mx.default_device() != mx.gpu:
        return optimizer.update
    compiled = []

    def update(model, grads):
        if not compiled:
            optimizer.init(model.trainable_parameters())
            state = [optimizer.state]
            compiled.append(mx.compile(optimizer.apply_gradients, inputs=state, outputs=state))
        model.update(compiled[0](grads, model.trainable_parameters()))

    return update


def max_diff(a, b, dtype=None):
    """Largest absolute difference over the leaves of two trees (optionally one dtype)."""
    worst = 0.0
    for (k, x), (_, y) in zip(tree_flatten(a), tree_flatten(b)):
        if dtype is not None and x.dtype != dtype:
            continue
        assert x.dtype == y.dtype, (k, x.dtype, y.dtype)
        worst = max(worst, mx.abs(x.astype(mx.float32) - y.astype(mx.float32)).max().item())
    return worst


def report(group, **values):
    """Rank 0's result: a line in the launcher's results file (and on stdout).

    The file, not the output, is what ``run_ranks`` reads: mpirun may
    interleave the lines of several ranks.
    """
    if group.rank() == 0:
        line = "RESULT " + json.dumps(values)
        print(line + "\n", end="", flush=True)  # one write: ranks' lines stay whole
        if os.environ.get("MLX_FSDP_TEST_RESULTS"):
            with open(os.environ["MLX_FSDP_TEST_RESULTS"], "a") as f:
                f.write(line + "\n")
