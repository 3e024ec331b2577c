"""mlx-lm's compiled trainer step with fsdp_step's sharded accumulation vs mlx-lm's own.

Reference: a plain AdamW with ``TrainingArgs(grad_accumulation_steps=2)``
(mlx-lm sums full gradients and all-reduces every 2nd micro-batch). Ours:
``fsdp_step(AdamW, grad_accumulation_steps=2, accumulation="sharded")`` given
every micro-batch by a trainer that does not accumulate.
Usage: lm_accumulate.py MODEL DATA
"""

import sys

import mlx.core as mx
import mlx.optimizers as optim
from lm_common import compare, lora_model, run_trainer

from mlx_fsdp.lm import sharded_training

model_path, data = sys.argv[1:3]
world = mx.distributed.init()
with sharded_training(optim.AdamW(learning_rate=1e-3), grad_accumulation_steps=2,
                      accumulation="sharded") as opt:
    ours = run_trainer(*lora_model(model_path), data, opt)
reference = run_trainer(*lora_model(model_path), data, optim.AdamW(learning_rate=1e-3),
                        grad_accumulation_steps=2)
compare(world, reference, ours)
