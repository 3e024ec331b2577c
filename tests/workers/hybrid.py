"""Hybrid sharding: shard over groups of 2 ranks, replicate across them.

Usage: hybrid.py [fully] [muon] [shard=K]   (4 ranks on MPI, or K x M; on
ring it reports the split error)

``fully`` shards the parameters too: every layer, then the model, with
``fully_shard(group=shard)``. ``muon`` trains with Muon (AdamW beside it),
its matrices whole on owner ranks; ``shard=3`` shards over groups of 3
(6 ranks: each lone matrix's owner bucket is all-summed in its shard group,
:mod:`mlx_fsdp.summed`, then summed over the replicas).
"""

from common import OPTIMIZERS, averaged_grads, batch, loss_fn, make_model, max_diff, reference_clip, report

import gc
import sys

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
from mlx.utils import tree_flatten

import mlx_fsdp

world = mx.distributed.init()
n, rank = world.size(), world.rank()
args = sys.argv[1:]
size = int(next((a.split("=")[1] for a in args if a.startswith("shard=")), 2))
make = (lambda: optim.MultiOptimizer([optim.Muon(learning_rate=2e-2), optim.AdamW(learning_rate=1e-2)],
                                     [lambda path, g: g.ndim == 2])) if "muon" in args \
    else OPTIMIZERS["adam"]
try:
    shard, replica = mlx_fsdp.hybrid_groups(size)
except RuntimeError as e:
    report(world, error=str(e))
    raise SystemExit(0)

model, ref_model = make_model(bf16=False), make_model(bf16=False)
fully = "fully" in args
inner = make()
placement = inner if "muon" in args else None
if fully:
    for name in ("inp", "wide", "table", "out"):
        setattr(model, name, mlx_fsdp.fully_shard(getattr(model, name), group=shard,
                                                  placement=placement))
    model = mlx_fsdp.fully_shard(model, group=shard, placement=placement)
opt = mlx_fsdp.fsdp_step(inner, group=shard, dp_group=replica, communication_size=512,
                         max_norm=0.5)
ref = make()
worst = 0.0
for step in range(4):
    _, g = nn.value_and_grad(model, loss_fn)(model, *batch(step, rank))
    opt.update(model, g)
    g, _ = reference_clip(averaged_grads(ref_model, step, n), 0.5)
    ref.update(ref_model, g)
    mx.eval(model.parameters(), ref_model.parameters(), opt.state, ref.state)
    whole = mlx_fsdp.full_parameters(model) if fully else model.parameters()
    worst = max(worst, max_diff(whole, ref_model.parameters()))
state_elems = sum(v.size for _, v in tree_flatten(opt.state["optimizer"]) if v.ndim)
ref_elems = sum(v.size for _, v in tree_flatten(ref.state) if v.ndim)
report(world, n=n, shard_size=shard.size(), replica_size=replica.size(), max_diff=worst,
       state_fraction=state_elems / ref_elems, fully=fully,
       sharded_buckets=sum(b.sharded_params for b in opt.plan.buckets))
# On MPI a split group freed after MPI_Finalize aborts: drop them first.
del opt, model, shard, replica
gc.collect()
