"""Shape-aware optimizers (Muon, Adafactor, Muon/AdamW) vs plain MLX on averaged gradients.

Usage: owners.py STEPS CONFIG [CONFIG ...], each CONFIG ``optimizer:max_norm:comm:init``
(``max_norm`` < 0 disables clipping; ``init`` 1 calls ``opt.init`` before the
first step). Prints one RESULT line per config on rank 0.

The model has a 3-D ``nn.Conv1d`` weight, a 4-D ``nn.Conv2d`` weight, an
embedding, non-square odd matrices, biases and a scalar. Its loss is a
weighted squared distance to targets that differ per rank and step, so every
gradient is non-trivial and depends on the parameters.
"""

import sys

from common import max_diff, report

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
from mlx.utils import tree_flatten, tree_map

import mlx_fsdp


class ShapesModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(11, 8)
        self.conv = nn.Conv1d(8, 6, kernel_size=3)  # weight (6, 3, 8)
        self.conv2 = nn.Conv2d(2, 4, kernel_size=(2, 3))  # weight (4, 2, 3, 2)
        self.mix = mx.random.normal((7, 15)) * 0.2
        self.proj = mx.random.normal((15, 3)) * 0.2
        self.wide = nn.Linear(3, 16)
        self.table = nn.Linear(16, 17)
        self.scale = mx.array(0.75)


def make_model():
    mx.random.seed(0)
    model = ShapesModel()
    mx.eval(model.parameters())
    return model


def loss_fn(model, step, rank):
    total = 0.0
    for i, (_, p) in enumerate(tree_flatten(model.parameters())):
        t = mx.random.normal(p.shape, key=mx.random.key(10000 * step + 100 * rank + i))
        total = total + ((p - t).square() * (1.0 + 0.1 * i)).sum()
    return total


def is_matrix(path, g):
    return g.ndim >= 2 and "embed" not in path


class UnknownMuon(optim.Muon):
    """A subclass mlx_fsdp does not know: placed on owners by default, with a warning."""


OPTIMIZERS = {
    "muon": lambda: optim.Muon(learning_rate=0.02),
    "adafactor": lambda: optim.Adafactor(learning_rate=1e-2, relative_step=False, beta_1=0.9),
    "adafactor_default": lambda: optim.Adafactor(),
    "muon_adamw": lambda: optim.MultiOptimizer(
        [optim.Muon(learning_rate=0.02), optim.AdamW(learning_rate=1e-2)], [is_matrix]
    ),
    # Muon gets one matrix: most ranks own nothing for it.
    "muon_one": lambda: optim.MultiOptimizer(
        [optim.Muon(learning_rate=0.02), optim.AdamW(learning_rate=1e-2)],
        [lambda path, g: path == "mix"],
    ),
    "unknown": lambda: UnknownMuon(learning_rate=0.02),
    # The negative control: Muon forced onto flat shards is not Muon.
    "muon_flat": lambda: optim.Muon(learning_rate=0.02),
}

PLACEMENT = {"muon_flat": "flat"}


def averaged_grads(model, step, world):
    vg = nn.value_and_grad(model, loss_fn)
    total = None
    for r in range(world):
        _, g = vg(model, step, r)
        total = g if total is None else tree_map(lambda a, b: a + b, total, g)
    return tree_map(lambda a: a / world, total)


def sub_states(opt):
    return opt.state["states"] if "states" in opt.state else [opt.state]


def owned_state_diff(fsdp, ref, plan, rank):
    """Max difference between this rank's owned state and the plain optimizer's."""
    ref_states = [dict(tree_flatten(s)) for s in sub_states(ref)]
    mine = sub_states(fsdp.optimizer)
    worst, count, misplaced = 0.0, 0, 0
    for b in plan.buckets:
        for s in b.slots:
            has = s.path in mine[b.optimizer]
            if s.owner is None or s.owner != rank:
                misplaced += int(s.owner is not None and has)
                continue
            misplaced += int(not has)
            count += 1
            for k, v in mine[b.optimizer][s.path].items():
                r = ref_states[b.optimizer][f"{s.path}.{k}"]
                assert v.shape == r.shape, (s.path, k, v.shape, r.shape)
                worst = max(worst, mx.abs(v - r).max().item())
    return worst, count, misplaced


def run(group, name, max_norm, comm, init, steps):
    n, rank = group.size(), group.rank()
    model, ref_model = make_model(), make_model()
    opt = mlx_fsdp.fsdp_step(OPTIMIZERS[name](), max_norm=max_norm, communication_size=comm,
                             placement=PLACEMENT.get(name))
    ref = OPTIMIZERS[name]()
    if init:
        opt.init(model.trainable_parameters())
    worst, norm_diff, clipped = 0.0, 0.0, 0
    for step in range(steps):
        _, g = nn.value_and_grad(model, loss_fn)(model, step, rank)
        opt.update(model, g)
        g = averaged_grads(ref_model, step, n)
        if max_norm is not None:
            g, ref_norm = optim.clip_grad_norm(g, max_norm)
        ref.update(ref_model, g)
        mx.eval(model.parameters(), ref_model.parameters(), opt.state, ref.state)
        worst = max(worst, max_diff(model.parameters(), ref_model.parameters()))
        if max_norm is not None:
            norm_diff = max(norm_diff, abs(opt.grad_norm.item() - ref_norm.item()))
            clipped += int(opt.grad_norm.item() > max_norm)
    plan = opt.plan
    state_diff, owned_here, misplaced = owned_state_diff(opt, ref, plan, rank)
    stats = mx.distributed.all_gather(
        mx.array([state_diff, owned_here, misplaced], mx.float32)[None], group=group
    ).tolist()
    owned = [s for b in plan.buckets if b.owned for s in b.slots]
    report(
        group,
        config=f"{name}:{max_norm}:{comm}:{init}",
        n=n,
        steps=steps,
        max_diff=worst,
        norm_diff=norm_diff,
        clipped=clipped,
        buckets=len(plan.buckets),
        owner_buckets=sum(b.owned for b in plan.buckets),
        owned={s.path: s.owner for s in owned},
        state_diff=max(row[0] for row in stats),
        owned_per_rank=[int(row[1]) for row in stats],
        misplaced=sum(int(row[2]) for row in stats),
    )


def main():
    group = mx.distributed.init()
    steps = int(sys.argv[1])
    for cfg in sys.argv[2:]:
        name, max_norm, comm, init = cfg.split(":")
        max_norm = None if float(max_norm) < 0 else float(max_norm)
        run(group, name, max_norm, int(comm), bool(int(init)), steps)


if __name__ == "__main__":
    main()
