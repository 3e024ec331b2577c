"""fp32 master shards survive a checkpoint and a change of world size.

Usage: ckpt_master.py save DIR      train a bfloat16 model with masters 2 steps, save
       ckpt_master.py resave DIR OUT load DIR, save it again to OUT unchanged
"""

import sys

from common import batch, loss_fn, make_model, report

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim

import mlx_fsdp
from mlx_fsdp.sharded_state import held_shapes

mode, path = sys.argv[1], sys.argv[2]
group = mx.distributed.init()
model = make_model(bf16=False)
model.set_dtype(mx.bfloat16)
opt = mlx_fsdp.fsdp_step(optim.AdamW(learning_rate=1e-2), master_dtype=mx.float32,
                         communication_size=300 if mode == "save" else 32 << 20)
if mode == "save":
    for step in range(2):
        _, g = nn.value_and_grad(model, loss_fn)(model, *batch(step, group.rank()))
        opt.update(model, g)
        mx.eval(model.parameters(), opt.state)
    mlx_fsdp.save_checkpoint(path, model, opt)
else:
    mlx_fsdp.load_checkpoint(path, model, opt)
    mlx_fsdp.save_checkpoint(sys.argv[3], model, opt)
held = held_shapes(opt.plan, group.rank(), 0)
ok = set(opt.state["master"]) == set(held)
report(group, n=group.size(), masters_held=mx.distributed.all_sum(mx.array(int(ok)), group=group).item())
