"""What fully_shard refuses, on every rank, with a message that says the fix.

Usage: fully_shard_errors.py CASE

* ``muon_rows``: Muon's matrices sharded by rows (no ``placement``): fsdp_step refuses.
* ``ddp``: ddp_step on a fully sharded model refuses.
* ``mismatch``: the last rank wraps a module of another shape: every rank
  gets the same RankMismatch from fully_shard, before any collective of a step.
"""

import sys

from common import report

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim

import mlx_fsdp

case = sys.argv[1]
group = mx.distributed.init()
rank = group.rank()
mx.random.seed(0)
try:
    width = 6 if case == "mismatch" and rank == group.size() - 1 else 5
    model = mlx_fsdp.fully_shard(nn.Sequential(nn.Linear(4, width), nn.Linear(width, 3)))
    vg = nn.value_and_grad(model, lambda m, x: m(x).sum())
    _, grads = vg(model, mx.ones((2, 4)))
    if case == "muon_rows":
        opt = mlx_fsdp.fsdp_step(optim.Muon(learning_rate=0.01))
    else:
        opt = mlx_fsdp.ddp_step(optim.SGD(learning_rate=0.01))
    opt.update(model, grads)
    mx.eval(model.parameters())
    print(f"rank {rank}: NO ERROR\n", end="", flush=True)
except Exception as e:  # noqa: BLE001 (the test reads the message)
    print(f"rank {rank}: {type(e).__name__}: {e}\n", end="", flush=True)
report(group, case=case)
