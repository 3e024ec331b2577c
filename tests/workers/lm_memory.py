"""``python -m mlx_fsdp.lora`` with each rank's memory read where the whole model could appear.

Usage: ``lm_memory.py FLAGS``. Prints one ``MEMORY {json}`` line per rank:
``loaded`` (the peak from the start through the model's load and
``shard_model``), ``saving`` (what saving the fine-tuned model added to the
memory in use before it; full fine-tuning only) and ``run`` (the whole run's
peak).
"""

import importlib
import json
import sys

import mlx.core as mx

import mlx_fsdp.lora as cli

train = importlib.import_module("mlx_fsdp.lm.train")
seen = {}


def after_sharding(shard_model):
    def wrapped(*args, **kwargs):
        out = shard_model(*args, **kwargs)
        seen["loaded"] = mx.get_peak_memory()
        return out
    return wrapped


def measured_save(save):
    def wrapped(*args):
        before = mx.get_active_memory()
        run = mx.get_peak_memory()
        mx.reset_peak_memory()
        save(*args)
        seen["saving"] = mx.get_peak_memory() - before
        seen["run"] = max(run, mx.get_peak_memory())
    return wrapped


train.shard_model = after_sharding(train.shard_model)
cli.save_model_directory = measured_save(cli.save_model_directory)
cli.main(sys.argv[1:])
seen["run"] = max(seen.get("run", 0), mx.get_peak_memory())
seen["rank"] = mx.distributed.init().rank()
print("MEMORY " + json.dumps(seen), flush=True)
