"""``opt.init(model.parameters())`` on a LoRA model (frozen, maybe quantized base), then mlx-lm's trainer.

Plain optimizers accept the whole tree, frozen and quantized arrays included,
and later get gradients for the adapters only. Reference: a plain AdamW so
initialized under mlx-lm's DDP; ours: fsdp_step(AdamW) so initialized. One
RESULT line per model; a model whose run raised reports the error.
Usage: lm_init.py MODEL [MODEL ...] DATA
"""

import sys

import mlx.core as mx
import mlx.optimizers as optim
from lm_common import compare, lora_model, report, run_trainer

from mlx_fsdp.lm import sharded_training

*models, data = sys.argv[1:]
world = mx.distributed.init()
for model_path in models:
    model, tokenizer = lora_model(model_path)
    try:
        with sharded_training(optim.AdamW(learning_rate=1e-3)) as opt:
            opt.init(model.parameters())
            ours = run_trainer(model, tokenizer, data, opt)
    except ValueError as e:  # raised alike on every rank (a refused tree)
        report(world, model=model_path, error=str(e))
        continue
    model, tokenizer = lora_model(model_path)
    plain = optim.AdamW(learning_rate=1e-3)
    plain.init(model.parameters())
    reference = run_trainer(model, tokenizer, data, plain)
    compare(world, reference, ours, model=model_path)
