"""``python -m mlx_fsdp.lora`` with each rank's memory read where the whole model could appear.

Usage: ``lm_memory.py FLAGS``. Prints one ``MEMORY {json}`` line per rank:
``loaded`` (the peak from the start through the model's load and
``shard_model``), ``saving`` (what saving the fine-tuned model added to the
memory in use before it; full fine-tuning only), ``testing`` (what
``--test`` added so), the memory in use when each began (``saving_from``,
``testing_from``), and ``run`` (the whole run's peak).
"""

import importlib
import json
import sys

import mlx.core as mx
import mlx_lm.lora

import mlx_fsdp.lora as cli

train = importlib.import_module("mlx_fsdp.lm.train")
seen = {}


def after_sharding(shard_model):
    def wrapped(*args, **kwargs):
        out = shard_model(*args, **kwargs)
        seen["loaded"] = mx.get_peak_memory()
        return out
    return wrapped


def measured(name, fn):
    def wrapped(*args):
        before = mx.get_active_memory()
        seen["run"] = max(seen.get("run", 0), mx.get_peak_memory())
        mx.reset_peak_memory()
        out = fn(*args)
        seen[name] = mx.get_peak_memory() - before
        seen[name + "_from"] = before
        seen["run"] = max(seen["run"], mx.get_peak_memory())
        return out
    return wrapped


train.shard_model = after_sharding(train.shard_model)
cli.save_model_directory = measured("saving", cli.save_model_directory)
mlx_lm.lora.evaluate_model = measured("testing", mlx_lm.lora.evaluate_model)
cli.main(sys.argv[1:])
seen["run"] = max(seen["run"], mx.get_peak_memory())
seen["rank"] = mx.distributed.init().rank()
print("MEMORY " + json.dumps(seen), flush=True)
