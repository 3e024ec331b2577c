"""Shared by the checkpoint workers and tests: global batches, optimizers, the plain reference."""

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
from mlx.utils import tree_flatten

try:  # as a worker script, or imported by the tests as workers.ckpt_common
    from common import IN, loss_fn
except ImportError:
    from workers.common import IN, loss_fn

GLOBAL_BATCH = 12  # divides by 1, 2, 3 and 4 ranks
TOTAL_STEPS = 20   # of the cosine schedule: the learning rate changes every step


def global_batch(step: int):
    key = mx.random.key(7000 + step)
    kx, ky = mx.random.split(key)
    return (mx.random.normal((GLOBAL_BATCH, IN), key=kx),
            mx.random.randint(0, 5, (GLOBAL_BATCH,), key=ky))


def local_batch(step: int, rank: int, world: int):
    """Rank ``rank``'s equal slice of the global batch: the mean over ranks is the global mean."""
    x, y = global_batch(step)
    per = GLOBAL_BATCH // world
    return x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per]


def make_optimizer(name: str):
    schedule = optim.cosine_decay(2e-2, TOTAL_STEPS)
    if name == "adamw":
        return optim.AdamW(learning_rate=schedule, weight_decay=0.05)
    if name == "multi":
        return optim.MultiOptimizer(
            [optim.AdamW(learning_rate=schedule, weight_decay=0.05),
             optim.SGD(learning_rate=schedule, momentum=0.9)],
            [lambda path, g: g.ndim == 2],
        )
    if name == "muon":  # Muon's matrices are owner-placed: whole state on one rank
        return optim.MultiOptimizer(
            [optim.Muon(learning_rate=schedule), optim.AdamW(learning_rate=schedule)],
            [lambda path, g: g.ndim >= 2],
        )
    raise ValueError(name)


def train(model, opt, steps, rank=0, world=1, start=0):
    """Train on the global batches ``start .. start + steps - 1``, this rank's slices."""
    vg = nn.value_and_grad(model, loss_fn)
    for step in range(start, start + steps):
        _, g = vg(model, *local_batch(step, rank, world))
        opt.update(model, g)
        mx.eval(model.parameters(), opt.state)


def by_key_diff(a, b) -> float:
    """Largest difference between two trees matched by key (dtypes must match too)."""
    a, b = dict(tree_flatten(a)), dict(tree_flatten(b))
    assert a.keys() == b.keys(), sorted(a.keys() ^ b.keys())
    worst = 0.0
    for k in a:
        assert a[k].dtype == b[k].dtype, (k, a[k].dtype, b[k].dtype)
        assert a[k].shape == b[k].shape, (k, a[k].shape, b[k].shape)
        worst = max(worst, mx.abs(a[k].astype(mx.float32) - b[k].astype(mx.float32)).max().item())
    return worst


def sub_states(opt):
    """The state of each (sub-)optimizer of a wrapper or a plain optimizer."""
    inner = getattr(opt, "optimizer", opt)
    return [o.state for o in getattr(inner, "optimizers", [inner])]


def node(tree, path: str):
    """The sub-tree of a nested (plain MLX) state at a parameter path."""
    for part in path.split("."):
        tree = tree[int(part)] if isinstance(tree, list) else tree[part]
    return tree
